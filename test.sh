#!/usr/bin/env bash
# The whole test suite: the Rust workspace (`cargo test --workspace`), then the Python package
# (pytest, in the venv python/venv.sh makes: PyTorch from PyPI, the package built from this
# checkout). Arguments go to cargo test.
#
#   ./test.sh
set -euo pipefail
cd "$(dirname "$0")"
cargo test --workspace --locked "$@"
python=$(python/venv.sh)
"$python" -m pytest python/tests -q
