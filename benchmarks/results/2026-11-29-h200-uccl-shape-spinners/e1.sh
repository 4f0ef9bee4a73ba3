#!/bin/bash
# e1 (nvidia-h200, both ranks on GPU 0): UCCL's shape (sendrecv_loop --shape uccl) over the engine
# (main; main with stream/worker spins off; with the caller's wait spin off; with both off; the try
# branch) and over the raw TCP reference, alternated twice; the same with OMP_NUM_THREADS=1 for main
# and raw; then UCCL's benchmark as it is (main, try, main with no spinning), two rounds each.
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in main try; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
SZ=64K,256K,1M,10M,100M
lp() { local tag=$1 b=$2 via=$3; shift 3; local site; eval "site=\$SITE_$b"
  env "$@" PYTHONPATH=$site timeout 90 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --via $via --sizes $SZ --rounds 6 --json $R/loop_$tag.json > $R/loop_$tag.txt 2>&1
  printf "%-16s exit %s GB/s %s\n" $tag $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s ", $4}' $R/loop_$tag.txt)"
}
echo "== UCCL's shape, receiver GB/s (median of 6 rounds) at 64K 256K 1M 10M 100M"
for round in 1 2; do
  lp main_$round main engine X=1
  lp spin0_$round main engine TCPX_P2P_SPIN_US=0
  lp wait0_$round main engine TCPX_P2P_WAIT_SPIN_US=0
  lp off_$round main engine TCPX_P2P_SPIN_US=0 TCPX_P2P_WAIT_SPIN_US=0
  lp try_$round try engine X=1
  lp raw_$round main raw X=1
  lp main_omp1_$round main engine OMP_NUM_THREADS=1
  lp raw_omp1_$round main raw OMP_NUM_THREADS=1
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
for round in 1 2; do
  [ $SECONDS -gt 480 ] && break
  ub umain_$round main X=1; ub utry_$round try X=1; ub uoff_$round main TCPX_P2P_SPIN_US=0 TCPX_P2P_WAIT_SPIN_US=0
done
rm -f $R/b.py; tar -C $R -czf $OUT/e1.tgz .
echo "total ${SECONDS} s"
