#!/usr/bin/env bash
# loop.py (one prepared NIXL handle posted ITERS times; medians, and CPU
# seconds per transfer of each process) with the OLD and NEW builds in turn.
# Usage: ab_loop.sh OLD NEW [ALTERNATIONS] [ITERS]
set -euo pipefail
OLD=$1 NEW=$2 N=${3:-3} IT=${4:-15}
here=$(dirname "$0")
cd "$here/../../.."
PKG=crates/p2p-python/python/tcpx_p2p
. .venv/bin/activate
for i in $(seq 1 "$N"); do
  for v in old new; do
    src=$OLD; [ "$v" = new ] && src=$NEW
    cp "$src/_native.abi3.so" "$PKG/_native.abi3.so"
    cp "$src/libplugin_TCPX_P2P.so" "$PKG/nixl/libplugin_TCPX_P2P.so"
    for shape in "131072 4096 WRITE" "131072 4096 READ" "1 536870912 WRITE" "1 536870912 READ"; do
      set -- $shape
      echo "$v-$i: $(python "$here/loop.py" "$1" "$2" "$IT" "$3" 2>&1 | grep -v NIXL)"
    done
  done
done
