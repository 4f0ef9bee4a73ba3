#!/bin/bash
# d1 (nvidia-h200, one GPU, both processes on it): the unit tests once;
# UCCL's benchmark_uccl.py (v0.1.1, import changed only) with every recv /
# send call's wall time and the calling thread's run-queue wait
# (schedwrap.py), I/O threads pinned to the GPU's NUMA node (default)
# beside not pinned (TCPX_P2P_CPU_AFFINITY=off), alternated; then
# sendrecv_loop.py GPU memory with --lag 0 beside --lag 20.
OUT=$1
R=$(mktemp -d -p /dev/shm)
nvidia-smi -L; nproc; lscpu | grep -iE "numa|model name|thread|socket"
for d in /sys/bus/pci/devices/*; do [ "$(cat $d/vendor)" = 0x10de ] && [ "$(cat $d/class)" = 0x030200 ] && echo "GPU $d local_cpulist $(cat $d/local_cpulist)"; done
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/tp/*.whl
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
echo "== unit tests"; timeout 200 ./.device/unit -q --test-threads 4 2>&1 | tail -4
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/b.py
ub() { local tag=$1; shift
  local port=$((29500 + RANDOM % 500)) pids=()
  for r in 0 1; do
    env "$@" PYTHONPATH=$S SCHED_OUT=$R/${tag}_rank$r.json MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 60 python3 .device/schedwrap.py $R/b.py --local-gpu-idx 0 > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.err &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  local rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  printf "%-8s exit%s server %s\n" $tag "$rcs" "$(grep -E '(64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB) :' $R/${tag}_rank1.txt | awk '{print $(NF-4)}' | tr '\n' ' ')"
}
echo "== UCCL benchmark, server rows GB/s at 64 KB, 256 KB, 1 MB, 10 MB, 100 MB"
for round in 1 2 3 4 5; do
  ub gpu_$round TCPX_P2P_CPU_AFFINITY=gpu
  ub off_$round TCPX_P2P_CPU_AFFINITY=off
done
for t in gpu_1 off_1 gpu_2 off_2; do echo "== $t server (rank 1)"; python3 .device/sched.py $R/${t}_rank1.json 262144,1048576; done
echo "== $t client (rank 0)"; python3 .device/sched.py $R/off_2_rank0.json 262144,1048576
echo "uccl done at ${SECONDS} s"
echo "== sendrecv_loop GPU 0 -> GPU 0, lag 0 / 20"
for lag in 0 20 0 20; do
  PYTHONPATH=$S timeout 120 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --sizes 256K,1M --iters 10 --rounds 20 --lag $lag --json $R/loop_lag$lag.json 2>&1 | tail -4
done
tar -C $R -czf $OUT/d1.tgz .
echo "total ${SECONDS} s"
