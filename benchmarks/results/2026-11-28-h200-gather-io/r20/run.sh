#!/bin/bash
# GPU 256 MiB pipelined write and KV 4,096 x 32 KiB: old (6566d2a) and new (62c8e6d), alternated five times.
OUT=$1
W() { ls .device/w/$1/*.whl; }
R=$OUT/r; mkdir -p $R
for round in 1 2 3 4 5; do
for b in old new; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus "$GPUS" --op write --sizes 256M --json $R/pipe_${b}_$round.json > $R/pipe_${b}_$round.txt 2>&1
    echo "pipelined $b round $round rc=$? $(grep -E '^write ' $R/pipe_${b}_$round.txt | tail -1)"
    timeout 50 python3 -m tcpx_p2p.bench pair --memory gpu --gpus "$GPUS" --inflight 1 --op write --kv-blocks 4096 --block-size 32K > $R/kv_${b}_$round.txt 2>&1
    echo "kv $b round $round rc=$? $(grep -E '^writex' $R/kv_${b}_$round.txt | tail -1)"
  )
done
done
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
