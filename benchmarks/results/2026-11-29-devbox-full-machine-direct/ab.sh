#!/bin/bash
# alternated old/new, UCCL's shape, host memory, HOGS cpu hogs
# old = 10e7172 (before), new = 80baf04 (the posting thread writes messages up to 1 MiB itself when no CPU is idle), raw = the plain TCP reference; 2-core box, host memory
for r in 1 2 3; do
  for i in $(seq $HOGS); do (timeout 60 yes > /dev/null &); done
  for b in old new; do
    echo "hogs=$HOGS $b r$r: $(PYTHONPATH=/tmp/site_$b python3 benchmarks/sendrecv_loop.py --shape uccl --sizes 64K,256K,1M,10M --rounds 6 --json benchmarks/results/2026-11-29-devbox-full-machine-direct/ab_${HOGS}_${b}_$r.json | awk 'NR>1{printf "%s ", $4}')"
  done
  echo "hogs=$HOGS raw r$r: $(python3 benchmarks/sendrecv_loop.py --shape uccl --via raw --sizes 64K,256K,1M,10M --rounds 6 --json benchmarks/results/2026-11-29-devbox-full-machine-direct/ab_${HOGS}_raw_$r.json | awk 'NR>1{printf "%s ", $4}')"
  pkill yes; sleep 1
done
