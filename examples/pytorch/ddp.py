"""A site of several ranks as one Murmur peer: the ranks train one replica with PyTorch's own
DistributedDataParallel (gloo on CPU here; NCCL on GPUs, see docs/pytorch.md), and rank 0
speaks for the group to the swarm. After each step the other ranks take what the swarm did to
rank 0's model, so the group stays one replica.

    torchrun --nproc-per-node 2 examples/pytorch/ddp.py --config examples/pytorch/cnn.toml \\
        --data-dir site-a [--bootstrap /ip4/.../p2p/...]

Each rank trains on its half of every batch of the peer's data (the site's batch is the run's
``training.batch_size``). Rank 0 prints the node's lines and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import murmur
import murmur.cli
from fashion import (
    DEFAULT_DATA,
    Cnn,
    Mlp,
    accuracy,
    epoch_samples,
    learning_rate,
    load_split,
    make_optimizer,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    murmur.cli.add_node_arguments(parser)
    parser.add_argument("--model", choices=["mlp", "cnn"], help="default: the config's")
    parser.add_argument("--data", type=Path, help=f"Fashion-MNIST (default {DEFAULT_DATA})")
    parser.add_argument("--shard", type=Path, help="train on this shard (nodectl shard)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, help="stop after this many steps")
    parser.add_argument("--out", type=Path, help="each rank saves its parameters here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    config = tomllib.loads(Path(args.config).read_text())
    training, optimizer_spec = config["training"], config.get("optimizer", {})
    seed = int(config.get("run", {}).get("seed", 0))
    torch.manual_seed(seed)
    data = args.data or Path(config.get("data", {}).get("dir", DEFAULT_DATA))
    train_x, train_y = load_split(args.shard or data, "train")
    test_x, test_y = load_split(data, "t10k")
    kind = args.model or config.get("model", {}).get("kind", "cnn")
    inner = Mlp() if kind == "mlp" else Cnn()
    model = DistributedDataParallel(inner)
    optimizer = make_optimizer(inner, optimizer_spec)
    batch = int(training["batch_size"])
    samples = min(len(train_x), epoch_samples(len(train_x), args.shard, config))
    per_epoch = max(1, math.ceil(samples / batch))
    total = per_epoch * int(training["epochs"])
    if args.steps is not None:
        total = min(total, args.steps)

    swarm = murmur.cli.join(
        args,
        model,
        optimizer,
        process_group=dist.group.WORLD,
        evaluate=(lambda: accuracy(inner, test_x, test_y)) if rank == 0 else None,
        steps_per_epoch=per_epoch,
    )
    started = time.perf_counter()
    # Every rank follows rank 0's clock (a checkpoint, a state sync): `swarm.steps`.
    step, order_epoch, order = swarm.steps, -1, None
    while step < total:
        epoch, at = divmod(step, per_epoch)
        if epoch != order_epoch:
            generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
            order, order_epoch = torch.randperm(len(train_x), generator=generator), epoch
        indices = order[at * batch : (at + 1) * batch][rank::world]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(optimizer_spec, step, total)
        loss = F.cross_entropy(model(train_x[indices]), train_y[indices])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        swarm.step(loss.detach(), samples=batch)
        step = swarm.steps
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {name: value.clone() for name, value in inner.state_dict().items()},
            args.out / f"rank{rank}.pt",
        )
    if swarm.is_leader:
        test_accuracy, _ = accuracy(inner, test_x, test_y)
        status = swarm.status()
        summary = {
            "ranks": world,
            "steps": step,
            "test_accuracy": round(test_accuracy, 5),
            "exchanges": status["sync"]["exchanges"] + status["sync"]["served"],
            "state_syncs": status["sync"]["state_syncs"],
            "wall_s": round(time.perf_counter() - started, 3),
            "pid": os.getpid(),
        }
        print(json.dumps(summary), flush=True)
    swarm.leave()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
