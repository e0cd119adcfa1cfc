#!/usr/bin/env bash
# Print one line per testnet daemon: peer, state, step, epoch, live peers, test accuracy (for a
# language model, validation loss), role.
set -euo pipefail
source "$(dirname "$0")/common.sh"

# The first value of a top-level JSON field (enough for nodectl's flat status keys).
field() { # json, key
    echo "$1" | grep -o "\"$2\":[^,}]*" | head -1 | cut -d: -f2- | tr -d '"'
}

names=() statuses=()
for dir in $(node_dirs); do
    name=$(basename "$dir")
    names+=("$name")
    statuses+=("$(in_node "${name#node-}" "$nodectl" --log error status --data-dir "$dir" --json 2>/dev/null || true)")
done
# A language model is judged by its validation loss, an image model by its accuracy.
figure=accuracy
for json in "${statuses[@]+"${statuses[@]}"}"; do
    [ -n "$json" ] && [ "$(field "$json" model)" = gpt ] && figure="val loss"
done
printf '%-8s %-54s %-9s %8s %6s %6s %9s %-8s\n' node peer state step epoch peers "$figure" role
for i in "${!names[@]}"; do
    json=${statuses[$i]}
    if [ -z "$json" ]; then
        printf '%-8s %-54s %-9s\n' "${names[$i]}" "-" "stopped"
        continue
    fi
    if [ "$figure" = accuracy ]; then
        value=$(field "$json" test_accuracy)
        [ "$value" = null ] && value=- || value=$(awk -v a="$value" 'BEGIN { printf "%.2f%%", 100 * a }')
    else
        value=$(field "$json" test_loss)
        [ "$value" = null ] && value=- || value=$(awk -v a="$value" 'BEGIN { printf "%.4f", a }')
    fi
    printf '%-8s %-54s %-9s %8s %6s %6s %9s %-8s\n' "${names[$i]}" "$(field "$json" peer_id)" \
        "$(field "$json" state)" "$(field "$json" step)" "$(field "$json" epoch)" \
        "$(field "$json" live_peers)" "$value" "$(field "$json" role)"
done
