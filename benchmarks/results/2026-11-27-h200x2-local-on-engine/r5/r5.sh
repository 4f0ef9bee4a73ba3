#!/bin/bash
# Why local_bench's 4 KiB engine write takes ~190 us on two GPUs where
# tcpx-p2p-bench pair takes ~32: local_bench with and without its plain
# reference copy (which gives this process a CUDA context on the peer's
# GPU), socket net and same-host net, alternated twice.
set -u
cd "$(dirname "$0")/../../../.."  # the repository; the wheel under .device/new3
OUT=$1
S=$OUT/summary.txt
{ date -u +%FT%TZ; nvidia-smi -L; nproc; } > "$S" 2>&1
W=tcpx_p2p-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl
. benchmarks/device_env.sh .device/new3/$W
for r in 1 2; do for net in 0 1; do for plain in with without; do
  tag=r${r}_net${net}_${plain}_plain; flag=""; [ $plain = without ] && flag=--no-plain
  TCPX_P2P_SAME_HOST_NET=$net timeout 50 python3 benchmarks/local_bench.py --device gpu --gpu 0 --peer-gpu 1 --sizes 4K,64K,1M $flag --out /tmp/lb_$tag > "$OUT/$tag.txt" 2>&1
  echo "== $tag: status $?" >> "$S"; grep " B " "$OUT/$tag.txt" >> "$S"
done; done; done
tar -C "$OUT" -czf /tmp/all.tgz . && mv /tmp/all.tgz "$OUT/all.tgz"
find "$OUT" -mindepth 1 ! -name all.tgz ! -name summary.txt -delete
cat "$S"
