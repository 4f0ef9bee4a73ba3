#!/bin/bash
# The engine's read over the same-host net copied by the reader from keys
# the target grants (TCPX_P2P_SAME_HOST_PULL=1, the default) and paired
# (=0), beside read_ipc of a same-host connection in the same runs,
# alternated, three rounds each (host memory, this 2-core box).
set -u
cd "$(dirname "$0")/../../.."
OUTDIR=${1:-$(dirname "$0")}
for r in 1 2 3; do
  for m in 1 0; do
    TCPX_P2P_SAME_HOST_NET=1 TCPX_P2P_SAME_HOST_PULL=$m timeout 300 \
      python benchmarks/local_bench.py --device cpu --sizes 64K,256K,1M,4M,16M,64M --out /tmp/lbrun > "$OUTDIR/pull${m}_run$r.txt" 2>&1
    mv /tmp/lbrun/local_bench_cpu.json "$OUTDIR/local_bench_cpu_pull${m}_run$r.json"
  done
done
