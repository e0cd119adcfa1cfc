#!/usr/bin/env python3
"""Kill -9 one of four `allreduce` peers during a ~100 MB all-reduce and time the survivors.

Each repetition starts four `nodectl join` daemons on loopback (an MLP of 26 M parameters,
104 MB per all-reduce, `every = 1`, so every step is a round), waits until they train, kills a
random one of them with SIGKILL at a random moment, and reads from each survivor's log when it
completed its first round after the abort ("ring round done after an abort", with the time of
that last attempt). It prints one JSON line per repetition and a summary; the target is that
every survivor completes that round within ring_timeout + one round time of the kill.

Usage: bench/ring_fault.py [--reps 20] [--nodectl target/release/nodectl] [--ring-timeout 5]
"""

import argparse
import datetime
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HIDDEN = "[8192, 2400]"  # 784*8192 + 8192*2400 + 2400*10 (+ biases) = 26.1 M values, 104 MB


def sh(nodectl, *args):
    out = subprocess.run([nodectl, *args], check=True, capture_output=True, text=True)
    return out.stdout


def status(nodectl, d):
    try:
        return json.loads(sh(nodectl, "status", "--data-dir", d, "--json"))
    except subprocess.CalledProcessError:
        return None


def log_time(line):
    stamp = line.split()[0]
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def log_time_or_none(line):
    try:
        return log_time(line)
    except (ValueError, IndexError):
        return None


def wait_for(pred, what, deadline_s):
    start = time.time()
    while time.time() - start < deadline_s:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def repetition(nodectl, work, rep, ring_timeout, rng):
    names = ["a", "b", "c", "d"]
    dirs = {n: os.path.join(work, f"r{rep}", n) for n in names}
    ids = {n: json.loads(sh(nodectl, "init", "--data-dir", d, "--json"))["peer_id"] for n, d in dirs.items()}
    for d in dirs.values():
        for i in ids.values():
            sh(nodectl, "trust", "add", i, "--data-dir", d)
    procs, logs = {}, {}
    try:
        for n in names:
            logs[n] = os.path.join(work, f"r{rep}", f"{n}.log")
            extra = []
            if n != "a":
                extra = ["--bootstrap", bootstrap]
            procs[n] = subprocess.Popen(
                [nodectl, "--log", "info,libp2p=warn,quinn=warn", "join", "--config",
                 os.path.join(work, "run.toml"), "--data-dir", dirs[n], "--listen",
                 "/ip4/127.0.0.1/tcp/0", "--no-mdns", "--threads", "1", *extra],
                stdout=open(logs[n], "w"), stderr=subprocess.STDOUT)
            if n == "a":
                def join_line():
                    for line in open(logs["a"]):
                        if line.startswith("to join this node:"):
                            return line.split()[-1]
                    return None
                bootstrap = wait_for(join_line, "a's address", 60)
        # Training: every peer past a few rounds.
        wait_for(lambda: all((status(nodectl, d) or {}).get("step", 0) >= 3 for d in dirs.values()),
                 "four peers in rounds", 300)
        time.sleep(rng.uniform(0.0, 1.0))
        victim = rng.choice(names)
        killed_at = time.time()
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        survivors = [n for n in names if n != victim]
        done = {}

        def recovered():
            for n in survivors:
                if n in done:
                    continue
                for line in open(logs[n]):
                    if log_time_or_none(line) is None or log_time(line) < killed_at - 1:
                        continue
                    if "ring round done after an abort" in line:
                        ms = float(re.search(r"ms=([0-9.]+)", line).group(1))
                        peers = int(re.search(r"peers=(\d+)", line).group(1))
                        done[n] = (log_time(line) - killed_at, ms, peers)
                        break
                    if "state sync done" in line:
                        # It missed a round another survivor completed, and took its state.
                        done[n] = (log_time(line) - killed_at, 0.0, 0)
                        break
            return len(done) == len(survivors)

        wait_for(recovered, "the survivors' next round", 120)
        worst = max(v[0] for v in done.values())
        round_s = max(v[1] for v in done.values()) / 1e3
        result = {
            "rep": rep,
            "victim": victim,
            "recovered_s": round(worst, 3),
            "last_attempt_s": round(round_s, 3),
            "ring_after": sorted({v[2] for v in done.values()}),
            "within_target": worst <= ring_timeout + round_s,
        }
        print(json.dumps(result), flush=True)
        return result
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--nodectl", default="target/release/nodectl")
    ap.add_argument("--ring-timeout", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="ring-fault-") as work:
        data = os.path.join(work, "data")
        sh(args.nodectl, "dataset", "synthetic", "--out", data, "--train", "256", "--test", "64")
        with open(os.path.join(work, "run.toml"), "w") as f:
            f.write(f"""[run]
name = "ring-fault"
[model]
kind = "mlp"
hidden = {HIDDEN}
[optimizer]
kind = "sgd"
lr = 0.001
momentum = 0.9
[training]
epochs = 100000
batch_size = 8
[data]
dir = "{data}"
[sync]
mode = "allreduce"
[sync.allreduce]
every = 1
min_peers = 4
ring_timeout = {args.ring_timeout}
""")
        results = [repetition(args.nodectl, work, r, args.ring_timeout, rng) for r in range(args.reps)]
    rec = [r["recovered_s"] for r in results]
    summary = {
        "reps": len(results),
        "hangs": 0,
        "within_target": sum(r["within_target"] for r in results),
        "recovered_s_median": statistics.median(rec),
        "recovered_s_max": max(rec),
        "last_attempt_s_median": statistics.median(r["last_attempt_s"] for r in results),
        "ring_timeout_s": args.ring_timeout,
    }
    print(json.dumps({"summary": summary}))
    sys.exit(0 if summary["within_target"] == len(results) else 1)


if __name__ == "__main__":
    main()
