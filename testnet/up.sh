#!/usr/bin/env bash
# Start a local testnet of N nodectl daemons on loopback.
#
#   testnet/up.sh [-n N] [-c CONFIG] [-p PARTITION] [-k SHARDS] [-m] [-P] [--prometheus]
#                 [--link PROFILE] [--link-node I=PROFILE ...] [--stagger SECONDS]
#                 [--transport tcp|quic|both] [--nat KINDS [--open-relay]]
#                 [--python SCRIPT [--python-node I ...]] [--netns]
#
#   -n N          number of daemons (default 4)
#   -c CONFIG     run config (default configs/fashion-mlp-gossip.toml)
#   -p PARTITION  how the training data is split: iid (default), dirichlet:ALPHA, labels:K;
#                 for text (a `gpt` config), iid or documents (whole plays to each peer)
#   -k SHARDS     shards to make (default N); more leave shards for nodes started later with
#                 testnet/start.sh
#   -m            discover peers by mDNS alone, each daemon in its own network namespace on a
#                 private bridge (testnet/netns.sh; needs root). Default: bootstrap from node 0
#                 on 127.0.0.1, mDNS off.
#   -P, --prometheus  also start a Prometheus server (Debian `prometheus`) on 127.0.0.1:19090
#                 scraping every node's /metrics each second, and wait until it reports
#                 every node up. Node i gets fixed ports that survive restarts (control API
#                 17300 + i, libp2p 17400 + i); PROMETHEUS_PORT and API_BASE_PORT change them.
#                 testnet/chaos.sh needs it.
#   --link PROFILE  emulated wide-area links: each daemon in its own network namespace
#                 (testnet/netns.sh; needs root), its link shaped to PROFILE =
#                 RATE[,DELAY_MS[,LOSS_PCT]], such as 100mbit,25 (rate each way, one-way delay
#                 between two peers, loss each way). Peers bootstrap from node 0; mDNS off.
#   --link-node I=PROFILE  another profile for node I (repeatable): a mixed swarm.
#   --netns       each daemon in its own network namespace on a bridge with no rate limit or
#                 delay (testnet/netns.sh; needs root), bootstrapping from node 0: what each
#                 peer sends can be counted at its interface (run.sh writes interfaces.json).
#   --stagger SECONDS  start each daemon after node 0 this long after the one before it
#                 (peers that do not start together); not with -m.
#   --transport tcp|quic|both  what the daemons listen on (default both, as a node's default
#                 `listen`); peers connect over what they listen on. On links of tens of
#                 milliseconds exchanges over TCP take less time (docs/operations.md, "Slow links").
#   --nat KINDS   a NAT testbed (testnet/nat.sh; needs root): one site per node, KINDS a comma
#                 list of public, home, symmetric and relayonly, the first public, such as
#                 public,home,home. Node 0 serves as a relay (`relay = true`, default limits:
#                 control only); the others bootstrap from it. The link profiles apply to the
#                 sites' internet links. Sets N.
#   --open-relay  with --nat: node 0 relays with its circuit limits raised to 1 GiB and an hour,
#                 enough to carry exchanges for runs with sync.relayed_exchanges
#   --python SCRIPT  PyTorch peers: each node runs `python SCRIPT` with `nodectl join`'s flags
#                 (a script built on murmur.cli, such as examples/pytorch/fashion.py) in place
#                 of nodectl, in the venv python/venv.sh makes (or $PYTHON)
#   --python-node I  only node I runs SCRIPT (repeatable); the others run nodectl: a swarm of
#                 native and PyTorch peers of one model
#
# Shards the training data ($NODECTL_DATA, default the config's data.dir), starts the
# daemons with their own data dirs, shards and logs under testnet/run/, waits until each sees
# N-1 peers (polling `nodectl wait`), and prints a status table. testnet/down.sh stops them.
set -euo pipefail
source "$(dirname "$0")/common.sh"

