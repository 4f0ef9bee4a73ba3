#!/usr/bin/env bash
# One bounded GPU round on a machine with one or more GPUs (two processes
# share GPU 0 when there is only one):
#   bash benchmarks/gpu_round.sh WHEEL OUTDIR [STEPS]
# STEPS (comma-separated, default suites,bench,kv): suites = the CUDA
# end-to-end tests over the socket net and over the plugin net (TCPX
# stand-in); bench = send / write / read GPU -> GPU at 64 KiB ... 256 MiB;
# kv = 4,096 x 32 KiB scattered KV blocks beside one message of the same
# bytes. Each step runs under its own time limit and the summary is written
# as it goes, so a cut-off round still returns what it did.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 OUTDIR=$2 STEPS=${3:-suites,bench,kv}
# Everything is written to a scratch folder and packed into OUTDIR/round.tgz
# after each step (with summary.txt beside it), so few files come back.
O=$(mktemp -d)/round
mkdir -p "$O" "$OUTDIR"
. benchmarks/device_env.sh "$WHEEL"
EMU=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())')
NG=$(nvidia-smi -L 2>/dev/null | wc -l)
GPUS=0,$((NG > 1 ? 1 : 0))
{ date -u +%FT%TZ; nvidia-smi -L; echo "gpus used: $GPUS"; } > "$O/device.txt" 2>&1
has() { case ",$STEPS," in *",$1,"*) return 0;; *) return 1;; esac; }
note() {
  tail -"${2:-3}" "$O/$1" | sed "s|^|$1: |" >> "$O/summary.txt"
  cp "$O/summary.txt" "$OUTDIR/summary.txt"
  tar -C "$(dirname "$O")" -czf "$OUTDIR/round.tgz" round
}
PT="python3 -m pytest -p no:cacheprovider -q -rs"
if has suites; then
  timeout 200 $PT tests/test_api.py -k cuda > "$O/suite_socket_cuda.txt" 2>&1; note suite_socket_cuda.txt 1
  TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU timeout 200 $PT tests/test_api.py -k cuda > "$O/suite_plugin_cuda.txt" 2>&1; note suite_plugin_cuda.txt 1
fi
B="python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS"
if has bench; then
  for op in send write read; do
    f=bench_gpu_$op
    timeout 90 $B --op $op --sizes 64K,1M,16M,256M --json "$O/$f.json" > "$O/$f.txt" 2>&1; note $f.txt 6
  done
fi
if has kv; then
  f=bench_kv_write_scattered
  timeout 60 $B --op write --kv-blocks 4096 --block-size 32K --kv-layout scattered --json "$O/$f.json" > "$O/$f.txt" 2>&1; note $f.txt 3
  f=bench_kv_one_message
  timeout 60 $B --op write --sizes 128M --json "$O/$f.json" > "$O/$f.txt" 2>&1; note $f.txt 3
fi
cat "$O/summary.txt"
