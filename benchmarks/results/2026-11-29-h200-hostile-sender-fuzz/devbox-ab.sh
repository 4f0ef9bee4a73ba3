#!/bin/bash
# The 2-core box, host memory: two builds alternated six times, each installed with
# `pip install --target DIR WHEEL`: bash devbox-ab.sh BEFORE_DIR AFTER_DIR (from the repository root, with ./run's .venv).
# Prints, per run, the pipelined 256 MiB write (GB/s) and the one-at-a-time write p50 at 4 KiB and 64 KiB (us).
declare -A SITE=([head]=$1 [new]=$2)
for i in 1 2 3 4 5 6; do
  for b in head new; do
    [ $((i % 2)) = 0 ] && { [ $b = head ] && b=new || b=head; }
    r=$(PYTHONPATH=${SITE[$b]} timeout 120 .venv/bin/python -m tcpx_p2p.bench pair --memory host --op write --sizes 256M 2>&1 | awk '$1=="write" && $2=="256M" {print $4}')
    k=$(PYTHONPATH=${SITE[$b]} timeout 120 .venv/bin/python -m tcpx_p2p.bench pair --memory host --inflight 1 --op write --sizes 4K,64K --rounds 1 2>&1 | awk '$1=="write" && ($2=="4K" || $2=="64K") {printf "%s p50 %s ", $2, $5}')
    echo "$i $b pipelined256M $r GB/s; $k"
  done
done
