#!/usr/bin/env bash
# Side-by-side all-reduce bandwidth: `nodectl bench allreduce` (both data planes) vs
# torch.distributed all_reduce on the gloo backend, on this machine over loopback.
#
#   bench/compare-gloo.sh [-r ROUNDS] [-n PEERS] [-s SIZES_MB] [-p PYTHON]
#
# Runs the two alternately ROUNDS times (the machine's speed drifts, so each round's pair is
# measured back to back) and prints one JSON object per round and a summary: per peer count and
# size, the median busbw of each and the median of the per-round ratios nodectl / gloo.
# PYTHON must have torch installed (`python3 -m venv v && v/bin/pip install torch`).
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=3 peers=2,4 sizes=1,16,100 python=python3
while getopts "r:n:s:p:h" opt; do
    case $opt in
        r) rounds=$OPTARG ;;
        n) peers=$OPTARG ;;
        s) sizes=$OPTARG ;;
        p) python=$OPTARG ;;
        *) sed -n '2,11p' "$0"; exit 2 ;;
    esac
done

cargo build --release --locked -q -p murmur-daemon
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for round in $(seq "$rounds"); do
    echo "round $round/$rounds" >&2
    ./target/release/nodectl --log warn bench allreduce --peers "$peers" --sizes-mb "$sizes" \
        --json | sed "s/^/nodectl /" >>"$results"
    "$python" bench/torch_allreduce.py --peers "$peers" --sizes-mb "$sizes" | sed "s/^/gloo /" >>"$results"
done
"$python" - "$results" <<'PY'
import collections, json, statistics, sys
ours = collections.defaultdict(list)     # (plane, peers, mib) -> [busbw per round]
gloo = collections.defaultdict(list)     # (peers, mib) -> [busbw per round]
for line in open(sys.argv[1]):
    who, text = line.split(" ", 1)
    data = json.loads(text)
    if who == "nodectl":
        for size in data["sizes"]:
            ours[(data["plane"], data["peers"], size["mib"])].append(size["busbw_gbps_median"])
    else:
        for world, sizes in data["worlds"].items():
            for size in sizes:
                gloo[(int(world), size["mib"])].append(size["busbw_gbps_median"])
summary = []
for (plane, peers, mib), values in sorted(ours.items()):
    theirs = gloo[(peers, mib)]
    ratios = [o / t for o, t in zip(values, theirs)]
    summary.append({"plane": plane, "peers": peers, "mib": mib,
                    "nodectl_busbw_gbps_median": statistics.median(values),
                    "gloo_busbw_gbps_median": statistics.median(theirs),
                    "ratio_median": round(statistics.median(ratios), 3),
                    "ratios": [round(r, 3) for r in ratios]})
print(json.dumps({"bench": "allreduce_vs_gloo", "summary": summary}, indent=1))
PY
