#!/bin/bash
# d2: the 1 MiB mismatch of d1 (sendrecv_loop --lag 20, GPU 0 -> GPU 0):
# where the bytes differ, and whether every message of the rounds lands.
OUT=$1
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/tp/*.whl
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo PYTHONPATH=$S
run() { echo "== $*"; timeout 150 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 "$@" 2>&1 | tail -6; }
run --sizes 256K,1M --iters 10 --rounds 20 --lag 20
run --sizes 256K,1M --iters 10 --rounds 20 --lag 20 --check-all
run --sizes 1M --iters 10 --rounds 20 --lag 20 --check-all
run --sizes 1M,4M --iters 10 --rounds 20 --lag 20 --check-all
run --sizes 64K,1M --iters 10 --rounds 20 --lag 0 --check-all
echo "total ${SECONDS} s"
