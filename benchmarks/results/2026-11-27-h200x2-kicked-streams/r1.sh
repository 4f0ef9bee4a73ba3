#!/bin/bash
# Round 1 (build w5 = 31b5f42): a traced 131,072 x 4 KiB NIXL WRITE and READ with every stream's events; the vLLM rows paired; UCCL's benchmark_uccl.py
set -u
D=${FILES:?a folder with the wheel w5/}
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
NIXL_PP=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")")
W=$(ls $D/w5/*.whl)
( . benchmarks/device_env.sh "$W" >/dev/null 2>&1 || exit 1
export PYTHONPATH=$NIXL_PP:$PYTHONPATH
nproc; nvidia-smi -L
mkdir -p $OUT/t
for op in WRITE READ; do
  tag=k4_$op
  TCPX_P2P_LOG=trace timeout 120 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --kv 131072x4K --sizes '' --ops $op --backends TCPX_P2P --telemetry --notifs 0 --rounds 1 --bytes-per-row 1G --out $OUT/t/nb_$tag > $OUT/t/trace_$tag.txt 2>&1; echo "$tag exit $?"
  grep -E "many desc|telemetry|GB/s" $OUT/t/trace_$tag.txt | grep -v TRACE | head -12
  grep -E "lat: " $OUT/t/trace_$tag.txt | sed 's/\x1b\[[0-9;]*m//g' | gzip -6 > $OUT/t/lat_$tag.log.gz
  rm -f $OUT/t/trace_$tag.txt
done
timeout 150 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K,131072x16K --backends TCPX_P2P --telemetry --notifs 0 --rounds 1 --paired --bytes-per-row 8G --out $OUT/t/paired > $OUT/t/paired.txt 2>&1; echo "paired exit $?"
grep -E "paired|same bytes|GB/s" $OUT/t/paired.txt | grep -v "^round"
)
UCCL_BENCH=$FILES/benchmark_uccl_v011.py timeout 300 bash benchmarks/gpu_round.sh "$W" $OUT/ub uccl_bench > /dev/null 2>&1; echo "uccl_bench exit $?"
cat $OUT/ub/summary.txt
cd $OUT && tar czf t.tgz t && rm -rf t
