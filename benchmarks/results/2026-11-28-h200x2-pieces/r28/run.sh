#!/bin/bash
# Blocking write 4 KiB / 64 KiB GPU 0 -> GPU 1 (p50), pre (1d5b567, the last build before the redesign) vs new (ee84b47), alternated three times.
OUT=$1
W() { ls .device/w/$1/*.whl; }
R=$OUT/r; mkdir -p $R
for round in 1 2 3; do
for b in pre new; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    echo "== blocking $b round $round"
    timeout 70 python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS --inflight 1 --op write --sizes 4K,64K --rounds 2 --out $R/blocking_${b}_$round > $R/blocking_${b}_$round.txt 2>&1
    echo rc=$?; grep -E "^write" $R/blocking_${b}_$round.txt
  )
done
done
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
