#!/bin/bash
# d7 (nvidia-h200, both ranks on GPU 0): UCCL benchmark as it is beside no spinning (TCPX_P2P_SPIN_US=0 TCPX_P2P_WAIT_SPIN_US=0), alternated.
OUT=$1
R=$(mktemp -d -p /dev/shm)
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/tp/*.whl
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
python3 -c "import torch; print('torch', torch.__version__, 'threads', torch.get_num_threads(), torch.__config__.parallel_info().splitlines()[:6])"
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/b.py
ub() { local tag=$1; shift
  local port=$((29500 + RANDOM % 500)) pids=()
  local c0=$(head -1 /proc/stat)
  for r in 0 1; do
    env "$@" PYTHONPATH=$S MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 60 python3 $R/b.py --local-gpu-idx 0 > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.err &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  local rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
  printf "%-8s exit%s server %s\n" $tag "$rcs" "$(grep -E '(64.0 KB|256.0 KB|1.0 MB|10.0 MB|100.0 MB) :' $R/${tag}_rank1.txt | awk '{print $(NF-4)}' | tr '\n' ' ')"
}
echo "== UCCL benchmark, server rows GB/s at 64 KB, 256 KB, 1 MB, 10 MB, 100 MB"
for round in 1 2 3 4 5 6; do
  ub asis_$round X=1
  ub spin0_$round TCPX_P2P_SPIN_US=0 TCPX_P2P_WAIT_SPIN_US=0
done
echo "uccl done at ${SECONDS} s"
tar -C $R -czf $OUT/d7.tgz .
echo "total ${SECONDS} s"
