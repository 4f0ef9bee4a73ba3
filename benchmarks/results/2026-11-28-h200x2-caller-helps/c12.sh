#!/bin/bash
# (1) Traced (TCPX_P2P_LOG=trace): UCCL's benchmark_uccl.py (v0.1.1, import
# changed only, sync, defaults) twice on `diag` (main + trace points: a
# round of progress over 300 us, callers turned away by a busy engine
# lock, the progress task waiting over 300 us for that lock).
# (2) `fix` (the engine's round lock without hand-off) beside `old` (main),
# alternated: UCCL's benchmark six rounds each, then the core figures
# (gpu_round.sh core) two rounds each.
OUT=$1
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
for b in old diag fix; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L; nproc
ub() { local tag=$1 b=$2 log=$3; shift 3
  local port=$((29500 + RANDOM % 500)) pids=() site; eval "site=\$SITE_$b"
  for r in 0 1; do
    PYTHONPATH=$site TCPX_P2P_LOG=$log MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 60 python3 $R/benchmark_uccl.py --local-gpu-idx $r "$@" > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.log &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  local rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  printf "%-10s exit%s server %s | client %s\n" $tag "$rcs" "$(grep -E '(64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB) :' $R/${tag}_rank1.txt | awk '{print $(NF-4)}' | tr '\n' ' ')" "$(grep -E '(64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB) :' $R/${tag}_rank0.txt | awk '{print $(NF-4)}' | tr '\n' ' ')"
}
echo "GB/s at 64 KB, 256 KB, 1 MB, 10 MB, 100 MB"
ub t1 diag trace; ub t2 diag trace
for t in t1 t2; do for r in 1 0; do
  L=$R/${t}_rank$r.log
  echo "== $t rank $r: long rounds $(grep -c 'long round' $L), busy-engine reports $(grep -c 'engine was busy' $L), lock waits over 300 us $(grep -c 'engine lock waited' $L)"
  grep -E "engine was busy" $L | sed 's/.*away=//' | sort -n | tail -5 | tr '\n' ' '; echo " (largest turned-away counts)"
  grep -E "engine lock waited" $L | sed 's/.*us=\([0-9]*\).*/\1/' | sort -n | tail -8 | tr '\n' ' '; echo " (longest lock waits, us)"
  grep -E "long round" $L | sed 's/.*lat: long round//; s/^.*us=//' | head -0
  grep -E "long round" $L | sed 's/.*\(us=[0-9]*\) \(cmds_us=[0-9]*\) \(post_us=[0-9]*\) \(test_us=[0-9]*\).*/\1 \2 \3 \4/' | sort -t= -k2 -n -r | head -6
done; done
gzip -f $R/t*.log
for round in 1 2 3 4 5 6; do
  if [ $((round % 2)) = 1 ]; then order="old fix"; else order="fix old"; fi
  for b in $order; do ub ${b}_$round $b warn; done
done
tar -C $R -czf $OUT/c12.tgz .
echo "uccl done at ${SECONDS} s"
ROUNDS=2 timeout $((575 - SECONDS)) bash benchmarks/gpu_round.sh "old=$(ls .device/w/old/*.whl) fix=$(ls .device/w/fix/*.whl)" $OUT/core core > /dev/null 2>&1
grep -vE "^\(|^ bytes|^ |^$|results:|^op|tcpx-p2p-bench" $OUT/core/summary.txt | head -40
echo "total ${SECONDS} s"
