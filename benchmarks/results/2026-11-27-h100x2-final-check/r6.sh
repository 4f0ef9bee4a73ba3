#!/bin/bash
# Round 6: the final build against the one this work started from: core figures (old = w0, new = w5), then the GPU suites and the demo on the new build
set -u
D=${FILES:?a folder with the wheels w0/ and w5/}
ROUNDS=1 timeout 260 bash benchmarks/gpu_round.sh "old=$(ls $D/w0/*.whl) new=$(ls $D/w5/*.whl)" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^[0-9]{6,}" $OUT/core/summary.txt
timeout 300 bash benchmarks/gpu_round.sh "$(ls $D/w5/*.whl)" $OUT/suites suites > /dev/null 2>&1; echo "suites exit $?"
grep -vE "^\s*$" $OUT/suites/summary.txt | tail -30
