#!/bin/bash
# NIXL 131,072 x 4 KiB GPU 0 -> GPU 1 under three settings (one run each)
set -u
W=$(ls $WHEEL)
. benchmarks/device_env.sh "$W" >/dev/null 2>&1 || { echo "env failed"; exit 1; }
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):${PYTHONPATH:-}
for e in TCPX_P2P_STAGING_DEPTH=8 TCPX_P2P_MIN_PART=512K TCPX_P2P_CHUNK=32M; do
  env $e timeout 60 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K --backends TCPX_P2P --telemetry --notifs 0 --rounds 2 --bytes-per-row 3G --out $OUT/$e > $OUT/$e.txt 2>&1
  echo "== $e (exit $?)"; grep -E "many|telemetry" $OUT/$e.txt | sed 's/prep_xfer_dlist.*telemetry://'
done
