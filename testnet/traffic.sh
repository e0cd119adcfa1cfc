#!/usr/bin/env bash
# Bytes per second that each running testnet daemon sends over TCP, sampled over a window.
# With no parameter exchange running, that is heartbeat and discovery traffic.
#
#   testnet/traffic.sh [-s SECONDS]   (default 30)
set -euo pipefail
source "$(dirname "$0")/common.sh"

window=30
while getopts "s:h" opt; do
    case $opt in
        s) window=$OPTARG ;;
        *) sed -n '2,6p' "$0"; exit 2 ;;
    esac
done

# Sum of bytes_sent over the established TCP sockets of a pid.
sent() {
    ss -tinpH state established 2>/dev/null | awk -v pid="pid=$1," '
        $0 ~ pid { own = 1; next }
        /^[^ \t]/ { own = 0 }
        own && match($0, /bytes_sent:[0-9]+/) { total += substr($0, RSTART + 11, RLENGTH - 11) }
        END { print total + 0 }'
}

declare -A before
for f in "$run_dir"/node-*.pid; do
    before[$f]=$(sent "$(cat "$f")")
done
start=$(date +%s.%N)
# The window is what is measured, not a synchronisation.
sleep "$window"
elapsed=$(echo "$(date +%s.%N) - $start" | bc)
peers=$(ls "$run_dir"/node-*.pid | wc -l)
for f in "$run_dir"/node-*.pid; do
    after=$(sent "$(cat "$f")")
    rate=$(echo "($after - ${before[$f]}) / $elapsed" | bc -l)
    printf '%s: %.0f bytes/s sent to %d peers (%.0f bytes/s per peer)\n' \
        "$(basename "$f" .pid)" "$rate" $((peers - 1)) "$(echo "$rate / ($peers - 1)" | bc -l)"
done
