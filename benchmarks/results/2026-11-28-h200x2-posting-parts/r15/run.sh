#!/bin/bash
# NIXL 131,072 x 4 KiB WRITE traced with thread ids (the last build): each transfer's receive streams, to see what slows the first part.
OUT=$1
W=$(ls .device/r15/new/*.whl)
R=$OUT/r; mkdir -p $R
(
  . benchmarks/device_env.sh $W >/dev/null 2>&1; pair_gpus
  NIXL_WHEEL=.device/nixl.tgz; n=$(mktemp -d); tar -C "$n" -xf $NIXL_WHEEL
  export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):$PYTHONPATH
  TCPX_P2P_LOG="trace,tcpx_p2p::workers=info" timeout 100 python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out $R/vllm_tr --sizes 4K --kv 131072x4K --ops WRITE --backends TCPX_P2P --notifs 0 --rounds 1 --bytes-per-row 3G > $R/vllm_tr.txt 2> $R/vllm_tr.log
  echo rc=$?; grep -E "many descriptors|GB/s" $R/vllm_tr.txt | head -8
  timeout 60 python3 benchmarks/rma_timeline.py $R/vllm_tr.log --op write --bytes 536870912 --streams > $R/tl_streams.txt 2>&1
  awk '/^transfer 2:/,/^transfer 4:/' $R/tl_streams.txt | head -60
  gzip -f $R/vllm_tr.log
)
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
