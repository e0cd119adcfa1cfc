#!/usr/bin/env bash
# A NAT testbed: peers on an emulated internet, some of them behind home routers. Needs root.
#
#   testnet/nat.sh up KIND... [--link PROFILE] [--link-node I=PROFILE ...]
#   testnet/nat.sh ns I         the namespace peer I runs in
#   testnet/nat.sh addr I       the address peer I listens on
#   testnet/nat.sh down
#
# Each KIND makes one site, numbered from 0 in order:
#
#   public     the peer sits on the internet itself, at 10.77.0.(I+1)
#   home       the peer sits behind a home router at 10.77.0.(I+1) that maps each of its
#              sockets to one public port whatever it sends to (endpoint-independent mapping,
#              nftables `masquerade`) and drops what nobody inside asked for: a hole punch
#              through it works
#   symmetric  as home, but the router maps a socket to a new public port for each
#              destination (`masquerade random`): a hole punch through it fails
#   relayonly  as home, but the router lets the peer reach site 0 alone (a firewall that
#              allows one host): every other peer is reached through site 0 as a relay
#
# A peer behind a router is at 192.168.(I+1).2 in namespace $NETNS_PREFIX-h$I; the router is
# namespace $NETNS_PREFIX-n$I. The internet is testnet/netns.sh's: one link per site, with the
# link profiles (--link, --link-node) applying to the sites' internet links, routers' included.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
prefix=${NETNS_PREFIX:-murmur}
state=${WANLINK_STATE:-/tmp}
kinds_file=$state/$prefix-nat-kinds

usage() { sed -n '2,26p' "$0" >&2; exit 2; }

down() {
    for ns in $(ip netns list | awk '{print $1}' | grep "^$prefix-h[0-9]*$" || true); do
        ip netns del "$ns"
    done
    rm -f "$kinds_file"
    "$root/testnet/netns.sh" down
}

kind_of() { # site index
    [ -f "$kinds_file" ] || { echo "nat.sh: no testbed is up (run testnet/nat.sh up first)" >&2; exit 1; }
    local kind
    kind=$(sed -n "$(($1 + 1))p" "$kinds_file")
    [ -n "$kind" ] || { echo "nat.sh: the testbed has no site $1" >&2; exit 1; }
    echo "$kind"
}

# Puts the peer of site $1 behind a router: a LAN namespace, a veth pair to the site's internet
# namespace (now the router), forwarding, and the router's NAT and firewall.
router() { # site index, kind
    local i=$1 wan=veth$1 lan=lan$1
    local router_ns=$prefix-n$i home_ns=$prefix-h$i net=192.168.$((i + 1))
    ip netns add "$home_ns"
    ip link add lan0 netns "$home_ns" type veth peer name "$lan" netns "$router_ns"
    ip -n "$router_ns" addr add "$net.1/24" dev "$lan"
    ip -n "$router_ns" link set "$lan" up
    ip -n "$home_ns" addr add "$net.2/24" dev lan0
    ip -n "$home_ns" link set lan0 up
    ip -n "$home_ns" link set lo up
    ip -n "$home_ns" route add default via "$net.1"
    ip netns exec "$router_ns" sysctl -q -w net.ipv4.ip_forward=1
    local mapping=masquerade outbound="iifname \"$lan\" accept"
    [ "$2" = symmetric ] && mapping="masquerade random"
    [ "$2" = relayonly ] && outbound="iifname \"$lan\" ip daddr 10.77.0.1 accept"
    # The nat table needs its prerouting chain even though it is empty: without one, replies to
    # masqueraded packets are not translated back. The router drops what arrives unasked for
    # itself, as home routers do: accepted, a punch packet that beats the outbound one would
    # leave a connection entry for the router's own port, and the outbound packet would then be
    # mapped to another port, which the other side does not expect.
    ip netns exec "$router_ns" nft -f - <<EOF
table ip nat {
    chain prerouting { type nat hook prerouting priority dstnat; }
    chain postrouting { type nat hook postrouting priority srcnat; oifname "$wan" $mapping; }
}
table inet firewall {
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "$wan" ct state new drop
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        $outbound
    }
}
EOF
}

up() {
    local kinds=() link_args=()
    while [ $# -gt 0 ]; do
        case $1 in
            public|home|symmetric|relayonly) kinds+=("$1"); shift ;;
            --link|--link-node) link_args+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
            *) echo "nat.sh: unknown site kind or option '$1' (kinds: public, home, symmetric, relayonly)" >&2; usage ;;
        esac
    done
    [ ${#kinds[@]} -gt 0 ] || { echo "nat.sh: name at least one site" >&2; usage; }
    command -v nft > /dev/null || {
        echo "installing nftables (the routers' NAT)" >&2
        apt-get install -y -q nftables > /dev/null
    }
    down
    "$root/testnet/netns.sh" up ${#kinds[@]} "${link_args[@]+"${link_args[@]}"}"
    printf '%s\n' "${kinds[@]}" > "$kinds_file"
    for i in "${!kinds[@]}"; do
        [ "${kinds[i]}" = public ] || router "$i" "${kinds[i]}"
        echo "site $i: ${kinds[i]} peer at $(addr "$i") in $(ns "$i")"
    done
}

ns() { # site index
    case $(kind_of "$1") in
        public) echo "$prefix-n$1" ;;
        *) echo "$prefix-h$1" ;;
    esac
}

addr() { # site index
    case $(kind_of "$1") in
        public) echo "10.77.0.$(($1 + 1))" ;;
        *) echo "192.168.$(($1 + 1)).2" ;;
    esac
}

case "${1:-}" in
    up) shift; up "$@" ;;
    ns) ns "${2:?usage: nat.sh ns I}" ;;
    addr) addr "${2:?usage: nat.sh addr I}" ;;
    down) down ;;
    *) usage ;;
esac
