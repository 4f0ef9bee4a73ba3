#!/bin/bash
# UCCL-over-TCP stands on NCCL's net: NCCL's socket transport (PyTorch,
# NCCL_NET=Socket, P2P/SHM off) at UCCL's benchmark sizes and iterations,
# beside our send/recv in the same run (tcpx-p2p-bench --reference), and
# UCCL's benchmark_uccl.py (v0.1.1, import changed only, sync, defaults)
# twice. HEAD wheel h0. GPU 0 -> GPU 1.
OUT=$1
. benchmarks/device_env.sh "$(ls .device/w/h0/*.whl)" >/dev/null 2>&1
for it in 10 50; do
  echo "== tcpx-p2p-bench send, $it iterations, --reference"
  timeout 200 python3 -m tcpx_p2p.bench pair --memory gpu --gpus 0,1 --op send --sizes 64K,256K,1M,10M,16M,100M --iters $it --reference --json $OUT/bench_send_$it.json 2>&1 | grep -v Warning | tail -25
done
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
for round in 1 2; do
  port=$((29500 + RANDOM % 500)); pids=()
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r timeout 120 python3 $R/benchmark_uccl.py --local-gpu-idx $r > $R/u${round}_rank$r.txt 2>&1 &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  echo "== uccl sync defaults round $round (exit$rcs) client | server"
  paste <(grep -E "GB/s" $R/u${round}_rank0.txt | sed 's/Gbps.*|  *\([0-9.]* GB\/s\).*/\1/') <(grep -E "GB/s" $R/u${round}_rank1.txt | sed 's/.*Gbps |  *\([0-9.]* GB\/s\).*/\1/')
done
