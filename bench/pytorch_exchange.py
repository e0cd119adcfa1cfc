"""What handing a PyTorch model's parameters to the swarm and landing a mix on it cost, on the
node's own path (the `murmur` package's replica adapter and the Rust side that lends it the
buffers), against a memcpy of the model's bytes. Prints one JSON object of medians.

    target/python-venv/bin/python bench/pytorch_exchange.py --params 100e6 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch import nn

from murmur import _native
from murmur._replica import TorchReplica


def model_of(params: float, width: int) -> nn.Module:
    """Square linear layers (no bias) of ``width``, as many as make ``params`` values."""
    layers = max(1, math.ceil(params / (width * width)))
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6, help="values in the model")
    parser.add_argument("--width", type=int, default=4096, help="the layers' width")
    parser.add_argument("--rounds", type=int, default=9, help="exchanges timed")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = model_of(args.params, args.width).to(getattr(torch, args.dtype))
    figures = json.loads(_native.bench_exchange(TorchReplica(model), args.rounds))
    figures.update(dtype=args.dtype, threads=torch.get_num_threads())
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
