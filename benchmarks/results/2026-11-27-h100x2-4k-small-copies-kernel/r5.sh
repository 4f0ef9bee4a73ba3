#!/bin/bash
# Round 5: NIXL 131,072 x 4 KiB and x 16 KiB, w2 (before) vs w4 (many small copies through the copy kernel), alternated, 2 rounds each
set -u
D=${FILES:?a folder with the wheels w2/ and w4/}
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
NIXL_PP=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")")
mkdir -p $OUT/nixl
for r in 1 2; do
  for tag in w2 w4; do
    ( . benchmarks/device_env.sh "$(ls $D/$tag/*.whl)" >/dev/null 2>&1 || exit 1
      export PYTHONPATH=$NIXL_PP:$PYTHONPATH
      timeout 130 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K,131072x16K --backends TCPX_P2P --telemetry --notifs 0 --rounds 2 --bytes-per-row 4G --out $OUT/nixl/${tag}_$r > $OUT/nixl/${tag}_$r.txt 2>&1; echo "nixl $tag round $r exit $?"
      grep -E "many desc|KV " $OUT/nixl/${tag}_$r.txt | grep -v "^round" | sed 's/^/  /' )
  done
done
cd $OUT && tar czf r5.tgz nixl; ls $OUT
