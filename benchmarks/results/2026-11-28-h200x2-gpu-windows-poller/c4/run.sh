#!/bin/bash
# 256 MiB write pipelined, old (78634a1) beside new, alternated six more
# times; 8 GPU peers into one GPU beside one alone (new); the socket net's
# UCCL-compat and hostile-argument suites (new).
OUT=$1
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/device.txt; date -u >> $R/device.txt
W() { ls .device/$1/*.whl; }
for round in 5 6 7 8 9 10; do
for b in old new2; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    timeout 50 python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS --op write --sizes 256M --json $R/pipelined_${b}_$round.json > $R/pipelined_${b}_$round.txt 2>&1
    echo "$b r$round rc=$? $(grep -E '^write' $R/pipelined_${b}_$round.txt)"
  )
done
done
(
  . benchmarks/device_env.sh $(W new2) >/dev/null 2>&1; pair_gpus
  timeout 130 python3 -m tcpx_p2p.bench peers --memory gpu --gpus "$GPUS" --peers 8 --procs 2 --busy 8 --busy-size 16M --json $R/peers_gpu.json > $R/peers_gpu.txt 2>&1; echo "peers rc=$?"; tail -14 $R/peers_gpu.txt
  PT="python3 -m pytest -q -p no:cacheprovider -rfE"
  TCPX_P2P_NET=socket timeout 130 $PT tests/test_uccl_compat.py tests/test_hostile_args.py -x > $R/suite_uccl_hostile.txt 2>&1; echo "uccl+hostile rc=$?"; tail -3 $R/suite_uccl_hostile.txt
)
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
