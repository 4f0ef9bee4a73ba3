#!/bin/bash
# d10 (nvidia-h200, both ranks on GPU 0): new (8d2b9a9: no spinning while runnable threads outnumber the CPUs) beside idle1 (no spinning unless a CPU is idle: runnable threads fewer than CPUs), alternated:
# UCCL benchmark as it is, five rounds each; then the core figures, one round each.
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in new idle1; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/b.py
ub() { local tag=$1 b=$2; shift 2
  local port=$((29500 + RANDOM % 500)) pids=() site; eval "site=\$SITE_$b"
  for r in 0 1; do
    env "$@" PYTHONPATH=$site MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 60 python3 $R/b.py --local-gpu-idx 0 > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.err &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  local rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  printf "%-12s exit%s server %s\n" $tag "$rcs" "$(grep -E '(64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB) :' $R/${tag}_rank1.txt | awk '{print $(NF-4)}' | tr '\n' ' ')"
}
echo "== UCCL benchmark as it is, server rows GB/s at 64 KB, 256 KB, 1 MB, 10 MB, 100 MB"
for round in 1 2 3 4 5; do
  if [ $((round % 2)) = 1 ]; then order="new idle1"; else order="idle1 new"; fi
  for b in $order; do ub ${b}_$round $b X=1; done
done
rm -f $R/b.py; tar -C $R -czf $OUT/d10_uccl.tgz .
echo "uccl done at ${SECONDS} s"
ROUNDS=1 timeout $((560 - SECONDS)) bash benchmarks/gpu_round.sh "new=$(ls .device/w/new/*.whl) idle1=$(ls .device/w/idle1/*.whl)" $OUT/core core > /dev/null 2>&1
grep -E "^== |GB/s|p50|µs" $OUT/core/summary.txt | head -50
echo "total ${SECONDS} s"
