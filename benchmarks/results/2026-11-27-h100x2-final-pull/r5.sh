#!/bin/bash
# Round 5: the GPU cases of the end-to-end suites over the socket net, the
# benchmark's GPU cases and the demo, on this work's final build (`1acd30e`), then
# the same-host net's tests with CUDA
set -u
D=${FILES:?a folder with the wheel w10/ (`1acd30e`)}
W=$(ls $D/w10/*.whl)
SUITE_NETS=socket SUITE_LIMIT=400 timeout 480 bash benchmarks/gpu_round.sh "$W" $OUT/suites suites > /dev/null 2>&1; echo "suites exit $?"
grep -E "^== |passed|failed|error|exit" $OUT/suites/summary.txt | head -40
(. benchmarks/device_env.sh "$W"; timeout 60 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_same_host_net.py -k cuda 2>&1 | tail -2)
