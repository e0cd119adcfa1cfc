#!/usr/bin/env bash
# Print one line per testnet daemon: peer, state, step, epoch, live peers, test accuracy, role.
set -euo pipefail
source "$(dirname "$0")/common.sh"

# The first value of a top-level JSON field (enough for nodectl's flat status keys).
field() { # json, key
    echo "$1" | grep -o "\"$2\":[^,}]*" | head -1 | cut -d: -f2- | tr -d '"'
}

printf '%-8s %-54s %-9s %8s %6s %6s %9s %-8s\n' node peer state step epoch peers accuracy role
for dir in $(node_dirs); do
    name=$(basename "$dir")
    if json=$(in_node "${name#node-}" "$nodectl" --log error status --data-dir "$dir" --json 2>/dev/null); then
        acc=$(field "$json" test_accuracy)
        [ "$acc" = null ] && acc=- || acc=$(awk -v a="$acc" 'BEGIN { printf "%.2f%%", 100 * a }')
        printf '%-8s %-54s %-9s %8s %6s %6s %9s %-8s\n' "$name" "$(field "$json" peer_id)" \
            "$(field "$json" state)" "$(field "$json" step)" "$(field "$json" epoch)" \
            "$(field "$json" live_peers)" "$acc" "$(field "$json" role)"
    else
        printf '%-8s %-54s %-9s\n' "$name" "-" "stopped"
    fi
done
