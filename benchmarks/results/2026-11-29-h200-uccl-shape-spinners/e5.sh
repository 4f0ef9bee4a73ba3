#!/bin/bash
# e5 (nvidia-h200, 16 CPUs): the engine's unit tests, old (bdaec07, before counted spinners) and new
# (7e68c89) binaries alternated three times, all tests in parallel; then each once on one test thread.
OUT=$1
for i in 1 2 3; do
  for b in unit_old unit; do
    timeout 120 ./.device/$b -q > $OUT/${b}_$i.txt 2>&1; rc=$?
    echo "$b run $i exit $rc $(grep 'test result' $OUT/${b}_$i.txt) $(grep -- '--- FAILED' $OUT/${b}_$i.txt | tr '\n' ' ')"
  done
done
for b in unit_old unit; do
  timeout 200 ./.device/$b -q --test-threads=1 > $OUT/${b}_serial.txt 2>&1; rc=$?
  echo "$b serial exit $rc $(grep 'test result' $OUT/${b}_serial.txt) $(grep -- '--- FAILED' $OUT/${b}_serial.txt | tr '\n' ' ')"
done
uptime; nproc
echo "total ${SECONDS} s"
