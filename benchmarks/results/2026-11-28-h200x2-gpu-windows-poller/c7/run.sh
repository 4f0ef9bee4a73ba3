#!/bin/bash
# After the review's refactor of the GPU read and write paths: the engine's
# unit tests (GPU cases included) and the GPU cases of the API tests over
# the socket net.
OUT=$1
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/device.txt; date -u >> $R/device.txt
chmod +x .device/unit
timeout 60 .device/unit --test-threads=4 > $R/unit.txt 2>&1; echo "unit rc=$?" >> $R/unit.txt
grep -E "gpu|test result|FAILED|panicked|rc=" $R/unit.txt | head -12
. benchmarks/device_env.sh $(ls .device/final/*.whl) >/dev/null 2>&1; pair_gpus
TCPX_P2P_NET=socket timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_api.py -k cuda > $R/suite_socket_cuda.txt 2>&1; echo "cuda rc=$?"; tail -3 $R/suite_socket_cuda.txt
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
