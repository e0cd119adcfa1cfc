#!/usr/bin/env bash
# Start a Prometheus server (Debian `prometheus`) that scrapes every node of the running testnet
# each second, and wait until it reports all of them up. Called by `up.sh -P`.
#
#   testnet/prometheus.sh N
#
# Writes testnet/run/prometheus.yml, keeps its data in testnet/run/prometheus/, logs to
# testnet/run/prometheus.log; down.sh stops it. Try in the web UI at the printed address:
# murmur_steps_total, rate(murmur_sent_bytes_total[30s]), murmur_live_peers.
set -euo pipefail
source "$(dirname "$0")/common.sh"

n=${1:?usage: testnet/prometheus.sh N}
port=${PROMETHEUS_PORT:-19090}
base=$(cat "$run_dir/api-base")
config="$run_dir/prometheus.yml"
{
    echo "global:"
    echo "  scrape_interval: 1s"
    echo "  evaluation_interval: 5s"
    echo "scrape_configs:"
    echo "  - job_name: murmur"
    echo "    static_configs:"
    for i in $(seq 0 $((n - 1))); do
        echo "      - targets: ['127.0.0.1:$((base + i))']"
        echo "        labels: {node: 'node-$i'}"
    done
} > "$config"
promtool check config "$config" > /dev/null

prometheus --config.file="$config" --storage.tsdb.path="$run_dir/prometheus" \
    --web.listen-address="127.0.0.1:$port" >> "$run_dir/prometheus.log" 2>&1 &
echo $! > "$run_dir/prometheus.pid"

# Every node up, as Prometheus itself reports it (the `up` series of each target).
deadline=$((SECONDS + 60))
up=0
while [ $SECONDS -lt $deadline ]; do
    up=$(promtool query instant "http://127.0.0.1:$port" 'sum(up{job="murmur"})' 2>/dev/null |
        sed -n 's/.*=> \([0-9]*\) @.*/\1/p' | head -1) || true  # not serving yet
    [ "${up:-0}" = "$n" ] && break
    sleep 0.5
done
if [ "${up:-0}" != "$n" ]; then
    echo "prometheus sees ${up:-0} of $n nodes up after 60 s; its log: $run_dir/prometheus.log" >&2
    exit 1
fi
echo "prometheus: http://127.0.0.1:$port scrapes $n nodes, all up"
promtool query instant "http://127.0.0.1:$port" 'up{job="murmur"}'
