#!/usr/bin/env bash
# Break a testnet on purpose and watch it cope. Each scenario starts its own testnet, runs it
# to the end, and prints the evaluation (as testnet/run.sh does) plus what it measured.
#
#   testnet/scenario.sh [-c CONFIG] [--python SCRIPT] SCENARIO
#
#   --python SCRIPT  the nodes are PyTorch peers running SCRIPT (see up.sh)
#
#   staleness   node 3 of 4 runs 4x slower (--slowdown 4); prints the largest clock gap
#               (max - min step over live nodes) seen by polling every node every 0.2s.
#               Set NODECTL_MAX_STALENESS=off to see the gap without the bound.
#   churn       kill -9 node 2 of 4 at 30% of the run, restart it at 60%.
#   late-join   a fifth node joins at 50% of the run.
set -euo pipefail
cd "$(dirname "$0")/.."
source testnet/common.sh

config=configs/fashion-mlp-gossip.toml up_flags=()
args=()
for arg in "$@"; do
    case $arg in
        --python) args+=(-y) ;;
        *) args+=("$arg") ;;
    esac
done
set -- "${args[@]+"${args[@]}"}"
while getopts "c:y:h" opt; do
    case $opt in
        c) config=$OPTARG ;;
        y) up_flags+=(--python "$OPTARG") ;;
        *) sed -n '2,15p' "$0"; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
scenario=${1:?usage: testnet/scenario.sh [-c CONFIG] staleness|churn|late-join}

step_of() { # node index: its step, or nothing if it is not answering
    "$nodectl" --log error status --data-dir "$run_dir/node-$1" --json 2>/dev/null \
        | grep -o '"step":[0-9]*' | head -1 | cut -d: -f2
}
finished() { # node index
    "$nodectl" --log error status --data-dir "$run_dir/node-$1" --json 2>/dev/null \
        | grep -q '"state":"finished"'
}
total_epochs() { # from node 0's status
    local json
    json=$("$nodectl" --log error status --data-dir "$run_dir/node-0" --json)
    echo "$json" | grep -o '"epochs":[0-9]*' | cut -d: -f2
}

cargo build --release --locked -q -p murmur-daemon
trap 'testnet/down.sh > /dev/null' EXIT
nodes=(0 1 2 3)
case $scenario in
    staleness) testnet/up.sh -n 3 -k 4 -c "$config" "${up_flags[@]+"${up_flags[@]}"}" > /dev/null; testnet/start.sh 3 --slowdown 4 > /dev/null ;;
    churn) testnet/up.sh -n 4 -c "$config" "${up_flags[@]+"${up_flags[@]}"}" > /dev/null ;;
    late-join) testnet/up.sh -n 4 -k 5 -c "$config" "${up_flags[@]+"${up_flags[@]}"}" > /dev/null ;;
    *) echo "unknown scenario $scenario" >&2; exit 2 ;;
esac
epochs=$(total_epochs)
max_gap=0 killed=0 restarted=0 joined=0 started=$SECONDS
while true; do
    steps=() live_steps=()
    for i in "${nodes[@]}"; do
        s=$(step_of "$i" || true)
        steps+=("${s:--}")
        [ -n "$s" ] && live_steps+=("$s")
    done
    if [ "${#live_steps[@]}" -gt 1 ]; then
        lo=$(printf '%s\n' "${live_steps[@]}" | sort -n | head -1)
        hi=$(printf '%s\n' "${live_steps[@]}" | sort -n | tail -1)
        [ $((hi - lo)) -gt "$max_gap" ] && max_gap=$((hi - lo))
    fi
    # Progress of the run, from node 0's epoch count.
    epoch=$("$nodectl" --log error status --data-dir "$run_dir/node-0" --json 2>/dev/null \
        | grep -o '"epoch":[0-9]*' | head -1 | cut -d: -f2 || echo 0)
    pct=$((100 * ${epoch:-0} / epochs))
    if [ "$scenario" = churn ] && [ $killed = 0 ] && [ $pct -ge 30 ]; then
        kill -KILL "$(cat "$run_dir/node-2.pid")"; killed=1
        echo "$((SECONDS - started))s: killed node 2 (kill -9) at ${pct}%: steps ${steps[*]}"
    fi
    if [ "$scenario" = churn ] && [ $killed = 1 ] && [ $restarted = 0 ] && [ $pct -ge 60 ]; then
        testnet/start.sh 2 > /dev/null; restarted=1
        echo "$((SECONDS - started))s: restarted node 2 at ${pct}%: steps ${steps[*]}"
    fi
    if [ "$scenario" = late-join ] && [ $joined = 0 ] && [ $pct -ge 50 ]; then
        testnet/start.sh 4 > /dev/null; joined=1; nodes=(0 1 2 3 4)
        echo "$((SECONDS - started))s: node 4 joined at ${pct}%: steps ${steps[*]}"
    fi
    all=1
    for i in "${nodes[@]}"; do finished "$i" || all=0; done
    [ $all = 1 ] && break
    sleep 0.2
done
echo "all nodes finished after $((SECONDS - started))s; largest clock gap between live nodes: $max_gap steps"
testnet/down.sh > /dev/null
trap - EXIT
dirs=()
for i in "${nodes[@]}"; do dirs+=("$run_dir/node-$i"); done
"$nodectl" --log warn evaluate --config "$config" --target 0.87 "${dirs[@]}"
"$nodectl" --log warn evaluate --config "$config" --target 0.87 --json "${dirs[@]}" > "$run_dir/summary.json"
