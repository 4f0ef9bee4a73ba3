#!/bin/bash
# g1 (nvidia-h200, both ranks on GPU 0): HEAD (engine as 1984421, not run on a GPU before): the unit tests,
# GPU tests included; then gpu_round.sh's uccl_shape step (its first run as a step; engine and plain TCP, no
# NCCL on one GPU) and the core step.
OUT=$1
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
timeout 150 ./.device/unit -q > $OUT/unit.txt 2>&1; echo "unit exit $? $(grep 'test result' $OUT/unit.txt) $(grep -- '--- FAILED' $OUT/unit.txt | tr '\n' ' ')"
timeout $((570 - SECONDS)) bash benchmarks/gpu_round.sh "$(ls .device/w/head/*.whl)" $OUT/r uccl_shape core > /dev/null 2>&1
echo "round exit $?"; cat $OUT/r/summary.txt | grep -v "^\s*$" | head -120
echo "total ${SECONDS} s"
