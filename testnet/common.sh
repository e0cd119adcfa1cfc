# Shared by the testnet scripts: paths and the nodectl binary.
# shellcheck shell=bash
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
run_dir="${TESTNET_DIR:-$root/testnet/run}"
nodectl="$root/target/release/nodectl"
# The port the relay of a NAT testbed (node 0, up.sh --nat) listens on.
RELAY_PORT=4001

# What a run config says of its data, from `nodectl config validate --json` (nodectl built):
# its data directory (`data.dir`, or the default for the model's kind), and whether the model
# reads text (a `gpt`, or a run of PyTorch peers whose data dir holds text).
config_data_dir() { # config
    "$nodectl" --log error config validate "$1" --json | grep -o '"data_dir":"[^"]*"' | cut -d'"' -f4
}
config_reads_text() { # config
    "$nodectl" --log error config validate "$1" --json | grep -q '"reads_text":true'
}

# A synthetic dataset in DIR/data and CONFIG trained with no end (`epochs` a million) in
# DIR/run.toml: the runs of soak.sh and relay-flood.sh, which last as long as they choose.
endless_synthetic_run() { # dir, config
    "$nodectl" dataset synthetic --out "$1/data" --train 8192 --test 1024 >/dev/null
    sed 's/^epochs = .*/epochs = 1000000/' "$2" >"$1/run.toml"
}

# The data dirs of the nodes started by up.sh, in order.
node_dirs() {
    find "$run_dir" -maxdepth 1 -name 'node-*' -type d 2>/dev/null | sort
}

# The kind of site node i sits in on a NAT testbed (up.sh --nat): public, home, symmetric or
# relayonly; nothing when the testnet has none.
nat_kind() { # index
    [ -f "$run_dir/nat" ] && sed -n "$(($1 + 1))p" "$run_dir/nat"
}

# The network namespace node i runs in: its own on emulated links, its home network behind a
# router on a NAT testbed (testnet/nat.sh).
node_ns() { # index
    case $(nat_kind "$1") in
        "" | public) echo "murmur-n$1" ;;
        *) echo "murmur-h$1" ;;
    esac
}

# The address node i listens on.
node_host() { # index
    if [ ! -f "$run_dir/netns" ]; then
        echo 127.0.0.1
        return
    fi
    case $(nat_kind "$1") in
        "" | public) echo "10.77.0.$(($1 + 1))" ;;
        *) echo "192.168.$(($1 + 1)).2" ;;
    esac
}

# What the interface of each of the first N nodes sent and received, in bytes (everything:
# parameters, heartbeats, discovery, framing), as a JSON list; the testnet has namespaces.
interface_bytes() { # N
    local i dev tx rx rows=()
    for i in $(seq 0 $(($1 - 1))); do
        dev=$(ip -n "$(node_ns "$i")" -o link show | awk -F': ' '$2 !~ /^lo/ { sub(/@.*/, "", $2); print $2; exit }')
        tx=$(ip netns exec "$(node_ns "$i")" cat "/sys/class/net/$dev/statistics/tx_bytes")
        rx=$(ip netns exec "$(node_ns "$i")" cat "/sys/class/net/$dev/statistics/rx_bytes")
        rows+=("{\"node\": $i, \"interface\": \"$dev\", \"tx_bytes\": $tx, \"rx_bytes\": $rx}")
    done
    (IFS=,; echo "[${rows[*]}]")
}

# Runs a command in node i's network namespace when the testnet has them.
in_node() { # index, command...
    local i=$1; shift
    if [ -f "$run_dir/netns" ]; then ip netns exec "$(node_ns "$i")" "$@"; else "$@"; fi
}

# The Python training script node i runs in place of `nodectl join` (up.sh --python), if any.
node_script() { # index
    [ -f "$run_dir/python" ] || return 0
    local nodes
    nodes=$(cat "$run_dir/python-nodes" 2>/dev/null || echo all)
    if [ "$nodes" = all ] || echo ",$nodes," | grep -q ",$1,"; then
        cat "$run_dir/python"
    fi
}

# The Python the testnet's PyTorch peers run: $PYTHON, else the venv python/venv.sh makes.
python_bin() {
    echo "${PYTHON:-$root/target/python-venv/bin/python}"
}

# Starts daemon i of the testnet in $run_dir (config, data and shard from up.sh), in the
# background, logging to node-i.log; extra arguments go to `nodectl join` (or to the node's
# Python script, which takes the same flags: up.sh --python).
start_node() { # index, extra flags...
    local i=$1; shift
    local dir="$run_dir/node-$i" host script
    host=$(node_host "$i")
    script=$(node_script "$i")
    # With fixed ports (up.sh -P), node i keeps its addresses across restarts: Prometheus
    # finds its control API at API base + i, and peers its libp2p port at API base + 100 + i.
    local p2p=0
    [ -f "$run_dir/api-base" ] && p2p=$(($(cat "$run_dir/api-base") + 100 + i))
    # The relay of a NAT testbed (up.sh --nat) declares its address, port included.
    [ -f "$run_dir/nat" ] && [ "$i" = 0 ] && p2p=$RELAY_PORT
    local cmd=("$nodectl" join)
    [ -n "$script" ] && cmd=("$(python_bin)" -u "$script")
    cmd+=(--config "$(cat "$run_dir/config")" --data-dir "$dir"
        --data "$(cat "$run_dir/data")" --shard "$run_dir/shards/shard-$(printf %03d "$i")"
        --threads 1)
    # The transports the testnet listens on (up.sh --transport; both by default, as a node).
    local transport=both
    [ -f "$run_dir/transport" ] && transport=$(cat "$run_dir/transport")
    [ "$transport" != quic ] && cmd+=(--listen "/ip4/$host/tcp/$p2p")
    [ "$transport" != tcp ] && cmd+=(--listen "/ip4/$host/udp/$p2p/quic-v1")
    [ -f "$run_dir/api-base" ] && cmd+=(--api "127.0.0.1:$(($(cat "$run_dir/api-base") + i))")
    cmd+=("$@")
    # `ip netns exec` execs nodectl (or python), so $! is the daemon's own pid either way.
    [ -f "$run_dir/netns" ] && cmd=(ip netns exec "$(node_ns "$i")" "${cmd[@]}")
    "${cmd[@]}" >> "$run_dir/node-$i.log" 2>&1 &
    echo $! > "$run_dir/node-$i.pid"
}

# Waits for node i's `ready` line (its latest start), with a deadline.
wait_ready() { # index
    local log="$run_dir/node-$1.log" deadline=$((SECONDS + 60)) ready
    # The log may not be there yet: the background start opens it.
    until ready=$(grep -c '^ready ' "$log" 2>/dev/null); [ "${ready:-0}" -ge "${2:-1}" ]; do
        if [ $SECONDS -ge $deadline ] || ! kill -0 "$(cat "$run_dir/node-$1.pid")" 2>/dev/null; then
            echo "node $1 did not become ready; its log:" >&2
            tail -5 "$log" >&2
            exit 1
        fi
        sleep 0.1
    done
}
