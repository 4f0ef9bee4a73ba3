#!/bin/bash
# d5: the 1 MiB mismatch traced with the payload bytes each side saw
# (trace point `lat: payload bytes`), until a run fails (at most 4).
OUT=$1
R=$(mktemp -d -p /dev/shm)
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/tp/*.whl
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo PYTHONPATH=$S
for i in 1 2 3 4; do
  TCPX_P2P_LOG=trace timeout 150 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --sizes 256K,1M --iters 10 --rounds 20 --lag 20 > $R/t$i.out 2> $R/t$i.err
  rc=$?; echo "run $i exit $rc"; grep differ $R/t$i.err | cut -c1-250
  if [ $rc != 0 ]; then grep "payload bytes" $R/t$i.err | grep "seq=201 " | cut -c28-300; break; fi
done
gzip $R/*.err; tar -C $R -czf $OUT/d5.tgz .
echo "total ${SECONDS} s"
