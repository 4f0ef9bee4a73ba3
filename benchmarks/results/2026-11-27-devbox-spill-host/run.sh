#!/bin/bash
# Host memory on the 2-core box: builds installed into site folders
# ($SITES/site_<tag>, e.g. old = 4ed12b1, new = this work), alternated.
#   SITES=DIR BUILDS="new old" ROUNDS=6 bash run.sh OUT [full]
# full: pipelined 64 / 256 MiB write with raw TCP, blocking write 4K /
# 64K / 1M, KV 4,096 x 32 KiB; else blocking write and send of 1 MiB.
set -u
PY=${PY:-python3}
O=${1:?an output folder}; mkdir -p "$O"
for r in $(seq 1 "${ROUNDS:-6}"); do
  for b in ${BUILDS:-new old}; do
    export PYTHONPATH=$SITES/site_$b
    if [ "${2:-}" = full ]; then
      timeout 150 $PY -m tcpx_p2p.bench pair --memory host --sizes 64M,256M --op write --reference > "$O/${b}_pipe_$r.txt" 2>&1
      timeout 150 $PY -m tcpx_p2p.bench pair --memory host --inflight 1 --op write --sizes 4K,64K,1M --rounds 2 > "$O/${b}_block_$r.txt" 2>&1
      timeout 150 $PY -m tcpx_p2p.bench pair --memory host --op write --kv-blocks 4096 --block-size 32K > "$O/${b}_kv_$r.txt" 2>&1
    else
      timeout 150 $PY -m tcpx_p2p.bench pair --memory host --inflight 1 --op write,send --sizes 1M --rounds 2 > "$O/${b}_$r.txt" 2>&1
      echo "$b $r: $(grep -E '^(write|send) +1M ' "$O/${b}_$r.txt" | awk '{print $1, "p50", $5}' | tr '\n' ' ')"
    fi
  done
done
