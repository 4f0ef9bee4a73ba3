#!/bin/bash
# Round 2: copy rates at 4 KiB blocks; NIXL 131,072 x 4 KiB, w1 vs w2 alternated; UCCL 0.1.1 itself (nccl transport) beside us on UCCL's benchmark
set -u
D=${FILES:?a folder with the wheels (w1/, w2/, one .whl each), gputest (the p2p-gpu test binary), uccl011.tgz (UCCL 0.1.1 trimmed, libcudart.so.12) and ub2.sh}
mkdir -p $OUT/cr $OUT/nixl $OUT/ub
for b in 4096 32768; do
  COPY_RATES_BLOCK=$b timeout 60 $D/gputest tests::copy_rates --ignored --nocapture --test-threads 1 > $OUT/cr/copy_rates_$b.txt 2>&1; echo "copy_rates $b exit $?"; grep -E "thread|present" $OUT/cr/copy_rates_$b.txt
done
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
NIXL_PP=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")")
for r in 1 2; do
  for tag in w1 w2; do
    ( . benchmarks/device_env.sh "$(ls $D/$tag/*.whl)" >/dev/null 2>&1 || exit 1
      export PYTHONPATH=$NIXL_PP:$PYTHONPATH
      timeout 100 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K --backends TCPX_P2P --telemetry --notifs 0 --rounds 2 --bytes-per-row 2G --out $OUT/nixl/${tag}_$r > $OUT/nixl/${tag}_$r.txt 2>&1; echo "nixl $tag round $r exit $?"
      grep -E "many desc|telemetry" $OUT/nixl/${tag}_$r.txt | sed 's/^/  /' )
  done
done
( . benchmarks/device_env.sh "$(ls $D/w2/*.whl)" >/dev/null 2>&1
  OURS_PP=$PYTHONPATH
  U=$(mktemp -d); tar -C $U -xzf $D/uccl011.tgz
  NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
  for r in 1 2; do
    PYTHONPATH=$U/pkg:$OURS_PP LD_LIBRARY_PATH=$U/lib:$NCCL_LIB:${LD_LIBRARY_PATH:-} UCCL_P2P_TRANSPORT=nccl NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo UCCL_SOCKET_IFNAME=lo NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET bash $D/ub2.sh uccl $OUT/ub uccl_$r
    bash $D/ub2.sh ours $OUT/ub ours_$r
  done
  zcat $OUT/ub/uccl_1_rank1.log.gz | grep -iE "NET/|via|transport|error|Assert" | head -12 )
cd $OUT && tar czf r2.tgz cr nixl ub 2>/dev/null; ls $OUT
