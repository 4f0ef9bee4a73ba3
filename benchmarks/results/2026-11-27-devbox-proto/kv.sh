#!/usr/bin/env bash
# 131,072 × 4 KiB NIXL transfers (vLLM's shape), host memory: the old build
# (OLD, as in blocking.sh) and this checkout alternated twice.
# Usage: OLD=DIR OUT=DIR bash kv.sh
set -u
cd "$(dirname "$0")/../../.." && . .venv/bin/activate
mkdir -p "$OUT"
for i in 1 2; do
  for v in base new; do
    if [ $v = base ]; then export PYTHONPATH=$OLD; else unset PYTHONPATH; fi
    python benchmarks/nixl_bench.py --memory host --sizes "" --kv 131072x4K --backends TCPX_P2P --telemetry \
      --notifs 0 --rounds 3 --bytes-per-row 1G --out "$OUT/kv-$v-$i" > "$OUT/kv-$v-$i.txt" 2>&1
    grep -E "^ +KV|many descriptors|telemetry" "$OUT/kv-$v-$i.txt" | sed "s/^/$v-$i: /"
  done
done
