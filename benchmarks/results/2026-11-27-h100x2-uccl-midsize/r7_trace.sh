#!/bin/bash
set -u
W=$(ls $WHEELS/b6/*.whl)
TCPX_P2P_LOG=trace bash $(dirname "$0")/ub.sh $W $OUT/t tr --sizes 262144,1048576 --iters 20 >/dev/null 2>&1
grep -h "GB/s" $OUT/t/tr_rank*.txt
rm -f $OUT/t/bench.py
