#!/bin/bash
# Round 4: the GPU cases of the end-to-end suites, the benchmark's GPU cases and the demo on this work's final build (w7)
set -u
D=${FILES:?a folder with the wheel w7/}
timeout 560 bash benchmarks/gpu_round.sh "$(ls $D/w7/*.whl)" $OUT/suites suites > /dev/null 2>&1; echo "suites exit $?"
cat $OUT/suites/summary.txt | tail -60
