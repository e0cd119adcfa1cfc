#!/usr/bin/env bash
# Break a running testnet on purpose: kill -9 a random node at every interval and restart it
# after a random pause, for a bounded time, reproducibly (the same seed kills the same nodes
# at the same moments). Meanwhile every node's status is sampled each second, so that
# testnet/report.sh can show every kill and recovery afterwards.
#
#   testnet/up.sh -n 4 -P          # fixed ports: a restarted node keeps its addresses
#   testnet/chaos.sh [-d SECONDS] [-i SECONDS] [-s SEED] [-k COUNT]
#   testnet/report.sh               # PNG plots and a Markdown summary in testnet/run/report/
#
#   -d SECONDS  how long to run (default 300); every node is running again at the end (a node
#               that does not recover is given up on after 60 s, which may overrun it)
#   -i SECONDS  time between kills (default 40)
#   -s SEED     seed of the choices (default 1)
#   -k COUNT    kill only among the last COUNT nodes (default all of them): the others run the
#               whole time, for figures over long lives amid churn
#
# Writes testnet/run/chaos.jsonl (one line per kill, restart and recovery) and
# testnet/run/samples.jsonl (every node's `nodectl status --json` each second).
set -euo pipefail
source "$(dirname "$0")/common.sh"

duration=300 interval=40 seed=1 killable=
while getopts "d:i:s:k:h" opt; do
    case $opt in
        d) duration=$OPTARG ;;
        i) interval=$OPTARG ;;
        s) seed=$OPTARG ;;
        k) killable=$OPTARG ;;
        *) sed -n '2,19p' "$0"; exit 2 ;;
    esac
done
[ -f "$run_dir/api-base" ] || {
    echo "chaos needs a testnet with fixed ports: start it with testnet/up.sh -P" >&2
    exit 1
}
mapfile -t dirs < <(node_dirs)
n=${#dirs[@]}
[ "$n" -ge 2 ] || { echo "no testnet running in $run_dir (testnet/up.sh -P)" >&2; exit 1; }
killable=${killable:-$n}
[ "$killable" -ge 1 ] && [ "$killable" -le "$n" ] || {
    echo "-k $killable: give a count of nodes from 1 to the testnet's $n" >&2
    exit 2
}

events="$run_dir/chaos.jsonl" samples="$run_dir/samples.jsonl"
: > "$events"
: > "$samples"
now() { date +%s.%N | cut -c1-14; }
event() { # kind, node, extra JSON fields
    printf '{"t":%s,"event":"%s","node":%d%s}\n' "$(now)" "$1" "$2" "${3:-}" >> "$events"
}

# Every node's status each second, or null while it is down.
sample() {
    while true; do
        for i in $(seq 0 $((n - 1))); do
            status=$("$nodectl" --log error status --data-dir "$run_dir/node-$i" --json 2>/dev/null) || status=null
            printf '{"t":%s,"node":%d,"status":%s}\n' "$(now)" "$i" "$status" >> "$samples"
        done
        sleep 1
    done
}
# A node's own step (the first "step" of its status; its peers' come after), or -1 while it
# does not answer; a node that has finished counts as far ahead.
own_step() {
    local status
    status=$("$nodectl" --log error status --data-dir "$run_dir/node-$1" --json 2>/dev/null) ||
        { echo -1; return; }
    if grep -q '"state":"finished"' <<< "$status"; then echo 1000000000; return; fi
    local step
    step=$(grep -o '"step":[0-9]*' <<< "$status" | head -1 | cut -d: -f2)
    echo "${step:--1}"
}
# Whether every node is $progress steps past the steps in the array named $1.
progress=20
trained_on() {
    local -n since=$1
    for i in $(seq 0 $((n - 1))); do
        [ "$(own_step "$i")" -ge $((since[i] + progress)) ] || return 1
    done
}

sample &
sampler=$!
trap 'kill $sampler 2>/dev/null || true' EXIT

# bash's RANDOM is reproducible once seeded.
RANDOM=$seed
event start -1 ",\"seed\":$seed,\"duration\":$duration,\"interval\":$interval,\"nodes\":$n"
echo "chaos: $n nodes, ${duration}s, a kill every ${interval}s, seed $seed"
end=$((SECONDS + duration))
# The last kill comes early enough for its restart (at most 10 s later) to fit.
while [ $((SECONDS + interval + 10)) -le "$end" ]; do
    sleep "$interval"
    victim=$((n - killable + RANDOM % killable))
    pause=$((3 + RANDOM % 8))
    pid=$(cat "$run_dir/node-$victim.pid")
    kill -KILL "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
    event kill "$victim" ",\"down_for\":$pause"
    echo "$(date +%T) killed node $victim (kill -9); restarting it in ${pause}s"
    sleep "$pause"
    "$(dirname "$0")/start.sh" "$victim" > /dev/null
    event restart "$victim"
    # Recovered: it sees every peer again, and every node (it too) has trained on by
    # $progress steps since, or finished: a swarm that sees itself but no longer trains, as a
    # stalled ring, is not recovered.
    deadline=$((SECONDS + 60)) recovered=1
    until "$nodectl" --log error status --data-dir "$run_dir/node-$victim" --json 2>/dev/null |
        grep -q "\"live_peers\":$((n - 1)),"; do
        if [ $SECONDS -ge $deadline ]; then recovered=0; break; fi
        sleep 0.2
    done
    if [ "$recovered" = 1 ]; then
        declare -a from=()
        for i in $(seq 0 $((n - 1))); do from[i]=$(own_step "$i"); done
        until trained_on from; do
            if [ $SECONDS -ge $deadline ]; then recovered=0; break; fi
            sleep 0.2
        done
    fi
    if [ "$recovered" = 1 ]; then
        event recovered "$victim"
        echo "$(date +%T) node $victim is back with $((n - 1)) peers, and every node trains on"
    else
        event unrecovered "$victim"
        echo "$(date +%T) node $victim: the swarm does not see all $n nodes train on 60 s after its restart" >&2
    fi
done
[ $SECONDS -lt "$end" ] && sleep $((end - SECONDS))
event end -1
echo "chaos done; samples in $samples, events in $events; testnet/report.sh plots them"
