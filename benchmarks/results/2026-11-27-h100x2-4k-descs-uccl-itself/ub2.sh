#!/bin/bash
# ub2.sh IMPL OUTDIR TAG [bench args...]: UCCL's benchmark on GPUs 0/1; IMPL=ours (import changed) or uccl (UCCL 0.1.1 itself, NCCL restricted to sockets)
I=$1; O=$2; T=$3; shift 3
mkdir -p $O
if [ $I = ours ]; then
  sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' "$UCCL_BENCH" > $O/bench_ours.py; B=$O/bench_ours.py
else
  cp "$UCCL_BENCH" $O/bench_uccl.py; B=$O/bench_uccl.py
fi
port=$((29500 + RANDOM % 500)); pids=()
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
    timeout 100 python3 $B --local-gpu-idx $r "$@" > $O/${T}_rank$r.txt 2> $O/${T}_rank$r.log &
  pids+=($!); [ $r = 0 ] && sleep 0.1
done
rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
echo "== $T (exit:$rcs) args: $*"; grep -hE "Server\].*GB/s" $O/${T}_rank*.txt
gzip -f $O/${T}_rank*.log
