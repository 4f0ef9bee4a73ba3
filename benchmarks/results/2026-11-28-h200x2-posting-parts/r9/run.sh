#!/bin/bash
# 1) 4 KiB blocking write GPU 0 -> 1 traced with the copy / write split; 2) NIXL 131,072 x 4 KiB WRITE/READ with the posting steps traced; 3) UCCL's benchmark_uccl.py (v0.1.1), defaults and 4 sizes.
OUT=$1
W=$(ls .device/r9/new/*.whl)
R=$OUT/r; mkdir -p $R
(
  . benchmarks/device_env.sh $W >/dev/null 2>&1; pair_gpus
  TCPX_P2P_LOG=trace timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS --inflight 1 --op write --sizes 4K --iters 300 --rounds 1 > $R/trace_4k.table 2> $R/trace_4k.log
  echo "== trace 4k"; grep -E "^write" $R/trace_4k.table
  timeout 60 python3 benchmarks/lat_breakdown.py $R/trace_4k.log --json $R/trace_4k.json > $R/trace_4k.split 2>&1; head -28 $R/trace_4k.split
  gzip -f $R/trace_4k.log
  timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS --inflight 1 --op write --sizes 4K --iters 300 --rounds 3 > $R/untraced_4k.table 2>&1
  echo "== untraced 4k"; grep -E "^write" $R/untraced_4k.table
  NIXL_WHEEL=.device/nixl.tgz; n=$(mktemp -d); tar -C "$n" -xf $NIXL_WHEEL
  export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):$PYTHONPATH
  echo "== vllm4k traced"
  TCPX_P2P_LOG="trace,tcpx_p2p::net=info,tcpx_p2p::workers=info,tcpx_p2p::transfer=info" timeout 150 python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out $R/vllm_tr --sizes 4K --kv 131072x4K --backends TCPX_P2P --telemetry --notifs 0 --rounds 1 --bytes-per-row 4G > $R/vllm_tr.txt 2> $R/vllm_tr.log
  echo rc=$?; grep -E "posting|many descriptors" $R/vllm_tr.txt | sed 's/(once per request, not in GB\/s); //'
  timeout 60 python3 benchmarks/rma_timeline.py $R/vllm_tr.log --posting > $R/vllm_posting.txt 2>&1; head -12 $R/vllm_posting.txt; tail -12 $R/vllm_posting.txt
  gzip -f $R/vllm_tr.log
)
UCCL_BENCH=.device/r9/benchmark_uccl_v011.py ROUNDS=1 timeout 280 bash benchmarks/gpu_round.sh "$W" $R/ub uccl_bench > /dev/null 2>&1; echo "uccl_bench exit $?"
grep -vE "^(GPU|[0-9]{4}-)" $R/ub/summary.txt | tail -30
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
