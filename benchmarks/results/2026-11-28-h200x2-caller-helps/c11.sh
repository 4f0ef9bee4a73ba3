#!/bin/bash
# new (the caller helps, aeaf123 + its summons fix) beside old (cd20ddc), GPU 0 -> GPU 1,
# alternated: UCCL's benchmark_uccl.py (v0.1.1, import changed only, sync,
# its defaults) eight rounds each (server and client rows at 64 KB - 100
# MB); then the core figures (benchmarks/gpu_round.sh core), two rounds each.
OUT=$1
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
for b in old new; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L; nproc
ub() { local tag=$1 b=$2; shift 2
  local port=$((29500 + RANDOM % 500)) pids=() site; eval "site=\$SITE_$b"
  for r in 0 1; do
    PYTHONPATH=$site MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 60 python3 $R/benchmark_uccl.py --local-gpu-idx $r "$@" > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.err &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  local rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  printf "%-10s exit%s server %s | client %s\n" $tag "$rcs" "$(grep -E '(64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB) :' $R/${tag}_rank1.txt | awk '{print $(NF-4)}' | tr '\n' ' ')" "$(grep -E '(64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB) :' $R/${tag}_rank0.txt | awk '{print $(NF-4)}' | tr '\n' ' ')"
}
echo "GB/s at 64 KB, 256 KB, 1 MB, 10 MB, 100 MB"
for round in 1 2 3 4 5 6 7 8; do
  if [ $((round % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for b in $order; do ub ${b}_$round $b; done
done
tar -C $R -czf $OUT/c11_uccl.tgz .
echo "uccl done at ${SECONDS} s"
ROUNDS=2 timeout $((570 - SECONDS)) bash benchmarks/gpu_round.sh "old=$(ls .device/w/old/*.whl) new=$(ls .device/w/new/*.whl)" $OUT/core core > /dev/null 2>&1
grep -E "^== |GB/s|p50|µs" $OUT/core/summary.txt | head -60
echo "total ${SECONDS} s"
