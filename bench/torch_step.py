#!/usr/bin/env python3
"""PyTorch side of `bench/compare-torch.sh`: samples/s of one MLP training step on CPU.

The step is the same one `nodectl bench train` times: forward, softmax cross-entropy, backward
and an SGD (momentum 0.9) update of the 784-256-128-10 MLP, repeated on one fixed batch. Each
trial runs whole steps for --trial-secs; the median over trials is reported as one JSON line.
Needs `pip install torch`.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--trial-secs", type=float, default=2.0)
    p.add_argument("--warmup", type=int, default=50)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.rand(args.batch, 784)
    y = torch.randint(0, 10, (args.batch,))

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    rates = []
    for _ in range(args.trials):
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < args.trial_secs:
            for _ in range(10):
                step()
            steps += 10
        rates.append(steps * args.batch / (time.perf_counter() - start))
    print(json.dumps({"framework": "pytorch", "torch": torch.__version__, "batch": args.batch,
                      "threads": args.threads, "samples_per_sec": round(statistics.median(rates), 1),
                      "samples_per_sec_trials": [round(r, 1) for r in rates]}))


if __name__ == "__main__":
    main()
