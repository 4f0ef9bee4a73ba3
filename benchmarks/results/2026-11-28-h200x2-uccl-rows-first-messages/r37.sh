#!/bin/bash
# Per-message times (HEAD wheel h0), 64 KiB then 1 MiB then 256 KiB, GPU 0 -> GPU 1:
# do the first messages of the first multi-part size pay a first use in the
# CUDA driver? Default; CUDA_MODULE_LOADING=EAGER; the copy kernel off
# (TCPX_P2P_COPY_KERNEL=0); the driver's batch copy off. Twice each, alternated.
OUT=$1
. benchmarks/device_env.sh "$(ls .device/w/h0/*.whl)" >/dev/null 2>&1
for i in 1 2; do
  for v in "X=1" "CUDA_MODULE_LOADING=EAGER" "TCPX_P2P_COPY_KERNEL=0" "TCPX_P2P_COPY_BATCH=0"; do
    echo "== $v round $i"; env $v SIZES=65536,1048576,262144 N=20 timeout 100 python3 .device/permsg.py 2>&1 | grep -v Warning | grep -v " 262144"
  done
done
