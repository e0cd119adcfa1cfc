#!/usr/bin/env python3
"""One hivemind peer for a decentralized-training baseline (Fashion-MNIST).

Each peer trains on its own IDX shard with hivemind.Optimizer in local-updates
mode (use_local_updates=True): every peer steps its own optimizer on every
batch; parameters are averaged with the swarm in the background once per
hivemind epoch (= --target-batch-size samples across the swarm).

Start the first peer without --initial-peers; it prints
"hivemind peer: <maddr>" lines. Start the others with
--initial-peers <one of those maddrs>.

Tuning note: a hivemind epoch ends when the swarm reaches --target-batch-size
samples OR when the tracker's ETA for it passes. With delayed state averaging a
peer blocks at the next epoch boundary until the previous averaging round
(>= --matchmaking-time) has finished, so keep the compute time per hivemind
epoch well above the matchmaking time; otherwise epochs become time-driven
(a few hundred samples each) and throughput collapses.

In local-updates mode hivemind uses "delta rule" averaging and every local
step waits for a pending averaging round, so each round costs roughly
--matchmaking-time of training time on every peer in it.

Output (--out, JSON lines):
  {"t", "samples", "test_accuracy", "hivemind_epoch", ...}   every --eval-every s
  {"final": true, "wall_s", "time_to_target_s", ...}          last line
"""

import argparse
import gzip
import json
import logging
import os
import re
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# When this process started (its imports are quick next to hivemind's, imported in main): the
# clock of a run's time to target, as a Murmur node's start.
STARTED = time.time()

# ---------------------------------------------------------------- data (IDX)


def read_idx(path):
    """Read an IDX file (raw or .gz) into a numpy array (plain numpy)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = data[0] << 8 | data[1], data[2], data[3]
    if zero != 0:
        raise ValueError(f"{path}: bad IDX magic")
    dtypes = {
        0x08: np.uint8,
        0x09: np.int8,
        0x0B: np.dtype(">i2"),
        0x0C: np.dtype(">i4"),
        0x0D: np.dtype(">f4"),
        0x0E: np.dtype(">f8"),
    }
    dims = np.frombuffer(data, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    arr = np.frombuffer(data, dtype=dtypes[dtype_code], offset=4 + 4 * ndim)
    return arr.reshape(tuple(dims))


def find_idx(directory, stem):
    for name in (stem, stem + ".gz"):
        p = os.path.join(directory, name)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"no {stem}[.gz] in {directory}")


def load_split(directory, prefix):
    x = read_idx(find_idx(directory, f"{prefix}-images-idx3-ubyte"))
    y = read_idx(find_idx(directory, f"{prefix}-labels-idx1-ubyte"))
    assert len(x) == len(y), (x.shape, y.shape)
    x = torch.from_numpy(x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    x = (x - 0.2860) / 0.3530  # Fashion-MNIST mean/std
    return x, torch.from_numpy(y.astype(np.int64))


def ensure_test_dir(test_dir):
    if os.path.isdir(test_dir):
        return
    print(f"{test_dir} missing; installing dataset-fashion-mnist with apt-get", flush=True)
    cmd = ["apt-get", "install", "-y", "dataset-fashion-mnist"]
    if os.geteuid() != 0:
        cmd = ["sudo", *cmd]
    subprocess.run(cmd, check=True)
    if not os.path.isdir(test_dir):
        raise FileNotFoundError(test_dir)


# ---------------------------------------------------------------- models


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x):
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


MODELS = {"cnn": Cnn, "mlp": Mlp}


@torch.no_grad()
def evaluate(model, x, y, batch=2000):
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        correct += (model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum().item()
    model.train()
    return correct / len(x)


# ---------------------------------------------------------------- hivemind log counter


class AveragingCounter(logging.Handler):
    """Counts hivemind's 'Averaged parameters with N peers' / failures (needs verbose=True)."""

    PAT = re.compile(r"Averaged parameters with (\d+) peers")

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.rounds, self.failed, self.group_sizes = 0, 0, []

    def emit(self, record):
        msg = record.getMessage()
        m = self.PAT.search(msg)
        if m:
            self.rounds += 1
            self.group_sizes.append(int(m.group(1)))
        elif msg.startswith("Averaging failed"):
            self.failed += 1


