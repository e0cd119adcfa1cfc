"""Fashion-MNIST with your own PyTorch model in a Murmur swarm, or alone with ``--plain``.

The run config drives both: ``[training]`` gives the epochs and the batch size, ``[optimizer]``
the learning rate and schedule, ``[sync]`` how the swarm mixes. The models mirror Murmur's own
MLP and CNN tensor for tensor (``fc1.weight`` is ``[256, 784]``...), so PyTorch peers and
``nodectl join`` peers of the same model can train one run together.

    python examples/pytorch/fashion.py --config examples/pytorch/cnn-single.toml --plain
    python examples/pytorch/fashion.py --config examples/pytorch/cnn.toml --data-dir node-a
    python examples/pytorch/fashion.py --config examples/pytorch/cnn.toml --data-dir node-b \\
        --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...

``testnet/run.sh --python examples/pytorch/fashion.py -c examples/pytorch/cnn.toml`` starts
several peers with their own shards. The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import math
import os
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import murmur
import murmur.cli

DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"


class Mlp(nn.Module):
    """Murmur's default MLP: 784-256-128-10 with ReLU."""

    def __init__(self, hidden: tuple[int, ...] = (256, 128)) -> None:
        super().__init__()
        widths = [28 * 28, *hidden, 10]
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            setattr(self, f"fc{i + 1}", nn.Linear(fan_in, fan_out))
        self.layers = len(widths) - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for i in range(self.layers):
            x = getattr(self, f"fc{i + 1}")(x)
            if i + 1 < self.layers:
                x = F.relu(x)
        return x


class Cnn(nn.Module):
    """Murmur's CNN: two 3x3 convolution blocks (32, 64 channels) with max-pooling, then
    3136-128-10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (raw or gzip) as an array."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_split(directory: Path, stem: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 1, 28, 28) scaled to [0, 1] and labels of ``stem`` (``train`` or ``t10k``)."""

    def find(name: str) -> Path:
        for candidate in (directory / name, directory / f"{name}.gz"):
            if candidate.exists():
                return candidate
        raise SystemExit(
            f"no {name}[.gz] in {directory}: install Fashion-MNIST "
            "(apt-get install dataset-fashion-mnist) or pass --data DIR"
        )

    images = read_idx(find(f"{stem}-images-idx3-ubyte"))
    labels = read_idx(find(f"{stem}-labels-idx1-ubyte"))
    x = torch.from_numpy(images.copy()).float().div_(255.0).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))


def epoch_samples(train: int, shard: Path | None, config: dict) -> int:
    """Samples in an epoch: ``training.epoch_samples``, else the mean shard size of a shard set
    (as Murmur's trainer counts it, so that every peer takes as many steps), else the set."""
    if "epoch_samples" in config["training"]:
        return int(config["training"]["epoch_samples"])
    if shard is not None and (shard / "shard.json").exists():
        info = json.loads((shard / "shard.json").read_text())
        return int(info["set_samples"]) // int(info["peers"])
    return train


