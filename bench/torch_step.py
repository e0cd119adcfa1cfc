#!/usr/bin/env python3
"""PyTorch side of `bench/compare-torch.sh`: samples/s of one training step, on CPU or a GPU.

The step is the same one `nodectl bench train` times: forward, softmax cross-entropy, backward
and an SGD (momentum 0.9) update, repeated on one fixed batch, of the default MLP
(784-256-128-10) or the default CNN (conv 3x3 32, pool, conv 3x3 64, pool, 128, 10). Each trial
runs whole steps for --trial-secs (on a GPU it waits for the device before reading the clock);
the median over trials is reported as one JSON line. fp32 eager mode, TF32 off. Needs
`pip install torch`.
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
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    if args.model == "mlp":
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                              nn.Linear(128, 10))
        x = torch.rand(args.batch, 784)
    else:
        model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
                              nn.Linear(128, 10))
        x = torch.rand(args.batch, 1, 28, 28)
    device = torch.device(args.device)
    model, x = model.to(device), x.to(device)
    y = torch.randint(0, 10, (args.batch,)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    sync()
    rates = []
    for _ in range(args.trials):
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < args.trial_secs:
            for _ in range(10):
                step()
            steps += 10
            sync()
        rates.append(steps * args.batch / (time.perf_counter() - start))
    print(json.dumps({"framework": "pytorch", "torch": torch.__version__, "model": args.model,
                      "device": args.device, "batch": args.batch,
                      "threads": args.threads, "samples_per_sec": round(statistics.median(rates), 1),
                      "samples_per_sec_trials": [round(r, 1) for r in rates]}))


if __name__ == "__main__":
    main()
