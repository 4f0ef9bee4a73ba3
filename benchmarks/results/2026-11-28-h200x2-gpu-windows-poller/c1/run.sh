#!/bin/bash
# The engine's unit tests on the GPU machine (the GPU cases run there), then
# the GPU cases of the end-to-end suites over the socket net, new build.
OUT=$1
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/device.txt; date -u >> $R/device.txt
chmod +x .device/unit
timeout 240 .device/unit --test-threads=4 > $R/unit.txt 2>&1; echo "unit rc=$?" >> $R/unit.txt
grep -E "gpu|test result|FAILED|panicked|rc=" $R/unit.txt | head -30
SUITE_NETS=socket SUITE_LIMIT=240 timeout 330 bash benchmarks/gpu_round.sh .device/new/*.whl $R/suites suites > $R/suites.log 2>&1
echo "suites rc=$?"
cat $R/suites/summary.txt 2>/dev/null | grep -E "^== |passed|failed|error|GB/s" | head -40
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
