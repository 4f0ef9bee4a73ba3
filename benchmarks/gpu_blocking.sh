#!/usr/bin/env bash
# One transfer at a time on a GPU machine, beside its floor, and the
# benchmark's reference handling there:
#   bash benchmarks/gpu_blocking.sh WHEEL OUTDIR
# 1. tests/test_bench.py (with a GPU its GPU cases run: NCCL skipped on one
#    GPU with the reason, the GPU copies in the blocking floor);
# 2. tcpx-p2p-bench pair --inflight 1, write / read / send, 4 KiB … 256 MiB,
#    GPU → GPU (GPU 0 → GPU 1, or both sides on GPU 0 with one GPU) and
#    host → host, each beside raw TCP and the staged copies measured in the
#    same run; then --inflight 8 the same way (the pipelined figures beside);
# 3. --memory gpu --gpus 0,0 --reference: must print its table with NCCL
#    skipped (it used to hang after NCCL's "Duplicate GPU detected").
# Each step runs under its own time limit; OUTDIR gets the JSON and tables.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 O=$2
mkdir -p "$O"
. benchmarks/device_env.sh "$WHEEL"
{ date -u +%FT%TZ; nvidia-smi -L; uptime; } > "$O/device.txt" 2>&1
pair_gpus
B="python3 -m tcpx_p2p.bench pair"
SIZES=4K,64K,1M,16M,256M
timeout 300 python3 -m pytest -p no:cacheprovider -q tests/test_bench.py > "$O/test_bench.txt" 2>&1
tail -1 "$O/test_bench.txt"
for n in 1 8; do
  for mem in gpu host; do
    timeout 580 $B --memory $mem --gpus $GPUS --inflight $n --op write,read,send --sizes $SIZES --out "$O/blocking" \
      > "$O/inflight${n}_$mem.txt" 2> "$O/inflight${n}_$mem.err"
    echo "inflight $n $mem: status $?"
  done
done
timeout 300 $B --memory gpu --gpus 0,0 --sizes 64K,1M --reference --json "$O/one_gpu_reference.json" \
  > "$O/one_gpu_reference.txt" 2> "$O/one_gpu_reference.err"
echo "one GPU with --reference: status $? (124 = it hung)"
tail -3 "$O/one_gpu_reference.txt"
