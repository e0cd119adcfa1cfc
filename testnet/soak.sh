#!/usr/bin/env bash
# Soak: a swarm of daemons trains for a long while with random churn and a hostile peer among
# them, and must neither deadlock nor grow in memory.
#
#   testnet/soak.sh [-n PEERS] [-d SECONDS] [-i SECONDS] [-k COUNT] [-w SECONDS] [-c CONFIG]
#                   [-t TRANSPORT]
#
#   -n PEERS    daemons (default 16)
#   -d SECONDS  how long (default 600)
#   -w SECONDS  warm-up: memory is compared from this long into each daemon's life to the end
#               (default 120)
#   -i SECONDS  time between kills (default 30): testnet/chaos.sh kills a random daemon with
#               SIGKILL and restarts it after a random pause
#   -k COUNT    kill only among the last COUNT daemons (default all): the others live through
#               the whole soak amid the churn, which shows whether their memory levels off
#   -c CONFIG   run config (default configs/ci-tiny-gossip.toml, a tiny MLP), trained with no
#               end (`epochs` set to a million), on a synthetic dataset
#   -t TRANSPORT  what the daemons listen on and peers connect over: tcp, quic or both
#               (default both, as a node's default `listen`)
#
# The adversary (testnet/adversary, not part of nodectl) joins the run and, against every
# peer it meets, claims step 0, answers exchanges with steered parameters, holds streams open,
# asks for state and sends garbage. Every 10 s each daemon's resident memory is sampled
# (testnet/run/soak/rss.jsonl: resident in all, its anonymous part, and its threads; the heap
# figures of the statuses chaos.sh samples go to testnet/run/soak/memory.jsonl); at the end
# each daemon must answer its status and have trained and exchanged in the last minute. Prints
# one JSON line per daemon (resident memory and the bytes it holds by its own count after
# warm-up and at the end, for daemons that ran since warm-up), the growth of anonymous memory,
# of the heap by glibc's count and of the bytes held by the daemon's count over every life past
# its warm-up (in a soak of 20 minutes or more, also for each ten minutes of a life), and a
# summary line; exits 1 if a daemon stalled.
set -euo pipefail
source "$(dirname "$0")/common.sh"

n=16 duration=600 interval=30 warmup=120 config="$root/configs/ci-tiny-gossip.toml" transport=both killable=
while getopts "n:d:i:k:w:c:t:h" opt; do
    case $opt in
        n) n=$OPTARG ;;
        d) duration=$OPTARG ;;
        i) interval=$OPTARG ;;
        k) killable=$OPTARG ;;
        w) warmup=$OPTARG ;;
        c) config=$OPTARG ;;
        t) transport=$OPTARG ;;
        *) sed -n '2,31p' "$0"; exit 2 ;;
    esac
done

echo "soak: building nodectl and the adversary (release)" >&2
(cd "$root" && cargo build --release --locked -q -p murmur-daemon -p murmur-adversary)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
endless_synthetic_run "$scratch" "$config"

NODECTL_DATA="$scratch/data" "$root/testnet/up.sh" -n "$n" -c "$scratch/run.toml" -P \
    --transport "$transport" >&2
soak="$run_dir/soak"
mkdir -p "$soak"
status0=$("$nodectl" --log error status --data-dir "$run_dir/node-0" --json)
field() { sed -n "s/.*\"$1\":\"\\([^\"]*\\)\".*/\\1/p" <<<"$status0" | head -1; }
"$root/target/release/adversary" --run-id "$(field run_id)" --fingerprint "$(field fingerprint)" \
    --bootstrap "$(cat "$run_dir/bootstrap")" --duration "$duration" >"$soak/adversary.jsonl" \
    2>"$soak/adversary.log" &
adversary=$!
"$root/testnet/chaos.sh" -d "$duration" -i "$interval" -k "${killable:-$n}" >"$soak/chaos.log" 2>&1 &
chaos=$!
cleanup() {
    kill "$adversary" "$chaos" 2>/dev/null || true
    "$root/testnet/down.sh" -g 5 >/dev/null 2>&1 || true
    rm -rf "$scratch"
}
trap cleanup EXIT

