#!/bin/bash
# f4 (nvidia-h200, both ranks on GPU 0): final (540c3de) beside head (49e4fa7): the unit tests (GPU tests included),
# the core figures one round each alternated, UCCL's benchmark twice each.
OUT=$1
R=$(mktemp -d -p /dev/shm)
for b in head final; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
timeout 120 ./.device/unit -q > $R/unit.txt 2>&1; echo "unit exit $? $(grep 'test result' $R/unit.txt) $(grep -- '--- FAILED' $R/unit.txt | tr '\n' ' ')"
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
ub ufinal1 final X=1; ub uhead1 head X=1; ub uhead2 head X=1; ub ufinal2 final X=1
rm -f $R/b.py
tar -C $R -czf $OUT/f4.tgz .
echo "unit+ub at ${SECONDS} s"
ROUNDS=1 timeout $((570 - SECONDS)) bash benchmarks/gpu_round.sh "head=$(ls .device/w/head/*.whl) final=$(ls .device/w/final/*.whl)" $OUT/core core > /dev/null 2>&1
echo "core exit $?"; grep -E "^== |^ *(write|send|kv|[0-9])" $OUT/core/summary.txt | head -50
echo "total ${SECONDS} s"
