#!/bin/bash
# ub.sh WHEEL OUTDIR TAG [bench args...]: UCCL's benchmark, import changed only, 2 ranks on GPUs 0/1
W=$1; O=$2; T=$3; shift 3
mkdir -p $O
. benchmarks/device_env.sh "$W" >/dev/null 2>&1 || { echo "env failed"; exit 1; }
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' "$UCCL_BENCH" > $O/bench.py
port=$((29500 + RANDOM % 500)); pids=()
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
    timeout 120 python3 $O/bench.py --local-gpu-idx $r "$@" > $O/${T}_rank$r.txt 2> $O/${T}_rank$r.log &
  pids+=($!); [ $r = 0 ] && sleep 0.1
done
rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
echo "== $T (exit:$rcs) args: $*"; grep -E "GB/s" $O/${T}_rank0.txt
gzip -f $O/${T}_rank*.log
