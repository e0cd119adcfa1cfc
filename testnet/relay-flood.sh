#!/usr/bin/env bash
# A relay under a flood: a NAT testbed of one public relay and two peers behind home routers
# trains, while a crowd of fresh identities asks the relay for reservations and circuits over
# and over (testnet/adversary, bin relay-flood). The relay must keep to its [relay_limits]
# and keep serving its own run. Needs root.
#
#   testnet/relay-flood.sh [-d SECONDS] [-i IDENTITIES] [-c CONFIG]
#
#   -d SECONDS     how long the flood lasts (default 60)
#   -i IDENTITIES  identities flooding at once (default 256: twice the default 128
#                  reservations)
#   -c CONFIG      run config (default configs/ci-tiny-gossip.toml on synthetic data, trained
#                  with no end)
#
# Prints the flood's own tally, the relay's count of requests accepted and refused (libp2p's
# relay events in its /metrics), its memory (resident, and held by its own count) before, at
# most during, and 30 s after the flood, and, for each peer, the exchanges it made during the
# flood and its connections at the end (testnet/connections.sh). Exits 1 if a peer stopped
# exchanging during the flood.
set -euo pipefail
source "$(dirname "$0")/common.sh"

duration=60 identities=256 config="$root/configs/ci-tiny-gossip.toml"
while getopts "d:i:c:h" opt; do
    case $opt in
        d) duration=$OPTARG ;;
        i) identities=$OPTARG ;;
        c) config=$OPTARG ;;
        *) sed -n '2,18p' "$0"; exit 2 ;;
    esac
done

echo "relay-flood: building nodectl and the flood (release)" >&2
(cd "$root" && cargo build --release --locked -q -p murmur-daemon -p murmur-adversary)
scratch=$(mktemp -d)
trap '"$root/testnet/down.sh" > /dev/null 2>&1 || true; rm -rf "$scratch"' EXIT
endless_synthetic_run "$scratch" "$config"
NODECTL_DATA="$scratch/data" "$root/testnet/up.sh" -c "$scratch/run.toml" --nat public,home,home >&2

status() { # node index
    in_node "$1" "$nodectl" --log error status --data-dir "$run_dir/node-$1" --json
}
exchanges() { # node index
    status "$1" | python3 -c 'import json,sys; s=json.load(sys.stdin)["sync"]; print(s["exchanges"] + s["served"])'
}
memory_mb() { # node index: resident and held (the daemon's own count of its heap blocks), MB
    status "$1" | python3 -c 'import json,sys; m=json.load(sys.stdin).get("memory") or {}; print(round(m.get("resident_bytes", 0) / 2**20, 1), round((m.get("allocated_bytes") or 0) / 2**20, 1))'
}
relay_events() { # what the relay counted, from its /metrics
    in_node 0 python3 - "$(cat "$run_dir/node-0/api")" <<'EOF'
import json, re, sys, urllib.request
text = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10).read().decode()
events = {}
for line in text.splitlines():
    m = re.match(r'libp2p_relay_events_total\{event="(\w+)"\} (\S+)', line)
    if m:
        events[m.group(1)] = int(float(m.group(2)))
print(json.dumps(events))
EOF
}

# The home peers hold their reservations and have punched through before the flood starts.
deadline=$((SECONDS + 120))
until "$root/testnet/connections.sh" --json | python3 -c '
import json, sys
pairs = json.load(sys.stdin)["pairs"]
sys.exit(0 if all(p["connection"] in ("direct", "hole_punched") for p in pairs) else 1)'; do
    if [ $SECONDS -ge $deadline ]; then
        echo "the peers did not all connect directly within 120 s:" >&2
        "$root/testnet/connections.sh" >&2
        exit 1
    fi
    sleep 1
done
echo "every pair is connected directly; flooding the relay for ${duration}s with $identities identities" >&2

before_events=$(relay_events)
read -r before_mb before_held < <(memory_mb 0)
declare -a before_exchanges
for i in 0 1 2; do before_exchanges[i]=$(exchanges "$i"); done
relay=$(cat "$run_dir/bootstrap")
# From the internet side of site 1's router: a stranger on the internet.
ip netns exec murmur-n1 "$root/target/release/relay-flood" --relay "$relay" \
    --identities "$identities" --duration "$duration" > "$scratch/flood.jsonl" &
flood=$!
peak_mb=$before_mb peak_held=$before_held
while kill -0 "$flood" 2>/dev/null; do
    read -r now_mb now_held < <(memory_mb 0)
    peak_mb=$(python3 -c "print(max($peak_mb, $now_mb))")
    peak_held=$(python3 -c "print(max($peak_held, $now_held))")
    sleep 2
done
wait "$flood"
after_events=$(relay_events)
# The flood's connections close as its process exits; what the relay keeps after them.
sleep 30
read -r after_mb after_held < <(memory_mb 0)
stalled=0
for i in 0 1 2; do
    made=$(($(exchanges "$i") - before_exchanges[i]))
    echo "{\"node\":$i,\"exchanges_during_flood\":$made}"
    [ "$made" -gt 0 ] || stalled=1
done
echo "{\"flood\":$(tail -1 "$scratch/flood.jsonl"),\"relay_events_before\":$before_events,\"relay_events_after\":$after_events,\"relay_resident_mb\":{\"before\":$before_mb,\"peak\":$peak_mb,\"after_30s\":$after_mb},\"relay_held_mb\":{\"before\":$before_held,\"peak\":$peak_held,\"after_30s\":$after_held}}"
"$root/testnet/connections.sh"
exit "$stalled"
