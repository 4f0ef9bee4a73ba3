#!/bin/bash
# Round 2: the same-host net's one-sided path on GPUs (`8775de1`): the same-host tests
# with CUDA, then the engine's write / read over the same-host net with the
# target copying itself (TCPX_P2P_SAME_HOST_PULL=1) and without (=0),
# alternated, beside write_ipc / read_ipc in the same runs: GPU 0 -> GPU 1,
# and two processes on GPU 0
set -u
D=${FILES:?a folder with the wheel w9/ (`8775de1`)}
. benchmarks/device_env.sh "$(ls $D/w9/*.whl)"
nproc; nvidia-smi -L
timeout 200 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_same_host_net.py -k cuda > $OUT/tests_same_host_net.txt 2>&1; echo "same-host net tests (cuda) exit $?"; tail -3 $OUT/tests_same_host_net.txt
for r in 1 2; do
  for m in 1 0; do
    TCPX_P2P_SAME_HOST_NET=1 TCPX_P2P_SAME_HOST_PULL=$m timeout 80 python3 benchmarks/local_bench.py --device gpu --gpu 0 --peer-gpu 1 --sizes 64K,1M,16M,256M --out $OUT/two_pull${m}_r$r > $OUT/two_pull${m}_r$r.txt 2>&1
    echo "two GPUs pull=$m round $r exit $?"; grep " B " $OUT/two_pull${m}_r$r.txt
  done
done
for m in 1 0; do
  TCPX_P2P_SAME_HOST_NET=1 TCPX_P2P_SAME_HOST_PULL=$m timeout 80 python3 benchmarks/local_bench.py --device gpu --gpu 0 --sizes 64K,1M,16M,256M --out $OUT/one_pull$m > $OUT/one_pull$m.txt 2>&1
  echo "one GPU pull=$m exit $?"; grep " B " $OUT/one_pull$m.txt
done
