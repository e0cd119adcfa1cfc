#!/usr/bin/env bash
# The main job: a local multi-node training run. N peers train one model together on
# Fashion-MNIST (or, with a `gpt` config, a language model on Shakespeare), each on its own
# shard, exchanging parameters over libp2p on loopback.
#
#   testnet/run.sh [-n N] [-c CONFIG] [-p PARTITION] [-t TARGET] [-P]
#                  [--link PROFILE] [--link-node I=PROFILE ...] [--stagger SECONDS]
#                  [--transport tcp|quic|both] [--nat KINDS [--open-relay]]
#                  [--python SCRIPT [--python-node I ...]] [--netns]
#
#   -n N          peers (default 4)
#   -c CONFIG     run config (default configs/fashion-mlp-gossip.toml)
#   -p PARTITION  iid (default), dirichlet:ALPHA or labels:K; for text, iid or documents
#   -t TARGET     test accuracy whose time to reach is reported (default 0.87); for a
#                 language model, a validation loss (default 1.9)
#   -P            also run Prometheus, scraping every node (see up.sh -P)
#   --link PROFILE  emulated wide-area links, RATE[,DELAY_MS[,LOSS_PCT]] such as 20mbit,50;
#                 --link-node I=PROFILE gives node I another (see up.sh; needs root)
#   --stagger SECONDS  start the peers this long one after another (see up.sh)
#   --transport tcp|quic|both  what the peers listen on (default both; see up.sh)
#   --nat KINDS   peers on a NAT testbed, one site per peer (public,home,home,symmetric, ...;
#                 see up.sh; needs root); sets N, and before stopping the peers prints how each
#                 pair is connected (testnet/connections.sh)
#   --open-relay  with --nat: the relay (node 0) carries exchanges too (see up.sh)
#   --python SCRIPT  PyTorch peers running SCRIPT (examples/pytorch/fashion.py, lm.py) in place
#                 of nodectl; --python-node I makes only node I one (see up.sh)
#   --netns       each peer in a network namespace on an unshaped bridge (see up.sh)
#
# In network namespaces (--link, --netns, --nat), the bytes each peer's interface sent and
# received, everything included, go to testnet/run/interfaces.json before the peers stop.
#
# Builds nodectl, installs the dataset if it is missing (Debian's dataset-fashion-mnist, or the
# Shakespeare corpus through data/fetch-shakespeare.sh), shards the data, starts the testnet,
# shows progress until every peer has trained to the config's end, stops the peers (each
# saves a final checkpoint), then prints each node's final test accuracy (validation loss for
# a language model), bytes sent, the consensus distance max_i ||x_i - mean|| / ||mean||, and
# writes everything to testnet/run/summary.json. NODECTL_DATA points at another dataset
# directory.
set -euo pipefail
cd "$(dirname "$0")/.."
source testnet/common.sh

n=4 config=configs/fashion-mlp-gossip.toml partition=iid target="" up_flags=()
args=()
for arg in "$@"; do
    case $arg in
        --link) args+=(-l) ;;
        --link-node) args+=(-L) ;;
        --stagger) args+=(-s) ;;
        --transport) args+=(-T) ;;
        --nat) args+=(-N) ;;
        --open-relay) args+=(-R) ;;
        --python) args+=(-y) ;;
        --python-node) args+=(-Y) ;;
        --netns) args+=(-E) ;;
        *) args+=("$arg") ;;
    esac
done
set -- "${args[@]+"${args[@]}"}"
nat=""
while getopts "n:c:p:t:l:L:s:T:N:y:Y:ERPh" opt; do
    case $opt in
        n) n=$OPTARG ;;
        c) config=$OPTARG ;;
        p) partition=$OPTARG ;;
        t) target=$OPTARG ;;
        P) up_flags+=(-P) ;;
        l) up_flags+=(--link "$OPTARG") ;;
        L) up_flags+=(--link-node "$OPTARG") ;;
        s) up_flags+=(--stagger "$OPTARG") ;;
        T) up_flags+=(--transport "$OPTARG") ;;
        N) nat=$OPTARG; up_flags+=(--nat "$OPTARG") ;;
        R) up_flags+=(--open-relay) ;;
        y) up_flags+=(--python "$OPTARG") ;;
        Y) up_flags+=(--python-node "$OPTARG") ;;
        E) up_flags+=(--netns) ;;
        h) sed -n '2,39p' "$0"; exit 0 ;;
        *) sed -n '2,39p' "$0" >&2; exit 2 ;;
    esac
done

cargo build --release --locked -p murmur-daemon
"$nodectl" --log error config validate "$config" > /dev/null
export NODECTL_DATA=${NODECTL_DATA:-$(config_data_dir "$config")}
if config_reads_text "$config"; then
    target=${target:-1.9}
    if [ ! -d "$NODECTL_DATA" ]; then
        echo "the Shakespeare corpus is not in $NODECTL_DATA; fetching it" >&2
        data/fetch-shakespeare.sh --out "$NODECTL_DATA"
    fi
else
    target=${target:-0.87}
    if [ ! -d "$NODECTL_DATA" ]; then
        echo "Fashion-MNIST is not in $NODECTL_DATA; installing dataset-fashion-mnist" >&2
        sudo=""
        [ "$(id -u)" -ne 0 ] && sudo="sudo"
        $sudo apt-get update -q
        $sudo apt-get install -y -q dataset-fashion-mnist
    fi
fi
if [ -n "$nat" ]; then
    n=$(echo "$nat" | tr ',' '\n' | grep -c .)
fi
trap 'testnet/down.sh > /dev/null' EXIT
testnet/up.sh -n "$n" -c "$config" -p "$partition" "${up_flags[@]+"${up_flags[@]}"}"

# Progress until every node reports `finished`; a node that dies fails the run.
started=$SECONDS last=-1
while true; do
    finished=0 steps=""
    for i in $(seq 0 $((n - 1))); do
        if ! kill -0 "$(cat "$run_dir/node-$i.pid")" 2>/dev/null; then
            echo "node $i exited before the end of the run; its log:" >&2
            tail -5 "$run_dir/node-$i.log" >&2
            exit 1
        fi
        json=$(in_node "$i" "$nodectl" --log error status --data-dir "$run_dir/node-$i" --json 2>/dev/null || true)
        steps="$steps $(echo "$json" | grep -o '"step":[0-9]*' | head -1 | cut -d: -f2)"
        case $json in *'"state":"finished"'*) finished=$((finished + 1)) ;; esac
    done
    elapsed=$((SECONDS - started))
    if [ "$finished" = "$n" ]; then break; fi
    if [ $((elapsed / 5)) != "$last" ]; then
        last=$((elapsed / 5))
        echo "${elapsed}s: steps${steps}; $finished/$n peers finished"
    fi
    sleep 1
done
echo "all $n peers finished in $((SECONDS - started))s; stopping them"
if [ -n "$nat" ]; then
    testnet/connections.sh | tee "$run_dir/connections.txt"
    testnet/connections.sh --json > "$run_dir/connections.json"
fi
if [ -f "$run_dir/netns" ]; then
    interface_bytes "$n" | tee "$run_dir/interfaces.json"
fi
testnet/down.sh > /dev/null
trap - EXIT

dirs=()
for i in $(seq 0 $((n - 1))); do dirs+=("$run_dir/node-$i"); done
"$nodectl" --log warn evaluate --config "$config" --target "$target" "${dirs[@]}"
"$nodectl" --log warn evaluate --config "$config" --target "$target" --json "${dirs[@]}" \
    > "$run_dir/summary.json"
echo "summary: $run_dir/summary.json"
