#!/bin/bash
# UCCL's benchmark, old (b1) and new (b3) builds alternated; then the core figures old vs new
set -u
OLD=$(ls $WHEELS/b1/*.whl); NEW=$(ls $WHEELS/b3/*.whl)
for i in 1 2 3; do
for v in "old:$OLD:" "new:$NEW:"; do
  IFS=: read t w a <<< "$v"
  for api in sync async; do
    [ $api = async ] && [ $i -gt 2 ] && continue
    flag=""; [ $api = async ] && flag=--async-api
    bash $(dirname "$0")/ub.sh $w $OUT/ub ${t}_${api}_$i $flag >/dev/null 2>&1
    echo "== $t $api $i (server | client GB/s)"; paste <(grep -E "GB/s" $OUT/ub/${t}_${api}_${i}_rank1.txt | awk '{print $2,$3,$8}') <(grep -E "GB/s" $OUT/ub/${t}_${api}_${i}_rank0.txt | awk '{print $8}') | sed -n 4,10p | tr '\n' ';'; echo
  done
done; done | tee $OUT/uccl_ab.txt
TCPX_P2P_LOG=trace bash $(dirname "$0")/ub.sh $NEW $OUT/ub trnew --sizes 65536,262144,1048576,10485760 --iters 20 >/dev/null 2>&1
echo "== traced new, 20 iters"; grep -h "GB/s" $OUT/ub/trnew_rank*.txt
ROUNDS=2 timeout 400 bash benchmarks/gpu_round.sh "old=$OLD new=$NEW" $OUT/core core > /dev/null 2>&1
cat $OUT/core/summary.txt | tail -40
tar czf $OUT/r4.tgz -C $OUT ub core uccl_ab.txt 2>/dev/null
rm -rf $OUT/ub $OUT/core/round.tgz
