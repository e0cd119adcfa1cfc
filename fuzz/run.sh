#!/usr/bin/env bash
# Fuzzes every decoder of untrusted bytes for a bounded time and prints, per target, one JSON
# line: executions, seconds, executions per second, coverage, corpus size and crashes.
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]     (default 60 s, every target)
#
# Built by cargo-fuzz with `--sanitizer none`, which works on the stable toolchain (Rust is
# memory-safe; the fuzzers look for panics, aborts, runaway allocations and hangs). The
# corpus grows in fuzz/corpus/<target> from the seeds in fuzz/seeds/<target>; a crashing
# input is kept in fuzz/artifacts/<target>/ and the script exits 1. Turn each crash into a
# regression test next to the decoder (docs/fuzzing.md).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift || true
if ! [[ $seconds =~ ^[0-9]+$ ]] || ((seconds == 0)); then
    echo "fuzz/run.sh: seconds per target must be a whole number above 0, not \`$seconds\`" >&2
    exit 2
fi

if ! command -v cargo-fuzz >/dev/null; then
    echo "fuzz/run.sh: installing cargo-fuzz (once)" >&2
    cargo install cargo-fuzz --locked
fi

if (($# > 0)); then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list)
fi

echo "fuzz/run.sh: building ${#targets[@]} targets (instrumented, release)" >&2
cargo fuzz build --sanitizer none >&2
# Run what was just built (cargo fuzz run would build again on every source change).
bin=fuzz/target/$(rustc -vV | sed -n 's/^host: //p')/release

# The last value libFuzzer's final statistics give for `name` (-print_final_stats=1).
stat() { sed -n "s/^stat::$1: *//p" "$2" | tail -1; }

mkdir -p fuzz/logs
failed=0
for target in "${targets[@]}"; do
    corpus=fuzz/corpus/$target
    mkdir -p "$corpus" "fuzz/artifacts/$target"
    if [[ -d fuzz/seeds/$target ]]; then
        cp -n fuzz/seeds/"$target"/* "$corpus"/
    fi
    log=fuzz/logs/$target.log
    started=$(mktemp)
    echo "fuzz/run.sh: $target for ${seconds} s (log: $log)" >&2
    status=0
    # A single input may take 10 s and 2 GiB at most: more is a hang or a runaway allocation.
    "$bin/$target" "$corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$target/" >"$log" 2>&1 || status=$?
    executions=$(stat number_of_executed_units "$log")
    rate=$(stat average_exec_per_sec "$log")
    rss=$(stat peak_rss_mb "$log")
    coverage=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
    # Inputs kept by this run only: earlier ones are regression tests by now.
    crashes=$(find "fuzz/artifacts/$target" -type f -newer "$started" | wc -l)
    rm -f "$started"
    printf '{"target":"%s","seconds":%s,"executions":%s,"execs_per_s":%s,"coverage":%s,"corpus":%s,"peak_rss_mb":%s,"crashes":%s,"exit":%s}\n' \
        "$target" "$seconds" "${executions:-0}" "${rate:-0}" "${coverage:-0}" \
        "$(find "$corpus" -type f | wc -l)" "${rss:-0}" "$crashes" "$status"
    if ((status != 0 || crashes > 0)); then
        failed=1
        echo "fuzz/run.sh: $target found a crash; see $log and fuzz/artifacts/$target/" >&2
    fi
done
exit "$failed"
