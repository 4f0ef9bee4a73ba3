#!/bin/bash
# The engine's unit tests on the GPU machine (GPU cases included), then the
# core figures, old (78634a1) beside new (GPU windows resumable across the
# poller, both directions), alternated twice, GPU 0 -> GPU 1.
OUT=$1
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/device.txt; date -u >> $R/device.txt
chmod +x .device/unit
timeout 60 .device/unit --test-threads=4 > $R/unit.txt 2>&1; echo "unit rc=$?" >> $R/unit.txt
grep -E "gpu|test result|FAILED|panicked|rc=" $R/unit.txt | head -30
W() { ls .device/$1/*.whl; }
ROUNDS=2 timeout 520 bash benchmarks/gpu_round.sh "old=$(W old) new=$(W new2)" $R/core core > $R/core.log 2>&1; echo "core exit $?"
grep -E "^== |^write|^writex|^[0-9]+ " $R/core/summary.txt | head -60
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
