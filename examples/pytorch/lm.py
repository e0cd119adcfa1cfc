"""A small causal language model built with Hugging Face `transformers` from a config (no
download from a hub), trained on Shakespeare in a Murmur swarm, or alone with ``--plain``.

The model is GPT-2's architecture at the size of Murmur's own GPT (4 layers, 4 heads, width
128, a context of 64 bytes; a token is a byte, decision 0053). As Murmur's trainer does, each
document keeps its last tenth for validation, a sample is a window of ``context + 1`` bytes,
and the validation loss is the mean cross-entropy per byte over 512 held-out windows.

    data/fetch-shakespeare.sh
    python examples/pytorch/lm.py --config examples/pytorch/lm-single.toml --plain
    testnet/run.sh --python examples/pytorch/lm.py -c examples/pytorch/lm.toml

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import tomllib
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import murmur
import murmur.cli
from fashion import epoch_samples, learning_rate

HELD_OUT = 512
VALIDATION_SHARE = 0.1


def corpus_dir() -> Path:
    """Where data/fetch-shakespeare.sh installs the texts."""
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "murmur" / "shakespeare"


def load_text(directory: Path, share: float) -> list[torch.Tensor]:
    """The bytes of every ``.txt`` document of ``directory``, by name: the first ``share`` of
    each, or with a negative ``share`` the last ``-share``."""
    documents = []
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise SystemExit(
            f"no .txt documents in {directory}: run data/fetch-shakespeare.sh or pass --data DIR"
        )
    for path in files:
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        held = int(len(data) * VALIDATION_SHARE)
        if share < 0:
            documents.append(data[len(data) - held :])
        else:
            documents.append(data[: len(data) - held] if share < 1.0 else data)
    return documents


def windows(documents: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every window of ``length`` bytes: its document and start, as two index tensors."""
    which, starts = [], []
    for i, document in enumerate(documents):
        count = max(0, len(document) - length + 1)
        which.append(torch.full((count,), i, dtype=torch.long))
        starts.append(torch.arange(count))
    return torch.cat(which), torch.cat(starts)


def batch_of(
    documents: list[torch.Tensor], which: torch.Tensor, starts: torch.Tensor, length: int
) -> torch.Tensor:
    pairs = zip(which.tolist(), starts.tolist(), strict=True)
    rows = [documents[d][s : s + length] for d, s in pairs]
    return torch.stack(rows).long()


def build_model(layers: int, heads: int, width: int, context: int) -> GPT2LMHeadModel:
    """GPT-2 over bytes, without dropout (as Murmur's GPT)."""
    config = GPT2Config(
        vocab_size=256,
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


def loss_of(model: GPT2LMHeadModel, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def validate(model: GPT2LMHeadModel, held_out: torch.Tensor) -> tuple[float, float]:
    """Next-byte accuracy and the mean loss per byte on the held-out windows."""
    model.eval()
    right = total = 0
    loss = 0.0
    with torch.no_grad():
        for start in range(0, len(held_out), 64):
            tokens = held_out[start : start + 64]
            logits = model(tokens[:, :-1]).logits
            target = tokens[:, 1:]
            loss += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
            ).item()
            right += (logits.argmax(-1) == target).sum().item()
            total += target.numel()
    model.train()
    return right / total, loss / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    murmur.cli.add_node_arguments(parser)
    parser.add_argument("--data", type=Path, help="the corpus (default: fetch-shakespeare's)")
    parser.add_argument("--shard", type=Path, help="train on this shard (nodectl shard)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--steps", type=int, help="stop after this many steps")
    parser.add_argument("--plain", action="store_true", help="train alone, without Murmur")
    parser.add_argument("--leave-when-done", action="store_true", help="leave once trained")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--width", type=int, default=128, help="residual width (default 128)")
    parser.add_argument("--context", type=int, default=64, help="context in bytes (default 64)")
    args = parser.parse_args()

    config = tomllib.loads(Path(args.config).read_text())
    training, optimizer_spec = config["training"], config.get("optimizer", {})
    seed = int(config.get("run", {}).get("seed", 0))
    torch.manual_seed(seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = args.data or Path(config.get("data", {}).get("dir") or corpus_dir())
    length = args.context + 1
    # A shard written by `nodectl shard` holds training text only: all of it is trained on.
    train = load_text(args.shard, share=1.0) if args.shard else load_text(data, share=0.9)
    which, starts = windows(train, length)
    validation = load_text(data, share=-0.1)
    held_which, held_starts = windows(validation, length)
    pick = torch.linspace(0, len(held_which) - 1, HELD_OUT).long()
    held_out = batch_of(validation, held_which[pick], held_starts[pick], length)

    model = build_model(args.layers, args.heads, args.width, args.context)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=float(optimizer_spec.get("lr", 1e-3)),
        betas=tuple(optimizer_spec.get("betas", (0.9, 0.999))),
        weight_decay=float(optimizer_spec.get("weight_decay", 0.01)),
    )
    clip = optimizer_spec.get("grad_clip")
    batch = int(training["batch_size"])
    per_epoch = max(1, math.ceil(epoch_samples(len(which), args.shard, config) / batch))
    total = per_epoch * int(training["epochs"])
    if args.steps is not None:
        total = min(total, args.steps)

    swarm = None
    if not args.plain:
        swarm = murmur.cli.join(
            args,
            model,
            optimizer,
            evaluate=lambda: validate(model, held_out),
            steps_per_epoch=per_epoch,
        )
    started = time.perf_counter()
    step = swarm.start_step if swarm else 0
    first = step
    generator = torch.Generator()
    try:
        while step < total:
            generator.manual_seed(seed * 100_003 + step)
            chosen = torch.randint(len(which), (batch,), generator=generator)
            tokens = batch_of(train, which[chosen], starts[chosen], length)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(optimizer_spec, step, total)
            loss = loss_of(model, tokens)
            optimizer.zero_grad()
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
            optimizer.step()
            step += 1
            if swarm is not None:
                swarm.step(loss.detach())
                step = swarm.steps
            elif step % per_epoch == 0:
                _, val = validate(model, held_out)
                print(f"epoch {step // per_epoch}: validation loss {val:.4f}", file=sys.stderr)
        wall = time.perf_counter() - started
        accuracy, val_loss = validate(model, held_out)
        summary = {
            "swarm": swarm is not None,
            "params": sum(p.numel() for p in model.parameters()),
            "validation_loss": round(val_loss, 5),
            "next_byte_accuracy": round(accuracy, 5),
            "steps": step,
            "wall_s": round(wall, 3),
            "samples_per_sec": round((step - first) * batch / wall, 1) if wall > 0 else 0.0,
            "pid": os.getpid(),
        }
        print(json.dumps(summary), flush=True)
        if swarm is not None:
            swarm.finish()
            if not args.leave_when_done:
                swarm.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if swarm is not None:
            swarm.leave()


if __name__ == "__main__":
    main()
