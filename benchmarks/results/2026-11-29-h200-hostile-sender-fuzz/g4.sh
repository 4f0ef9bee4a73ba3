#!/bin/bash
# g4 (nvidia-h200): the build where a wake reaches a task parked on its descriptor (c908c80) and a failed receive
# waits for its GPU copies (be9326e): the unit tests; the two cases that hung in g3 played again (seed 12 case 261,
# seed 13 case 573, 30 s each); the hostile-sender test into GPU memory, seeds 11-13, 60 s each; the core figures,
# this build beside the build before the session's engine changes (head = cdcd9a5), alternated.
OUT=$1
export TCPX_P2P_IFNAME=lo PYTHONUNBUFFERED=1
T=fuzz_tests::a_hostile_senders_parts_land_only_inside_open_gpu_receives
timeout 150 ./.device/unit -q > $OUT/unit.txt 2>&1; echo "unit exit $? $(grep 'test result' $OUT/unit.txt) $(grep -- '--- FAILED' $OUT/unit.txt | tr '\n' ' ')"
for sc in 12:261 13:573; do
  TCPX_P2P_FUZZ_SECS=30 TCPX_P2P_FUZZ_SEED=${sc%:*} TCPX_P2P_FUZZ_CASE=${sc#*:} timeout 60 ./.device/unit $T --nocapture > $OUT/replay_$sc.txt 2>&1
  echo "replay $sc exit $? $(grep -E 'Seen|test result' $OUT/replay_$sc.txt | tr '\n' ' ')"; grep -A1 panicked $OUT/replay_$sc.txt | tail -1 | cut -c1-2000
done
for seed in 11 12 13; do
  TCPX_P2P_FUZZ_SECS=60 TCPX_P2P_FUZZ_SEED=$seed timeout 100 ./.device/unit $T --nocapture > $OUT/fuzz_gpu_$seed.txt 2>&1
  echo "gpu seed $seed exit $? $(grep -E 'Seen|test result' $OUT/fuzz_gpu_$seed.txt | tr '\n' ' ')"; grep -A1 panicked $OUT/fuzz_gpu_$seed.txt | tail -1 | cut -c1-2000
done
timeout $((570 - SECONDS)) bash benchmarks/gpu_round.sh "head=$(ls .device/w/head/*.whl) new=$(ls .device/w/g4/*.whl)" $OUT/core core > /dev/null 2>&1
echo "core exit $?"; grep -E "^== |^ *(write|[0-9])" $OUT/core/summary.txt | head -40
echo "total ${SECONDS} s"
