#!/bin/bash
# GPU 256 MiB pipelined write: old (6566d2a), new (62c8e6d), v1 (new, the control reader keeping its whole linger again), v2 (v1, the progress task napping through transfers in flight again), alternated three times.
OUT=$1
W() { ls .device/w/$1/*.whl; }
R=$OUT/r; mkdir -p $R
for round in 1 2 3; do
for b in old new v1 v2; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus "$GPUS" --op write --sizes 256M --json $R/pipe_${b}_$round.json > $R/pipe_${b}_$round.txt 2>&1
    echo "pipelined $b round $round rc=$? $(grep -E '^write ' $R/pipe_${b}_$round.txt)"
  )
done
done
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
