#!/bin/bash
# connect_local's connections on the engine and the same-host net (this
# build) beside the old same-host connection type (OLD_PY: a Python whose
# tcpx_p2p is the build before the move), each way alone in a loop
# (../2026-11-27-devbox-write-leases/ipc_alone.py, `local` way), host
# memory, 2-core box, builds alternated, two rounds; then local_bench's
# interleaved ways once per build.
set -u
cd "$(dirname "$0")/../../.."
OUTDIR=${1:-$(dirname "$0")}
NEW_PY=${NEW_PY:-.venv/bin/python}
OLD_PY=${OLD_PY:?set OLD_PY to the python of the old build}
LOOP=benchmarks/results/2026-11-27-devbox-write-leases/ipc_alone.py
for r in 1 2; do
  for size in 4096 65536 1048576 16777216; do
    for op in write read; do
      for b in new old; do
        if [ "$b" = new ]; then PY=$NEW_PY; else PY=$OLD_PY; fi
        echo "$b $(timeout 300 "$PY" "$LOOP" local $op $size 500 2>&1 | tail -1)"
      done
    done
  done
done > "$OUTDIR/alone.txt"
for b in new old; do
  if [ "$b" = new ]; then PY=$NEW_PY; else PY=$OLD_PY; fi
  timeout 600 "$PY" benchmarks/local_bench.py --device cpu --sizes 4K,64K,1M,16M \
    --out /tmp/lb_$b > "$OUTDIR/local_bench_$b.txt" 2>&1
  mv /tmp/lb_$b/local_bench_cpu.json "$OUTDIR/local_bench_cpu_$b.json"
done
