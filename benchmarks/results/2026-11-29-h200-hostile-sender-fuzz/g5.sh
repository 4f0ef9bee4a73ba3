#!/bin/bash
# g5 (nvidia-h200): gpu_round.sh's new `unit` step (its first run): the unit test binary of be9326e, the
# hostile-sender test into GPU memory, seeds 31 and 32, 45 s each.
OUT=$1
export TCPX_P2P_IFNAME=lo
UNIT_TESTS=$PWD/.device/unit FUZZ_SECS=45 FUZZ_SEEDS="31 32" timeout 400 bash benchmarks/gpu_round.sh "$(ls .device/w/g4/*.whl)" $OUT/r unit > /dev/null 2>&1
echo "round exit $?"; grep -v "^\s*$" $OUT/r/summary.txt
echo "total ${SECONDS} s"
