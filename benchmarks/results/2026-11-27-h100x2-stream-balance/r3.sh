#!/bin/bash
# Round 3: parts to the least-queued stream (new = w2) beside the build before it (old = w1): NIXL at vLLM's descriptor counts, each list timed against one descriptor transfer by transfer in turn (--paired), alternated twice
set -u
D=${FILES:?a folder with the wheels w1/ and w2/}
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
NIXL_PP=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")")
mkdir -p $OUT/v
for r in 1 2; do
  for b in old new; do
    w=w1; [ $b = new ] && w=w2
    ( . benchmarks/device_env.sh "$(ls $D/$w/*.whl)" >/dev/null 2>&1 || exit 1
      export PYTHONPATH=$NIXL_PP:$PYTHONPATH
      timeout 150 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K,131072x16K --backends TCPX_P2P --telemetry --notifs 0 --rounds 1 --paired --bytes-per-row 3G --out $OUT/v/${b}_$r > $OUT/v/${b}_$r.txt 2>&1; echo "$b round $r exit $?" )
    grep -E "paired|same bytes" $OUT/v/${b}_$r.txt
  done
done
cd $OUT && tar czf v.tgz v && rm -rf v