def learning_rate(optimizer: dict, step: int, total: int) -> float:
    """The run's learning rate at ``step``: constant, or linear warmup then cosine decay."""
    base = float(optimizer.get("lr", 0.1))
    if optimizer.get("schedule", "constant") != "warmup_cosine":
        return base
    warmup = int(optimizer.get("warmup_steps", 0))
    floor = float(optimizer.get("min_lr", 0.0))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, spec: dict) -> torch.optim.Optimizer:
    kind = spec.get("kind", "sgd")
    lr = float(spec.get("lr", 0.1))
    if kind == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=float(spec.get("weight_decay", 0.01))
        )
    return torch.optim.SGD(
        model.parameters(),
        lr=lr,
        momentum=float(spec.get("momentum", 0.0)),
        nesterov=bool(spec.get("nesterov", False)),
        weight_decay=float(spec.get("weight_decay", 0.0)),
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Test accuracy and mean loss."""
    model.eval()
    right, loss = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(x), 1000):
            logits = model(x[start : start + 1000])
            loss += F.cross_entropy(logits, y[start : start + 1000], reduction="sum").item()
            right += (logits.argmax(1) == y[start : start + 1000]).sum().item()
    model.train()
    return right / len(x), loss / len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    murmur.cli.add_node_arguments(parser)
    parser.add_argument("--model", choices=["mlp", "cnn"], help="default: the config's")
    parser.add_argument("--data", type=Path, help=f"Fashion-MNIST (default {DEFAULT_DATA})")
    parser.add_argument("--shard", type=Path, help="train on this shard (nodectl shard)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--epochs", type=int, help="override training.epochs")
    parser.add_argument("--steps", type=int, help="stop after this many steps")
    parser.add_argument("--plain", action="store_true", help="train alone, without Murmur")
    parser.add_argument(
        "--leave-when-done",
        action="store_true",
        help="leave as soon as training ends (default: answer peers until stopped)",
    )
    args = parser.parse_args()

    config = tomllib.loads(Path(args.config).read_text())
    training, optimizer_spec = config["training"], config.get("optimizer", {})
    seed = int(config.get("run", {}).get("seed", 0))
    kind = args.model or config.get("model", {}).get("kind", "cnn")
    torch.manual_seed(seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = args.data or Path(config.get("data", {}).get("dir", DEFAULT_DATA))
    train_x, train_y = load_split(args.shard or data, "train")
    test_x, test_y = load_split(data, "t10k")

    model = Mlp() if kind == "mlp" else Cnn()
    optimizer = make_optimizer(model, optimizer_spec)
    batch = int(training["batch_size"])
    # As Murmur's trainer counts them: the epoch's samples in batches, the last one short.
    samples = min(len(train_x), epoch_samples(len(train_x), args.shard, config))
    per_epoch = max(1, math.ceil(samples / batch))
    epochs = args.epochs or int(training["epochs"])
    total = per_epoch * epochs
    if args.steps is not None:
        total = min(total, args.steps)

    swarm = None
    if not args.plain:
        swarm = murmur.cli.join(
            args,
            model,
            optimizer,
            evaluate=lambda: accuracy(model, test_x, test_y),
            steps_per_epoch=per_epoch,
        )
    started = time.perf_counter()
    step = swarm.start_step if swarm else 0
    first = step
    order, order_epoch = None, -1
    try:
        while step < total:
            epoch, at = divmod(step, per_epoch)
            if epoch != order_epoch:
                generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
                order, order_epoch = torch.randperm(len(train_x), generator=generator), epoch
            indices = order[at * batch : (at + 1) * batch]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(optimizer_spec, step, total)
            loss = F.cross_entropy(model(train_x[indices]), train_y[indices])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if swarm is not None:
                swarm.step(loss.detach())
                # A state sync may have moved this replica's clock on.
                step = swarm.steps
            elif step % per_epoch == 0:
                acc, _ = accuracy(model, test_x, test_y)
                print(f"epoch {step // per_epoch}: test accuracy {acc:.4f}", file=sys.stderr)
        wall = time.perf_counter() - started
        test_accuracy, test_loss = accuracy(model, test_x, test_y)
        summary = {
            "model": kind,
            "swarm": swarm is not None,
            "test_accuracy": round(test_accuracy, 5),
            "test_loss": round(test_loss, 5),
            "steps": step,
            "wall_s": round(wall, 3),
            "samples_per_sec": round((step - first) * batch / wall, 1) if wall > 0 else 0.0,
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
            # Equal for two runs that trained bit for bit alike.
            "params_sha256": hashlib.sha256(
                b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())
            ).hexdigest()[:16],
        }
        if swarm is not None:
            summary["peer_id"] = swarm.peer_id
        print(json.dumps(summary), flush=True)
        if swarm is not None:
            swarm.finish()
            if not args.leave_when_done:
                # Answer the peers still training until stopped (SIGTERM, Ctrl-C, nodectl leave).
                swarm.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if swarm is not None:
            swarm.leave()


if __name__ == "__main__":
    main()
