#!/usr/bin/env bash
# PNG plots (accuracy, loss, clock gap and bytes per node over time, every kill and recovery
# marked) and a Markdown summary of a testnet run recorded by testnet/chaos.sh, written to
# testnet/run/report/. Uses matplotlib, installed into target/report-venv on first use.
#
#   testnet/report.sh [RUN_DIR]
set -euo pipefail
source "$(dirname "$0")/common.sh"

python=python3
if ! "$python" -c "import matplotlib" 2>/dev/null; then
    venv="$root/target/report-venv"
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import matplotlib" 2>/dev/null; then
        echo "installing matplotlib into $venv" >&2
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q matplotlib
    fi
    python="$venv/bin/python"
fi
"$python" "$root/testnet/report.py" "${1:-$run_dir}"
