#!/bin/bash
# d4: the 1 MiB mismatch with the driver's batch copy off / on.
OUT=$1
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/tp/*.whl
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo PYTHONPATH=$S
run() { echo "== $*"; timeout 150 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --sizes 256K,1M --iters 10 --rounds 20 --lag 20 2>&1 | tail -2 | cut -c1-300; }
for i in 1 2; do TCPX_P2P_COPY_BATCH=0 run batch0; TCPX_P2P_COPY_BATCH=1 run batch1; done
TCPX_P2P_COPY_KERNEL=0 run kernel0
nvidia-smi | head -4
echo "total ${SECONDS} s"
