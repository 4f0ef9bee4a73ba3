#!/bin/bash
# UCCL-over-TCP stands on NCCL's net: NCCL's socket transport (PyTorch,
# NCCL_NET=Socket, P2P/SHM off) at UCCL's benchmark sizes and iterations,
# beside our send/recv in the same run (tcpx-p2p-bench --reference), and
# UCCL's benchmark_uccl.py (v0.1.1, import changed only, sync, defaults)
# (the bench part of r40, rerun). HEAD wheel h0. GPU 0 -> GPU 1.
OUT=$1
. benchmarks/device_env.sh "$(ls .device/w/h0/*.whl)" >/dev/null 2>&1
for it in 10 50; do
  echo "== tcpx-p2p-bench send, $it iterations, --reference"
  timeout 200 python3 -m tcpx_p2p.bench pair --memory gpu --gpus 0,1 --op send --sizes 64K,256K,1M,10M,16M,100M --iters $it --reference --json $OUT/bench_send_$it.json 2>&1 | grep -v Warning | tail -25
done

