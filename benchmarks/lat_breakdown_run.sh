#!/usr/bin/env bash
# Where one blocking host write's time goes, both sides traced:
#   bash benchmarks/lat_breakdown_run.sh OUTDIR [SIZES] [INLINE_MAX_LIST]
# GPU memory: MEMORY=gpu (both processes on GPUS, default 0,0); another
# operation than write: OP=send (or read); fewer writes: ITERS.
# For each size (default 64K 1M) and each TCPX_P2P_INLINE_MAX (default
# "0 64K 1M": every write through the net; the default threshold; inline up
# to the largest allowed), 200 blocking writes host → host with
# TCPX_P2P_LOG=trace, then benchmarks/lat_breakdown.py over the trace:
# OUTDIR/breakdown-OP-MEMORY-SIZE-inlineMAX.{txt,json}. Tracing costs a few µs
# per event; the split between steps is what this is for, not the sums.
set -uo pipefail
cd "$(dirname "$0")/.."
O=$1 SIZES=${2:-"64K 1M"} LIST=${3:-"0 64K 1M"}
MEMORY=${MEMORY:-host} GPUS=${GPUS:-0,0} OP=${OP:-write} ITERS=${ITERS:-200}
MEM_ARGS=(--memory "$MEMORY")
[ "$MEMORY" = gpu ] && MEM_ARGS+=(--gpus "$GPUS")
mkdir -p "$O"
T=$(mktemp -d)
for size in $SIZES; do
  for im in $LIST; do
    name=breakdown-$OP-$MEMORY-$size-inline$im
    TCPX_P2P_LOG=trace TCPX_P2P_INLINE_MAX=$im timeout 300 python3 -m tcpx_p2p.bench pair "${MEM_ARGS[@]}" \
      --inflight 1 --op "$OP" --sizes "$size" --iters "$ITERS" --rounds 1 --out "$T/$name" \
      > "$T/$name.table" 2> "$T/$name.log"
    python3 benchmarks/lat_breakdown.py "$T/$name.log" --json "$O/$name.json" > "$O/$name.txt"
    grep -E "^$OP " "$T/$name.table" | sed 's/^/# traced run: /' >> "$O/$name.txt"
    echo "$name: $(wc -l < "$T/$name.log") trace lines"
  done
done
rm -rf "$T"
