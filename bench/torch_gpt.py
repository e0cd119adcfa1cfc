#!/usr/bin/env python3
"""PyTorch's side of Murmur's GPT: the same model, written the way nanoGPT writes it, as the
oracle the trainer's GPT is checked against.

The model: token and position embeddings, blocks of LayerNorm, causal multi-head
self-attention (one `c_attn` linear whose output splits into queries, keys and values), a
residual add, LayerNorm, a 4x MLP with the tanh GELU, a residual add; a final LayerNorm and an
output head tied to the token embedding. Parameter names are nanoGPT's, which are the names in
Murmur's checkpoints.

    python3 bench/torch_gpt.py fixture OUT.safetensors

writes the gradients of one step of a small GPT whose parameters and batch follow fixed formulas
(see `fixture_params`), the reference that `trainer/tests/pytorch_reference.rs` compares every
gradient of Murmur's GPT against.

    python3 bench/torch_gpt.py bench [--batch 12] [--threads 1] [--trials 7] [--trial-secs 2]

times training steps (forward, backward, AdamW) of nanoGPT's CPU configuration on one fixed
batch, fp32 eager mode, as `nodectl bench train --model gpt` times Murmur's, and prints one JSON
line with tokens/s (the median over trials). Needs `pip install torch safetensors`.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(width, 3 * width)
        self.attn.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(width, 4 * width)
        self.mlp.c_proj = nn.Linear(4 * width, width)

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = self.attn.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.attn.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp.c_proj(h)


class Gpt(nn.Module):
    def __init__(self, layers, heads, width, context, vocab):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, width)
        self.transformer.wpe = nn.Embedding(context, width)
        self.transformer.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.transformer.ln_f = nn.LayerNorm(width)

    def forward(self, tokens, targets):
        t = tokens.size(1)
        x = self.transformer.wte(tokens) + self.transformer.wpe(torch.arange(t))
        for block in self.transformer.h:
            x = block(x)
        logits = self.transformer.ln_f(x) @ self.transformer.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# The fixture: 2 blocks, 2 heads, width 16, context 8, the byte vocabulary; 3 sequences of 8.
FIXTURE = dict(layers=2, heads=2, width=16, context=8, vocab=256)
FIXTURE_SEQUENCES = 3


def fixture_params(model):
    """Parameter i of the flat buffer (tensors in Murmur's layout order, which is
    `named_parameters` order) is ((i * 37) % 101 - 50) / 256, exact in f32."""
    i = 0
    with torch.no_grad():
        for _, p in model.named_parameters():
            idx = torch.arange(i, i + p.numel())
            p.copy_((((idx * 37) % 101) - 50).float().reshape(p.shape) / 256.0)
            i += p.numel()


def fixture_batch():
    """Tokens (b * 131 + t * 17) % 256 and targets (b * 71 + t * 29 + 3) % 256."""
    b = torch.arange(FIXTURE_SEQUENCES).reshape(-1, 1)
    t = torch.arange(FIXTURE["context"]).reshape(1, -1)
    return (b * 131 + t * 17) % 256, (b * 71 + t * 29 + 3) % 256


def fixture(out):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Gpt(**FIXTURE)
    fixture_params(model)
    tokens, targets = fixture_batch()
    loss = model(tokens, targets)
    loss.backward()
    tensors = {"loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():
        tensors[f"grad.{name}"] = p.grad.detach().contiguous()
    save_file(tensors, out, metadata={"torch": torch.__version__})
    print(f"loss {loss.item():.9g}; {len(tensors) - 1} gradients written to {out} "
          f"(torch {torch.__version__})")


# nanoGPT's configuration for a CPU, as `nodectl bench train --model gpt`.
NANO_CPU = dict(layers=4, heads=4, width=128, context=64, vocab=256)


def bench(args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Gpt(**NANO_CPU)
    context, vocab = NANO_CPU["context"], NANO_CPU["vocab"]
    i = torch.arange(args.batch * context).reshape(args.batch, context)
    tokens = (i * 7919) % vocab
    targets = (tokens + 1) % vocab
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(tokens, targets).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    rates = []
    for _ in range(args.trials):
        start, steps = time.perf_counter(), 0
        while time.perf_counter() - start < args.trial_secs:
            step()
            steps += 1
        rates.append(steps * args.batch * context / (time.perf_counter() - start))
    print(json.dumps({
        "bench": "torch_gpt", "batch": args.batch, "threads": args.threads,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_sec": round(statistics.median(rates), 1),
        "tokens_per_sec_trials": [round(r, 1) for r in rates],
        "torch": torch.__version__,
    }))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fixture", help="write the gradients of the fixture's step")
    f.add_argument("out")
    b = sub.add_parser("bench", help="tokens/s of the training step")
    b.add_argument("--batch", type=int, default=12, help="sequences of 64 tokens")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--trials", type=int, default=7)
    b.add_argument("--trial-secs", type=float, default=2.0)
    b.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    if args.command == "fixture":
        fixture(args.out)
    else:
        bench(args)


if __name__ == "__main__":
    main()
