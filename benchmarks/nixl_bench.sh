#!/usr/bin/env bash
# NIXL through TCPX_P2P beside NIXL's UCX backend and our own Python API, on
# one GPU (two processes), VRAM → VRAM:
#   bash benchmarks/nixl_bench.sh WHEEL NIXL_WHEEL [OUTDIR] [nixl_bench.py args]
# WHEEL: the tcpx-p2p wheel; NIXL_WHEEL: nixl-cu13 1.5.1 as a wheel
# (installed with --no-deps: torch comes from the machine), or as a folder
# it was installed into (pip install --no-deps --target DIR), or a tarball
# of such a folder (the wheel is large: nixl_ep_cu13/ can be left out of
# the folder). OUTDIR defaults to $OUT.
# Results: OUTDIR/nixl_bench.json and OUTDIR/nixl_bench.txt (the table).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 NIXL_WHEEL=$2 O=${3:-${OUT:-.}}
shift 2; [ $# -gt 0 ] && shift
. benchmarks/device_env.sh "$WHEEL"
case "$NIXL_WHEEL" in
*.whl) python3 -m pip install -q --no-index --no-deps --target "$SITE" "$NIXL_WHEEL" || exit 1 ;;
*.tar*|*.tgz) N=$(mktemp -d); tar -C "$N" -xf "$NIXL_WHEEL" || exit 1
    # The folder holding the package itself (not its .libs or .data).
    D=$(dirname "$(dirname "$(find "$N" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")")
    export PYTHONPATH=$D:$PYTHONPATH ;;
*) export PYTHONPATH=$NIXL_WHEEL:$PYTHONPATH ;;
esac
mkdir -p "$O"
{ date -u +%FT%TZ; nvidia-smi -L 2>/dev/null; } > "$O/device.txt"
timeout 540 python3 benchmarks/nixl_bench.py --memory gpu --out "$O" "$@" 2>&1 | tee "$O/nixl_bench.txt"
