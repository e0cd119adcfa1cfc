#!/usr/bin/env bash
# The Python environment of the murmur package's tests, examples and testnet peers: a venv in
# target/python-venv ($MURMUR_VENV names another) with PyTorch and the test tools from PyPI
# (python/requirements-dev.txt), and the package built from this checkout with maturin, as a
# release wheel. Prints the venv's python; run it again after changing the package.
#
#   python/venv.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${MURMUR_VENV:-$root/target/python-venv}
if [ ! -x "$venv/bin/python" ]; then
    echo "making the Python venv $venv" >&2
    python3 -m venv "$venv" >&2
fi
# No cache: PyTorch's wheels (the CUDA libraries) would be kept twice, installed and cached,
# several GB that a clean machine may not have.
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
    -r "$root/python/requirements-dev.txt" >&2
# The wheel's Rust half builds in the workspace's target dir, beside nodectl's release build;
# the build backend runs the venv's maturin.
PATH="$venv/bin:$PATH" "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    --force-reinstall "$root/python" >&2
echo "$venv/bin/python"
