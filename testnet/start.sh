#!/usr/bin/env bash
# Start (or restart) one daemon of the running testnet: a node that crashed, or a late joiner
# on a spare shard (see `up.sh -k`). It bootstraps from node 0 and keeps its data dir, so a
# restarted node resumes from its checkpoint or, if that is too old, by state sync.
#
#   testnet/start.sh INDEX [extra nodectl join flags]
set -euo pipefail
source "$(dirname "$0")/common.sh"

i=${1:?usage: testnet/start.sh INDEX [flags]}; shift
if [ -f "$run_dir/node-$i.pid" ] && kill -0 "$(cat "$run_dir/node-$i.pid")" 2>/dev/null; then
    echo "node $i is running already" >&2
    exit 1
fi
[ -d "$run_dir/shards/shard-$(printf %03d "$i")" ] || {
    echo "no shard $i in $run_dir/shards: start the testnet with more shards (up.sh -k)" >&2
    exit 1
}
starts=$(grep -c '^ready ' "$run_dir/node-$i.log" 2>/dev/null || true)
start_node "$i" --no-mdns --bootstrap "$(cat "$run_dir/bootstrap")" "$@"
wait_ready "$i" $((starts + 1))
echo "node $i started (pid $(cat "$run_dir/node-$i.pid"))"
