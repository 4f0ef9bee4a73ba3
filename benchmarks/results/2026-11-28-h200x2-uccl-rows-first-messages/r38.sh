#!/bin/bash
# Traced per-message times (t1 = HEAD + trace points in the GPU send pipe),
# 64 KiB then 1 MiB, GPU 0 -> GPU 1, both processes traced, twice.
OUT=$1
. benchmarks/device_env.sh "$(ls .device/w/t1/*.whl)" >/dev/null 2>&1
R=$(mktemp -d -p /dev/shm)
for i in 1 2; do
  mkdir -p $R/run$i; echo "== run $i"; LOGDIR=$R/run$i TCPX_P2P_LOG=trace SIZES=65536,1048576 N=20 timeout 100 python3 .device/permsg.py > $R/run$i.txt 2> $R/run$i.log
  cat $R/run$i.txt
done
tar -C $R -czf $OUT/r38.tgz .
