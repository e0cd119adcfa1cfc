"""PyTorch peers in one run: they mix, and a late joiner takes the swarm's state."""

from __future__ import annotations

import time

import torch

import murmur
from conftest import DEADLINE, Mlp, Peer, batches, flat, train_step


def test_two_peers_mix_their_parameters(run_config, node_args, swarms):
    config = run_config("pair", interval=4, max_staleness=8)

    def train(swarm: murmur.Swarm, model: Mlp, seed: int, steps: int) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = batches(seed=seed)
        for step in range(steps):
            swarm.step(train_step(model, optimizer, data[step % len(data)]))
        swarm.finish()

    torch.manual_seed(1)
    a_model, b_model = Mlp(), Mlp()
    a = murmur.join(config, a_model, **node_args("a"))
    swarms.append(a)
    b = murmur.join(config, b_model, **node_args("b", bootstrap=a.listen))
    swarms.append(b)
    peers = [Peer(lambda: train(a, a_model, 10, 60)), Peer(lambda: train(b, b_model, 20, 60))]
    for peer in peers:
        peer.join("a peer's 60 steps")
    mixed = a.status()["sync"]["exchanges"] + b.status()["sync"]["exchanges"]
    assert mixed >= 3, f"only {mixed} exchanges in 60 steps at an interval of 4"
    apart = (flat(a_model) - flat(b_model)).norm() / flat(a_model).norm()

    # The same two loops, alone: their replicas end farther apart.
    torch.manual_seed(1)
    alone_a, alone_b = Mlp(), Mlp()
    for model, seed in ((alone_a, 10), (alone_b, 20)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = batches(seed=seed)
        for step in range(60):
            train_step(model, optimizer, data[step % len(data)])
    apart_alone = (flat(alone_a) - flat(alone_b)).norm() / flat(alone_a).norm()
    assert apart < 0.5 * apart_alone, f"{apart:.4f} apart mixed, {apart_alone:.4f} alone"


def test_a_late_joiner_takes_the_swarms_parameters_and_optimizer_state(
    run_config, node_args, swarms
):
    config = run_config("late", interval=4, max_staleness=8)
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    first = murmur.join(config, model, optimizer, **node_args("first"))
    swarms.append(first)
    data = batches(seed=4)
    for step in range(100):
        first.step(train_step(model, optimizer, data[step % len(data)]))

    def keep_training() -> None:
        step = 0
        while first.steps < 400 and first.running:
            first.step(train_step(model, optimizer, data[step % len(data)]))
            step += 1
        first.finish()

    running = Peer(keep_training)
    late_model = Mlp()
    late_optimizer = torch.optim.SGD(late_model.parameters(), lr=0.05, momentum=0.9)
    late = murmur.join(
        config, late_model, late_optimizer, **node_args("late", bootstrap=first.listen)
    )
    swarms.append(late)
    deadline = time.monotonic() + DEADLINE
    # A loop of a real model steps slower than a heartbeat arrives (one a second): this one
    # waits for it, so that it has heard how far the swarm is.
    while late.status()["live_peers"] == 0:
        assert time.monotonic() < deadline, "the late joiner did not hear the first peer"
        time.sleep(0.05)
    late_data = batches(seed=5)
    while late.steps < 100:
        assert time.monotonic() < deadline, f"the late joiner is at step {late.steps}, not 100+"
        late.step(train_step(late_model, late_optimizer, late_data[late.steps % len(late_data)]))
    # The engine counts the state sync once the replica took it over: a moment later.
    while (status := late.status())["sync"]["state_syncs"] == 0:
        assert time.monotonic() < deadline, f"no state sync counted: {status['sync']}"
        time.sleep(0.05)
    # The peer's optimizer is the same: its momentum came with its parameters.
    assert all("momentum_buffer" in late_optimizer.state[p] for p in late_model.parameters())
    late.finish()
    running.join("the first peer's 400 steps")
