#!/usr/bin/env bash
# What joining a swarm costs a PyTorch training loop that has no partners: the Fashion-MNIST
# CNN (examples/pytorch/fashion.py, batch 64) trained alone (`--plain`) and as a peer alone in
# its run (gossip, a snapshot due every 4 steps; alone, the peer lets it pass), alternated (plain
# first in odd rounds, the swarm first in even ones, so that a drift of the machine's speed
# weighs on both). Prints each pair and a JSON line with the median ratio of steps/s and
# whether every pair trained bit for bit alike (the parameters' hash).
#
#   bench/pytorch_overhead.sh [-r ROUNDS] [-e EPOCHS] [-s STEPS] [-t THREADS]
#
#   defaults: 5 rounds of one epoch each (938 steps), torch's threads 2
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=5 epochs=1 steps="" threads=2
while getopts "r:e:s:t:h" opt; do
    case $opt in
        r) rounds=$OPTARG ;;
        e) epochs=$OPTARG ;;
        s) steps=$OPTARG ;;
        t) threads=$OPTARG ;;
        *) sed -n '2,12p' "$0"; exit 2 ;;
    esac
done
python=${PYTHON:-$(python/venv.sh)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() { # plain|swarm, round
    local flags=(--config examples/pytorch/cnn.toml --epochs "$epochs" --threads "$threads")
    [ -n "$steps" ] && flags+=(--steps "$steps")
    [ "$1" = plain ] && flags+=(--plain)
    [ "$1" = swarm ] && flags+=(--data-dir "$work/peer-$2" --no-mdns --listen /ip4/127.0.0.1/tcp/0
        --leave-when-done)
    "$python" examples/pytorch/fashion.py "${flags[@]}" 2>/dev/null | tail -1
}
ratios=() same=true
for round in $(seq 1 "$rounds"); do
    if [ $((round % 2)) = 1 ]; then
        plain=$(run plain "$round")
        swarm=$(run swarm "$round")
    else
        swarm=$(run swarm "$round")
        plain=$(run plain "$round")
    fi
    figures=$("$python" - "$plain" "$swarm" <<'PY'
import json, sys
plain, swarm = (json.loads(a) for a in sys.argv[1:])
print(swarm["samples_per_sec"] / plain["samples_per_sec"],
      str(plain["params_sha256"] == swarm["params_sha256"]).lower(),
      plain["samples_per_sec"], swarm["samples_per_sec"], plain["test_accuracy"])
PY
)
    read -r ratio equal plain_sps swarm_sps accuracy <<< "$figures"
    echo "round $round: plain $plain_sps samples/s, swarm $swarm_sps samples/s, ratio $ratio, bit for bit $equal, accuracy $accuracy" >&2
    ratios+=("$ratio")
    [ "$equal" = true ] || same=false
done
median=$(printf '%s\n' "${ratios[@]}" | sort -g | awk '{ a[NR] = $1 } END { print NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }')
echo "{\"rounds\": $rounds, \"epochs\": $epochs, \"steps\": \"${steps:-all}\", \"threads\": $threads, \"median_ratio\": $median, \"ratios\": [$(IFS=,; echo "${ratios[*]}")], \"bit_for_bit\": $same}"
