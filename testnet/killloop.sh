#!/usr/bin/env bash
# Crash consistency: kill -9 a training peer at random moments, many times over, and check after
# every kill that what it keeps on disk is whole and that it starts again.
#
#   testnet/killloop.sh [-n ITERATIONS] [-s SEED] [-c CONFIG]
#
#   -n ITERATIONS  kills (default 200)
#   -s SEED        seed of the random moments (default 1)
#   -c CONFIG      run config (default configs/ci-tiny-gossip.toml: a checkpoint every epoch,
#                  several a second), trained with no end (`epochs` set to a million)
#
# Two daemons train on a synthetic dataset: a partner that keeps running, and a victim that is
# started, killed with SIGKILL after a random 0.05 to 3 s (while it starts and writes its API
# token and address, trains, exchanges parameters with the partner, writes checkpoints and its
# peer book), and started again. Every 5th start is from an empty data dir, so that kills also
# land in the first write of the identity key and the store. After every kill:
#   - every checkpoint left must load and evaluate (`nodectl evaluate`, which also reads the
#     node's last-status.json), and the identity key must load (`nodectl id`): anything else
#     is a corrupt state;
#   - a start that exits on its own with an error before the kill is a failed restart.
# At the end the victim starts once more and must exchange with the partner again.
#
# Writes testnet/run/killloop/iterations.jsonl (one line per kill) and prints a summary line:
#   {"iterations":200,"restart_failures":0,"corrupt_states":0,"checkpoints_checked":...}
set -euo pipefail
source "$(dirname "$0")/common.sh"

iterations=200 seed=1 config="$root/configs/ci-tiny-gossip.toml"
while getopts "n:s:c:h" opt; do
    case $opt in
        n) iterations=$OPTARG ;;
        s) seed=$OPTARG ;;
        c) config=$OPTARG ;;
        *) sed -n '2,24p' "$0"; exit 2 ;;
    esac
done
[[ $iterations =~ ^[0-9]+$ ]] || { echo "-n takes a number of kills, not \`$iterations\`" >&2; exit 2; }
[ -f "$config" ] || { echo "no run config at $config (-c)" >&2; exit 2; }

work="$run_dir/killloop"
rm -rf "$work"
mkdir -p "$work"
echo "killloop: building nodectl (release)" >&2
(cd "$root" && cargo build --release --locked -q -p murmur-daemon)
data="$work/data"
"$nodectl" dataset synthetic --out "$data" --train 4096 --test 1024 >/dev/null
# The run must not end before the loop does: the same config, with no end in sight.
sed 's/^epochs = .*/epochs = 1000000/' "$config" >"$work/run.toml"
config="$work/run.toml"

partner="$work/partner" victim="$work/victim"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

join() { # data dir, log, extra flags...
    local dir=$1 log=$2; shift 2
    "$nodectl" join --config "$config" --data "$data" --data-dir "$dir" --threads 1 \
        --listen /ip4/127.0.0.1/tcp/0 --api 127.0.0.1:0 "$@" >>"$log" 2>&1 &
    pids+=($!)
}

join "$partner" "$work/partner.log"
partner_pid=$!
deadline=$((SECONDS + 60))
until bootstrap=$(sed -n 's/^to join this node: .*--bootstrap //p' "$work/partner.log" | head -1) \
    && [ -n "$bootstrap" ]; do
    if [ $SECONDS -ge $deadline ] || ! kill -0 "$partner_pid" 2>/dev/null; then
        echo "killloop: the partner did not start; its log:" >&2
        tail -5 "$work/partner.log" >&2
        exit 1
    fi
    sleep 0.1
done

RANDOM=$seed
results="$work/iterations.jsonl"
: >"$results"
restart_failures=0 corrupt=0 checked=0
for ((i = 1; i <= iterations; i++)); do
    fresh=false
    if ((i % 5 == 1)); then
        rm -rf "$victim"
        fresh=true
    fi
    log="$work/victim-$i.log"
    join "$victim" "$log" --bootstrap "$bootstrap"
    pid=$!
    # 0.05 to 3 s, in milliseconds.
    delay_ms=$((50 + RANDOM % 2951))
    sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
    outcome=killed
    if kill -9 "$pid" 2>/dev/null; then
        wait "$pid" 2>/dev/null || true
    else
        status=0
        wait "$pid" 2>/dev/null || status=$?
        if ((status != 0)); then
            outcome="exited $status"
            restart_failures=$((restart_failures + 1))
            echo "killloop: iteration $i: the victim failed to start (exit $status):" >&2
            tail -3 "$log" >&2
        else
            outcome="exited 0"
        fi
    fi
    # What the kill left behind.
    problems=()
    mapfile -t checkpoints < <(find "$victim/checkpoints" -name '*.safetensors' 2>/dev/null | sort)
    if ((${#checkpoints[@]} > 0)); then
        if ! "$nodectl" evaluate --config "$config" --data "$data" --log warn \
            "${checkpoints[@]}" >"$work/evaluate-$i.out" 2>&1; then
            problems+=("checkpoints: $(tail -1 "$work/evaluate-$i.out")")
        fi
        checked=$((checked + ${#checkpoints[@]}))
    fi
    if [ -e "$victim/identity.key" ] && ! "$nodectl" id --data-dir "$victim" >/dev/null 2>"$work/id-$i.err"; then
        problems+=("identity key: $(tail -1 "$work/id-$i.err")")
    fi
    if ((${#problems[@]} > 0)); then
        corrupt=$((corrupt + 1))
        printf 'killloop: iteration %d: corrupt state: %s\n' "$i" "${problems[*]}" >&2
    else
        rm -f "$log" "$work/evaluate-$i.out" "$work/id-$i.err"
    fi
    # Temporary files a kill left mid-write: harmless, but they must not pile up.
    temporary=$(find "$victim" -name '*.tmp*' 2>/dev/null | wc -l)
    printf '{"iteration":%d,"fresh":%s,"delay_ms":%d,"outcome":"%s","checkpoints":%d,"temporary_files":%d,"problems":%d}\n' \
        "$i" "$fresh" "$delay_ms" "$outcome" "${#checkpoints[@]}" "$temporary" "${#problems[@]}" >>"$results"
    if ((i % 20 == 0)); then
        echo "killloop: $i of $iterations kills, $restart_failures failed restarts, $corrupt corrupt states" >&2
    fi
done

# One more start: it must come up and exchange with the partner.
log="$work/victim-final.log"
join "$victim" "$log" --bootstrap "$bootstrap"
final_pid=$!
final=failed
deadline=$((SECONDS + 60))
while [ $SECONDS -lt $deadline ] && kill -0 "$final_pid" 2>/dev/null; do
    exchanges=$("$nodectl" status --data-dir "$victim" --json 2>/dev/null \
        | sed -n 's/.*"exchanges":\([0-9]*\).*/\1/p' || true)
    if [ "${exchanges:-0}" -ge 1 ]; then
        final=ok
        break
    fi
    sleep 0.5
done
most_temporary=$(sed -n 's/.*"temporary_files":\([0-9]*\).*/\1/p' "$results" | sort -n | tail -1)
printf '{"iterations":%d,"seed":%d,"restart_failures":%d,"corrupt_states":%d,"checkpoints_checked":%d,"most_temporary_files":%d,"final_restart":"%s"}\n' \
    "$iterations" "$seed" "$restart_failures" "$corrupt" "$checked" "${most_temporary:-0}" "$final"
[ "$final" = ok ] && ((restart_failures == 0 && corrupt == 0))