# ---------------------------------------------------------------- main


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        help="multiaddrs of existing peers (space or comma separated); empty for the first peer",
    )
    p.add_argument(
        "--host-maddr",
        action="append",
        default=None,
        help="listen multiaddr (repeatable); default /ip4/127.0.0.1/tcp/0",
    )
    p.add_argument("--run-id", default="fmnist_baseline")
    p.add_argument(
        "--target-batch-size",
        type=int,
        default=32768,
        help="samples across the swarm per hivemind epoch (one param-averaging round per epoch)",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=float, default=1, help="local passes over the shard")
    p.add_argument(
        "--shard", required=True, help="dir with train-{images-idx3,labels-idx1}-ubyte[.gz]"
    )
    p.add_argument(
        "--test-dir",
        default="/usr/share/datasets/fashion-mnist",
        help="dir with t10k-{images-idx3,labels-idx1}-ubyte[.gz]",
    )
    p.add_argument("--model", choices=sorted(MODELS), default="cnn")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument(
        "--seed", type=int, default=0, help="data-order seed (use a different one per peer)"
    )
    p.add_argument(
        "--init-seed", type=int, default=0, help="model-init seed (keep equal on all peers)"
    )
    p.add_argument("--target-accuracy", type=float, default=0.87)
    p.add_argument(
        "--eval-every", type=float, default=10.0, help="seconds between test evaluations"
    )
    p.add_argument("--out", required=True, help="JSON lines output file (appended)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--matchmaking-time",
        type=float,
        default=2.0,
        help="s to wait for peers when forming an averaging group (hivemind suggests 3-5 locally)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="averager request_timeout; must be < matchmaking time (default: matchmaking/2, max 3)",
    )
    p.add_argument(
        "--averaging-timeout",
        type=float,
        default=6.0,
        help="give up an averaging round after this many s (stragglers wait this long at the end)",
    )
    p.add_argument(
        "--average-state-every", type=int, default=1, help="average params every N hivemind epochs"
    )
    p.add_argument(
        "--min-peers",
        type=int,
        default=1,
        help="wait (up to --wait-timeout s) for this many peers in the run before training",
    )
    p.add_argument("--wait-timeout", type=float, default=120.0)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="hide hivemind INFO status lines (warnings still shown)",
    )
    a = p.parse_args()
    a.initial_peers = [m for item in a.initial_peers for m in item.split(",") if m.strip()]
    a.host_maddr = a.host_maddr or ["/ip4/127.0.0.1/tcp/0"]
    if a.request_timeout is None:
        a.request_timeout = min(3.0, a.matchmaking_time / 2)
    return a


