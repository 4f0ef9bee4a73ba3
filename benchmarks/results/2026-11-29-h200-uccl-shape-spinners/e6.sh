#!/bin/bash
# e6 (nvidia-h200, 16 CPUs): the engine's unit tests at 10e7172 (tests waiting until no worker is held), four runs, all tests in parallel.
OUT=$1
for i in 1 2 3 4; do
  timeout 120 ./.device/unit -q > $OUT/unit_$i.txt 2>&1; rc=$?
  echo "unit run $i exit $rc $(grep 'test result' $OUT/unit_$i.txt) $(grep -- '--- FAILED' $OUT/unit_$i.txt | tr '\n' ' ')"
done
echo "total ${SECONDS} s"
