#!/bin/bash
# Round 3: UCCL's benchmark, w2 (before) vs w3 (a waiting caller lands its receive's parts), alternated; then the core figures old (w2) / new (w3)
set -u
D=${FILES:?a folder with the wheels w2/ and w3/ and ub2.sh}
mkdir -p $OUT/ub
for r in 1 2 3; do
  for tag in w2 w3; do
    ( . benchmarks/device_env.sh "$(ls $D/$tag/*.whl)" >/dev/null 2>&1 || exit 1
      bash $D/ub2.sh ours $OUT/ub ${tag}_sync_$r | grep -E "==|64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB" )
  done
done
ROUNDS=1 timeout 420 bash benchmarks/gpu_round.sh "old=$(ls $D/w2/*.whl) new=$(ls $D/w3/*.whl)" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
cat $OUT/core/summary.txt 2>/dev/null | tail -40
cd $OUT && tar czf r3.tgz ub core 2>/dev/null; ls $OUT
