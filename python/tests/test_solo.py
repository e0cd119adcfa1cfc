"""A PyTorch peer alone in its run trains as the same loop without Murmur, bit for bit, and is
seen by the node's observers as a native peer is."""

from __future__ import annotations

import json
import urllib.request

import torch

import murmur
from conftest import Mlp, batches, train_step


def test_a_peer_with_no_partners_trains_bit_for_bit_as_without_murmur(run_config, node_args):
    data = batches(seed=7)

    def model_and_optimizer() -> tuple[Mlp, torch.optim.Optimizer]:
        torch.manual_seed(3)
        model = Mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    plain, optimizer = model_and_optimizer()
    for step in range(40):
        train_step(plain, optimizer, data[step % len(data)])

    model, optimizer = model_and_optimizer()
    config = run_config("solo")
    with murmur.join(config, model, optimizer, steps_per_epoch=10, **node_args("solo")) as swarm:
        for step in range(40):
            swarm.step(train_step(model, optimizer, data[step % len(data)]))
        assert swarm.steps == 40
        status = swarm.status()
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs from the plain loop's"
    # Snapshots fell due (every 4 steps) and found no partner: nothing landed.
    assert status["step"] == 40
    assert status["sync"]["exchanges"] == 0


def test_the_node_is_seen_as_a_native_one_is(run_config, node_args, swarms):
    model = Mlp()
    swarm = murmur.join(run_config("seen"), model, steps_per_epoch=5, **node_args("seen"))
    swarms.append(swarm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in batches(seed=1, count=6):
        swarm.step(train_step(model, optimizer, batch), samples=8)
    with urllib.request.urlopen(f"http://{swarm.api}/status", timeout=10) as answer:
        status = json.load(answer)
    assert status["peer_id"] == swarm.peer_id
    assert (status["step"], status["samples_seen"], status["model"]) == (6, 48, "pytorch")
    assert status["fingerprint"] == murmur.fingerprint(model)
    with urllib.request.urlopen(f"http://{swarm.api}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    assert "murmur_steps_total 6" in metrics, metrics[:600]
    # The control API's address is in the data dir, where `nodectl status --data-dir` looks.
    assert (node_args("seen")["data_dir"] / "api").read_text() == swarm.api
