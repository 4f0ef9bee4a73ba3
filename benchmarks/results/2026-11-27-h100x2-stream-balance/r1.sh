#!/bin/bash
# Round 1: per-part data events of a 131,072 x 4 KiB NIXL WRITE and of one 512 MiB descriptor, traced in both agents
set -u
D=${FILES:?a folder with the wheel w1/}
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
NIXL_PP=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")")
. benchmarks/device_env.sh "$(ls $D/w1/*.whl)" >/dev/null 2>&1 || exit 1
export PYTHONPATH=$NIXL_PP:$PYTHONPATH
nproc; nvidia-smi -L
mkdir -p $OUT/t
for what in "--kv 131072x4K --sizes ''" "--kv '' --sizes 512M"; do
  tag=$(echo "$what" | grep -q 4K && echo k4 || echo m512)
  eval TCPX_P2P_LOG=trace timeout 170 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 $what --ops WRITE --backends TCPX_P2P --telemetry --notifs 0 --rounds 1 --bytes-per-row 1G --out $OUT/t/nb_$tag > $OUT/t/trace_$tag.txt 2>&1; echo "$tag exit $?"
  grep -E "many desc|telemetry|GB/s" $OUT/t/trace_$tag.txt | grep -v TRACE | head -20
  wc -l $OUT/t/trace_$tag.txt
  grep -E "lat: " $OUT/t/trace_$tag.txt | grep -oE "lat: [a-zA-Z ]+" | sort | uniq -c | sort -rn | head -40
  grep -E "lat: " $OUT/t/trace_$tag.txt | sed 's/\x1b\[[0-9;]*m//g' | gzip -6 > $OUT/t/lat_$tag.log.gz
  rm -f $OUT/t/trace_$tag.txt
done
ls -la $OUT/t
cd $OUT && tar czf t.tgz t && rm -rf t
