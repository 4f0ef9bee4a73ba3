#!/usr/bin/env bash
# The full GPU round on a two-GPU machine, in one command:
#   bash benchmarks/gpu_final.sh WHEEL BIN_DIR OUTDIR
# WHEEL from `maturin build --release`; BIN_DIR from
# `benchmarks/gpu_plugin_check.sh --stage BIN_DIR`. Everything lands in
# OUTDIR/gpu-round.tar.gz (and OUTDIR/summary.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 BIN=$2 OUT=$3
R=$(mktemp -d)/gpu-round
mkdir -p "$R" "$OUT"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEEL" || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EMU=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())')
{ date -u +%FT%TZ; nvidia-smi -L; nproc; python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'; } > "$R/device.txt" 2>&1
step() { echo "== $1" | tee -a "$R/summary.txt"; }
if [ "${PART:-all}" != bench ]; then
step "tests, socket net (cpu and cuda buffers)"
timeout 600 python3 -m pytest tests -v -p no:cacheprovider -k "not soak" > "$R/tests_socket.txt" 2>&1; tail -1 "$R/tests_socket.txt" | tee -a "$R/summary.txt"
step "tests, plugin net through the stand-in, cuda buffers (unpack kernel)"
TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU timeout 600 python3 -m pytest tests/test_api.py -v -p no:cacheprovider -k cuda > "$R/tests_plugin_cuda.txt" 2>&1; tail -1 "$R/tests_plugin_cuda.txt" | tee -a "$R/summary.txt"
step "unpack kernel and plugin checks"
BIN_DIR=$BIN timeout 600 bash benchmarks/gpu_plugin_check.sh "$R/gpu_plugin_check.json" > "$R/gpu_plugin_check.txt" 2>&1; tail -5 "$R/gpu_plugin_check.txt" | tee -a "$R/summary.txt"
step "NCCL loads the stand-in"
timeout 600 python3 benchmarks/nccl_emu_check.py "$R/nccl" --plugin "$BIN/libnccl_net_emu.so" > "$R/nccl_emu_check.txt" 2>&1; tail -5 "$R/nccl_emu_check.txt" | tee -a "$R/summary.txt"
fi
if [ "${PART:-all}" != tests ]; then
B="python3 -m tcpx_p2p.bench pair"
step "benchmarks"
$B --memory gpu --sizes 64K,1M,16M,256M --reference --json "$R/bench_gpu_send.json" 2>/dev/null | tee -a "$R/summary.txt"
$B --memory host --sizes 64K,1M,16M,256M --reference --json "$R/bench_host_send.json" 2>/dev/null | tee -a "$R/summary.txt"
TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU $B --memory gpu --sizes 16M,256M --json "$R/bench_gpu_plugin.json" 2>&1 | tail -4 | tee -a "$R/summary.txt"
TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU TCPX_P2P_CHANNELS=4 $B --memory gpu --sizes 16M,256M --json "$R/bench_gpu_plugin_ch4.json" 2>&1 | tail -4 | tee -a "$R/summary.txt"
$B --memory gpu --sizes 128M --json "$R/bench_gpu_128M.json" 2>/dev/null | tail -2 | tee -a "$R/summary.txt"
$B --memory gpu --kv-blocks 4096 --block-size 32K --json "$R/bench_gpu_sendv_kv.json" 2>/dev/null | tail -2 | tee -a "$R/summary.txt"
$B --memory gpu --op write --kv-blocks 4096 --block-size 32K --json "$R/bench_gpu_writev_kv.json" 2>/dev/null | tail -2 | tee -a "$R/summary.txt"
$B --memory gpu --op write --sizes 64K,16M,256M --json "$R/bench_gpu_write.json" 2>/dev/null | tail -4 | tee -a "$R/summary.txt"
$B --memory gpu --op read --sizes 64K,16M,256M --json "$R/bench_gpu_read.json" 2>/dev/null | tail -4 | tee -a "$R/summary.txt"
fi
cp "$R/summary.txt" "$OUT/summary.txt"
tar -C "$(dirname "$R")" -czf "$OUT/gpu-round-${PART:-all}.tar.gz" gpu-round
