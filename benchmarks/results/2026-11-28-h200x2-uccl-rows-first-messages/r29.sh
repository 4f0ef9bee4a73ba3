#!/bin/bash
# HEAD (2a8e1ff) on two GPUs: UCCL's benchmark_uccl.py (v0.1.1, import
# changed only) with its defaults, sync twice and async once untraced, then
# sync once with both ranks traced (a per-message timeline of where the
# 256 KB - 10 MB rows' time goes); then NIXL 131,072 x 4 KiB / 16 KiB
# WRITE and READ paired against one descriptor, three calls of two rounds.
OUT=$1
W=$(ls .device/w/h0/*.whl)
. benchmarks/device_env.sh "$W" >/dev/null 2>&1; pair_gpus
nvidia-smi -L; nproc
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $OUT/benchmark_uccl.py
ub() { # tag, extra env (k=v) ..., -- bench args
  local tag=$1; shift; local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  local port=$((29500 + RANDOM % 500)) pids=() rcs=""
  for r in 0 1; do
    env "${envs[@]}" MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 150 python3 $OUT/benchmark_uccl.py --local-gpu-idx $r "$@" > $OUT/${tag}_rank$r.txt 2> $OUT/${tag}_rank$r.log &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  echo "== $tag exit:$rcs"; paste <(grep -E "GB/s" $OUT/${tag}_rank0.txt) <(grep -E "GB/s" $OUT/${tag}_rank1.txt | sed 's/.*Gbps |//')
}
ub sync1 X=1 --
ub sync2 X=1 --
ub async1 X=1 -- --async-api
ub traced TCPX_P2P_LOG=trace --
gzip -f $OUT/*.log
n=$(mktemp -d); tar -C "$n" -xf .device/nixl.tgz
export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):$PYTHONPATH
for round in 1 2 3; do
  echo "== vllm round $round"
  timeout 110 python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out $OUT/vllm_$round --sizes 4K --kv 131072x4K,131072x16K --backends TCPX_P2P --telemetry --paired --notifs 0 --rounds 2 --bytes-per-row 6G > $OUT/vllm_$round.txt 2>&1
  echo rc=$?; grep -E "posting|many descriptors|paired" $OUT/vllm_$round.txt | sed 's/(once per request, not in GB\/s); //; s/prep_xfer_dlist.*make_prepped_xfer [0-9.]* ms//'
done
