#!/bin/bash
# connect_local's write_ipc / read_ipc on two GPUs: old (the same-host
# connection type of its own), new (on the engine), new2 (new + a cheaper
# identity check and GPU registration in one driver call), alternated
# twice; the new2 build's same-host tests with CUDA; and where a 4 KiB
# engine write over the same-host net goes on GPUs (traced).
set -u
cd "$(dirname "$0")/../../../.."  # the repository; wheels under .device/{old,new,new2}
OUT=$1
S=$OUT/summary.txt
{ date -u +%FT%TZ; nvidia-smi -L; nproc; } > "$S" 2>&1
W=tcpx_p2p-0.1.0-cp39-abi3-manylinux_2_34_x86_64.whl
( . benchmarks/device_env.sh .device/new2/$W
  timeout 200 python3 -m pytest -p no:cacheprovider -q -rs tests/test_local.py tests/test_same_host_net.py tests/test_api.py -k "allocation or gpu or cuda" > "$OUT/tests_new2.txt" 2>&1
  echo "== tests (new2): status $?" >> "$S"; tail -6 "$OUT/tests_new2.txt" >> "$S" )
lb() { # lb BUILD TAG LIMIT ARGS...
  local b=$1 tag=$2 lim=$3; shift 3
  ( . benchmarks/device_env.sh .device/$b/$W
    TCPX_P2P_SAME_HOST_NET=1 timeout "$lim" python3 benchmarks/local_bench.py --device gpu "$@" --out /tmp/lb_$tag > "$OUT/$tag.txt" 2>&1
    echo "== $tag: status $?" >> "$S"; cat "$OUT/$tag.txt" >> "$S"
    cp /tmp/lb_$tag/local_bench_gpu.json "$OUT/$tag.json" 2>/dev/null )
}
for r in 1 2; do for b in old new new2; do
  lb $b two_gpus_${b}_r$r 60 --gpu 0 --peer-gpu 1 --sizes 4K,64K,1M,16M
done; done
( . benchmarks/device_env.sh .device/new2/$W
  for net in 0 1; do
    TCPX_P2P_SAME_HOST_NET=$net timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus 0,1 --inflight 1 --op write --sizes 4K,64K,1M --iters 200 --rounds 1 > "$OUT/pair_net$net.txt" 2>&1
    echo "== pair write, TCPX_P2P_SAME_HOST_NET=$net: status $?" >> "$S"; grep -E "^write" "$OUT/pair_net$net.txt" >> "$S"
  done
  TCPX_P2P_SAME_HOST_NET=1 TCPX_P2P_LOG=trace timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus 0,1 --inflight 1 --op write --sizes 4K --iters 100 --rounds 1 > "$OUT/trace_4k.table" 2> "$OUT/trace_4k.log"
  timeout 30 python3 benchmarks/lat_breakdown.py "$OUT/trace_4k.log" > "$OUT/trace_4k.txt" 2>&1
  echo "== traced 4K write on the same-host net" >> "$S"; tail -30 "$OUT/trace_4k.txt" >> "$S"
  gzip -f "$OUT/trace_4k.log" )
tar -C "$OUT" -czf "/tmp/all.tgz" . && mv /tmp/all.tgz "$OUT/all.tgz"
find "$OUT" -mindepth 1 ! -name all.tgz ! -name summary.txt -delete
cat "$S"
