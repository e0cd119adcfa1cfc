#!/usr/bin/env bash
# Print one line per testnet daemon: peer, state, step, live peers, test accuracy.
set -euo pipefail
source "$(dirname "$0")/common.sh"

printf '%-8s %-54s %-9s %8s %6s %6s %9s\n' node peer state step epoch peers accuracy
for dir in $(node_dirs); do
    name=$(basename "$dir")
    run=("$nodectl")
    [ -f "$run_dir/netns" ] && run=(ip netns exec "murmur-n${name#node-}" "$nodectl")
    if json=$("${run[@]}" --log error status --data-dir "$dir" --json 2>/dev/null); then
        echo "$json" | python3 -c '
import json, sys
s = json.load(sys.stdin)
acc = "-" if s["test_accuracy"] is None else "%.2f%%" % (100 * s["test_accuracy"])
print("%-8s %-54s %-9s %8d %6d %6d %9s" % (sys.argv[1], s["peer_id"], s["state"], s["step"],
      s["epoch"], s["live_peers"], acc))' "$name"
    else
        printf '%-8s %-54s %-9s\n' "$name" "-" "stopped"
    fi
done
