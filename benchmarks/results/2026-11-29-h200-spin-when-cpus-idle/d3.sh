#!/bin/bash
# d3: the 1 MiB mismatch: which pages, three untraced runs; two traced
# (TCPX_P2P_LOG=trace, both ranks); one with TCPX_P2P_SPLICE=0.
OUT=$1
R=$(mktemp -d -p /dev/shm)
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/tp/*.whl
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo PYTHONPATH=$S
run() { local tag=$1; shift; echo "== $tag: $*"; timeout 150 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --sizes 256K,1M --iters 10 --rounds 20 --lag 20 "$@" > $R/$tag.out 2> $R/$tag.err; echo "exit $?"; tail -3 $R/$tag.out; grep -E "differ|Error|error" $R/$tag.err | head -5; }
for i in 1 2 3; do run plain$i; done
TCPX_P2P_SPLICE=0 run nosplice
for i in 1 2; do TCPX_P2P_LOG=trace run trace$i; ls -la $R/trace$i.err; done
TCPX_P2P_SPLICE=0 run nosplice2
gzip $R/*.err; tar -C $R -czf $OUT/d3.tgz .
echo "total ${SECONDS} s"
