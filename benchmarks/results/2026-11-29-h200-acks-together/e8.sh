#!/bin/bash
# e8 (nvidia-h200, both ranks on GPU 0): where 256 KB / 1 MB go in UCCL's shape as it is: each side's thread groups'
# run and CPU-wait time over the timed calls (--sched), ours beside the raw reference, alternated; then one traced run.
OUT=$1
R=$(mktemp -d -p /dev/shm)
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/cur/*.whl
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo PYTHONPATH=$S
nproc; which perf; cat /proc/loadavg
lp() { local tag=$1 via=$2; shift 2
  env "$@" timeout 90 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --via $via --sizes 64K,256K,1M,10M --rounds 6 --sched --json $R/loop_$tag.json > $R/loop_$tag.txt 2>&1
  echo "== $tag exit $?"; cat $R/loop_$tag.txt
}
for round in 1 2; do lp eng_$round engine X=1; lp raw_$round raw X=1; done
lp eng_omp1 engine OMP_NUM_THREADS=1
TCPX_P2P_LOG=trace timeout 90 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --sizes 256K --rounds 4 --sched > $R/trace_loop.txt 2> $R/trace.log
echo "== traced exit $?"; cat $R/trace_loop.txt
python3 benchmarks/lat_breakdown.py $R/trace.log > $R/trace_breakdown.txt 2>&1; head -30 $R/trace_breakdown.txt
gzip $R/trace.log
tar -C $R -czf $OUT/e8.tgz .
echo "total ${SECONDS} s"
