#!/usr/bin/env bash
# Where one blocking host write's time goes, both sides traced:
#   bash benchmarks/lat_breakdown_run.sh OUTDIR [SIZES] [INLINE_MAX_LIST]
# For each size (default 64K 1M) and each TCPX_P2P_INLINE_MAX (default
# "0 64K 1M": every write through the net; the default threshold; inline up
# to the largest allowed), 200 blocking writes host → host with
# TCPX_P2P_LOG=trace, then benchmarks/lat_breakdown.py over the trace:
# OUTDIR/breakdown-write-SIZE-inlineMAX.{txt,json}. Tracing costs a few µs
# per event; the split between steps is what this is for, not the sums.
set -uo pipefail
cd "$(dirname "$0")/.."
O=$1 SIZES=${2:-"64K 1M"} LIST=${3:-"0 64K 1M"}
mkdir -p "$O"
T=$(mktemp -d)
for size in $SIZES; do
  for im in $LIST; do
    name=breakdown-write-$size-inline$im
    TCPX_P2P_LOG=trace TCPX_P2P_INLINE_MAX=$im timeout 300 python3 -m tcpx_p2p.bench pair \
      --inflight 1 --op write --sizes "$size" --iters 200 --rounds 1 --out "$T/$name" \
      > "$T/$name.table" 2> "$T/$name.log"
    python3 benchmarks/lat_breakdown.py "$T/$name.log" --json "$O/$name.json" > "$O/$name.txt"
    grep -E '^write ' "$T/$name.table" | sed 's/^/# traced run: /' >> "$O/$name.txt"
    echo "$name: $(wc -l < "$T/$name.log") trace lines"
  done
done
rm -rf "$T"
