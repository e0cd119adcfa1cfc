#!/usr/bin/env bash
# Side-by-side MLP training-step throughput: nodectl vs PyTorch on this machine.
#
#   bench/compare-torch.sh [-r ROUNDS] [-b BATCH] [-t THREADS] [-p PYTHON]
#
# Runs `nodectl bench train` and bench/torch_step.py alternately ROUNDS times (the machine's
# speed drifts, so each round's pair is measured back to back), then prints one JSON object
# with both medians and the median of the per-round ratios. PYTHON must have torch installed
# (`python3 -m venv v && v/bin/pip install torch`).
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=5 batch=64 threads=2 python=python3
while getopts "r:b:t:p:h" opt; do
    case $opt in
        r) rounds=$OPTARG ;;
        b) batch=$OPTARG ;;
        t) threads=$OPTARG ;;
        p) python=$OPTARG ;;
        *) sed -n '2,10p' "$0"; exit 2 ;;
    esac
done

cargo build --release --locked -q -p murmur-daemon
ours=() theirs=()
for round in $(seq "$rounds"); do
    o=$(./target/release/nodectl --log warn bench train --model mlp --batch "$batch" \
        --threads "$threads" --trials 5 --trial-secs 1 --peak-size 0 --json 2>/dev/null)
    t=$("$python" bench/torch_step.py --batch "$batch" --threads "$threads" --trials 5 --trial-secs 1)
    ours+=("$(echo "$o" | "$python" -c 'import json,sys; print(json.load(sys.stdin)["samples_per_sec"])')")
    theirs+=("$(echo "$t" | "$python" -c 'import json,sys; print(json.load(sys.stdin)["samples_per_sec"])')")
    echo "round $round: nodectl ${ours[-1]} samples/s, pytorch ${theirs[-1]} samples/s" >&2
done
"$python" - "${ours[*]}" "${theirs[*]}" "$batch" "$threads" <<'PY'
import json, statistics, sys
ours = [float(v) for v in sys.argv[1].split()]
theirs = [float(v) for v in sys.argv[2].split()]
ratios = [o / t for o, t in zip(ours, theirs)]
print(json.dumps({"batch": int(sys.argv[3]), "threads": int(sys.argv[4]),
                  "nodectl_samples_per_sec_median": statistics.median(ours),
                  "pytorch_samples_per_sec_median": statistics.median(theirs),
                  "ratio_median": round(statistics.median(ratios), 3),
                  "ratios": [round(r, 3) for r in ratios]}))
PY
