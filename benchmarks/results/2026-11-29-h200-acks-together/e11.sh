#!/bin/bash
# e11 (nvidia-h200, both ranks on GPU 0): flush (the posting thread waits for its parts' copies to the device once, after
# landing them all, not after each) beside ack (receives acknowledged together), UCCL's shape as it is (--sched) alternated
# three times, OMP_NUM_THREADS=1 once each, the raw reference twice; traced runs of flush at 64K and 256K; UCCL's benchmark; flush's unit tests.
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in ack flush; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
SZ=64K,256K,1M,10M
lp() { local tag=$1 b=$2 via=$3; shift 3; local site; eval "site=\$SITE_$b"
  env "$@" PYTHONPATH=$site timeout 90 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --via $via --sizes $SZ --rounds 6 --sched --json $R/loop_$tag.json > $R/loop_$tag.txt 2>&1
  printf "%-14s exit %s GB/s %s\n" $tag $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s ", $4}' $R/loop_$tag.txt)"
}
echo "== UCCL's shape, receiver GB/s (median of 6 rounds) at $SZ"
for round in 1 2 3; do
  if [ $round = 2 ]; then order="flush ack"; else order="ack flush"; fi
  for b in $order; do lp ${b}_$round $b engine X=1; done
  [ $round != 3 ] && lp raw_$round flush raw X=1
done
for b in ack flush; do lp ${b}_omp1 $b engine OMP_NUM_THREADS=1; done
for n in 64K 256K; do
  TCPX_P2P_LOG=trace PYTHONPATH=$SITE_flush timeout 90 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --sizes $n --rounds 4 --sched > $R/trace_$n.txt 2> $R/trace_$n.log
  echo "traced $n exit $? $(awk 'NR==2 {print $4}' $R/trace_$n.txt) GB/s"
  python3 benchmarks/lat_breakdown.py $R/trace_$n.log > $R/trace_${n}_breakdown.txt 2>&1; gzip $R/trace_$n.log
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
ub uflush flush X=1; ub uack ack X=1; ub uflush2 flush X=1
rm -f $R/b.py
timeout 90 ./.device/unit -q > $R/unit.txt 2>&1; echo "unit exit $? $(grep 'test result' $R/unit.txt) $(grep -- '--- FAILED' $R/unit.txt | tr '\n' ' ')"
tar -C $R -czf $OUT/e11.tgz .
echo "loops+unit at ${SECONDS} s"
echo "total ${SECONDS} s"
