#!/bin/bash
# f2 (nvidia-h200, both ranks on GPU 0): head (49e4fa7), stage (a GPU message of several parts copied out once with no CPU idle), poster (with no CPU idle the receiver's posting thread lands every part of its receive whose bytes are here, reading headers its streams' tasks have not read, kicking none first)
# alternated: UCCL's shape at 64K/256K/1M/10M eight times each, the raw reference every other round; traced runs; UCCL's benchmark; unit tests.
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in head stage poster; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
timeout 120 ./.device/unit -q > $R/unit.txt 2>&1; echo "unit exit $? $(grep 'test result' $R/unit.txt) $(grep -- '--- FAILED' $R/unit.txt | tr '\n' ' ')"
lp() { local tag=$1 b=$2 via=$3 shape=$4 sz=$5 rounds=$6; local site; eval "site=\$SITE_$b"
  PYTHONPATH=$site timeout 120 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape $shape --via $via --sizes $sz --rounds $rounds --json $R/${shape}_$tag.json > $R/${shape}_$tag.txt 2>&1
  printf "%-16s exit %s GB/s %s\n" ${shape}_$tag $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s/%sus ", $4, $3}' $R/${shape}_$tag.txt)"
}
echo "== UCCL's shape, receiver GB/s/us (median of 6 rounds) at 64K 256K 1M 10M"
for round in 1 2 3 4 5 6 7 8; do
  if [ $SECONDS -gt 330 ]; then echo "(stopped at round $round for time)"; break; fi
  case $((round % 3)) in 0) order="stage poster head";; 1) order="head stage poster";; 2) order="poster head stage";; esac
  for b in $order; do lp ${b}_$round $b engine uccl 64K,256K,1M,10M 6; done
  [ $((round % 2)) = 1 ] && lp raw_$round head raw uccl 64K,256K,1M,10M 6
done
echo "loops done at ${SECONDS} s"
for b in head poster; do site=; eval "site=\$SITE_$b"
  TCPX_P2P_LOG=trace PYTHONPATH=$site timeout 60 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --sizes 256K,1M --rounds 3 --sched > $R/trace_$b.txt 2>&1
  echo "trace $b exit $? poster-landed $(grep -c 'rx landed by the poster' $R/trace_$b.txt) task-runs $(grep -c 'rx task runs' $R/trace_$b.txt) headers $(grep -c 'lat: rx header' $R/trace_$b.txt) $(grep -E '^ *(262144|1048576) ' $R/trace_$b.txt | awk '{printf "%s GB/s ", $4}')"
  gzip $R/trace_$b.txt
done
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
  ub ustage$i stage X=1; ub uhead$i head X=1; ub uposter$i poster X=1
done
rm -f $R/b.py
tar -C $R -czf $OUT/f2.tgz .
echo "total ${SECONDS} s"
