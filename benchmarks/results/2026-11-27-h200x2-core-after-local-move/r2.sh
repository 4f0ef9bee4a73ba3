#!/bin/bash
# The core figures, old / new alternated, then the peers step on the new build.
set -u
cd "$(dirname "$0")/../../.."  # the repository; wheels under .device/old and .device/new
OUT=$1
W=tcpx_p2p-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl
timeout 420 bash benchmarks/gpu_round.sh "old=.device/old/$W new=.device/new/$W" "$OUT/core" core > /dev/null 2>&1
timeout 150 bash benchmarks/gpu_round.sh ".device/new/$W" "$OUT/peers" peers > /dev/null 2>&1
cat "$OUT/core/summary.txt" "$OUT/peers/summary.txt"
