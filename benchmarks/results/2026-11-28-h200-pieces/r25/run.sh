#!/bin/bash
# NIXL 131,072 x 4 KiB WRITE/READ, old (78db7b8) vs new (ee84b47), alternated twice.
OUT=$1
W() { ls .device/w/$1/*.whl; }
R=$OUT/r; mkdir -p $R
for round in 1 2; do
for b in old new; do
  (
    . benchmarks/device_env.sh $(W $b) >/dev/null 2>&1; pair_gpus
    NIXL_WHEEL=.device/nixl.tgz; n=$(mktemp -d); tar -C "$n" -xf $NIXL_WHEEL
    export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):$PYTHONPATH
    echo "== vllm $b round $round"
    timeout 100 python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out $R/vllm_${b}_$round --sizes 4K --kv 131072x4K --backends TCPX_P2P --telemetry --paired --notifs 0 --rounds 2 --bytes-per-row 6G > $R/vllm_${b}_$round.txt 2>&1
    echo rc=$?; grep -E "posting|many descriptors|paired" $R/vllm_${b}_$round.txt | sed 's/(once per request, not in GB\/s); //; s/prep_xfer_dlist.*make_prepped_xfer [0-9.]* ms//'
  )
done
done
tar -C $OUT -czf $OUT/r.tgz r && rm -rf $R
