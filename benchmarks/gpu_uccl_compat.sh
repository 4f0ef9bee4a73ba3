#!/usr/bin/env bash
# UCCL-shaped tests (tests/test_uccl_compat.py) and the hostile-argument
# tests on GPU memory, over the socket net and the plugin net:
#   bash benchmarks/gpu_uccl_compat.sh WHEEL OUTDIR
# Needs 2+ GPUs and torch (conftest's GPU devices). Writes one log per net
# and summary.txt into OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 O=$2
mkdir -p "$O"
. benchmarks/device_env.sh "$WHEEL"
EMU=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())')
{ date -u +%FT%TZ; nvidia-smi -L; } > "$O/device.txt" 2>&1
PT="python3 -m pytest -p no:cacheprovider -v tests/test_uccl_compat.py tests/test_hostile_args.py"
TCPX_P2P_NET=socket timeout 300 $PT > "$O/uccl_compat_socket.txt" 2>&1
TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU timeout 300 $PT > "$O/uccl_compat_plugin.txt" 2>&1
for f in "$O"/uccl_compat_*.txt; do echo "$(basename "$f"): $(tail -1 "$f")"; done | tee "$O/summary.txt"
