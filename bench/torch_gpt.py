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

    python3 bench/torch_gpt.py curve OUT.json

trains a small GPT for 100 steps on the two excerpts of `trainer/testdata/shakespeare/`, from
parameters and batches given by formulas (see `curve`), with AdamW, matrices-only weight decay,
warm-up and cosine, and clipping, and writes its loss at every step: the curve that
`trainer/tests/pytorch_reference.rs` compares Murmur's against.

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
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


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


# The curve: 2 blocks, 2 heads, width 32, context 16; 4 sequences a step for 100 steps.
CURVE = dict(layers=2, heads=2, width=32, context=16, vocab=256)
CURVE_SEQUENCES, CURVE_STEPS = 4, 100
CURVE_LR, CURVE_MIN_LR, CURVE_WARMUP = 3e-3, 3e-4, 10


def curve_params(model):
    """LayerNorm gains 1; every other parameter i of the flat buffer
    ((i * 37) % 101 - 50) / 2560."""
    i = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            idx = torch.arange(i, i + p.numel())
            p.copy_((((idx * 37) % 101) - 50).float().reshape(p.shape) / 2560.0)
            if ".ln_" in name and name.endswith(".weight"):
                p.fill_(1.0)
            i += p.numel()


def curve_windows(text_dir, length):
    """Murmur's training windows of `length` tokens over the excerpts: documents by file name,
    each but its last tenth (rounded up), a window at every token."""
    import pathlib

    windows, documents = [], []
    for path in sorted(pathlib.Path(text_dir).glob("*.txt")):
        tokens = path.read_bytes()
        cut = len(tokens) - math.ceil(len(tokens) * 0.1)
        documents.append(tokens)
        windows += [(len(documents) - 1, start) for start in range(0, cut - length + 1)]
    return documents, windows


def curve_lr(step):
    """Murmur's warm-up and cosine: linear to the rate over the warm-up, then a cosine to the
    floor at the last step."""
    if step < CURVE_WARMUP:
        return CURVE_LR * (step + 1) / CURVE_WARMUP
    progress = min((step - CURVE_WARMUP) / max(CURVE_STEPS - CURVE_WARMUP, 1), 1.0)
    return CURVE_MIN_LR + (CURVE_LR - CURVE_MIN_LR) * 0.5 * (1.0 + math.cos(math.pi * progress))


def curve(out, text_dir):
    torch.manual_seed(0)
    model = Gpt(**CURVE)
    curve_params(model)
    context = CURVE["context"]
    documents, windows = curve_windows(text_dir, context + 1)
    decay = [p for n, p in model.named_parameters() if n.endswith(".weight") and ".ln_" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith(".weight") and ".ln_" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=CURVE_LR, betas=(0.9, 0.99), eps=1e-8)
    losses = []
    for step in range(CURVE_STEPS):
        # Window (step * sequences + j) * 7919 mod the count, for sequence j.
        picks = [windows[(step * CURVE_SEQUENCES + j) * 7919 % len(windows)]
                 for j in range(CURVE_SEQUENCES)]
        batch = torch.tensor([list(documents[d][s:s + context + 1]) for d, s in picks])
        for group in optimizer.param_groups:
            group["lr"] = curve_lr(step)
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "losses": losses}, f)
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} over {CURVE_STEPS} steps, written to {out}")


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
    c = sub.add_parser("curve", help="write the loss at every step of the curve's run")
    c.add_argument("out")
    c.add_argument("--text", default="trainer/testdata/shakespeare",
                   help="the excerpts' directory")
    b = sub.add_parser("bench", help="tokens/s of the training step")
    b.add_argument("--batch", type=int, default=12, help="sequences of 64 tokens")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--trials", type=int, default=7)
    b.add_argument("--trial-secs", type=float, default=2.0)
    b.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    if args.command == "fixture":
        fixture(args.out)
    elif args.command == "curve":
        curve(args.out, args.text)
    else:
        bench(args)


if __name__ == "__main__":
    main()
