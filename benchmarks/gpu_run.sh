#!/usr/bin/env bash
# Reproduces the GPU results on a machine with two GPUs, in one command:
#   bash benchmarks/gpu_run.sh [WHEEL] [OUTDIR]
# Installs the wheel (built elsewhere with `maturin build --release`) into a
# private folder, then runs the end-to-end tests with CUDA buffers (GPU 0 in
# one process, GPU 1 in the other), the demo, and the benchmark with its
# references (raw TCP, NCCL's socket transport). Results land in OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=${1:-$(ls -t .device/*.whl target/wheels/*.whl 2>/dev/null | head -1)}
OUT=${2:-${OUT:-benchmarks/results/gpu-$(date +%Y%m%d)}}
mkdir -p "$OUT"
. benchmarks/device_env.sh "$WHEEL"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi -L
    nproc
    python3 -c 'import torch; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
} 2>&1 | tee "$OUT/device.txt"
timeout 900 python3 -m pytest tests -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt"
python3 -m tcpx_p2p.demo --size 256M --iters 16 2>&1 | tee "$OUT/demo.txt"
for mem in host gpu; do
    python3 -m tcpx_p2p.bench pair --memory $mem --sizes 64K,1M,16M,256M --reference \
        --json "$OUT/bench_${mem}_send.json" 2>&1 | tee "$OUT/bench_${mem}_send.txt"
done
