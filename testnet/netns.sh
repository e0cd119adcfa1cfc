#!/usr/bin/env bash
# Private test hosts: N network namespaces on one link, so that peers talk over a real network
# (loopback carries no multicast, and has no rate or delay). Needs root.
#
#   testnet/netns.sh up N [--link PROFILE] [--link-node I=PROFILE ...]
#   testnet/netns.sh down
#
# `up` creates $NETNS_PREFIX-n0 .. -n(N-1) (prefix default `murmur`) at 10.77.0.1 .. 10.77.0.N,
# each with a veth pair to a hub namespace ($NETNS_PREFIX-br).
#
# Without --link the hub is a kernel bridge: a LAN with no rate limit. With --link every peer's
# link follows a profile RATE[,DELAY_MS[,LOSS_PCT]] (`100mbit,25`: 100 Mbit/s each way, 25 ms
# one-way delay between two peers on that profile, no loss); --link-node gives peer I another
# one (a mixed swarm: --link 100mbit,25 --link-node 3=5mbit,100). The rate is shaped by tc
# (tbf, on both ends of the veth pair: up and down); delay and loss are added by the
# testnet's userspace switch (target/release/wanlink, built here if missing), which replaces
# the bridge: a path between two profiles gets the mean of their delays and losses. This
# kernel has no netem, hence the switch. Link offloads are turned off so that frames stay
# within the MTU (ethtool, installed if missing).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
prefix=${NETNS_PREFIX:-murmur}
hub=$prefix-br
state=${WANLINK_STATE:-/tmp}
# WANLINK names another build of the switch (the tests use their own).
wanlink=${WANLINK:-$root/target/release/wanlink}

usage() { sed -n '2,19p' "$0" >&2; exit 2; }

down() {
    if [ -f "$state/$prefix-wanlink.pid" ]; then
        kill "$(cat "$state/$prefix-wanlink.pid")" 2>/dev/null || true
        rm -f "$state/$prefix-wanlink.pid"
    fi
    for ns in $(ip netns list | awk '{print $1}' | grep "^$prefix-\(br\|n[0-9]*\)$" || true); do
        ip netns del "$ns"
    done
}

# Checks a profile with the switch's own parser; prints `RATE_KBIT DELAY_MS LOSS_PCT`.
profile() { # text
    "$wanlink" profile "$1" || exit 2
}

# tbf on one end of a link: `burst` holds 10 ms at the rate (at least two full frames), the
# queue 50 ms, as on a modest home router.
shape() { # namespace, device, rate in kbit
    local burst=$(($3 * 1000 / 8 / 100))
    [ "$burst" -lt 3200 ] && burst=3200
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "${3}kbit" burst "$burst" latency 50ms
}

no_offloads() { # namespace, device
    ip netns exec "$1" ethtool -K "$2" tx off tso off gso off gro off > /dev/null 2>&1
}

up() {
    local n=$1; shift
    local default="" overrides=()
    while [ $# -gt 0 ]; do
        case $1 in
            --link) default=${2:?--link needs a profile}; shift 2 ;;
            --link-node) overrides+=("${2:?--link-node needs I=PROFILE}"); shift 2 ;;
            *) echo "netns.sh: unknown option $1" >&2; usage ;;
        esac
    done
    [ "$n" -ge 1 ] 2>/dev/null || { echo "netns.sh: N must be a number of peers, got $n" >&2; exit 2; }
    local profiles=()
    if [ -n "$default" ] || [ ${#overrides[@]} -gt 0 ]; then
        [ -x "$wanlink" ] || (cd "$root" && cargo build --release --locked -q -p murmur-wanlink)
        command -v ethtool > /dev/null || {
            echo "installing ethtool (link offloads must be off for the switch)" >&2
            apt-get install -y -q ethtool > /dev/null
        }
        [ -n "$default" ] || { echo "netns.sh: --link-node needs a --link for the other peers" >&2; exit 2; }
        profile "$default" > /dev/null
        for i in $(seq 0 $((n - 1))); do profiles[i]=$default; done
        for o in "${overrides[@]+"${overrides[@]}"}"; do
            local i=${o%%=*} p=${o#*=}
            if ! [[ "$i" =~ ^[0-9]+$ ]] || [ "$i" -ge "$n" ] || [ "$o" = "$i" ]; then
                echo "netns.sh: --link-node $o: expected I=PROFILE with I from 0 to $((n - 1))" >&2
                exit 2
            fi
            profile "$p" > /dev/null
            profiles[i]=$p
        done
    fi

    down
    ip netns add "$hub"
    if [ ${#profiles[@]} -eq 0 ]; then
        ip -n "$hub" link add br0 type bridge
        ip -n "$hub" link set br0 up
    else
        # The hub only forwards: no addresses, no IPv6 chatter of its own on the ports.
        ip netns exec "$hub" sysctl -q -w net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
    fi
    for i in $(seq 0 $((n - 1))); do
        local ns=$prefix-n$i
        ip netns add "$ns"
        ip link add "veth$i" netns "$ns" type veth peer name "port$i" netns "$hub"
        if [ ${#profiles[@]} -eq 0 ]; then
            ip -n "$hub" link set "port$i" master br0
        fi
        ip -n "$hub" link set "port$i" up
        ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev "veth$i"
        ip -n "$ns" link set "veth$i" up
        ip -n "$ns" link set lo up
        # mDNS sends to 224.0.0.251; route multicast out of the test link.
        ip -n "$ns" route add 224.0.0.0/4 dev "veth$i"
        if [ ${#profiles[@]} -gt 0 ]; then
            local kbit
            kbit=$(profile "${profiles[i]}" | cut -d' ' -f1)
            no_offloads "$ns" "veth$i"
            no_offloads "$hub" "port$i"
            shape "$ns" "veth$i" "$kbit"     # up: what peer i sends
            shape "$hub" "port$i" "$kbit"    # down: what the switch hands to peer i
        fi
    done
    if [ ${#profiles[@]} -gt 0 ]; then
        local ports=()
        for i in $(seq 0 $((n - 1))); do ports+=(--port "port$i=${profiles[i]}"); done
        local log=$state/$prefix-wanlink.log
        ip netns exec "$hub" "$wanlink" switch "${ports[@]}" > "$log" 2>&1 &
        echo $! > "$state/$prefix-wanlink.pid"
        local deadline=$((SECONDS + 10))
        until grep -q '^ready' "$log"; do
            if [ $SECONDS -ge $deadline ] || ! kill -0 "$(cat "$state/$prefix-wanlink.pid")" 2>/dev/null; then
                echo "the link switch did not start; its log ($log):" >&2
                cat "$log" >&2
                exit 1
            fi
            sleep 0.05
        done
        for i in $(seq 0 $((n - 1))); do echo "peer $i: ${profiles[i]}"; done
    fi
}

case "${1:-}" in
    up) shift; up "${1:?usage: netns.sh up N [--link PROFILE] [--link-node I=PROFILE]}" "${@:2}" ;;
    down) down ;;
    *) usage ;;
esac
