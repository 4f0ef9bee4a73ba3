#!/bin/bash
# Round 4: 131,072 x 4 KiB NIXL WRITE / READ, paired against one descriptor, with the I/O threads pinned to the GPU's CPUs (the default) and not pinned (TCPX_P2P_CPU_AFFINITY=off), alternated twice; build w2
set -u
D=${FILES:?a folder with the wheel w2/}
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
NIXL_PP=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")")
lscpu | grep -E "^CPU\(s\)|NUMA"; nvidia-smi topo -m | head -4
for g in 0 1; do cat /sys/bus/pci/devices/$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i $g | tr 'A-F' 'a-f' | sed 's/^0000//;s/^/0000/' )/local_cpulist 2>/dev/null; done
mkdir -p $OUT/v
. benchmarks/device_env.sh "$(ls $D/w2/*.whl)" >/dev/null 2>&1 || exit 1
export PYTHONPATH=$NIXL_PP:$PYTHONPATH
for r in 1 2; do
  for aff in gpu off; do
    TCPX_P2P_LOG=info TCPX_P2P_CPU_AFFINITY=$aff timeout 120 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K --backends TCPX_P2P --notifs 0 --rounds 1 --paired --bytes-per-row 8G --out $OUT/v/${aff}_$r > $OUT/v/${aff}_$r.txt 2>&1; echo "$aff round $r exit $?"
    grep -m2 -E "pinned" $OUT/v/${aff}_$r.txt | sed 's/.*INFO//'
    grep -E "paired|same bytes" $OUT/v/${aff}_$r.txt
  done
done
cd $OUT && tar czf v.tgz v && rm -rf v
