#!/usr/bin/env bash
# The long soak (issue: reliability): 32 peer processes x 8 concurrent
# one-sided transfers of mixed sizes for SECONDS (default 300), every byte
# read back and compared, RSS logged every 10 s; JSON to benchmarks/results/.
#   bash benchmarks/soak.sh [SECONDS]   (after ./run test has set things up)
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
TCPX_P2P_SOAK_SECONDS=${1:-300} TCPX_P2P_SOAK_JSON=benchmarks/results/soak-$(date +%F)-$(hostname).json \
    python -m pytest tests/test_soak.py -q -s -p no:cacheprovider