n=4 config="$root/configs/fashion-mlp-gossip.toml" mdns_only=0 partition=iid shards="" prometheus=0
stagger=0 transport=both nat="" open_relay=0 script="" script_nodes=() netns=0
links=()
# The long options, as getopts knows none.
args=()
for arg in "$@"; do
    case $arg in
        --prometheus) args+=(-P) ;;
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
while getopts "n:c:p:k:l:L:s:T:N:y:Y:ERmPh" opt; do
    case $opt in
        n) n=$OPTARG ;;
        c) config=$(cd "$(dirname "$OPTARG")" && pwd)/$(basename "$OPTARG") ;;
        p) partition=$OPTARG ;;
        k) shards=$OPTARG ;;
        m) mdns_only=1 ;;
        P) prometheus=1 ;;
        l) links+=(--link "$OPTARG") ;;
        L) links+=(--link-node "$OPTARG") ;;
        s) stagger=$OPTARG ;;
        T) transport=$OPTARG ;;
        N) nat=$OPTARG ;;
        R) open_relay=1 ;;
        y) script=$(cd "$(dirname "$OPTARG")" && pwd)/$(basename "$OPTARG") ;;
        Y) script_nodes+=("$OPTARG") ;;
        E) netns=1 ;;
        *) sed -n '2,51p' "$0"; exit 2 ;;
    esac
done
kinds=()
if [ -n "$nat" ]; then
    IFS=, read -r -a kinds <<< "$nat"
    for kind in "${kinds[@]}"; do
        case $kind in
            public | home | symmetric | relayonly) ;;
            *) echo "--nat takes public, home, symmetric and relayonly, not \`$kind\`" >&2; exit 2 ;;
        esac
    done
    if [ "${kinds[0]}" != public ]; then
        echo "--nat: the first site must be public: node 0 is the relay and the others bootstrap from it" >&2
        exit 2
    fi
    if [ "$mdns_only" = 1 ]; then
        echo "--nat: peers behind NAT bootstrap from node 0; not with -m" >&2
        exit 2
    fi
    n=${#kinds[@]}
elif [ "$open_relay" = 1 ]; then
    echo "--open-relay raises the limits of the relay of a NAT testbed; give --nat too" >&2
    exit 2
fi
shards=${shards:-$n}
if ! [[ $stagger =~ ^[0-9]+$ ]]; then
    echo "--stagger takes whole seconds, not \`$stagger\`" >&2
    exit 2
fi
case $transport in
    tcp | quic | both) ;;
    *) echo "--transport takes tcp, quic or both, not \`$transport\`" >&2; exit 2 ;;
esac
if [ "$stagger" -gt 0 ] && [ "$mdns_only" = 1 ]; then
    echo "--stagger starts peers one after another from node 0's bootstrap address; not with -m" >&2
    exit 2
fi
if [ -n "$(node_dirs)" ] && ls "$run_dir"/node-*.pid >/dev/null 2>&1; then
    echo "a testnet is already running in $run_dir; stop it with testnet/down.sh" >&2
    exit 1
