#!/bin/bash
# Per-message times (HEAD wheel h0), blocking send/recv GPU 0 -> GPU 1:
# A: 64 KiB then 1 MiB; B: 16 MiB first (every stream and worker in use once),
# then 64 KiB, then 1 MiB. Twice each.
OUT=$1
. benchmarks/device_env.sh "$(ls .device/w/h0/*.whl)" >/dev/null 2>&1
for i in 1 2; do
echo "== A$i"; SIZES=65536,1048576,262144 timeout 100 python3 .device/permsg.py
echo "== B$i"; SIZES=16777216,65536,1048576,262144 timeout 100 python3 .device/permsg.py
done 2>&1 | grep -v Warning
