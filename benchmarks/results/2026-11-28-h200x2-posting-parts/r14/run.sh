#!/bin/bash
# 1) Blocking send / recv 256 MiB (UCCL's loop), today's first build (old: 1af04da) and last (new), alternated twice; 2) the peers step on the last build (8 GPU peers into GPU 0; 64 host peers).
OUT=$1
W() { ls .device/r14/$1/*.whl; }
R=$OUT/r; mkdir -p $R
for round in 1 2; do
for b in old new; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    timeout 60 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus "$GPUS" --sizes 256M --rounds 3 --json $R/sendrecv_${b}_$round.json > $R/sendrecv_${b}_$round.txt 2>&1
    echo "== sendrecv $b round $round (rc $?)"; tail -3 $R/sendrecv_${b}_$round.txt
  )
done
done
ROUNDS=1 timeout 200 bash benchmarks/gpu_round.sh "$(W new)" $R/peers peers > /dev/null 2>&1; echo "peers exit $?"
grep -E "^== |many at once|threads (while|after)|deliver|descriptors|did not end" $R/peers/summary.txt | head -30
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
