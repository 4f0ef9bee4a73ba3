#!/bin/bash
# Traced (TCPX_P2P_LOG=trace, logs in memory): UCCL's benchmark_uccl.py
# (v0.1.1, import changed only), sync, its default sizes and iterations,
# new build (the caller helps), twice; then the same untraced twice.
OUT=$1
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
for b in new; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ub() { local tag=$1 b=$2 log=$3; shift 3
  local port=$((29500 + RANDOM % 500)) pids=() site; eval "site=\$SITE_$b"
  for r in 0 1; do
    PYTHONPATH=$site TCPX_P2P_LOG=$log MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 90 python3 $R/benchmark_uccl.py --local-gpu-idx $r "$@" > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.log &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  local rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  echo "== $tag (exit$rcs) client | server"; paste <(grep -E "GB/s" $R/${tag}_rank0.txt | sed 's/Gbps.*|  *\([0-9.]* GB\/s\).*/\1/') <(grep -E "GB/s" $R/${tag}_rank1.txt | sed 's/.*Gbps |  *\([0-9.]* GB\/s\).*/\1/')
}
ub t1 new trace
ub t2 new trace
ub u1 new warn
ub u2 new warn
for t in t1 t2; do
  echo "== $t receives over 0.5 ms (server)"; python3 .device/traces.py receives $R/${t}_rank1.log 55 2>&1 | tail -40
  echo "== $t quiet"; python3 .device/traces.py quiet $R/${t}_rank1.log $R/${t}_rank0.log 2>&1 | tail -15
  echo "caller ran jobs: server $(grep -c 'caller runs a job' $R/${t}_rank1.log) client $(grep -c 'caller runs a job' $R/${t}_rank0.log)"
done
tar -C $R -czf $OUT/c9.tgz .
echo "total ${SECONDS} s"