# Resident memory of every daemon every 10 s: time, node, pid, kB.
start=$SECONDS
: >"$soak/rss.jsonl"
while [ $((SECONDS - start)) -lt "$duration" ]; do
    for i in $(seq 0 $((n - 1))); do
        pid=$(cat "$run_dir/node-$i.pid" 2>/dev/null || echo 0)
        # Resident memory in all, its anonymous part (the heap and thread stacks; the rest is
        # mapped files), and the daemon's threads.
        read -r rss anon threads < <(awk '/^VmRSS:/ { r = $2 } /^RssAnon:/ { a = $2 }
            /^Threads:/ { t = $2 } END { if (r) print r, a, t }' "/proc/$pid/status" \
            2>/dev/null) || true
        [ -n "${rss:-}" ] && printf '{"t":%d,"node":%d,"pid":%d,"rss_kb":%d,"anon_kb":%d,"threads":%d}\n' \
            $((SECONDS - start)) "$i" "$pid" "$rss" "$anon" "$threads" >>"$soak/rss.jsonl"
    done
    sleep 10
done
wait "$chaos" || echo "soak: chaos.sh ended with an error (see $soak/chaos.log)" >&2

# Every daemon must train and exchange over the last minute.
status_of() { # node, file
    "$nodectl" --log error status --data-dir "$run_dir/node-$1" --json >"$2" 2>/dev/null || echo null >"$2"
}
for i in $(seq 0 $((n - 1))); do status_of "$i" "$soak/before-$i.json"; done
sleep 60
for i in $(seq 0 $((n - 1))); do status_of "$i" "$soak/after-$i.json"; done
# The memory figures of every status chaos.sh sampled, read once (the statuses take seconds to
# parse): one line per sample with the time, node, life, glibc's heap in use and the daemon's
# own count of the bytes it holds.
python3 - "$run_dir/samples.jsonl" >"$soak/memory.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        s = json.loads(line)
    except ValueError:  # a line cut short when the soak stopped
        continue
    status = s.get("status") or {}
    memory = status.get("memory") or {}
    if memory:
        print(json.dumps({"t": s["t"], "node": s["node"], "life": status["started_unix_s"],
                          "heap": memory.get("heap_in_use_bytes"),
                          "allocated": memory.get("allocated_bytes")}))
EOF
stalled=0
for i in $(seq 0 $((n - 1))); do
    python3 - "$i" "$soak/before-$i.json" "$soak/after-$i.json" "$soak/rss.jsonl" "$warmup" \
        "$soak/memory.jsonl" <<'EOF' || stalled=$((stalled + 1))
import json, sys
node, rss_file, warmup, memory_file = int(sys.argv[1]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
before, after = (json.load(open(path)) for path in sys.argv[2:4])
samples = [s for s in map(json.loads, open(rss_file)) if s["node"] == node]
pid = samples[-1]["pid"] if samples else None
life = [s for s in samples if s["pid"] == pid]
born = life[0]["t"] if life else 0
warm = [s for s in life if s["t"] >= born + warmup]
line = {"node": node, "pid": pid, "restarts": len({s["pid"] for s in samples}) - 1,
        "rss_mb_after_warmup": round(warm[0]["rss_kb"] / 1024, 1) if warm else None,
        "rss_mb_end": round(life[-1]["rss_kb"] / 1024, 1) if life else None,
        "anon_mb_after_warmup": round(warm[0]["anon_kb"] / 1024, 1) if warm else None,
        "anon_mb_end": round(life[-1]["anon_kb"] / 1024, 1) if life else None}
# What the daemon holds by its own count, in its last life (the statuses chaos.sh sampled).
held = [m for m in map(json.loads, open(memory_file))
        if m["node"] == node and m["allocated"] is not None]
held = [m for m in held if m["life"] == held[-1]["life"]]
held_warm = [m for m in held if m["t"] >= held[0]["t"] + warmup]
line["allocated_mb_after_warmup"] = round(held_warm[0]["allocated"] / 2**20, 2) if held_warm else None
line["allocated_mb_end"] = round(held[-1]["allocated"] / 2**20, 2) if held else None
ok = after is not None and before is not None
if ok:
    line["steps_last_minute"] = after["step"] - before["step"]
    line["exchanges_last_minute"] = (after["sync"]["exchanges"] + after["sync"]["served"]
                                     - before["sync"]["exchanges"] - before["sync"]["served"])
    line["failed"] = after["sync"]["failed"]
    line["blocked_peers"] = after["blocked_peers"]
    ok = line["steps_last_minute"] > 0 and line["exchanges_last_minute"] > 0
line["ok"] = ok
print(json.dumps(line))
sys.exit(0 if ok else 1)
EOF
done
tail -1 "$soak/adversary.jsonl" | sed 's/^/adversary: /'
# Every daemon life that lasted two minutes past its warm-up: how much its anonymous memory
# (sampled here), the heap it holds by glibc's count and the bytes it holds by its own exact
# count (both from the statuses chaos.sh sampled) grew
# from the first minute after the warm-up to the life's last (medians of each, which the
# exchanges' transient buffers do not sway), and the least-squares slope of every sample after
# the warm-up.
python3 - "$soak/rss.jsonl" "$soak/memory.jsonl" "$warmup" "$duration" <<'EOF'
import json, statistics, sys
rss_file, memory_file = sys.argv[1], sys.argv[2]
warmup, duration = int(sys.argv[3]), int(sys.argv[4])
lives = {}  # (what, node, life) -> [(seconds, MB)]
for s in map(json.loads, open(rss_file)):
    lives.setdefault(("anon", s["node"], s["pid"]), []).append((s["t"], s["anon_kb"] / 1024))
for m in map(json.loads, open(memory_file)):
    for what in ("heap", "allocated"):
        if m[what] is not None:
            lives.setdefault((what, m["node"], m["life"]), []).append((m["t"], m[what] / 2**20))
def slope(points):  # MB a minute
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var * 60 if var else 0.0
def growth(points):  # MB: the median of the last minute less that of the first
    first = [v for t, v in points if t < points[0][0] + 60]
    last = [v for t, v in points if t > points[-1][0] - 60]
    return statistics.median(last) - statistics.median(first)
def summarise(part):
    """The figures of every count over the lives for which `part(points)` gives samples."""
    summary = {}
    for what in ("anon", "heap", "allocated"):
        parts = [part(points) for (kind, _, _), points in lives.items() if kind == what]
        parts = [points for points in parts if points]
        if parts:
            growths = [growth(points) for points in parts]
            summary[what] = {"lives": len(parts),
                             "growth_mb_median": round(statistics.median(growths), 2),
                             "growth_mb_range": [round(min(growths), 2), round(max(growths), 2)],
                             "slope_mb_per_min_median":
                                 round(statistics.median(map(slope, parts)), 3),
                             "lives_growing": sum(g > 0 for g in growths)}
    return summary
def after_warmup(points):
    warm = [p for p in points if p[0] >= points[0][0] + warmup]
    # Lives that lasted two minutes past the warm-up (a sample lasts 1 to 10 s).
    return warm if warm and warm[-1][0] - warm[0][0] >= 120 else None
print("memory after warm-up: " + json.dumps(summarise(after_warmup)))
# In a soak of twenty minutes or more, the same figures for each ten minutes of a life (from the
# warm-up to minute 10, then 10 to 20, ...) over the lives that lasted the whole window: whether
# the growth slows, and in which of the three counts, shows what a short soak cannot.
if duration >= 1200:
    def window(a, b):
        def part(points):
            born = points[0][0]
            # A sample lasts 1 to 10 s; 30 s of slack keeps lives cut at the window's end.
            if points[-1][0] < born + b - 30:
                return None
            return [p for p in points if born + a <= p[0] < born + b]
        return part
    by_window = {}
    for k in range(duration // 600):
        a, b = max(warmup, 600 * k), 600 * (k + 1)
        if a < b:
            by_window[f"{a // 60}-{b // 60} min"] = summarise(window(a, b))
    print("memory by ten minutes of life: " + json.dumps(by_window))
EOF
# grep -c prints 0 and fails when no kill happened (an interval longer than the soak).
kills=$(grep -c '"event":"kill"' "$run_dir/chaos.jsonl" 2>/dev/null) || true
printf '{"peers":%d,"seconds":%d,"kill_interval_s":%d,"stalled":%d,"kills":%d}\n' "$n" "$duration" \
    "$interval" "$stalled" "${kills:-0}"
[ "$stalled" -eq 0 ]
