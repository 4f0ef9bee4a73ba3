#!/bin/bash
# The engine's unit tests on two H200s after the probe test's fix: the
# whole set twice (four at a time), the pool's tests twenty times.
OUT=$1
nvidia-smi -L; nproc
for i in 1 2; do
  timeout 150 ./.device/unit --test-threads=4 > $OUT/unit_$i.txt 2>&1; echo "run $i: exit $? $(grep -E '^test result' $OUT/unit_$i.txt)"
  grep -E "FAILED|panicked" $OUT/unit_$i.txt | head -5
done
ok=0; for i in $(seq 1 20); do
  r=$(timeout 60 ./.device/unit workers:: --test-threads=4 2>&1); echo "$r" | grep -E "FAILED|panicked" | head -3
  echo "$r" | grep -q "^test result: ok. 15 passed" && ok=$((ok+1))
done
echo "workers:: 20 runs, $ok passed whole"
echo "total ${SECONDS} s"
