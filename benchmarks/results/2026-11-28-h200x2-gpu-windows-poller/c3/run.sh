#!/bin/bash
# 256 MiB write pipelined, old (78634a1) beside new, alternated four times;
# then the socket net's UCCL-compat and hostile-argument suites and the
# benchmark's GPU tests on the new build.
OUT=$1
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/device.txt; date -u >> $R/device.txt
W() { ls .device/$1/*.whl; }
for round in 1 2 3 4; do
for b in old new2; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS --op write --sizes 256M --json $R/pipelined_${b}_$round.json > $R/pipelined_${b}_$round.txt 2>&1
    echo "$b r$round rc=$? $(grep -E '^write' $R/pipelined_${b}_$round.txt)"
  )
done
done
(
  . benchmarks/device_env.sh $(W new2) >/dev/null 2>&1; pair_gpus
  PT="python3 -m pytest -q -p no:cacheprovider -rfE"
  TCPX_P2P_NET=socket timeout 200 $PT tests/test_uccl_compat.py tests/test_hostile_args.py > $R/suite_uccl_hostile.txt 2>&1; echo "uccl+hostile rc=$?"; tail -3 $R/suite_uccl_hostile.txt
  timeout 120 $PT tests/test_bench.py -k gpu > $R/suite_bench_gpu.txt 2>&1; echo "bench gpu rc=$?"; tail -3 $R/suite_bench_gpu.txt
)
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
