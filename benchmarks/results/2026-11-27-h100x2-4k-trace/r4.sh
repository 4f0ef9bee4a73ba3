#!/bin/bash
# Round 4: a trace of NIXL 131,072 x 4 KiB WRITE / READ (control messages, parts, transfers), this build
set -u
D=${FILES:?a folder with the wheel w2/}
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
NIXL_PP=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")")
. benchmarks/device_env.sh "$(ls $D/w2/*.whl)" >/dev/null 2>&1 || exit 1
export PYTHONPATH=$NIXL_PP:$PYTHONPATH
mkdir -p $OUT/t
TCPX_P2P_LOG=trace timeout 150 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K --backends TCPX_P2P --telemetry --notifs 0 --rounds 1 --bytes-per-row 1G --out $OUT/t/nb > $OUT/t/trace.txt 2>&1; echo "exit $?"
grep -E "many desc|telemetry" $OUT/t/trace.txt
wc -l $OUT/t/trace.txt
grep -E "lat: (ctl|ended|post|waiter)" $OUT/t/trace.txt | gzip > $OUT/t/ctl.log.gz
grep -vE "lat: (rx header|rx done|isend|tx wrote)" $OUT/t/trace.txt | grep -E "lat:" | grep -oE "lat: [a-zA-Z ]+" | sort | uniq -c | sort -rn | head -30
grep -E "lat: (rx done|isend)" $OUT/t/trace.txt | awk '{print $1, $3, $6, $7, $8}' | gzip > $OUT/t/data.log.gz
ls -la $OUT/t; rm -f $OUT/t/trace.txt
