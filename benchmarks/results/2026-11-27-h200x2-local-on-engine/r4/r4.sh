#!/bin/bash
# connect_local's write_ipc / read_ipc on two GPUs: old (the same-host
# connection type of its own) beside new3 (on the engine, with the cheaper
# identity check, one-call GPU registration, no channel read when testing
# an ended push or pull), alternated twice; the same-host net's tests with
# CUDA on new3; local_bench's engine rows over the socket net (4 KiB probe).
set -u
cd "$(dirname "$0")/../../../.."  # the repository; wheels under .device/{old,new3}
OUT=$1
S=$OUT/summary.txt
{ date -u +%FT%TZ; nvidia-smi -L; nproc; } > "$S" 2>&1
W=tcpx_p2p-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl
( . benchmarks/device_env.sh .device/new3/$W
  timeout 150 python3 -m pytest -p no:cacheprovider -q -rs tests/test_same_host_net.py tests/test_local.py -k "gpu or net" > "$OUT/tests_new3.txt" 2>&1
  echo "== tests (new3): status $?" >> "$S"; tail -4 "$OUT/tests_new3.txt" >> "$S" )
lb() { # lb BUILD TAG LIMIT NET ARGS...
  local b=$1 tag=$2 lim=$3 net=$4; shift 4
  ( . benchmarks/device_env.sh .device/$b/$W
    TCPX_P2P_SAME_HOST_NET=$net timeout "$lim" python3 benchmarks/local_bench.py --device gpu "$@" --out /tmp/lb_$tag > "$OUT/$tag.txt" 2>&1
    echo "== $tag: status $?" >> "$S"; cat "$OUT/$tag.txt" >> "$S"
    cp /tmp/lb_$tag/local_bench_gpu.json "$OUT/$tag.json" 2>/dev/null )
}
for r in 1 2; do for b in old new3; do
  lb $b two_gpus_${b}_r$r 60 1 --gpu 0 --peer-gpu 1 --sizes 4K,64K,1M,16M
done; done
lb new3 two_gpus_new3_socket_net 60 0 --gpu 0 --peer-gpu 1 --sizes 4K,64K,1M
tar -C "$OUT" -czf "/tmp/all.tgz" . && mv /tmp/all.tgz "$OUT/all.tgz"
find "$OUT" -mindepth 1 ! -name all.tgz ! -name summary.txt -delete
cat "$S"
