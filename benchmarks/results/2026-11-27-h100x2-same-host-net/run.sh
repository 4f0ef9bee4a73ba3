#!/bin/bash
# The same-host net on 2 x H100 (merged build, TCPX_P2P_SAME_HOST_NET=1): its tests and the same-host tests on GPUs, then local_bench across GPUs 0 and 1 (its tcp rows: the engine over the same-host net)
set -u
W=$(ls $WHEEL)
. benchmarks/device_env.sh "$W" >/dev/null 2>&1 || { echo "env failed"; exit 1; }
export TCPX_P2P_SAME_HOST_NET=1
mkdir -p $OUT/sh
timeout 140 python3 -m pytest -p no:cacheprovider -q -rs tests/test_same_host_net.py tests/test_local.py > $OUT/sh/tests.txt 2>&1; echo "tests exit $?"; tail -8 $OUT/sh/tests.txt
timeout 140 python3 benchmarks/local_bench.py --device gpu --gpu 0 --peer-gpu 1 --out $OUT/sh > $OUT/sh/bench_two_gpus.txt 2>&1; echo "bench exit $?"; tail -25 $OUT/sh/bench_two_gpus.txt
