#!/bin/bash
# e2 (nvidia-h200, both ranks on GPU 0): counted spinners (cap2: at most half the CPUs other threads
# leave; cap4: a quarter) beside main and beside no spinning at all (off), in UCCL's shape
# (sendrecv_loop --shape uccl), as it is and with OMP_NUM_THREADS=1, alternated twice; the raw TCP
# reference; UCCL's benchmark as it is once each; then the core figures, main beside cap2.
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in main cap2 cap4; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
SZ=64K,256K,1M,10M,100M
lp() { local tag=$1 b=$2 via=$3; shift 3; local site; eval "site=\$SITE_$b"
  env "$@" PYTHONPATH=$site timeout 90 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --via $via --sizes $SZ --rounds 6 --json $R/loop_$tag.json > $R/loop_$tag.txt 2>&1
  printf "%-16s exit %s GB/s %s\n" $tag $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s ", $4}' $R/loop_$tag.txt)"
}
echo "== UCCL's shape, receiver GB/s (median of 6 rounds) at 64K 256K 1M 10M 100M"
for round in 1 2; do
  lp main_$round main engine X=1
  lp cap2_$round cap2 engine X=1
  lp cap4_$round cap4 engine X=1
  lp off_$round main engine TCPX_P2P_SPIN_US=0 TCPX_P2P_WAIT_SPIN_US=0
  lp raw_$round main raw X=1
  lp main_omp1_$round main engine OMP_NUM_THREADS=1
  lp cap2_omp1_$round cap2 engine OMP_NUM_THREADS=1
  lp off_omp1_$round main engine OMP_NUM_THREADS=1 TCPX_P2P_SPIN_US=0 TCPX_P2P_WAIT_SPIN_US=0
done
echo "loops done at ${SECONDS} s"
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
ub umain main X=1; ub ucap2 cap2 X=1; ub ucap4 cap4 X=1
rm -f $R/b.py; tar -C $R -czf $OUT/e2.tgz .
echo "uccl done at ${SECONDS} s"
ROUNDS=1 timeout $((570 - SECONDS)) bash benchmarks/gpu_round.sh "main=$(ls .device/w/main/*.whl) cap2=$(ls .device/w/cap2/*.whl)" $OUT/core core > /dev/null 2>&1
grep -E "^== |GB/s|p50|µs" $OUT/core/summary.txt | head -50
echo "total ${SECONDS} s"
