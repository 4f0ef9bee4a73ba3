#!/bin/bash
# g3 (nvidia-h200): the build where a part's copies to the GPU count as landing into its receive until they have
# landed (a failure is reported only after), and a task that ends flushes its copies first: the unit tests; the
# hostile-sender fuzz test into GPU memory, seeds 11-13, 80 s each (a hang prints the comm's state); the GPU
# end-to-end tests of the API over the socket net.
OUT=$1
export TCPX_P2P_IFNAME=lo PYTHONUNBUFFERED=1
timeout 150 ./.device/unit -q > $OUT/unit.txt 2>&1; echo "unit exit $? $(grep 'test result' $OUT/unit.txt) $(grep -- '--- FAILED' $OUT/unit.txt | tr '\n' ' ')"
for seed in 11 12 13; do
  TCPX_P2P_FUZZ_SECS=80 TCPX_P2P_FUZZ_SEED=$seed timeout 120 ./.device/unit fuzz_tests::a_hostile_senders_parts_land_only_inside_open_gpu_receives --nocapture > $OUT/fuzz_gpu_$seed.txt 2>&1
  echo "gpu seed $seed exit $? $(grep -E 'Seen|test result|panicked' $OUT/fuzz_gpu_$seed.txt | tr '\n' ' ')"
  grep -A1 panicked $OUT/fuzz_gpu_$seed.txt | tail -1 | cut -c1-3000
done
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/g3/*.whl
PYTHONPATH=$S TCPX_P2P_NET=socket timeout 200 python3 -m pytest -p no:cacheprovider -q -rs tests/test_api.py -k cuda > $OUT/api_cuda.txt 2>&1
echo "api cuda exit $? $(tail -1 $OUT/api_cuda.txt)"
echo "total ${SECONDS} s"
