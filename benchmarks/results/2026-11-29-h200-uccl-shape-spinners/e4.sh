#!/bin/bash
# e4 (nvidia-h200, both ranks on GPU 0): cap4 (main: counted spinners) beside try4 (the same with, where
# no spinner fits, the posting thread landing every part sent ahead itself), in UCCL's shape as it is and
# with OMP_NUM_THREADS=1, alternated three times; UCCL's benchmark twice each; main's unit tests twice.
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in cap4 try4; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
SZ=64K,256K,1M,10M,100M
lp() { local tag=$1 b=$2 via=$3; shift 3; local site; eval "site=\$SITE_$b"
  env "$@" PYTHONPATH=$site timeout 90 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --via $via --sizes $SZ --rounds 6 --json $R/loop_$tag.json > $R/loop_$tag.txt 2>&1
  printf "%-16s exit %s GB/s %s\n" $tag $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s ", $4}' $R/loop_$tag.txt)"
}
echo "== UCCL's shape, receiver GB/s (median of 6 rounds) at 64K 256K 1M 10M 100M"
for round in 1 2 3; do
  if [ $((round % 2)) = 1 ]; then order="cap4 try4"; else order="try4 cap4"; fi
  for b in $order; do lp ${b}_$round $b engine X=1; done
  for b in $order; do lp ${b}_omp1_$round $b engine OMP_NUM_THREADS=1; done
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
ub ucap4_1 cap4 X=1; ub utry4_1 try4 X=1; ub utry4_2 try4 X=1; ub ucap4_2 cap4 X=1
rm -f $R/b.py
echo "== main's unit tests (16 CPUs: spinning on), twice"
for i in 1 2; do timeout 120 ./.device/unit -q > $R/unit_$i.txt 2>&1; echo "unit run $i exit $? $(grep 'test result' $R/unit_$i.txt)"; done
tar -C $R -czf $OUT/e4.tgz .
echo "total ${SECONDS} s"
