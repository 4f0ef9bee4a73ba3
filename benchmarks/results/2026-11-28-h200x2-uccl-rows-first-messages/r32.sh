#!/bin/bash
# Does the machine itself stall? A thread spinning on the clock counts the
# gaps it was not run for: alone, beside UCCL's benchmark (v0.1.1, sync,
# defaults) untraced, and beside a traced run whose logs go to /dev/shm.
OUT=$1
W=$(ls .device/w/h0/*.whl)
. benchmarks/device_env.sh "$W" >/dev/null 2>&1
R=$(mktemp -d -p /dev/shm)
gcc -O2 -o $R/stall .device/stall.c
grep -E "^cpu " /proc/stat
$R/stall 4 alone 2> $R/alone.gaps
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
ub() { local tag=$1; shift
  local port=$((29500 + RANDOM % 500)) pids=()
  $R/stall 9 "stall beside $tag" 2> $R/$tag.gaps & local sp=$!
  for r in 0 1; do
    env "$@" MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 120 python3 $R/benchmark_uccl.py --local-gpu-idx $r > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.log &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  for p in "${pids[@]}"; do wait $p; done; wait $sp
  echo "== $tag"; paste <(grep -E "GB/s" $R/${tag}_rank0.txt | sed 's/Gbps.*|  *\([0-9.]* GB\/s\)/\1/') <(grep -E "GB/s" $R/${tag}_rank1.txt | sed 's/.*Gbps |//')
}
ub plain X=1
ub traced TCPX_P2P_LOG=trace
grep -E "^cpu " /proc/stat
tar -C $R -czf $OUT/r32.tgz --exclude=stall .
