#!/bin/bash
# UCCL's benchmark (new build b3), the smallest part size swept: 20 messages a size, each setting twice, alternated
set -u
W=$(ls $WHEELS/b3/*.whl)
for i in 1 2; do
for v in "mp128k:TCPX_P2P_MIN_PART=128K" "mp256k:TCPX_P2P_MIN_PART=256K" "mp512k:TCPX_P2P_MIN_PART=512K" "mp1m:TCPX_P2P_MIN_PART=1M"; do
  IFS=: read t e <<< "$v"
  env $e bash $(dirname "$0")/ub.sh $W $OUT/ub ${t}_$i --sizes 65536,262144,1048576,4194304,10485760,104857600 --iters 20 >/dev/null 2>&1
  echo "== $t $i server | client GB/s"; paste <(grep -E "GB/s" $OUT/ub/${t}_${i}_rank1.txt | awk '{print $2,$3,$8}') <(grep -E "GB/s" $OUT/ub/${t}_${i}_rank0.txt | awk '{print $8}') | tr '\n' ';'; echo
done; done | tee $OUT/minpart.txt
rm -rf $OUT/ub
