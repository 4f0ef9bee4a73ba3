#!/bin/bash
# NIXL (TCPX_P2P), GPU 0 -> GPU 1, 131,072 x 4 KiB beside one 512 MiB descriptor, this build (release plugin checked in the wheel)
set -u
W=$(ls $WHEEL)
. benchmarks/device_env.sh "$W" >/dev/null 2>&1 || { echo "env failed"; exit 1; }
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):${PYTHONPATH:-}
python3 -c "import tcpx_p2p, os; d=tcpx_p2p.nixl_plugin_dir(); print('plugin', os.path.getsize(os.path.join(d,'libplugin_TCPX_P2P.so')))"
timeout 220 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K --backends TCPX_P2P --telemetry --notifs 0 --rounds 3 --bytes-per-row 3G --out $OUT/v > $OUT/vllm4k.txt 2>&1; echo "exit $?"
grep -E "KV|telemetry|many" $OUT/vllm4k.txt | grep -v "^round" | tail -12
