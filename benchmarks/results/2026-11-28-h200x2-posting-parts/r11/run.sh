#!/bin/bash
# The new build's timeline of NIXL 131,072 x 4 KiB WRITE and READ (and one descriptor of 512 MiB), traced: posting, requests, streams.
OUT=$1
W=$(ls .device/r11/new/*.whl)
R=$OUT/r; mkdir -p $R
(
  . benchmarks/device_env.sh $W >/dev/null 2>&1; pair_gpus
  NIXL_WHEEL=.device/nixl.tgz; n=$(mktemp -d); tar -C "$n" -xf $NIXL_WHEEL
  export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):$PYTHONPATH
  cp benchmarks/nixl_bench.py $R/
  TCPX_P2P_LOG="trace,tcpx_p2p::workers=info" timeout 200 python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out $R/vllm_tr --sizes 4K --kv 131072x4K --backends TCPX_P2P --telemetry --notifs 0 --rounds 1 --bytes-per-row 4G > $R/vllm_tr.txt 2> $R/vllm_tr.log
  echo rc=$?; grep -E "posting|many descriptors|GB/s" $R/vllm_tr.txt | sed 's/(once per request, not in GB\/s); //; s/prep_xfer_dlist.*make_prepped_xfer [0-9.]* ms//'
  wc -l $R/vllm_tr.log
  for op in write read; do
    echo "== timeline $op"; timeout 60 python3 benchmarks/rma_timeline.py $R/vllm_tr.log --op $op --bytes 536870912 > $R/tl_$op.txt 2>&1; tail -30 $R/tl_$op.txt
  done
  timeout 60 python3 benchmarks/rma_timeline.py $R/vllm_tr.log --op write --bytes 536870912 --streams > $R/tl_streams.txt 2>&1; tail -40 $R/tl_streams.txt
  timeout 60 python3 benchmarks/rma_timeline.py $R/vllm_tr.log --posting > $R/posting.txt 2>&1; tail -6 $R/posting.txt
  gzip -f $R/vllm_tr.log
  echo "== untraced"
  timeout 100 python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out $R/vllm_u --sizes 4K --kv 131072x4K --backends TCPX_P2P --telemetry --paired --notifs 0 --rounds 2 --bytes-per-row 6G > $R/vllm_u.txt 2>&1
  grep -E "posting|many descriptors|paired" $R/vllm_u.txt | sed 's/(once per request, not in GB\/s); //; s/prep_xfer_dlist.*make_prepped_xfer [0-9.]* ms//'
)
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
