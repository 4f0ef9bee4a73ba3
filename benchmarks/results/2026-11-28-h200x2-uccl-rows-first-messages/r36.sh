#!/bin/bash
# Per-message times (HEAD wheel h0), 64 KiB then 1 MiB then 256 KiB, GPU 0 -> GPU 1:
# is a slow start of the first multi-part size the first use of each staging
# slot lent to the socket? Default; lending off (TCPX_P2P_SPLICE=0); staging
# depth 2 (half the slots). Twice each, alternated.
OUT=$1
. benchmarks/device_env.sh "$(ls .device/w/h0/*.whl)" >/dev/null 2>&1
for i in 1 2; do
  for v in "X=1" "TCPX_P2P_SPLICE=0" "TCPX_P2P_STAGING_DEPTH=2"; do
    echo "== $v round $i"; env $v SIZES=65536,1048576,262144 N=30 timeout 100 python3 .device/permsg.py 2>&1 | grep -v Warning
  done
done
