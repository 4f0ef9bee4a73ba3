#!/bin/bash
# g6 (nvidia-h200, both ranks on GPU 0): head (cdcd9a5, before this work) beside new (be9326e: a kick reaches a
# task parked in the poller; a stranded receive fails; failed GPU receives wait for their copies), alternated:
# UCCL's shape at 64K/256K/1M/10M six times each, plain TCP every other round; UCCL's benchmark as it is, 3 each.
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in head g4; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
lp() { local tag=$1 b=$2 via=$3 sz=$4 rounds=$5; local site; eval "site=\$SITE_$b"
  PYTHONPATH=$site timeout 120 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --via $via --sizes $sz --rounds $rounds --json $R/uccl_$tag.json > $R/uccl_$tag.txt 2>&1
  printf "%-12s exit %s GB/s %s\n" $tag $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s/%sus ", $4, $3}' $R/uccl_$tag.txt)"
}
echo "== UCCL's shape, receiver GB/s/us (median of 6 rounds) at 64K 256K 1M 10M"
for round in 1 2 3 4 5 6; do
  if [ $SECONDS -gt 260 ]; then echo "(stopped at round $round for time)"; break; fi
  if [ $((round % 2)) = 0 ]; then order="g4 head"; else order="head g4"; fi
  for b in $order; do lp ${b}_$round $b engine 64K,256K,1M,10M 6; done
  [ $((round % 2)) = 1 ] && lp raw_$round head raw 64K,256K,1M,10M 6
done
echo "loops done at ${SECONDS} s"
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/b.py
ub() { local tag=$1 b=$2
  local port=$((29500 + RANDOM % 500)) pids=() site; eval "site=\$SITE_$b"
  for r in 0 1; do
    PYTHONPATH=$site MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 60 python3 $R/b.py --local-gpu-idx 0 > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.err &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  local rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  printf "%-10s exit%s server %s\n" $tag "$rcs" "$(grep -E '(64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB) :' $R/${tag}_rank1.txt | awk '{print $(NF-4)}' | tr '\n' ' ')"
}
echo "== UCCL benchmark as it is, server rows GB/s at 64 KB, 256 KB, 1 MB, 10 MB, 100 MB"
for i in 1 2 3; do
  if [ $SECONDS -gt 430 ]; then break; fi
  ub uhead$i head; ub unew$i g4
done
rm -f $R/b.py
tar -C $R -czf $OUT/g6.tgz .
echo "total ${SECONDS} s"
