"""Plots `nodectl bench exchange --json` lines as an SVG: for each model size, one side's time
stage by stage (stacked), beside the time its frame takes on a link of `--link-mb-s`, and the
memory the exchange took above the replicas and the pair's copies.

    nodectl bench exchange --params 1M,10M,100M --json > exchange.jsonl
    python3 bench/plot_exchange.py exchange.jsonl docs/exchange.svg [--link-mb-s 430]

Standard library only: the SVG is written by hand, so the plot needs nothing installed.
"""

import argparse
import json
import math
import sys

STAGES = [
    ("difference_s", "difference", "#4e79a7"),
    ("write_s", "write", "#f28e2b"),
    ("read_s", "read", "#e15759"),
    ("judge_s", "judge", "#76b7b2"),
    ("mix_s", "mix", "#59a14f"),
]
WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 720, 360, 70, 50, 40


def label(params: int) -> str:
    """A parameter count as people write it: 1M, 100M, 1B."""
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "k")):
        if params >= scale:
            return f"{params / scale:g}{suffix}"
    return str(params)


def plot(rows: list[dict], link_mb_s: float) -> str:
    """The SVG of `rows`, one bar pair per size on a log time axis."""
    link = [row["frame_bytes"] / (link_mb_s * 1e6) for row in rows]
    highest = max(max(row["side_s"] for row in rows), max(link))
    lowest = min(min(row["side_s"] for row in rows), min(link))
    top_decade = math.ceil(math.log10(highest))
    bottom_decade = math.floor(math.log10(max(lowest, 1e-6)))
    plot_h = HEIGHT - BOTTOM - TOP

    def y(seconds: float) -> float:
        span = top_decade - bottom_decade
        share = (math.log10(max(seconds, 10**bottom_decade)) - bottom_decade) / span
        return HEIGHT - BOTTOM - share * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{LEFT}" y="20" font-size="14">One side of a pairwise exchange '
        f"({rows[0]['codec']}): stages against the frame's time at {link_mb_s:g} MB/s</text>",
    ]
    for decade in range(bottom_decade, top_decade + 1):
        yy = y(10**decade)
        out.append(
            f'<line x1="{LEFT}" y1="{yy:.1f}" x2="{WIDTH - 10}" y2="{yy:.1f}" stroke="#ddd"/>'
        )
        out.append(
            f'<text x="{LEFT - 8}" y="{yy + 4:.1f}" text-anchor="end">{10**decade:g} s</text>'
        )
    slot = (WIDTH - LEFT - 10) / len(rows)
    for i, row in enumerate(rows):
        x = LEFT + i * slot + slot * 0.2
        bar = slot * 0.25
        # The stages stacked in linear time, drawn on the log axis from their running sums.
        total = 0.0
        for key, _, colour in STAGES:
            start, total = total, total + row["stages"][key]
            if row["stages"][key] <= 0:
                continue
            y0, y1 = y(max(start, 10**bottom_decade)), y(total)
            out.append(
                f'<rect x="{x:.1f}" y="{y1:.1f}" width="{bar:.1f}" '
                f'height="{max(y0 - y1, 0.5):.1f}" fill="{colour}"/>'
            )
        yy = y(link[i])
        out.append(
            f'<rect x="{x + bar + 4:.1f}" y="{yy:.1f}" width="{bar:.1f}" '
            f'height="{HEIGHT - BOTTOM - yy:.1f}" fill="#bab0ac"/>'
        )
        memory = row.get("peak_extra_per_side_models")
        note = f"{label(row['params'])}" + (f", {memory}x model" if memory is not None else "")
        out.append(
            f'<text x="{x + bar:.1f}" y="{HEIGHT - BOTTOM + 18}" text-anchor="middle">{note}</text>'
        )
    legend = [(name, colour) for _, name, colour in STAGES] + [("link", "#bab0ac")]
    for j, (name, colour) in enumerate(legend):
        lx = LEFT + j * 95
        out.append(f'<rect x="{lx}" y="{HEIGHT - 20}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{lx + 16}" y="{HEIGHT - 10}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="`nodectl bench exchange --json` output")
    parser.add_argument("output", help="the SVG to write")
    parser.add_argument(
        "--link-mb-s",
        type=float,
        default=430.0,
        help="the link's rate in MB/s, as `nodectl bench transfer` measured it",
    )
    args = parser.parse_args()
    with open(args.input) as f:
        rows = [json.loads(line) for line in f if line.startswith("{")]
    if not rows:
        print(f"{args.input}: no `nodectl bench exchange --json` lines", file=sys.stderr)
        return 1
    with open(args.output, "w") as f:
        f.write(plot(rows, args.link_mb_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
