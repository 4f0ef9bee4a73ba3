#!/bin/bash
# f1 (nvidia-h200, both ranks on GPU 0): stage (a GPU message of several parts up to a slice copied out once when no
# CPU is idle) beside head (49e4fa7), alternated: UCCL's shape at 64K/256K/1M/10M six times each with the raw
# reference between; UCCL's benchmark three times each; the unit tests (GPU tests included).
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in head stage; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
timeout 120 ./.device/unit -q > $R/unit.txt 2>&1; echo "unit exit $? $(grep 'test result' $R/unit.txt) $(grep -- '--- FAILED' $R/unit.txt | tr '\n' ' ')"
timeout 60 ./.device/unit several_parts_is_written > $R/unit_new.txt 2>&1; echo "new test exit $? $(grep -E '^test .* (ok|FAILED)$' $R/unit_new.txt)"
lp() { local tag=$1 b=$2 via=$3 shape=$4 sz=$5 rounds=$6; local site; eval "site=\$SITE_$b"
  PYTHONPATH=$site timeout 120 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape $shape --via $via --sizes $sz --rounds $rounds --json $R/${shape}_$tag.json > $R/${shape}_$tag.txt 2>&1
  printf "%-16s exit %s GB/s %s\n" ${shape}_$tag $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s/%sus ", $4, $3}' $R/${shape}_$tag.txt)"
}
echo "== UCCL's shape, receiver GB/s/us (median of 6 rounds) at 64K 256K 1M 10M"
for round in 1 2 3 4 5 6; do
  if [ $SECONDS -gt 380 ]; then echo "(stopped at round $round for time)"; break; fi
  if [ $((round % 2)) = 0 ]; then order="stage head"; else order="head stage"; fi
  for b in $order; do lp ${b}_$round $b engine uccl 64K,256K,1M,10M 6; done
  [ $((round % 2)) = 1 ] && lp raw_$round head raw uccl 64K,256K,1M,10M 6
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
for i in 1 2 3; do
  if [ $((SECONDS)) -gt 520 ]; then break; fi
  ub ustage$i stage X=1; ub uhead$i head X=1
done
rm -f $R/b.py
tar -C $R -czf $OUT/f1.tgz .
echo "total ${SECONDS} s"
