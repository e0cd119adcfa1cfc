"""A PyTorch peer killed with SIGKILL: the others do not wait for it past the peer timeout, and
restarted it picks up from its checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import murmur
from conftest import DEADLINE, Mlp, batches, train_step

PEER = Path(__file__).parent / "peer_process.py"


class Process:
    """A peer process and the lines it prints."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(PEER), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, what: str, met) -> str:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if met(line):
                    return line
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"{what}: not within {DEADLINE} s; it printed {self.lines[-20:]}")

    def last_step(self) -> int:
        steps = [int(line.split()[1]) for line in self.lines if line.startswith("step ")]
        return max(steps, default=0)

    def steps_printed(self) -> int:
        return sum(line.startswith("step ") for line in self.lines)


def test_a_killed_peer_holds_nobody_and_resumes_from_its_checkpoint(run_config, node_args):
    config = run_config("killed", interval=4, max_staleness=4)
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    survivor = murmur.join(config, model, optimizer, **node_args("survivor", peer_timeout=2.0))
    data = batches(seed=8)
    pauses: list[tuple[float, float]] = []  # (when, how long) of each step of the survivor
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set():
            started = time.monotonic()
            survivor.step(train_step(model, optimizer, data[survivor.steps % len(data)]))
            pauses.append((started, time.monotonic() - started))
            time.sleep(0.005)  # the survivor's compute, so that the peer keeps up

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    peer_dir = node_args("killed")["data_dir"]
    args = ["--config", str(config), "--data-dir", str(peer_dir), "--steps-per-epoch", "5"]
    peer = Process(*args, "--bootstrap", survivor.listen[0])
    # Some steps in the swarm (it took the survivor's state on the way), then SIGKILL.
    peer.wait_for("the peer's 15th step", lambda _: peer.steps_printed() >= 15)
    os.kill(peer.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    peer.process.wait(10)
    killed_step = peer.last_step()

    # The survivor trains on: no step of its waits past the peer timeout (2 s) by much.
    deadline = killed_at + DEADLINE
    while time.monotonic() < killed_at + 4.0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    after = [took for when, took in pauses if when >= killed_at - 0.5]
    assert after, "the survivor took no step after the kill"
    assert max(after) < 2.0 + 2.0, f"the survivor waited {max(after):.1f} s for a dead peer"

    # Restarted, it resumes from its newest checkpoint: one at every epoch's end (5 steps),
    # the last it passed before dying (or one it took but had not printed yet). Then it takes
    # the swarm's state, being far behind.
    printed = [int(line.split()[1]) for line in peer.lines if line.startswith("step ")]
    # An epoch's end counts as passed when a step of training reached it (the step printed
    # before it is the one before it): a state taken over mid-run can land the peer on one, and
    # no checkpoint is written there.
    trained = zip([0, *printed[:-1]], printed, strict=True)
    passed = max(
        (step for before, step in trained if step % 5 == 0 and step == before + 1), default=0
    )
    # A kill during a write leaves `step-N.safetensors.tmp` beside the checkpoints; resume passes
    # over it, and so does this count.
    checkpoints = (peer_dir / "checkpoints").glob("step-*.safetensors")
    newest = max(int(f.stem.split("-")[1]) for f in checkpoints)
    assert passed <= newest <= killed_step + 5, f"{newest} after {peer.lines}"
    goal = survivor.steps + 20
    restarted = Process(*args, "--bootstrap", survivor.listen[0], "--steps", str(goal))
    line = restarted.wait_for("the restarted peer's start", lambda line: line.startswith("start "))
    assert int(line.split()[1]) == newest
    restarted.process.wait(DEADLINE)
    assert restarted.last_step() >= goal, restarted.lines[-5:]
    stop.set()
    trainer.join(DEADLINE)
    survivor.leave()
