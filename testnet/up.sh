#!/usr/bin/env bash
# Start a local testnet of N nodectl daemons on loopback.
#
#   testnet/up.sh [-n N] [-c CONFIG] [-m]
#
#   -n N       number of daemons (default 4)
#   -c CONFIG  run config (default configs/fashion-mlp.toml)
#   -m         discover peers by mDNS alone, each daemon in its own network namespace on a
#              private bridge (testnet/netns.sh; needs root). Default: bootstrap from node 0
#              on 127.0.0.1, mDNS off.
#
# Shards the training data (one IID shard per node), starts the daemons with their own data
# dirs, shards and logs under testnet/run/, waits until each sees N-1 peers (polling
# `nodectl wait`), and prints a status table. testnet/down.sh stops them.
set -euo pipefail
source "$(dirname "$0")/common.sh"

n=4 config="$root/configs/fashion-mlp.toml" mdns_only=0
while getopts "n:c:mh" opt; do
    case $opt in
        n) n=$OPTARG ;;
        c) config=$(cd "$(dirname "$OPTARG")" && pwd)/$(basename "$OPTARG") ;;
        m) mdns_only=1 ;;
        *) sed -n '2,14p' "$0"; exit 2 ;;
    esac
done
data=${NODECTL_DATA:-/usr/share/datasets/fashion-mnist}

if [ -n "$(node_dirs)" ] && ls "$run_dir"/node-*.pid >/dev/null 2>&1; then
    echo "a testnet is already running in $run_dir; stop it with testnet/down.sh" >&2
    exit 1
fi
cargo build --release --locked -q -p murmur-daemon
rm -rf "$run_dir" && mkdir -p "$run_dir"
"$nodectl" --log warn shard --data "$data" --peers "$n" --partition iid --seed 0 \
    --out "$run_dir/shards" > "$run_dir/shards.txt"

# Runs a command in node i's network namespace when the testnet has them.
in_node() { # index, command...
    local i=$1; shift
    if [ -f "$run_dir/netns" ]; then ip netns exec "murmur-n$i" "$@"; else "$@"; fi
}

start_node() { # index, extra flags...
    local i=$1; shift
    local dir="$run_dir/node-$i" host=127.0.0.1
    [ -f "$run_dir/netns" ] && host=10.77.0.$((i + 1))
    local cmd=("$nodectl" join --config "$config" --data-dir "$dir" --data "$data"
        --shard "$run_dir/shards/shard-$(printf %03d "$i")"
        --listen "/ip4/$host/tcp/0" --listen "/ip4/$host/udp/0/quic-v1" --threads 1 "$@")
    # `ip netns exec` execs nodectl, so $! is the daemon's own pid either way.
    [ -f "$run_dir/netns" ] && cmd=(ip netns exec "murmur-n$i" "${cmd[@]}")
    "${cmd[@]}" > "$run_dir/node-$i.log" 2>&1 &
    echo $! > "$run_dir/node-$i.pid"
}

wait_ready() { # index: polls the log for the ready line, with a deadline
    local log="$run_dir/node-$1.log" deadline=$((SECONDS + 60))
    until grep -q '^ready ' "$log" 2>/dev/null; do
        if [ $SECONDS -ge $deadline ] || ! kill -0 "$(cat "$run_dir/node-$1.pid")" 2>/dev/null; then
            echo "node $1 did not become ready; its log:" >&2
            tail -5 "$log" >&2
            exit 1
        fi
        sleep 0.1
    done
}

started=$(date +%s.%N)
if [ "$mdns_only" = 1 ]; then
    "$(dirname "$0")/netns.sh" up "$n"
    touch "$run_dir/netns"
    for i in $(seq 0 $((n - 1))); do start_node "$i"; done
else
    start_node 0 --no-mdns
    wait_ready 0
    bootstrap=$(sed -n 's/^to join this node: .*--bootstrap //p' "$run_dir/node-0.log" | head -1)
    for i in $(seq 1 $((n - 1))); do start_node "$i" --no-mdns --bootstrap "$bootstrap"; done
fi
for i in $(seq 0 $((n - 1))); do
    wait_ready "$i"
    in_node "$i" "$nodectl" --log warn wait --data-dir "$run_dir/node-$i" --min-peers $((n - 1)) --timeout 30 > /dev/null
done
elapsed=$(echo "$(date +%s.%N) - $started" | bc)
echo "all $n daemons see $((n - 1)) peers, ${elapsed}s after the first started ($([ "$mdns_only" = 1 ] && echo "mDNS only" || echo "bootstrap, mDNS off"))"
"$(dirname "$0")/status.sh"
