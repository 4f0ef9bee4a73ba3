#!/bin/bash
# The waiting caller runs queued I/O jobs itself (new = aeaf123) beside the
# build before (old = cd20ddc), GPU 0 -> GPU 1, alternated: UCCL's
# benchmark_uccl.py (v0.1.1, import changed only) sync with its defaults,
# three rounds each, async once each; then per-message times of a blocking
# send/recv loop (permsg.py: 64 KiB, 256 KiB, 1 MiB, 16 MiB; 10 each after
# an untimed one), two rounds each. Steps are skipped past 520 s.
OUT=$1
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
for b in old new; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L; nproc
ub() { local tag=$1 b=$2; shift 2
  [ $SECONDS -lt 520 ] || { echo "== $tag skipped (time)"; return; }
  local port=$((29500 + RANDOM % 500)) pids=() site t0=$SECONDS; eval "site=\$SITE_$b"
  for r in 0 1; do
    PYTHONPATH=$site MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 90 python3 $R/benchmark_uccl.py --local-gpu-idx $r "$@" > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.err &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  local rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  echo "== $tag (exit$rcs, $((SECONDS-t0)) s) client | server"; paste <(grep -E "GB/s" $R/${tag}_rank0.txt | sed 's/Gbps.*|  *\([0-9.]* GB\/s\).*/\1/') <(grep -E "GB/s" $R/${tag}_rank1.txt | sed 's/.*Gbps |  *\([0-9.]* GB\/s\).*/\1/')
}
for round in 1 2 3; do for b in old new; do ub ${b}_sync$round $b; done; done
for b in new old; do ub ${b}_async $b --async-api; done
for round in 1 2; do
  for b in new old; do
    [ $SECONDS -lt 520 ] || { echo "== permsg $b round $round skipped (time)"; continue; }
    eval "site=\$SITE_$b"
    echo "== permsg $b round $round"; PYTHONPATH=$site SIZES=65536,262144,1048576,16777216 N=10 timeout 60 python3 .device/permsg.py 2>&1 | grep -v Warning
  done
done
tar -C $R -czf $OUT/c8.tgz .
echo "total ${SECONDS} s"
