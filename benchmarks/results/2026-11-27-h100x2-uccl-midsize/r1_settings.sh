#!/bin/bash
# UCCL's own tests on the current build, then UCCL's benchmark under settings that change how mid-size messages are cut
set -u
W=$(ls $WHEELS/b1/*.whl)
UCCL_TESTS=$UCCL_TESTS timeout 290 bash benchmarks/gpu_round.sh "$W" $OUT/round uccl > /dev/null 2>&1
cat $OUT/round/summary.txt
for i in 1 2; do
for v in "base:" "mp1m:TCPX_P2P_MIN_PART=1M" "st2:TCPX_P2P_STREAMS=2" "st1:TCPX_P2P_STREAMS=1"; do
  IFS=: read t e <<< "$v"
  env $e bash $(dirname "$0")/ub.sh $W $OUT/ub ${t}_$i >/dev/null 2>&1
  echo "== $t$i $e"; paste <(grep -E "GB/s" $OUT/ub/${t}_${i}_rank1.txt | awk '{print $2,$3,$8}') <(grep -E "GB/s" $OUT/ub/${t}_${i}_rank0.txt | awk '{print $8}') | sed -n 4,9p
done; done
tar czf $OUT/r1.tgz -C $OUT round ub 2>/dev/null
