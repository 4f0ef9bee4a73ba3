#!/bin/bash
# g2 (nvidia-h200): the unit tests (GPU tests included) on the build with the hostile-sender fuzz test of the socket
# net's data streams; then that test at length: into GPU memory, seeds 1-3, 60 s each; host memory, seeds 4-5, 30 s each.
OUT=$1
export TCPX_P2P_IFNAME=lo
timeout 150 ./.device/unit -q > $OUT/unit.txt 2>&1; echo "unit exit $? $(grep 'test result' $OUT/unit.txt) $(grep -- '--- FAILED' $OUT/unit.txt | tr '\n' ' ')"
grep -A1 "fuzz_tests" $OUT/unit.txt | head -4
for seed in 1 2 3; do
  TCPX_P2P_FUZZ_SECS=60 TCPX_P2P_FUZZ_SEED=$seed timeout 100 ./.device/unit fuzz_tests::a_hostile_senders_parts_land_only_inside_open_gpu_receives --nocapture > $OUT/fuzz_gpu_$seed.txt 2>&1
  echo "gpu seed $seed exit $? $(grep -E 'Seen|test result|panicked' $OUT/fuzz_gpu_$seed.txt | tr '\n' ' ')"
done
for seed in 4 5; do
  TCPX_P2P_FUZZ_SECS=30 TCPX_P2P_FUZZ_SEED=$seed timeout 70 ./.device/unit fuzz_tests::a_hostile_senders_parts_land_only_inside_open_receives --nocapture > $OUT/fuzz_host_$seed.txt 2>&1
  echo "host seed $seed exit $? $(grep -E 'Seen|test result|panicked' $OUT/fuzz_host_$seed.txt | tr '\n' ' ')"
done
echo "total ${SECONDS} s"
