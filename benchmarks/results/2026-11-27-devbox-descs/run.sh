#!/usr/bin/env bash
# Before/after on one machine, host memory (DRAM) over loopback, NIXL with
# the TCPX_P2P plugin: vLLM's descriptor counts beside one descriptor of the
# same bytes. OLD and NEW are folders holding a build's _native.abi3.so and
# libplugin_TCPX_P2P.so; they are swapped into the editable install in turn
# (old, new, old, new, ...), so that both see the same machine load.
# Usage: run.sh OLD NEW OUTDIR [ALTERNATIONS] [KV]
set -euo pipefail
OLD=$1 NEW=$2 OUT=$3 N=${4:-3} KV=${5:-131072x4K}
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT"
PKG=crates/p2p-python/python/tcpx_p2p
. .venv/bin/activate
for i in $(seq 1 "$N"); do
  for v in old new; do
    src=$OLD; [ "$v" = new ] && src=$NEW
    cp "$src/_native.abi3.so" "$PKG/_native.abi3.so"
    cp "$src/libplugin_TCPX_P2P.so" "$PKG/nixl/libplugin_TCPX_P2P.so"
    python benchmarks/nixl_bench.py --memory host --sizes "" --kv "$KV" --backends TCPX_P2P \
      --telemetry --notifs 0 --rounds 3 --bytes-per-row 3G --out "$OUT/$v-$i" > "$OUT/$v-$i.txt" 2>&1
    grep -E "^ +KV|many descriptors|telemetry" "$OUT/$v-$i.txt" | sed "s/^/$v-$i: /"
  done
done
