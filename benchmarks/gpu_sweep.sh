#!/usr/bin/env bash
# Tuning sweep on a two-GPU machine (results chose the defaults):
#   bash benchmarks/gpu_sweep.sh [WHEEL] [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=${1:-$(ls -t .device/*.whl target/wheels/*.whl 2>/dev/null | head -1)}
OUT=${2:-${OUT:-benchmarks/results/sweep-$(date +%Y%m%d)}}
mkdir -p "$OUT"
. benchmarks/device_env.sh "$WHEEL"
B="python3 -m tcpx_p2p.bench pair"
for s in 4 8 16; do
    $B --memory gpu --sizes 16M,256M --streams $s --json "$OUT/gpu_send_streams$s.json" 2>/dev/null | tail -3
done
for s in 8 16; do
    $B --memory host --sizes 1M,16M,256M --streams $s --reference --json "$OUT/host_send_streams$s.json" 2>/dev/null | tail -4
done
for spin in 0 50 200; do
    TCPX_P2P_SPIN_US=$spin $B --memory gpu --sizes 64K --reference --json "$OUT/gpu_lat_spin$spin.json" 2>/dev/null | tail -2
done
for op in write read; do
    $B --memory gpu --op $op --sizes 64K,16M,256M --streams 8 --json "$OUT/gpu_${op}.json" 2>/dev/null | tail -4
done
$B --memory gpu --sizes 128M --streams 8 --json "$OUT/gpu_send_128M.json" 2>/dev/null | tail -2
$B --memory gpu --kv-blocks 4096 --block-size 32K --streams 8 --json "$OUT/gpu_sendv_kv4096.json" 2>/dev/null | tail -2
$B --memory gpu --op write --kv-blocks 4096 --block-size 32K --streams 8 --json "$OUT/gpu_writev_kv4096.json" 2>/dev/null | tail -2
