"""The examples run: each trains a few steps alone, and a swarm of the Fashion-MNIST one
learns its (synthetic) task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import DEADLINE, EXAMPLES

TEXT = Path(__file__).resolve().parents[2] / "trainer" / "testdata" / "shakespeare"


def run(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=3 * DEADLINE
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_fashion_example_trains_alone_and_in_a_swarm(tmp_path, fashion_like):
    config = tmp_path / "cnn.toml"
    text = (EXAMPLES / "cnn.toml").read_text()
    config.write_text(
        text.replace("epochs = 3", "epochs = 2").replace("batch_size = 64", "batch_size = 32")
    )
    common = [str(EXAMPLES / "fashion.py"), "--config", str(config), "--data", str(fashion_like)]
    plain = run(*common, "--plain", "--threads", "1")
    assert plain["steps"] == 32 and plain["test_accuracy"] > 0.5, plain
    swarm = run(
        *common,
        "--threads",
        "1",
        "--data-dir",
        str(tmp_path / "peer"),
        "--no-mdns",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--leave-when-done",
    )
    # Alone in its run, the peer trains as the plain loop, bit for bit.
    assert swarm["test_accuracy"] == plain["test_accuracy"], (swarm, plain)
    assert (tmp_path / "peer" / "checkpoints" / "step-32.safetensors").exists()


def test_the_language_model_example_trains(tmp_path):
    summary = run(
        str(EXAMPLES / "lm.py"),
        "--config",
        str(EXAMPLES / "lm-single.toml"),
        "--data",
        str(TEXT),
        "--plain",
        "--steps",
        "3",
        "--threads",
        "1",
    )
    assert summary["steps"] == 3 and summary["params"] > 800_000, summary
