#!/bin/bash
# The engine's unit tests (main, cd20ddc: the pool-growth test answered for
# by the test, the base reserved as one step) on two H200s: the whole set
# three times, four tests at a time (where the timing-dependent version
# failed once in four), then the pool's tests ten times.
OUT=$1
nvidia-smi -L; nproc
for i in 1 2 3; do
  timeout 150 ./.device/unit --test-threads=4 > $OUT/unit_$i.txt 2>&1; echo "run $i: exit $? $(grep -E '^test result' $OUT/unit_$i.txt)"
  grep -E "FAILED|panicked" $OUT/unit_$i.txt | head -5
done
for i in $(seq 1 10); do
  timeout 60 ./.device/unit workers:: --test-threads=4 2>&1 | grep -E "^test result|FAILED|panicked" | head -3
done
echo "total ${SECONDS} s"
