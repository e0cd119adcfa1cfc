"""What OpenTelemetry export costs a training run: the same 2-peer gossip run (testnet/run.sh),
alternately without telemetry and exporting to an OTLP sink every second, and each peer's
training throughput between its first and last test evaluation (startup and shutdown left out).

    python3 bench/telemetry_overhead.py [--rounds 3] [--config configs/fashion-mlp-gossip.toml]

Prints JSON: each run's samples per second (sum over the peers), the median of each mode, the
ratio on/off, and what the sink received. Export every second (OTEL_METRIC_EXPORT_INTERVAL and
OTEL_BSP_SCHEDULE_DELAY 1000 ms) is sixty times the default metric rate: a worst case.
"""

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Sink(BaseHTTPRequestHandler):
    """Accepts OTLP/HTTP exports and counts them (the payload is not decoded)."""

    received = {"requests": 0, "bytes": 0}

    def do_POST(self):
        length = int(self.headers.get("content-length", 0))
        self.rfile.read(length)
        Sink.received["requests"] += 1
        Sink.received["bytes"] += length
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def throughput(run_dir, batch):
    """Samples per second of each peer between its first and last evaluation, summed."""
    total = 0.0
    for path in sorted(glob.glob(os.path.join(run_dir, "node-*", "last-status.json"))):
        with open(path) as f:
            history = json.load(f)["history"]
        if len(history) < 2:
            sys.exit(f"{path}: fewer than two evaluations; use a longer run")
        first, last = history[0], history[-1]
        total += (last["step"] - first["step"]) * batch / (last["unix_s"] - first["unix_s"])
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", default="configs/fashion-mlp-gossip.toml")
    args = parser.parse_args()
    with open(os.path.join(ROOT, args.config)) as f:
        batch = int(re.search(r"^batch_size\s*=\s*(\d+)", f.read(), re.M).group(1))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"

    runs = {"off": [], "on": []}
    for r in range(args.rounds):
        # Alternate the order, so that a drift of the machine's speed hits both alike.
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            env = dict(os.environ)
            env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
            if mode == "on":
                env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                           OTEL_METRIC_EXPORT_INTERVAL="1000",
                           OTEL_BSP_SCHEDULE_DELAY="1000")
            with tempfile.TemporaryDirectory() as run_dir:
                env["TESTNET_DIR"] = run_dir
                subprocess.run([os.path.join(ROOT, "testnet", "run.sh"), "-n", "2", "-c",
                                args.config], env=env, cwd=ROOT, check=True,
                               stdout=subprocess.DEVNULL)
                runs[mode].append(throughput(run_dir, batch))
            print(f"round {r + 1} telemetry {mode}: {runs[mode][-1]:.0f} samples/s",
                  file=sys.stderr)
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    print(json.dumps({
        "config": args.config,
        "peers": 2,
        "samples_per_s": runs,
        "median_off": round(off, 1),
        "median_on": round(on, 1),
        "ratio_on_off": round(on / off, 4),
        "sink": Sink.received,
    }))


if __name__ == "__main__":
    main()
