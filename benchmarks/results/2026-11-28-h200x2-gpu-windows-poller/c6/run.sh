#!/bin/bash
# The engine's unit tests on the GPU machine, final code.
OUT=$1
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/device.txt; date -u >> $R/device.txt
chmod +x .device/unit
timeout 90 .device/unit --test-threads=4 > $R/unit.txt 2>&1; echo "unit rc=$?" >> $R/unit.txt
grep -E "gpu|test result|FAILED|panicked|rc=" $R/unit.txt | head -20
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
