#!/bin/bash
# Reads over the same-host net with leases (this build) beside the build
# before them (OLD_PY: a Python whose tcpx_p2p is that build's wheel),
# alternated, five rounds each, host memory, on the 2-core box. Each run
# also times read_ipc / write_ipc of a same-host connection in the same
# iterations (local_bench interleaves its ways), the yardstick across runs.
set -u
cd "$(dirname "$0")/../../.."
OUTDIR=${1:-$(dirname "$0")}
NEW_PY=${NEW_PY:-.venv/bin/python}
OLD_PY=${OLD_PY:?set OLD_PY to the python of the old build}
for r in 1 2 3 4 5; do
  for b in new old; do
    if [ "$b" = new ]; then PY=$NEW_PY; else PY=$OLD_PY; fi
    TCPX_P2P_SAME_HOST_NET=1 timeout 300 "$PY" benchmarks/local_bench.py --device cpu \
      --sizes 4K,64K,256K,1M,4M,16M --out /tmp/lbrun > "$OUTDIR/${b}_run$r.txt" 2>&1
    mv /tmp/lbrun/local_bench_cpu.json "$OUTDIR/local_bench_cpu_${b}_run$r.json"
  done
done
# Each way alone in a loop (loop.py), alternated, two rounds.
for r in 1 2; do
  for size in 4096 65536 1048576 4194304 16777216; do
    for op in read write; do
      for b in new old; do
        if [ "$b" = new ]; then PY=$NEW_PY; else PY=$OLD_PY; fi
        echo "$b $(timeout 300 "$PY" "$OUTDIR/loop.py" $op $size 500 2>&1 | tail -1)"
      done
    done
  done
done > "$OUTDIR/loops.txt"
