#!/bin/bash
# Blocking send/recv 256 MiB, pre (6566d2a, before the I/O workers' waits) vs new (ee84b47), alternated three times.
OUT=$1
W() { ls .device/w/$1/*.whl; }
R=$OUT/r; mkdir -p $R
for round in 1 2 3; do
for b in pre new; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    echo "== sendrecv $b round $round"
    timeout 60 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus "$GPUS" --sizes 256M --rounds 3 --json $R/sendrecv_${b}_$round.json > $R/sendrecv_${b}_$round.txt 2>&1
    echo rc=$?; tail -1 $R/sendrecv_${b}_$round.txt
  )
done
done
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
