#!/usr/bin/env bash
# How the daemons of a running testnet are connected to each other: for each pair, direct,
# hole-punched or relayed (from each node's `nodectl status --json`), and how long after the
# node started its first direct connection to the peer came up (from its log). Made for the NAT
# testbed (up.sh --nat), where it also shows each node's site, reachability, NAT mapping,
# client mode, hole punches and the tensor bytes that went through relays.
#
#   testnet/connections.sh [--json]
#
# The table reads row by column: node i's connection to node j. D direct, H hole-punched,
# R relayed, - none (it hears of the peer through others), x itself; a trailing `c` marks a
# peer that runs as a client. A second table gives the throughput of the parameter payloads
# node i received from node j (a moving average; - where none came).
set -euo pipefail
source "$(dirname "$0")/common.sh"

json=0
case "${1:-}" in
    --json) json=1 ;;
    "") ;;
    *) sed -n '2,14p' "$0" >&2; exit 2 ;;
esac

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
count=0
for dir in $(node_dirs); do
    i=${dir##*/node-}
    in_node "$i" "$nodectl" --log error status --data-dir "$dir" --json > "$scratch/$i.json" 2>/dev/null \
        || echo '{}' > "$scratch/$i.json"
    echo "$(nat_kind "$i")" > "$scratch/$i.kind"
    count=$((count + 1))
done
[ "$count" -gt 0 ] || { echo "no testnet in $run_dir (start one with testnet/up.sh)" >&2; exit 1; }

python3 - "$scratch" "$run_dir" "$count" "$json" <<'EOF'
import datetime, json, os, re, sys

scratch, run_dir, count, as_json = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
LETTER = {"direct": "D", "hole_punched": "H", "relayed": "R"}
LINE = re.compile(r"^(\S+Z)\s+INFO .*connected another way peer=(\S+) link=(\w+)")
# What the log says of how a link became: its Debug name.
DIRECT = {"Direct", "HolePunched"}

def stamp(text):
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()

nodes = []
for i in range(count):
    with open(os.path.join(scratch, f"{i}.json")) as f:
        status = json.load(f)
    with open(os.path.join(scratch, f"{i}.kind")) as f:
        kind = f.read().strip() or "-"
    # Since the node's latest start (its first timestamped line after its last `peer id`
    # banner): when the first direct link to each peer came up, and the first by a hole punch.
    started, first_direct, first_punch = None, {}, {}
    log = os.path.join(run_dir, f"node-{i}.log")
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            for line in f:
                if line.startswith("peer id:"):
                    started, first_direct, first_punch = None, {}, {}
                    continue
                head = line.split(" ", 1)[0]
                if started is None and head.endswith("Z"):
                    try:
                        started = stamp(head)
                    except ValueError:
                        pass
                m = LINE.match(line)
                if m and m.group(3) in DIRECT and started is not None:
                    first_direct.setdefault(m.group(2), stamp(m.group(1)) - started)
                    if m.group(3) == "HolePunched":
                        first_punch.setdefault(m.group(2), stamp(m.group(1)) - started)
    nodes.append({"index": i, "kind": kind, "status": status, "first_direct": first_direct,
                  "first_punch": first_punch})

ids = [n["status"].get("peer_id") for n in nodes]
pairs = []
for n in nodes:
    peers = {p["peer_id"]: p for p in n["status"].get("peers", [])}
    for j, peer_id in enumerate(ids):
        if j == n["index"] or peer_id is None:
            continue
        p = peers.get(peer_id, {})
        first, punch = n["first_direct"].get(peer_id), n["first_punch"].get(peer_id)
        pairs.append({
            "from": n["index"], "to": j,
            "connection": p.get("connection"),
            "peer_client": p.get("client", False),
            "first_direct_s": None if first is None else round(first, 1),
            "first_hole_punch_s": None if punch is None else round(punch, 1),
            "payload_mbit_s": p.get("throughput_mbit_s"),
        })
summary = [{
    "node": n["index"], "site": n["kind"],
    "reachability": n["status"].get("reachability"),
    "nat_mapping": n["status"].get("nat_mapping"),
    "client": n["status"].get("client", False),
    "hole_punches": n["status"].get("hole_punches", 0),
    "hole_punches_failed": n["status"].get("hole_punches_failed", 0),
    "relayed_bytes_out": n["status"].get("sync", {}).get("relayed_bytes_out", 0),
    "relayed_bytes_in": n["status"].get("relayed_bytes_in", 0),
    "exchanges": n["status"].get("sync", {}).get("exchanges", 0),
} for n in nodes]

if as_json:
    print(json.dumps({"nodes": summary, "pairs": pairs}))
    sys.exit(0)

print("connections (row: node i, column: node j): D direct, H hole-punched, R relayed, - none, c client")
print("      " + "".join(f"{j:>6}" for j in range(count)))
cell = {(p["from"], p["to"]): LETTER.get(p["connection"], "-") + ("c" if p["peer_client"] else "") for p in pairs}
for i in range(count):
    print(f"{i:>6}" + "".join(f"{'x' if i == j else cell.get((i, j), '?'):>6}" for j in range(count)))
print()
print("parameter payloads received (row from column), Mbit/s: - none")
mbit = {(p["from"], p["to"]): p["payload_mbit_s"] for p in pairs}
print("      " + "".join(f"{j:>6}" for j in range(count)))
for i in range(count):
    row = ["x" if i == j else ("-" if mbit.get((i, j)) is None else f"{mbit[(i, j)]:.0f}") for j in range(count)]
    print(f"{i:>6}" + "".join(f"{c:>6}" for c in row))
print()
print(f"{'node':>4} {'site':<10} {'reach':<8} {'NAT mapping':<21} {'client':<6} {'punches':>8} {'exchanges':>9} {'relayed out':>12} {'relayed in':>11}")
for s in summary:
    print(f"{s['node']:>4} {s['site']:<10} {s['reachability'] or '-':<8} {s['nat_mapping'] or '-':<21} "
          f"{'yes' if s['client'] else 'no':<6} {str(s['hole_punches']) + '/' + str(s['hole_punches'] + s['hole_punches_failed']):>8} "
          f"{s['exchanges']:>9} {s['relayed_bytes_out']:>12} {s['relayed_bytes_in']:>11}")
timed = [p for p in pairs if p["first_hole_punch_s"] is not None]
if timed:
    print()
    print("first direct connection by a hole punch, seconds after the node started:")
    for p in timed:
        print(f"  node {p['from']} -> node {p['to']}: {p['first_hole_punch_s']} s")
EOF
