"""A site of two gloo ranks (DistributedDataParallel) is one peer: rank 0 speaks for the group,
and both ranks end with the same parameters, mixes included."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

import murmur
from conftest import DEADLINE, EXAMPLES, Peer

sys.path.insert(0, str(EXAMPLES))
from fashion import Mlp, load_split


def test_two_ranks_of_a_site_train_one_replica_in_the_swarm(tmp_path, fashion_like):
    config = tmp_path / "site.toml"
    config.write_text(
        '[run]\nname = "site"\nseed = 2\n'
        '[optimizer]\nkind = "sgd"\nlr = 0.05\nmomentum = 0.9\n'
        "[training]\nepochs = 10\nbatch_size = 16\n"
        '[sync]\nmode = "gossip"\ninterval = 4\nmax_staleness = 16\n'
    )
    # A single-process peer of the same model, for the site to mix with.
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = load_split(fashion_like, "train")
    other = murmur.join(
        config,
        model,
        optimizer,
        data_dir=tmp_path / "other",
        listen=["/ip4/127.0.0.1/tcp/0"],
        mdns=False,
        progress=False,
    )

    def site_step(peer: murmur.Swarm) -> float:
        """The site's step as the peer last heard it; unbounded once the site has left."""
        steps = [p["step"] for p in peer.status()["peers"]]
        return max(steps) if steps else float("inf")

    def train() -> None:
        # Trains beside the site, from when it joins, a few steps ahead of it at most until
        # it leaves.
        # Waits for the site's first step, not only its daemon: a site still starting its
        # ranks would be left behind, and a member that has not mixed yet takes over a state
        # far ahead, clock included (decision 0033), which can carry it past `--steps`.
        deadline = time.monotonic() + DEADLINE
        while not any(peer["step"] > 0 for peer in other.status()["peers"]):
            assert time.monotonic() < deadline, "the site did not join and step"
            time.sleep(0.05)
        step = 0
        while other.steps < 80 and other.running:
            # Keeps within a few steps of the site while it trains: two ranks of DDP on a
            # loaded machine can be slower than the staleness gate's patience, and a peer that
            # runs on without them leaves the site nothing to mix with but a state to take.
            deadline = time.monotonic() + DEADLINE
            while other.steps > site_step(other) + 4:
                assert time.monotonic() < deadline, f"the site stopped at {site_step(other)}"
                time.sleep(0.01)
            indices = torch.arange(step * 16, step * 16 + 16) % len(x)
            loss = torch.nn.functional.cross_entropy(model(x[indices]), y[indices])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            other.step(loss.detach())
            step += 1
        other.finish()

    trainer = Peer(train)
    out = tmp_path / "ranks"
    site = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "ddp.py"),
            "--config",
            str(config),
            "--data-dir",
            str(tmp_path / "site"),
            "--data",
            str(fashion_like),
            "--model",
            "mlp",
            "--steps",
            "40",
            "--out",
            str(out),
            "--bootstrap",
            other.listen[0],
            "--no-mdns",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
        ],
        capture_output=True,
        text=True,
        timeout=3 * DEADLINE,
    )
    assert site.returncode == 0, site.stdout[-2000:] + site.stderr[-4000:]
    summary = json.loads(site.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 2 and summary["steps"] == 40, json.dumps(summary)
    assert summary["exchanges"] >= 2, json.dumps(summary)
    ranks = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    for name, value in ranks[0].items():
        assert torch.equal(value, ranks[1][name]), f"{name} differs between the ranks"
    trainer.join("the other peer's steps")
    other.leave()
