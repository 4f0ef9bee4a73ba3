#!/bin/bash
# Round 4: UCCL's benchmark_uccl.py (v0.1.1, import changed only) with its
# default sizes and iterations, sync and async, with the kernel's socket
# buffers (autotuned) and with TCPX_P2P_SOCKBUF=4M, alternated twice; then
# the core figures with each setting (`8775de1`)
set -u
D=${FILES:?a folder with the wheel w9/ (`8775de1`) and benchmark_uccl_v011.py}
W=$(ls $D/w9/*.whl)
nvidia-smi -L
(
. benchmarks/device_env.sh "$W"
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' "$D/benchmark_uccl_v011.py" > $OUT/benchmark_uccl.py
for round in 1 2; do
  for sb in 0 4M; do
    for api in sync async; do
      flag=""; [ $api = async ] && flag=--async-api
      port=$((29500 + RANDOM % 500)); pids=()
      for r in 0 1; do
        MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r TCPX_P2P_SOCKBUF=$sb \
          timeout 120 python3 $OUT/benchmark_uccl.py --local-gpu-idx $r $flag > $OUT/uccl_r${round}_sb${sb}_${api}_rank$r.txt 2>&1 &
        pids+=($!); [ $r = 0 ] && sleep 0.1
      done
      rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
      echo "== round $round sockbuf=$sb $api (exit codes:$rcs)"
      grep -E "KB|MB" $OUT/uccl_r${round}_sb${sb}_${api}_rank0.txt | grep "GB/s" | grep -E " (64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB) "
    done
  done
done
)
ROUNDS=1 timeout 330 bash benchmarks/gpu_round.sh "auto=$W sb4m=$W@TCPX_P2P_SOCKBUF=4M" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^[0-9]{5,}" $OUT/core/summary.txt | head -40
