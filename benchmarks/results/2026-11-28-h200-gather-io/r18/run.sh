#!/bin/bash
# 256 MiB pipelined write (three more rounds each) and 8 GPU peers into / out of one endpoint, old (6566d2a) beside new (62c8e6d), alternated.
OUT=$1
W() { ls .device/w/$1/*.whl; }
R=$OUT/r; mkdir -p $R
for round in 1 2 3; do
for b in old new; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus "$GPUS" --op write --sizes 256M --json $R/pipe_${b}_$round.json > $R/pipe_${b}_$round.txt 2>&1
    echo "pipelined $b round $round rc=$? $(grep -E '^write ' $R/pipe_${b}_$round.txt)"
  )
done
done
for b in old new; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    timeout 150 python3 -m tcpx_p2p.bench peers --memory gpu --gpus "$GPUS" --peers 8 --procs 2 --busy 8 --busy-size 16M --json $R/peers_gpu_$b.json > $R/peers_gpu_$b.txt 2>&1
    echo "peers $b rc=$?"; grep -E "many at once|out to many|threads while" $R/peers_gpu_$b.txt
  )
done
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
