# Shared by the testnet scripts: paths and the nodectl binary.
# shellcheck shell=bash
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
run_dir="${TESTNET_DIR:-$root/testnet/run}"
nodectl="$root/target/release/nodectl"

# The data dirs of the nodes started by up.sh, in order.
node_dirs() {
    find "$run_dir" -maxdepth 1 -name 'node-*' -type d 2>/dev/null | sort
}
