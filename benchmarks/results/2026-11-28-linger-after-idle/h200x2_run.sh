#!/bin/bash
# A longer linger (TCPX_P2P_IO_LINGER_MS=50 beside the default 5) on two
# GPUs, HEAD (h1): a transfer after 20 ms idle; UCCL's benchmark (v0.1.1,
# import changed only, sync, defaults); 256 MiB pipelined write and 4 KiB /
# 64 KiB one at a time. Alternated.
OUT=$1
. benchmarks/device_env.sh "$(ls .device/w/h1/*.whl)" >/dev/null 2>&1
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
B="python3 -m tcpx_p2p.bench pair --memory gpu --gpus 0,1"
for L in 5 50; do
  export TCPX_P2P_IO_LINGER_MS=$L
  echo "== linger $L ms: after 20 ms idle"
  timeout 60 $B --inflight 1 --gap 20 --op write,send --sizes 4K,1M --iters 20 --rounds 1 --json $OUT/gap_l$L.json 2>&1 | grep -E "^(write|send) "
done
for L in 5 50; do
  export TCPX_P2P_IO_LINGER_MS=$L
  port=$((29500 + RANDOM % 500)); pids=()
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r timeout 60 python3 $R/benchmark_uccl.py --local-gpu-idx $r > $R/u_$r.txt 2>&1 &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  echo "== linger $L ms: UCCL sync defaults (exit$rcs) client | server"
  paste <(grep -E "GB/s" $R/u_0.txt | sed 's/Gbps.*|  *\([0-9.]* GB\/s\).*/\1/') <(grep -E "GB/s" $R/u_1.txt | sed 's/.*Gbps |  *\([0-9.]* GB\/s\).*/\1/') | sed -n '5,10p'
done
for L in 5 50 5 50; do
  export TCPX_P2P_IO_LINGER_MS=$L
  echo "== linger $L ms: core"
  timeout 40 $B --op write --sizes 256M --iters 8 2>&1 | grep -E "^write "
  timeout 40 $B --inflight 1 --op write --sizes 4K,64K --iters 200 --rounds 1 2>&1 | grep -E "^write "
done
