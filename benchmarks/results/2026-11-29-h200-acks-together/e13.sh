#!/bin/bash
# e13 (nvidia-h200, both ranks on GPU 0): the blocking GPU send / recv loop at 16 MiB and 256 MiB, old (634ee23),
# final (86c97bd: receives acknowledged together) and final2 (receives of 16 MiB or more acknowledged as they land),
# rotated four times; then UCCL's shape at 64K/256K/1M, final2 beside final, twice.
OUT=$1
for b in old final final2; do S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/$b/*.whl; eval "SITE_$b=$S"; done
export TCPX_P2P_IFNAME=lo PYTHONUNBUFFERED=1
R=$(mktemp -d -p /dev/shm)
for round in 1 2 3 4; do
  case $round in 1) order="old final final2";; 2) order="final2 old final";; 3) order="final final2 old";; 4) order="final2 final old";; esac
  for b in $order; do eval "site=\$SITE_$b"
    PYTHONPATH=$site timeout 100 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --sizes 16M,256M --rounds 3 --json $R/sr_${b}_$round.json > $R/sr_${b}_$round.txt 2>&1
    printf "%-10s exit %s %s\n" ${b}_$round $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s GB/s ", $4}' $R/sr_${b}_$round.txt)"
  done
done
for round in 1 2; do
  for b in final final2; do eval "site=\$SITE_$b"
    PYTHONPATH=$site timeout 90 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,0 --shape uccl --sizes 64K,256K,1M --rounds 6 --json $R/uccl_${b}_$round.json > $R/uccl_${b}_$round.txt 2>&1
    printf "%-14s exit %s GB/s %s\n" uccl_${b}_$round $? "$(awk 'NR>1 && $1 ~ /^[0-9]+$/ {printf "%s ", $4}' $R/uccl_${b}_$round.txt)"
  done
done
tar -C $R -czf $OUT/e13.tgz .
echo "total ${SECONDS} s"
