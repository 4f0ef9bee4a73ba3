#!/bin/bash
# 8 GPU peers into GPU 0 and GPU 0 out to 8 peers, today's first build (old) and last (new), alternated twice.
OUT=$1
W() { ls .device/r14/$1/*.whl; }
R=$OUT/r2; mkdir -p $R
for round in 1 2; do
for b in old new; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    timeout 70 python3 -m tcpx_p2p.bench peers --memory gpu --gpus "$GPUS" --peers 8 --procs 2 --busy 8 --busy-size 16M --json $R/peers_${b}_$round.json > $R/peers_${b}_$round.txt 2>&1
    echo "== peers $b round $round (rc $?)"; grep -E "many at once|did not end" $R/peers_${b}_$round.txt | head -4
  )
done
done
tar -C $OUT -czf $OUT/r2.tgz r2 && rm -rf $R
