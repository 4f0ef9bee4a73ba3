#!/bin/bash
# A transfer after idle time on two GPUs (h1 = HEAD with tcpx-p2p-bench --gap):
# one at a time, GPU 0 -> GPU 1, back to back and after 20 ms of idle time;
# raw TCP (two Python processes, loopback) after the same idle time.
OUT=$1
. benchmarks/device_env.sh "$(ls .device/w/h1/*.whl)" >/dev/null 2>&1
for g in 0 20; do
  echo "== gap $g ms"
  timeout 200 python3 -m tcpx_p2p.bench pair --memory gpu --gpus 0,1 --inflight 1 --gap $g --op write,send --sizes 4K,64K,1M --iters 20 --rounds 2 --json $OUT/gpu_gap_$g.json 2>&1 | grep -E "^(write|send) |^op|floor"
done
for g in 0 20; do for n in 4096 1048576; do python3 benchmarks/results/2026-11-28-devbox-after-idle/cold_tcp.py $g $n 60; done; done
