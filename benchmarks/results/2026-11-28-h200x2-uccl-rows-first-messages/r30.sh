#!/bin/bash
# UCCL's benchmark_uccl.py (v0.1.1, import changed only), sync, its defaults, both ranks traced, twice; everything packed in one archive.
OUT=$1
W=$(ls .device/w/h0/*.whl)
. benchmarks/device_env.sh "$W" >/dev/null 2>&1
R=$(mktemp -d)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
for run in 1 2; do
  port=$((29500 + RANDOM % 500)); pids=()
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r TCPX_P2P_LOG=trace \
      timeout 120 python3 $R/benchmark_uccl.py --local-gpu-idx $r > $R/traced${run}_rank$r.txt 2> $R/traced${run}_rank$r.log &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  for p in "${pids[@]}"; do wait $p; echo "run $run exit $?"; done
  paste <(grep -E "GB/s" $R/traced${run}_rank0.txt) <(grep -E "GB/s" $R/traced${run}_rank1.txt | sed 's/.*Gbps |//')
done
tar -C $R -czf $OUT/traced.tgz .
