#!/usr/bin/env bash
# The main job: train Murmur's default model on Fashion-MNIST on this machine.
#
#   testnet/run.sh [-c CONFIG] [-- extra nodectl train flags]
#
# Installs the dataset if it is missing (Debian's dataset-fashion-mnist), builds nodectl in
# release mode, and trains the config (default configs/fashion-mlp.toml) from scratch.
# Today this is a single node; the multi-node testnet builds on it.
set -euo pipefail
cd "$(dirname "$0")/.."

config=configs/fashion-mlp.toml
while getopts "c:h" opt; do
    case $opt in
        c) config=$OPTARG ;;
        h) sed -n '2,9p' "$0"; exit 0 ;;
        *) sed -n '2,9p' "$0" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))

data_dir=${NODECTL_DATA:-/usr/share/datasets/fashion-mnist}
if [ ! -d "$data_dir" ]; then
    echo "Fashion-MNIST is not in $data_dir; installing dataset-fashion-mnist" >&2
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -q
    $sudo apt-get install -y -q dataset-fashion-mnist
fi

cargo build --release --locked -p murmur-daemon
exec ./target/release/nodectl train --config "$config" --data "$data_dir" --fresh "$@"
