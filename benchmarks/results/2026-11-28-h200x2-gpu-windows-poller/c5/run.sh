#!/bin/bash
# The GPU cases of the end-to-end API tests over the socket net, and the
# demo, on the final build (GPU windows in the poller both ways).
OUT=$1
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/device.txt; date -u >> $R/device.txt
. benchmarks/device_env.sh $(ls .device/new2/*.whl) >/dev/null 2>&1; pair_gpus
PT="python3 -m pytest -q -p no:cacheprovider -rfE"
TCPX_P2P_NET=socket timeout 220 $PT tests/test_api.py -k cuda > $R/suite_socket_cuda.txt 2>&1; echo "cuda rc=$?"; tail -3 $R/suite_socket_cuda.txt
timeout 80 python3 -m tcpx_p2p.demo --size 256M --iters 16 > $R/demo.txt 2>&1; echo "demo rc=$?"; tail -6 $R/demo.txt
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
