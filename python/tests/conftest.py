"""Shared helpers of the murmur package's tests: run configs, small models, synthetic data,
and peers in threads of this process (each swarm has a node of its own)."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import murmur

#: Every wait of a test has a deadline (seconds) that fails it with a message.
DEADLINE = 60.0

#: The repository's examples (`examples/pytorch`).
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "pytorch"


class Mlp(nn.Module):
    """Murmur's MLP shape at a small width: fc1, fc2, fc3."""

    def __init__(self, hidden: tuple[int, int] = (16, 8), inputs: int = 20) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.fc3 = nn.Linear(hidden[1], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def batches(seed: int, count: int = 32, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic batches: inputs whose label is the argmax of four fixed projections."""
    generator = torch.Generator().manual_seed(seed)
    projection = torch.randn(20, 4, generator=torch.Generator().manual_seed(1234))
    out = []
    for _ in range(count):
        x = torch.randn(size, 20, generator=generator)
        out.append((x, (x @ projection).argmax(1)))
    return out


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture
def run_config(tmp_path: Path) -> Callable[..., Path]:
    """Writes a run config; keyword arguments become `[sync]` keys, `model` a `[model]`
    section's text, `name` the run's name."""

    def write(name: str = "pytest", model: str = "", **sync: Any) -> Path:
        settings = {"mode": "gossip", "interval": 4, "max_staleness": 16, **sync}
        lines = [f'[run]\nname = "{name}"\nseed = 1\n', "[training]\nepochs = 1\nbatch_size = 8\n"]
        if model:
            lines.append(f"[model]\n{model}\n")
        lines.append("[sync]\n")
        for key, value in settings.items():
            text = f'"{value}"' if isinstance(value, str) else str(value).lower()
            lines.append(f"{key} = {text}\n")
        path = tmp_path / f"{name}.toml"
        path.write_text("".join(lines))
        return path

    return write


@pytest.fixture
def node_args(tmp_path: Path) -> Callable[[str], dict[str, Any]]:
    """`murmur.join`'s keyword arguments for a node of this test on loopback."""

    def args(name: str, **extra: Any) -> dict[str, Any]:
        return {
            "data_dir": tmp_path / name,
            "listen": ["/ip4/127.0.0.1/tcp/0"],
            "mdns": False,
            "progress": False,
            **extra,
        }

    return args


class Peer:
    """A swarm whose training loop runs in a thread of this process."""

    def __init__(self, target: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(target,), daemon=True)
        self._thread.start()

    def _run(self, target: Callable[[], Any]) -> None:
        try:
            self.result = target()
        except BaseException as e:  # reported by join()
            self.error = e

    def join(self, what: str) -> Any:
        self._thread.join(DEADLINE)
        assert not self._thread.is_alive(), f"{what}: not within {DEADLINE} s"
        if self.error is not None:
            raise self.error
        return self.result


def write_idx(path: Path, array: np.ndarray) -> None:
    """Writes ``array`` (uint8) as a gzipped IDX file."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


@pytest.fixture
def fashion_like(tmp_path: Path) -> Path:
    """A small dataset in Fashion-MNIST's files: 28x28 images whose class is the brightest
    of ten bands, 512 to train on and 128 to test."""
    directory = tmp_path / "fashion-like"
    directory.mkdir()
    rng = np.random.default_rng(5)
    for stem, count in (("train", 512), ("t10k", 128)):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        images = rng.integers(0, 60, (count, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            images[i, :, label * 2 : label * 2 + 3] += 150
        write_idx(directory / f"{stem}-images-idx3-ubyte.gz", images)
        write_idx(directory / f"{stem}-labels-idx1-ubyte.gz", labels)
    return directory


@pytest.fixture
def swarms() -> Iterator[list[murmur.Swarm]]:
    """Swarms a test starts; any still running at its end leave."""
    started: list[murmur.Swarm] = []
    yield started
    for swarm in started:
        swarm.leave()
