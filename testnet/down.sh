#!/usr/bin/env bash
# Stop the testnet daemons by pid: SIGTERM, then SIGKILL after a grace period. Keeps the logs.
#
#   testnet/down.sh [-g GRACE_SECONDS]   (default 15)
set -euo pipefail
source "$(dirname "$0")/common.sh"

grace=15
while getopts "g:h" opt; do
    case $opt in
        g) grace=$OPTARG ;;
        *) sed -n '2,4p' "$0"; exit 2 ;;
    esac
done

pids=()
for f in "$run_dir"/node-*.pid; do
    [ -e "$f" ] || continue
    pid=$(cat "$f")
    kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" && pids+=("$pid")
done
deadline=$((SECONDS + grace))
for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "pid $pid did not stop within ${grace}s; killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
    fi
done
rm -f "$run_dir"/node-*.pid
if [ -f "$run_dir/prometheus.pid" ]; then
    kill -TERM "$(cat "$run_dir/prometheus.pid")" 2>/dev/null || true
    rm -f "$run_dir/prometheus.pid"
fi
if [ -f "$run_dir/nat" ]; then
    "$(dirname "$0")/nat.sh" down
    rm -f "$run_dir/nat" "$run_dir/netns"
elif [ -f "$run_dir/netns" ]; then
    "$(dirname "$0")/netns.sh" down
    rm -f "$run_dir/netns"
fi
echo "stopped ${#pids[@]} daemons; logs in $run_dir"
