#!/bin/bash
# f5 (nvidia-h200, both ranks on GPU 0): final2 (the poster reads headers only for a receive it may land whole) beside
# head (49e4fa7): the unit tests; UCCL's shape at 64K/256K/1M/10M four times each alternated, the raw reference twice;
# the core figures two rounds each alternated.
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in head final2; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
timeout 120 ./.device/unit -q > $R/unit.txt 2>&1; echo "unit exit $? $(grep 'test result' $R/unit.txt) $(grep -- '--- FAILED' $R/unit.txt | tr '\n' ' ')"
lp() { local tag=$1 b=$2 via=$3 shape=$4 sz=$5 rounds=$6; local site; eval "site=\$SITE_$b"
  PYTHONPATH=$site timeout 120 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape $shape --via $via --sizes $sz --rounds $rounds --json $R/${shape}_$tag.json > $R/${shape}_$tag.txt 2>&1
  printf "%-16s exit %s GB/s %s\n" ${shape}_$tag $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s/%sus ", $4, $3}' $R/${shape}_$tag.txt)"
}
echo "== UCCL's shape, receiver GB/s/us (median of 6 rounds) at 64K 256K 1M 10M"
for round in 1 2 3 4; do
  if [ $((round % 2)) = 0 ]; then order="final2 head"; else order="head final2"; fi
  for b in $order; do lp ${b}_$round $b engine uccl 64K,256K,1M,10M 6; done
  [ $((round % 2)) = 1 ] && lp raw_$round head raw uccl 64K,256K,1M,10M 6
done
tar -C $R -czf $OUT/f5.tgz .
echo "loops at ${SECONDS} s"
ROUNDS=2 timeout $((560 - SECONDS)) bash benchmarks/gpu_round.sh "final2=$(ls .device/w/final2/*.whl) head=$(ls .device/w/head/*.whl)" $OUT/core core > /dev/null 2>&1
echo "core exit $?"; grep -E "^== |^ *(write|[0-9])" $OUT/core/summary.txt | head -50
echo "total ${SECONDS} s"
