#!/bin/bash
# old (f928906) and new (a225ae3) alternated, GPU pair on this machine.
OUT=$1 WHEELS=${2:?folder with old/ and new/ wheels}
for i in 1 2; do
  for b in old new; do
    (
      . benchmarks/device_env.sh $WHEELS/$b/*.whl
      pair_gpus
      timeout 60 python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS --sizes 64K,16M,256M --out $OUT/$b-$i > $OUT/$b-$i.txt 2>&1
      echo "$b $i rc=$? gpus=$GPUS"; grep -E "^send " $OUT/$b-$i.txt
    )
  done
done
nvidia-smi --query-gpu=name --format=csv,noheader
