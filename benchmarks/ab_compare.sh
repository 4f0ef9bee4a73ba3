#!/usr/bin/env bash
# Two builds on one lease, alternated (lease-to-lease variance is as large
# as most changes): bash benchmarks/ab_compare.sh OLD_WHEEL NEW_WHEEL OUTDIR [ROUNDS]
# Each round runs, for each wheel in turn, GPU → GPU latency and throughput
# at AB_SIZES (default 4K,64K,1M) and, unless AB_KV=0, a scattered
# 4,096 × 32 KiB KV writev.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=$1 NEW=$2 O=$3 ROUNDS=${4:-2}
mkdir -p "$O"
for r in $(seq 1 "$ROUNDS"); do
  for tag in old new; do
    w=$OLD; [ $tag = new ] && w=$NEW
    (
      . benchmarks/device_env.sh "$w"
      B="python3 -m tcpx_p2p.bench pair --memory gpu"
      timeout 90 $B --sizes "${AB_SIZES:-4K,64K,1M}" --json "$O/${tag}_r${r}_lat.json" > "$O/${tag}_r${r}_lat.txt" 2>/dev/null
      [ "${AB_KV:-1}" = 0 ] || timeout 60 $B --op write --kv-blocks 4096 --block-size 32K --json "$O/${tag}_r${r}_kv.json" > "$O/${tag}_r${r}_kv.txt" 2>/dev/null
    )
    echo "== $tag round $r"; grep -E "^(send|write) " "$O/${tag}_r${r}_lat.txt" "$O/${tag}_r${r}_kv.txt" 2>/dev/null | sed 's/^[^:]*://'
  done
done
