#!/bin/bash
# UCCL's benchmark (defaults, sync x3 and async x2): old (b1), b3 (send streams spin while a caller waits), b6 (and the poster lands up to 1 MiB), b6 with 4 MiB socket buffers
set -u
OLD=$(ls $WHEELS/b1/*.whl); B3=$(ls $WHEELS/b3/*.whl); B6=$(ls $WHEELS/b6/*.whl)
for i in 1 2 3; do
for v in "old:$OLD:" "b3:$B3:" "b6:$B6:" "b6buf:$B6:TCPX_P2P_SOCKBUF=4M"; do
  IFS=: read t w e <<< "$v"
  for api in sync async; do
    [ $api = async ] && [ $i -gt 2 ] && continue
    flag=""; [ $api = async ] && flag=--async-api
    env $e bash $(dirname "$0")/ub.sh $w $OUT/ub ${t}_${api}_$i $flag >/dev/null 2>&1
    echo "== $t $api $i (server | client GB/s)"; paste <(grep -E "GB/s" $OUT/ub/${t}_${api}_${i}_rank1.txt | awk '{print $2,$3,$8}') <(grep -E "GB/s" $OUT/ub/${t}_${api}_${i}_rank0.txt | awk '{print $8}') | sed -n 3,10p | tr '\n' ';'; echo
  done
done; done | tee $OUT/uccl_ab.txt
rm -rf $OUT/ub
