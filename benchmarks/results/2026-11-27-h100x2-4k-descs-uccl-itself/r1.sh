#!/bin/bash
# Round 1: UCCL 0.1.1 itself beside us on UCCL's benchmark; the 4 KiB descriptor rows, own API and NIXL, with time splits
set -u
D=${FILES:?a folder with the wheels (w1/, w2/, one .whl each), gputest (the p2p-gpu test binary), uccl011.tgz (UCCL 0.1.1 trimmed, libcudart.so.12) and ub2.sh}; W=$(ls $D/w1/*.whl)
. benchmarks/device_env.sh "$W" >/dev/null 2>&1 || { echo "env failed"; exit 1; }
pair_gpus; echo "GPUS=$GPUS"; nvidia-smi --query-gpu=name --format=csv,noheader | head -2
python3 -c "import tcpx_p2p, os; d=tcpx_p2p.nixl_plugin_dir(); print('plugin', os.path.getsize(os.path.join(d,'libplugin_TCPX_P2P.so')))"
OURS_PP=$PYTHONPATH
U=$(mktemp -d); tar -C $U -xzf $D/uccl011.tgz
NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
echo "nccl lib: $NCCL_LIB"; ls $NCCL_LIB 2>/dev/null
uccl_env() { PYTHONPATH=$U/pkg:$OURS_PP LD_LIBRARY_PATH=$U/lib:$NCCL_LIB:${LD_LIBRARY_PATH:-} NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo UCCL_SOCKET_IFNAME=lo NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET "$@"; }
uccl_env python3 -c "from uccl import p2p; print('uccl p2p ok', p2p)" 2>&1 | tail -3
mkdir -p $OUT/ub
for r in 1 2; do
  uccl_env bash $D/ub2.sh uccl $OUT/ub uccl_$r
  bash $D/ub2.sh ours $OUT/ub ours_$r
done
( zcat $OUT/ub/uccl_1_rank0.log.gz | grep -iE "NET/|via|Using network|transport|error" | head -20 ) > $OUT/ub/uccl_nccl_lines.txt 2>&1
# 4 KiB descriptors, own API
mkdir -p $OUT/kv
for lay in scattered contiguous; do
  timeout 100 python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS --op write,read --kv-blocks 131072 --block-size 4K --kv-layout $lay --seconds 3 > $OUT/kv/own_$lay.txt 2>&1; echo "own $lay exit $?"; tail -4 $OUT/kv/own_$lay.txt
done
timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS --op write,read --sizes 512M --seconds 3 > $OUT/kv/own_one.txt 2>&1; echo "own one exit $?"; tail -4 $OUT/kv/own_one.txt
TCPX_P2P_LOG=debug timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS --op write --kv-blocks 131072 --block-size 4K --seconds 3 > $OUT/kv/split_own.table 2> $OUT/kv/split_own.log
python3 benchmarks/time_split.py $OUT/kv/split_own.log > $OUT/kv/split_own.txt 2>&1; tail -25 $OUT/kv/split_own.txt; gzip -f $OUT/kv/split_own.log
# NIXL
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):$OURS_PP
timeout 150 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K --backends TCPX_P2P --telemetry --notifs 0 --rounds 2 --bytes-per-row 2G --out $OUT/nixl > $OUT/kv/nixl.txt 2>&1; echo "nixl exit $?"
grep -E "KV|telemetry|many" $OUT/kv/nixl.txt | grep -v "^round" | tail -8
cd $OUT && tar czf r1.tgz ub kv nixl 2>/dev/null; ls -la $OUT