fi
if [ ${#script_nodes[@]} -gt 0 ] && [ -z "$script" ]; then
    echo "--python-node names the nodes that run the script of --python SCRIPT; give it too" >&2
    exit 2
fi
cargo build --release --locked -q -p murmur-daemon
{ [ ${#links[@]} -gt 0 ] || [ -n "$nat" ]; } && cargo build --release --locked -q -p murmur-wanlink
# PyTorch peers run in the package's venv, built from this checkout unless $PYTHON is given.
[ -n "$script" ] && [ -z "${PYTHON:-}" ] && "$root/python/venv.sh" > /dev/null
data=$(cd "${NODECTL_DATA:-$(config_data_dir "$config")}" && pwd)
rm -rf "$run_dir" && mkdir -p "$run_dir"
"$nodectl" --log warn shard --data "$data" --peers "$shards" --partition "$partition" --seed 0 \
    --out "$run_dir/shards" > "$run_dir/shards.txt"
echo "$config" > "$run_dir/config"
echo "$transport" > "$run_dir/transport"
echo "$data" > "$run_dir/data"
if [ -n "$script" ]; then
    echo "$script" > "$run_dir/python"
    if [ ${#script_nodes[@]} -gt 0 ]; then
        (IFS=,; echo "${script_nodes[*]}") > "$run_dir/python-nodes"
    else
        echo all > "$run_dir/python-nodes"
    fi
fi
if [ "$prometheus" = 1 ]; then
    if [ "$mdns_only" = 1 ] || [ ${#links[@]} -gt 0 ] || [ -n "$nat" ]; then
        echo "-P scrapes the control APIs on loopback, which nodes in network namespaces (-m, --link) do not share" >&2
        exit 2
    fi
    command -v prometheus >/dev/null || {
        echo "prometheus is not installed: sudo apt-get install prometheus" >&2
        exit 1
    }
    echo "${API_BASE_PORT:-17300}" > "$run_dir/api-base"
fi

# An allreduce run is among trusted peers only, and an elastic run elects its center among them
# (decision 0047): every node trusts every node of the testnet.
if grep -Eq '^mode = "(allreduce|elastic)"' "$config"; then
    ids=()
    for i in $(seq 0 $((n - 1))); do
        ids+=("$("$nodectl" --log warn init --data-dir "$run_dir/node-$i" --json |
            sed -n 's/.*"peer_id":"\([^"]*\)".*/\1/p')")
    done
    for i in $(seq 0 $((n - 1))); do
        for id in "${ids[@]}"; do
            "$nodectl" --log warn trust add "$id" --data-dir "$run_dir/node-$i" > /dev/null
        done
    done
fi

# On a NAT testbed node 0 relays for the peers behind routers.
if [ -n "$nat" ]; then
    node0="$run_dir/node-0"
    [ -f "$node0/config.toml" ] || "$nodectl" --log warn init --data-dir "$node0" > /dev/null
    # It is only ever dialled, so AutoNAT never tests it: its address is declared, on a port
    # it keeps (common.sh, start_node).
    declared=()
    [ "$transport" != quic ] && declared+=("\"/ip4/10.77.0.1/tcp/$RELAY_PORT\"")
    [ "$transport" != tcp ] && declared+=("\"/ip4/10.77.0.1/udp/$RELAY_PORT/quic-v1\"")
    declared_list=$(IFS=,; echo "${declared[*]}")
    sed -i -e 's/^relay = false$/relay = true/' \
        -e "s|^external_addrs = \\[\\]\$|external_addrs = [${declared_list//,/, }]|" \
        "$node0/config.toml"
    if [ "$open_relay" = 1 ]; then
        sed -i -e 's/^max_circuit_bytes = .*/max_circuit_bytes = 1073741824/' \
            -e 's/^max_circuit_duration_s = .*/max_circuit_duration_s = 3600/' "$node0/config.toml"
    fi
    grep -q '^relay = true$' "$node0/config.toml" && grep -q '^external_addrs = \["' "$node0/config.toml" || {
        echo "cannot make node 0 a relay: no \`relay = false\` or \`external_addrs = []\` line in $node0/config.toml" >&2
        exit 1
    }
fi

started=$(date +%s%N)
if [ -n "$nat" ]; then
    "$(dirname "$0")/nat.sh" up "${kinds[@]}" "${links[@]+"${links[@]}"}" | tee "$run_dir/links.txt"
    printf '%s\n' "${kinds[@]}" > "$run_dir/nat"
    touch "$run_dir/netns"
elif [ "$mdns_only" = 1 ] || [ ${#links[@]} -gt 0 ] || [ "$netns" = 1 ]; then
    "$(dirname "$0")/netns.sh" up "$n" "${links[@]+"${links[@]}"}" | tee "$run_dir/links.txt"
    touch "$run_dir/netns"
fi
if [ "$mdns_only" = 1 ]; then
    for i in $(seq 0 $((n - 1))); do start_node "$i"; done
else
    start_node 0 --no-mdns
    wait_ready 0
    bootstrap=$(sed -n 's/^to join this node: .*--bootstrap //p' "$run_dir/node-0.log" | head -1)
    echo "$bootstrap" > "$run_dir/bootstrap"
    for i in $(seq 1 $((n - 1))); do
        # The scenario of peers that do not start together, not a wait for anything.
        [ "$stagger" -gt 0 ] && echo "starting node $i after $stagger s" && sleep "$stagger"
        start_node "$i" --no-mdns --bootstrap "$bootstrap"
    done
fi
for i in $(seq 0 $((n - 1))); do
    wait_ready "$i"
    in_node "$i" "$nodectl" --log warn wait --data-dir "$run_dir/node-$i" --min-peers $((n - 1)) --timeout 30 > /dev/null
done
elapsed_ms=$((($(date +%s%N) - started) / 1000000))
elapsed=$((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000)))
how="bootstrap, mDNS off"
[ "$mdns_only" = 1 ] && how="mDNS only"
[ ${#links[@]} -gt 0 ] && how="$how, emulated links ${links[*]}"
[ -n "$nat" ] && how="$how, NAT testbed $nat"
echo "all $n daemons see $((n - 1)) peers, ${elapsed}s after the first started ($how)"
[ "$prometheus" = 1 ] && "$(dirname "$0")/prometheus.sh" "$n"
"$(dirname "$0")/status.sh"
