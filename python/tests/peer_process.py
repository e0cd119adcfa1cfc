"""A PyTorch peer in a process of its own, for the tests that kill one: it trains the tests'
MLP on synthetic data and prints `start N` once joined, then `step N` after every step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import murmur
from conftest import Mlp, batches, train_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--steps-per-epoch", type=int, default=5)
    parser.add_argument("--peer-timeout", type=float, default=2.0)
    args = parser.parse_args()
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    swarm = murmur.join(
        args.config,
        model,
        optimizer,
        data_dir=args.data_dir,
        bootstrap=args.bootstrap,
        listen=["/ip4/127.0.0.1/tcp/0"],
        mdns=False,
        peer_timeout=args.peer_timeout,
        steps_per_epoch=args.steps_per_epoch,
        progress=False,
    )
    print(f"start {swarm.start_step}", flush=True)
    data = batches(seed=9)
    while swarm.steps < args.steps:
        swarm.step(train_step(model, optimizer, data[swarm.steps % len(data)]))
        print(f"step {swarm.steps}", flush=True)
    swarm.leave()


if __name__ == "__main__":
    main()
