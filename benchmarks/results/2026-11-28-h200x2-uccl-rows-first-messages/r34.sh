#!/bin/bash
# Traced: UCCL's benchmark (v0.1.1, import changed only), sync, 1 MB only,
# 40 messages, x1 (a send ends once its message landed: no run-ahead) and h0
# (HEAD), both ranks traced, logs kept in memory until packed.
OUT=$1
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
for b in h0 x1; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ub() { local tag=$1 b=$2; shift 2
  local port=$((29500 + RANDOM % 500)) pids=() site; eval "site=\$SITE_$b"
  for r in 0 1; do
    PYTHONPATH=$site TCPX_P2P_LOG=trace MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 120 python3 $R/benchmark_uccl.py --local-gpu-idx $r "$@" > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.log &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  local rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  echo "== $tag (exit$rcs) client | server"; paste <(grep -E "GB/s" $R/${tag}_rank0.txt | sed 's/Gbps.*|  *\([0-9.]* GB\/s\).*/\1/') <(grep -E "GB/s" $R/${tag}_rank1.txt | sed 's/.*Gbps |  *\([0-9.]* GB\/s\).*/\1/')
}
ub x1_1m x1 --sizes 65536,1048576 --iters 40
ub h0_1m h0 --sizes 65536,1048576 --iters 40
tar -C $R -czf $OUT/r34.tgz .
