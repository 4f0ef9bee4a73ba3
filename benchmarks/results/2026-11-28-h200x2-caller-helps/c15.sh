#!/bin/bash
# Traced (TCPX_P2P_LOG=trace): UCCL's benchmark_uccl.py (v0.1.1, import
# changed only, sync, defaults) twice on main with trace points in a
# receive's posting (where it lands parts already arrived); every posting
# round over 500 us with the posting thread's events in it.
OUT=$1
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/tp/*.whl
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for t in t1 t2; do
  port=$((29500 + RANDOM % 500)); pids=()
  for r in 0 1; do
    PYTHONPATH=$S TCPX_P2P_LOG=trace MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 60 python3 $R/benchmark_uccl.py --local-gpu-idx $r > $R/${t}_rank$r.txt 2> $R/${t}_rank$r.log &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  for p in "${pids[@]}"; do wait $p; done
  echo "== $t server rows: $(grep -E '(64.0 KB|256.0 KB|1.0 MB|10.0 MB) :' $R/${t}_rank1.txt | awk '{print $(NF-4)}' | tr '\n' ' ')"
  python3 .device/poster.py $R/${t}_rank1.log 2>&1 | head -90
done
gzip -f $R/*.log; tar -C $R -czf $OUT/c15.tgz .
echo "total ${SECONDS} s"
