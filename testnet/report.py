"""Turn a testnet run into PNG plots and a Markdown summary.

Reads testnet/run/samples.jsonl (every node's status each second, from chaos.sh) and
testnet/run/chaos.jsonl (kills, restarts, recoveries) and writes, in testnet/run/report/:
accuracy.png, loss.png, clock_gap.png, bytes.png and summary.md. Kills are red lines,
recoveries green dashed lines, on every plot.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default="testnet/run")
    args = parser.parse_args()
    samples_path = os.path.join(args.run_dir, "samples.jsonl")
    events_path = os.path.join(args.run_dir, "chaos.jsonl")
    for path in (samples_path, events_path):
        if not os.path.exists(path):
            sys.exit(f"{path} is missing: run testnet/chaos.sh first")
    samples = load_lines(samples_path)
    events = load_lines(events_path)
    if not samples:
        sys.exit(f"{samples_path} is empty: did chaos.sh run?")
    t0 = min(s["t"] for s in samples)
    out = os.path.join(args.run_dir, "report")
    os.makedirs(out, exist_ok=True)

    nodes = sorted({s["node"] for s in samples})
    series = {n: [s for s in samples if s["node"] == n and s["status"]] for n in nodes}
    kills = [e for e in events if e["event"] == "kill"]
    recoveries = [e for e in events if e["event"] == "recovered"]

    def mark(ax):
        for e in kills:
            ax.axvline(e["t"] - t0, color="red", linewidth=1)
        for e in recoveries:
            ax.axvline(e["t"] - t0, color="green", linewidth=1, linestyle="--")

    def plot(name, title, ylabel, value):
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for n in nodes:
            xs, ys = [], []
            for s in series[n]:
                y = value(s["status"])
                if y is not None:
                    xs.append(s["t"] - t0)
                    ys.append(y)
            ax.plot(xs, ys, ".", markersize=3, label=f"node {n}")
        mark(ax)
        ax.set_title(title + "  (red: kill -9, green dashed: recovered)")
        ax.set_xlabel("seconds since the first sample")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    written = [
        plot("accuracy.png", "test accuracy per node", "test accuracy",
             lambda st: st.get("test_accuracy")),
        plot("loss.png", "training loss per node (moving average)", "loss",
             lambda st: st.get("loss_ema") or None),
        plot("bytes.png", "tensor bytes sent per node (since its last start)", "MB sent",
             lambda st: st["sync"]["bytes_out"] / 1e6),
    ]

    # Clock gap: the largest step difference between the nodes that answered in one round of
    # samples (rounds are the sampler's passes over the nodes, one a second).
    rounds = {}
    for s in samples:
        rounds.setdefault(round(s["t"] - t0), []).append(s)
    gap_x, gap_y, gaps = [], [], []
    for second, group in sorted(rounds.items()):
        steps = [s["status"]["step"] for s in group if s["status"]]
        if len(steps) >= 2:
            gap_x.append(second)
            gap_y.append(max(steps) - min(steps))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(gap_x, gap_y, "-", linewidth=1)
    mark(ax)
    ax.set_title("clock gap: fastest minus slowest live node  (red: kill -9, green dashed: recovered)")
    ax.set_xlabel("seconds since the first sample")
    ax.set_ylabel("steps")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, "clock_gap.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # Summary.
    start = next((e for e in events if e["event"] == "start"), {})
    lines = ["# Testnet chaos report", ""]
    lines.append(f"- nodes: {len(nodes)}; chaos seed {start.get('seed', '?')}, "
                 f"{start.get('duration', '?')} s, a kill every {start.get('interval', '?')} s")
    lines.append(f"- samples: {len(samples)} over {samples[-1]['t'] - t0:.0f} s")
    unrecovered = [e for e in events if e["event"] == "unrecovered"]
    lines.append(f"- kills: {len(kills)}; recoveries: {len(recoveries)}; "
                 f"not recovered within 60 s of the restart: {len(unrecovered)}")
    lines.append(f"- largest clock gap between live nodes: {max(gap_y) if gap_y else 0} steps")
    lines += ["", "| kill | node | killed at s | restarted at s | recovered at s | down s | back after s | step before | step after recovery |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k, kill in enumerate(kills, 1):
        n = kill["node"]
        restart = next((e for e in events if e["event"] == "restart" and e["node"] == n and e["t"] > kill["t"]), None)
        rec = next((e for e in recoveries if e["node"] == n and e["t"] > kill["t"]), None)
        before = [s for s in series[n] if s["t"] <= kill["t"]]
        after = [s for s in series[n] if rec and s["t"] >= rec["t"]]
        fmt = lambda e: f"{e['t'] - t0:.1f}" if e else "never"  # noqa: E731
        lines.append(
            f"| {k} | {n} | {kill['t'] - t0:.1f} | {fmt(restart)} | {fmt(rec)} | "
            f"{(restart['t'] - kill['t']) if restart else float('nan'):.1f} | "
            f"{(rec['t'] - kill['t']) if rec else float('nan'):.1f} | "
            f"{before[-1]['status']['step'] if before else '-'} | "
            f"{after[0]['status']['step'] if after else '-'} |")
    lines += ["", "| node | last step | last test accuracy | sent MB | exchanges ok | failed | state syncs |",
              "|---|---|---|---|---|---|---|"]
    for n in nodes:
        if not series[n]:
            lines.append(f"| {n} | - | - | - | - | - | - |")
            continue
        st = series[n][-1]["status"]
        acc = st.get("test_accuracy")
        lines.append(
            f"| {n} | {st['step']} | {'-' if acc is None else f'{100 * acc:.2f} %'} | "
            f"{st['sync']['bytes_out'] / 1e6:.1f} | {st['sync']['exchanges']} | "
            f"{st['sync']['failed']} | {st['sync']['state_syncs']} |")
    lines += ["", "Plots: " + ", ".join(os.path.basename(p) for p in written), ""]
    summary = os.path.join(out, "summary.md")
    with open(summary, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"written: {', '.join(written + [summary])}")


if __name__ == "__main__":
    main()
