#!/usr/bin/env bash
# Private test hosts for the mDNS testnet: N network namespaces joined by a bridge, so that
# multicast DNS has a real link to run on (loopback carries no multicast). Needs root.
#
#   testnet/netns.sh up N     create murmur-n0 .. murmur-n(N-1) at 10.77.0.1 .. 10.77.0.N
#   testnet/netns.sh down     delete them
set -euo pipefail

prefix=murmur
bridge_ns=$prefix-br

down() {
    for ns in $(ip netns list | awk '{print $1}' | grep "^$prefix-" || true); do
        ip netns del "$ns"
    done
}

up() {
    local n=$1
    down
    ip netns add "$bridge_ns"
    ip -n "$bridge_ns" link add br0 type bridge
    ip -n "$bridge_ns" link set br0 up
    for i in $(seq 0 $((n - 1))); do
        local ns=$prefix-n$i
        ip netns add "$ns"
        ip link add "veth$i" netns "$ns" type veth peer name "port$i" netns "$bridge_ns"
        ip -n "$bridge_ns" link set "port$i" master br0 up
        ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev "veth$i"
        ip -n "$ns" link set "veth$i" up
        ip -n "$ns" link set lo up
        # mDNS sends to 224.0.0.251; route multicast out of the test link.
        ip -n "$ns" route add 224.0.0.0/4 dev "veth$i"
    done
}

case "${1:-}" in
    up) up "${2:?usage: netns.sh up N}" ;;
    down) down ;;
    *) sed -n '2,7p' "$0"; exit 2 ;;
esac
