#!/usr/bin/env bash
# Murmur's PyTorch peers beside hivemind (hivemind.Optimizer in local-updates mode, from PyPI)
# on the same MLP, the same Fashion-MNIST shards and 4 peers, each peer in a network namespace:
# on an unshaped bridge, or on emulated links (--link 20mbit,50). For each system: the time
# from the first peer's start until the mean of the peers' latest test accuracies reaches the
# target, and the bytes each peer's interface sent (everything: parameters, discovery,
# framing). Needs root. Prints one JSON line per system; the runs' files stay in OUT.
#
#   bench/compare-hivemind.sh [--link PROFILE] [-t TARGET] [-e EPOCHS] [-c CONFIG] [-o OUT]
#
#   --link PROFILE  emulated links (testnet/netns.sh), such as 20mbit,50; default: a bridge
#   -t TARGET       test accuracy to reach (default 0.85)
#   -e EPOCHS       local epochs of every peer, both systems (default: the config's)
#   -c CONFIG       Murmur's run config (default configs/fashion-mlp-gossip.toml; on links
#                   configs/fashion-mlp-gossip-wan-overlap.toml)
#   --hivemind-lr LR  hivemind's SGD learning rate (default 0.02, momentum 0.9)
#   -o OUT          where the runs' files go (default: a new directory under /tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
source testnet/common.sh

link="" target=0.85 epochs="" config="" out="" hivemind_lr=0.02
args=()
for arg in "$@"; do
    case $arg in
        --link) args+=(-l) ;;
        --hivemind-lr) args+=(-L) ;;
        *) args+=("$arg") ;;
    esac
done
set -- "${args[@]+"${args[@]}"}"
while getopts "l:t:e:c:o:L:h" opt; do
    case $opt in
        l) link=$OPTARG ;;
        t) target=$OPTARG ;;
        e) epochs=$OPTARG ;;
        c) config=$OPTARG ;;
        o) out=$OPTARG ;;
        L) hivemind_lr=$OPTARG ;;
        *) sed -n '2,18p' "$0"; exit 2 ;;
    esac
done
if [ -z "$config" ]; then
    config=configs/fashion-mlp-gossip.toml
    [ -n "$link" ] && config=configs/fashion-mlp-gossip-wan-overlap.toml
fi
epochs=${epochs:-$(sed -n 's/^epochs = \([0-9]*\).*/\1/p' "$config" | head -1)}
out=${out:-$(mktemp -d /tmp/compare-hivemind.XXXX)}
mkdir -p "$out"
python=${PYTHON:-$(python/venv.sh)}
"$python" -m pip install -q --disable-pip-version-check hivemind==1.1.12
net=(--netns)
[ -n "$link" ] && net=(--link "$link")

# Murmur: testnet/run.sh with PyTorch peers, its epochs set as hivemind's.
sed "s/^epochs = .*/epochs = $epochs/" "$config" > "$out/murmur.toml"
PYTHON=$python testnet/run.sh --python examples/pytorch/fashion.py -c "$out/murmur.toml" -n 4 \
    -t "$target" "${net[@]}" > "$out/murmur.log" 2>&1
cp "$run_dir/summary.json" "$out/murmur-summary.json"
cp "$run_dir/interfaces.json" "$out/murmur-interfaces.json"

# hivemind: the same shards, the same namespaces and links.
shards=$out/shards
rm -rf "$shards" && cp -r "$run_dir/shards" "$shards"
trap 'testnet/netns.sh down' EXIT
testnet/netns.sh up 4 ${link:+--link "$link"} > /dev/null
pids=()
hivemind_peer() { # index, extra flags...
    local i=$1; shift
    ip netns exec "murmur-n$i" "$python" bench/hivemind_peer.py --model mlp --epochs "$epochs" \
        --shard "$shards/shard-$(printf %03d "$i")" --seed "$i" --init-seed 0 --lr "$hivemind_lr" \
        --target-accuracy "$target" --eval-every 2 --min-peers 4 --quiet \
        --host-maddr "/ip4/10.77.0.$((i + 1))/tcp/31000" --out "$out/hivemind-$i.jsonl" "$@" \
        > "$out/hivemind-$i.log" 2>&1 &
    pids+=($!)
}
rm -f "$out"/hivemind-*.jsonl
hivemind_peer 0
deadline=$((SECONDS + 120))
until first=$(grep -m1 -o 'hivemind peer: /ip4/10.77.0.1/tcp/31000/p2p/[A-Za-z0-9]*' "$out/hivemind-0.log"); do
    [ $SECONDS -lt $deadline ] || { echo "hivemind peer 0 did not start; its log:" >&2; tail "$out/hivemind-0.log" >&2; exit 1; }
    sleep 0.2
done
for i in 1 2 3; do hivemind_peer "$i" --initial-peers "${first#hivemind peer: }"; done
for pid in "${pids[@]}"; do wait "$pid" || true; done
interface_bytes 4 > "$out/hivemind-interfaces.json"
testnet/netns.sh down
trap - EXIT

"$python" - "$out" "$target" "${link:-bridge}" <<'PY'
import json, statistics, sys
from pathlib import Path

out, target, link = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]

def time_to_target(histories):
    """Seconds from the first start until the mean of the latest accuracies reaches target."""
    start = min(h["start"] for h in histories)
    events = sorted((t, i, a) for i, h in enumerate(histories) for t, a in h["points"])
    latest = [None] * len(histories)
    for t, i, a in events:
        latest[i] = a
        if all(v is not None for v in latest) and statistics.mean(latest) >= target:
            return t - start
    return None

murmur = json.loads((out / "murmur-summary.json").read_text())
records = [[json.loads(line) for line in p.read_text().splitlines()]
           for p in sorted(out.glob("hivemind-*.jsonl"))]
hivemind = [{"start": r[0]["started_unix"],
             "points": [(x["unix"], x["test_accuracy"]) for x in r if not x.get("final")]}
            for r in records]
finals = [[x for x in r if x.get("final")] for r in records]
for system, interfaces, ttt, accuracy in (
    ("murmur", "murmur-interfaces.json", murmur["time_to_target_s"],
     [c["test_accuracy"] for c in murmur["checkpoints"]]),
    ("hivemind", "hivemind-interfaces.json", time_to_target(hivemind),
     [f[-1]["test_accuracy"] if f else None for f in finals]),
):
    sent = [n["tx_bytes"] for n in json.loads((out / interfaces).read_text())]
    print(json.dumps({"system": system, "link": link, "target": target,
                      "time_to_target_s": None if ttt is None else round(ttt, 1),
                      "final_accuracy": accuracy,
                      "bytes_sent_per_peer": round(statistics.mean(sent)),
                      "out": str(out)}))
PY
