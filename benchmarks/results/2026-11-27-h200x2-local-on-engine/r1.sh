#!/bin/bash
# The same-host path on two GPUs, connect_local on the engine (new) beside
# the old same-host connection type (old), builds alternated:
#   bash r1.sh OUTDIR   (wheels under .device/old and .device/new)
# 1. the new build's same-host tests with CUDA (test_local.py,
#    test_same_host_net.py);
# 2. benchmarks/local_bench.py GPU 0 -> GPU 1, TCPX_P2P_SAME_HOST_NET=1,
#    old / new alternated twice; then on one GPU, old / new once.
set -u
cd "$(dirname "$0")/../../.."  # the repository; wheels under .device/old and .device/new
OUT=$1
S=$OUT/summary.txt
{ date -u +%FT%TZ; nvidia-smi -L; nproc; } > "$S" 2>&1
( . benchmarks/device_env.sh .device/new/*.whl
  timeout 200 python3 -m pytest -p no:cacheprovider -q -rs tests/test_local.py tests/test_same_host_net.py > "$OUT/tests_new.txt" 2>&1
  echo "== tests (new): status $?" >> "$S"; tail -8 "$OUT/tests_new.txt" >> "$S" )
lb() { # lb BUILD TAG LIMIT ARGS...
  local b=$1 tag=$2 lim=$3; shift 3
  ( . benchmarks/device_env.sh .device/$b/*.whl
    TCPX_P2P_SAME_HOST_NET=1 timeout "$lim" python3 benchmarks/local_bench.py --device gpu "$@" --out /tmp/lb_$tag > "$OUT/$tag.txt" 2>&1
    echo "== $tag: status $?" >> "$S"; cat "$OUT/$tag.txt" >> "$S"
    cp /tmp/lb_$tag/local_bench_gpu.json "$OUT/$tag.json" 2>/dev/null )
}
for r in 1 2; do for b in old new; do
  lb $b two_gpus_${b}_r$r 80 --gpu 0 --peer-gpu 1 --sizes 4K,64K,1M,16M,256M
done; done
for b in old new; do
  lb $b one_gpu_$b 70 --gpu 0 --sizes 4K,64K,1M,16M,256M
done
tar -C "$OUT" -czf "$OUT/all.tgz" --exclude all.tgz . 2>/dev/null
cat "$S"