def wait_for_peers(dht, key, peer_id, n, timeout):
    from hivemind.utils import get_dht_time

    deadline = time.monotonic() + timeout
    while True:
        dht.store(key, subkey=peer_id, value=True, expiration_time=get_dht_time() + 30)
        entry = dht.get(key, latest=True)
        seen = len(entry.value) if entry is not None and isinstance(entry.value, dict) else 0
        if seen >= n or time.monotonic() > deadline:
            return seen
        time.sleep(1.0)


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)

    import hivemind  # imported late: slow import, and it sets up its own logging

    counter = AveragingCounter()
    logging.getLogger("hivemind").addHandler(counter)
    if a.quiet:  # keep INFO status records flowing to the counter, hide them on stderr
        from hivemind.utils import logging as hm_logging

        hm_logging.get_logger("hivemind")
        hm_logging._default_handler.setLevel(logging.WARNING)

    x_train, y_train = load_split(a.shard, "train")
    ensure_test_dir(a.test_dir)
    x_test, y_test = load_split(a.test_dir, "t10k")

    # same init on every peer (like a shared checkpoint): averaging independently initialised models
    # in the first round wrecks accuracy (seen: 0.80 -> 0.21). --seed only drives the data order.
    torch.manual_seed(a.init_seed)
    model = MODELS[a.model]()
    torch.manual_seed(a.seed)

    # shutdown_timeout > 3 s: the DHT loop may sleep 3 s after a benign pipe race during the
    # optimizer's shutdown
    dht = hivemind.DHT(
        initial_peers=a.initial_peers or None,
        host_maddrs=a.host_maddr,
        start=True,
        shutdown_timeout=10,
    )
    for maddr in dht.get_visible_maddrs():
        print(f"hivemind peer: {maddr}", flush=True)
    peer_id = str(dht.peer_id)

    def make_opt(params):
        if a.optimizer == "sgd":
            return torch.optim.SGD(params, lr=a.lr, momentum=a.momentum)
        return torch.optim.Adam(params, lr=a.lr)

    opt = hivemind.Optimizer(
        dht=dht,
        run_id=a.run_id,
        target_batch_size=a.target_batch_size,
        batch_size_per_step=a.batch_size,
        params=model.parameters(),
        optimizer=make_opt,
        use_local_updates=True,
        average_state_every=a.average_state_every,
        matchmaking_time=a.matchmaking_time,
        averaging_timeout=a.averaging_timeout,
        averager_opts=dict(request_timeout=a.request_timeout),
        verbose=True,  # status at INFO: needed by AveragingCounter
    )
    # A peer that joins late notices at its first opt.step() that it is behind, and loads the
    # parameters from its peers.

    if a.min_peers > 1:
        seen = wait_for_peers(dht, f"{a.run_id}_ready", peer_id, a.min_peers, a.wait_timeout)
        print(f"peers ready: {seen}/{a.min_peers}", flush=True)

    def emit(rec):
        with open(a.out, "a") as out:
            out.write(json.dumps(rec) + "\n")

    n = len(x_train)
    gen = torch.Generator().manual_seed(a.seed)
    total_steps = round(a.epochs * (n // a.batch_size))
    t0 = time.monotonic()
    samples, step, time_to_target, samples_to_target = 0, 0, None, None
    last_eval = t0
    best = 0.0

    def do_eval():
        nonlocal time_to_target, samples_to_target, best
        acc = evaluate(model, x_test, y_test)
        best = max(best, acc)
        t = time.monotonic() - t0
        if time_to_target is None and acc >= a.target_accuracy:
            time_to_target, samples_to_target = t, samples
        rec = {
            "t": round(t, 3),
            "unix": time.time(),
            "started_unix": STARTED,
            "samples": samples,
            "test_accuracy": acc,
            "hivemind_epoch": opt.local_epoch,
            "global_epoch": opt.tracker.global_epoch,
            "swarm_peers": opt.tracker.global_progress.num_peers,
            "avg_rounds": counter.rounds,
            "avg_failed": counter.failed,
            "peer": peer_id,
        }
        emit(rec)
        print(json.dumps(rec), flush=True)
        return acc

    do_eval()
    model.train()
    while step < total_steps:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n - a.batch_size + 1, a.batch_size):
            if step >= total_steps:
                break
            idx = perm[i : i + a.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            samples += len(idx)
            step += 1
            if time.monotonic() - last_eval >= a.eval_every:
                do_eval()
                last_eval = time.monotonic()

    acc = do_eval()
    wall = time.monotonic() - t0
    final = {
        "final": True,
        "wall_s": round(wall, 3),
        "samples": samples,
        "steps": step,
        "test_accuracy": acc,
        "best_accuracy": best,
        "target_accuracy": a.target_accuracy,
        "time_to_target_s": None if time_to_target is None else round(time_to_target, 3),
        "samples_to_target": samples_to_target,
        "hivemind_epoch": opt.local_epoch,
        "avg_rounds": counter.rounds,
        "avg_failed": counter.failed,
        "avg_group_sizes": counter.group_sizes,
        "model": a.model,
        "peer": peer_id,
    }
    emit(final)
    print(json.dumps(final), flush=True)

    opt.shutdown()
    # hivemind's own "goodbye" (progress record = None) is a fire-and-forget store that is lost
    # when the DHT is shut down right after; then the remaining peers keep counting us for
    # metadata_expiration (60 s) and burn --averaging-timeout per epoch on rounds that cannot
    # form. Store it synchronously instead.
    try:
        from hivemind.utils import get_dht_time

        tr = opt.tracker
        dht.store(
            tr.training_progress_key,
            subkey=tr._local_public_key,
            value=None,
            expiration_time=get_dht_time() + tr.metadata_expiration,
        )
    except Exception as e:  # private attributes: best effort only
        print(f"goodbye store failed: {e!r}", file=sys.stderr)
    dht.shutdown()


if __name__ == "__main__":
    main()
