#!/bin/bash
# Round 2: the kicked streams (new = w6 = 21218b8) beside the build before (old = w5 = 31b5f42), alternated: UCCL's benchmark_uccl.py three rounds, blocking send / recv
set -u
D=${FILES:?a folder with the wheels w5/ and w6/}
B="old=$(ls $D/w5/*.whl) new=$(ls $D/w6/*.whl)"
nproc; nvidia-smi -L
UCCL_BENCH=$D/benchmark_uccl_v011.py ROUNDS=3 timeout 330 bash benchmarks/gpu_round.sh "$B" $OUT/ub uccl_bench > /dev/null 2>&1; echo "uccl_bench exit $?"
ROUNDS=1 timeout 200 bash benchmarks/gpu_round.sh "$B" $OUT/sr sendrecv > /dev/null 2>&1; echo "sendrecv exit $?"
