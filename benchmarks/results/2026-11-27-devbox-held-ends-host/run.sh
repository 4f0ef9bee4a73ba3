#!/bin/bash
# Host memory on the 2-core box, builds installed from their wheels into
# site folders ($SITES/site_<tag>: old = 31b5f42, kick = 21218b8, new =
# 0a3c30c), alternated round by round.
#   SITES=DIR bash run.sh OUT
# round1: benchmarks/results/2026-11-27-devbox-spill-host/run.sh with
#   BUILDS="new old" ROUNDS=3 and "full" (pipelined 64 / 256 MiB write
#   with raw TCP, blocking write 4K / 64K / 1M, KV 4,096 x 32 KiB);
# round2: blocking write 4K / 64K / 1M, six rounds;
# round3: blocking write 64K alone, three builds, six rounds.
set -u
PY=${PY:-python3}
O=${1:?an output folder}; mkdir -p "$O/round1" "$O/round2" "$O/round3"
here=$(cd "$(dirname "$0")" && pwd)
SITES=$SITES BUILDS="new old" ROUNDS=3 PY=$PY bash "$here/../2026-11-27-devbox-spill-host/run.sh" "$O/round1" full
for r in 1 2 3 4 5 6; do
  for b in new old; do
    PYTHONPATH=$SITES/site_$b timeout 60 $PY -m tcpx_p2p.bench pair --memory host --inflight 1 --op write --sizes 4K,64K,1M --rounds 2 > "$O/round2/b2_${b}_$r.txt" 2>/dev/null
  done
done
for r in 1 2 3 4 5 6; do
  for b in new kick old; do
    PYTHONPATH=$SITES/site_$b timeout 60 $PY -m tcpx_p2p.bench pair --memory host --inflight 1 --op write --sizes 64K --rounds 3 > "$O/round3/b3_${b}_$r.txt" 2>/dev/null
  done
done
