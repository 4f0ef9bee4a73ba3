#!/bin/bash
# Round 6: the core figures of this work's final build (new = w10 = `1acd30e`) beside the build it started from (old = w8 = 78211b4), one round each
set -u
D=${FILES:?a folder with the wheels w8/ and w10/}
B="old=$(ls $D/w8/*.whl) new=$(ls $D/w10/*.whl)"
nvidia-smi -L
ROUNDS=1 timeout 300 bash benchmarks/gpu_round.sh "$B" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^[0-9]{5,}" $OUT/core/summary.txt | head -40
