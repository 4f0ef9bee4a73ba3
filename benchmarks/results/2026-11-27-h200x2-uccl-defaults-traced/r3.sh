#!/bin/bash
# Round 3: UCCL's benchmark_uccl.py (v0.1.1, import changed only), sync API,
# its default sizes and iterations, both ranks traced (TCPX_P2P_LOG=trace),
# twice, to see where its 256 KB and 1 MB rows' time goes
set -u
D=${FILES:?a folder with the wheel w9/ (`8775de1`) and benchmark_uccl_v011.py}
. benchmarks/device_env.sh "$(ls $D/w9/*.whl)"
nvidia-smi -L
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' "$D/benchmark_uccl_v011.py" > $OUT/benchmark_uccl.py
for run in 1 2; do
  port=$((29500 + RANDOM % 500)); pids=()
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r TCPX_P2P_LOG=trace \
      timeout 120 python3 $OUT/benchmark_uccl.py --local-gpu-idx $r > $OUT/run${run}_rank$r.txt 2> $OUT/run${run}_rank$r.log &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  for p in "${pids[@]}"; do wait $p; echo "run $run exit $?"; done
  grep -E "GB/s" $OUT/run${run}_rank0.txt
  gzip -f $OUT/run${run}_rank*.log
done
ls -la $OUT
