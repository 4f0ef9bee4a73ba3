#!/bin/bash
# Round 3: this work's final build (new = w7) beside the build it started from (old = w5 = 31b5f42), alternated: the core figures, blocking send / recv in UCCL's loop
set -u
D=${FILES:?a folder with the wheels w5/ and w7/}
B="old=$(ls $D/w5/*.whl) new=$(ls $D/w7/*.whl)"
nproc; nvidia-smi -L
ROUNDS=1 timeout 330 bash benchmarks/gpu_round.sh "$B" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^[0-9]{5,}|GB/s|p50" $OUT/core/summary.txt | head -60
ROUNDS=1 timeout 200 bash benchmarks/gpu_round.sh "$B" $OUT/sr sendrecv > /dev/null 2>&1; echo "sendrecv exit $?"
grep -E "^==|^ +[0-9]" $OUT/sr/summary.txt
