#!/bin/bash
# Where the posting call's time goes on the GPU host: NIXL 131,072 x 4 KiB WRITE/READ (new build), traced posting steps, and a perf profile where perf exists.
OUT=$1
W() { ls .device/w/$1/*.whl; }
R=$OUT/r; mkdir -p $R
. benchmarks/device_env.sh $(W new) >/dev/null 2>&1; pair_gpus
NIXL_WHEEL=.device/nixl.tgz; n=$(mktemp -d); tar -C "$n" -xf $NIXL_WHEEL
export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):$PYTHONPATH
lscpu | grep -E "Model name|MHz|^CPU\(s\)" > $R/cpu.txt
echo "== traced"
TCPX_P2P_LOG="warn,tcpx_p2p::endpoint=trace,tcpx_p2p::conn=trace" timeout 120 python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out $R/traced --sizes "" --kv 131072x4K --backends TCPX_P2P --notifs 0 --rounds 1 --bytes-per-row 2G > $R/traced.txt 2>&1
echo rc=$?; grep "rma posted" $R/traced.txt | head -12; grep "request posted" $R/traced.txt | head -6
grep -o "lat: [a-z ]*" $R/traced.txt | sort | uniq -c | sort -rn | head
if command -v perf >/dev/null; then
  echo "== perf"
  timeout 200 perf record -q -F 2000 --call-graph dwarf,16384 -o /tmp/perf.data -- python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out $R/perf --sizes "" --kv 131072x4K --ops WRITE --backends TCPX_P2P --notifs 0 --rounds 1 --bytes-per-row 2G > $R/perf.txt 2>&1
  echo rc=$?
  timeout 250 perf script -i /tmp/perf.data -F comm,tid,ip,sym > /tmp/perf.txt 2>/dev/null
  python3 .device/agg.py /tmp/perf.txt > $R/perf_agg.txt; head -60 $R/perf_agg.txt
else echo "no perf"; fi
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
