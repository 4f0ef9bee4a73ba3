#!/usr/bin/env bash
# The same-host path on a GPU machine: the GPU tests of tests/test_local.py
# (two processes on one GPU; on two GPUs where there are two), then
# benchmarks/local_bench.py on one GPU (and across GPUs 0 and 1 where there
# are two), beside loopback TCP and a plain copy. Results under OUTDIR.
#   bash benchmarks/local_gpu.sh WHEEL OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 O=$2
mkdir -p "$O"
. benchmarks/device_env.sh "$WHEEL"
{ date -u +%FT%TZ; nvidia-smi -L; } > "$O/device.txt" 2>&1
timeout 300 python3 -m pytest -p no:cacheprovider -v tests/test_local.py > "$O/tests_local.txt" 2>&1
tail -3 "$O/tests_local.txt"
timeout 300 python3 benchmarks/local_bench.py --device gpu --gpu 0 --out "$O/one_gpu" > "$O/bench_one_gpu.txt" 2>&1
cat "$O/bench_one_gpu.txt"
timeout 120 python3 benchmarks/local_bench.py --device cpu --out "$O/host" > "$O/bench_host.txt" 2>&1
cat "$O/bench_host.txt"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 300 python3 benchmarks/local_bench.py --device gpu --gpu 0 --peer-gpu 1 --out "$O/two_gpus" > "$O/bench_two_gpus.txt" 2>&1
  cat "$O/bench_two_gpus.txt"
fi
