#!/bin/bash
# Round 1: the build this work starts from (new = w8 = 78211b4) beside 31b5f42 (old = w5), the core figures alternated twice
set -u
D=${FILES:?a folder with the wheels w5/ and w8/}
B="old=$(ls $D/w5/*.whl) new=$(ls $D/w8/*.whl)"
nproc; nvidia-smi -L
ROUNDS=2 timeout 560 bash benchmarks/gpu_round.sh "$B" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^[0-9]{5,}|GB/s" $OUT/core/summary.txt | grep -v "^op" | head -80
