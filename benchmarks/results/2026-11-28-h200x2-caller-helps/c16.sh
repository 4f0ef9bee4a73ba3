#!/bin/bash
# c16: UCCL's benchmark once, untraced (main with the trace points, off),
# and the machine's /proc/stat (steal is its eighth column) and context
# switches before and after. (The per-thread counts came too late: both
# ranks had ended within the 6 s sleep.)
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/b.py
S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $S .device/w/tp/*.whl
export PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
head -1 /proc/stat; grep -E "^ctxt" /proc/stat
port=$((29500 + RANDOM % 500)); pids=()
for r in 0 1; do PYTHONPATH=$S MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r timeout 60 python3 $R/b.py --local-gpu-idx $r > $R/u_rank$r.txt 2>&1 & pids+=($!); [ $r = 0 ] && sleep 0.1; done
sleep 6; for p in "${pids[@]}"; do echo "pid $p threads $(ls /proc/$p/task | wc -l) nonvol $(cat /proc/$p/task/*/status 2>/dev/null | awk '/nonvoluntary/{s+=$2} END{print s}') vol $(cat /proc/$p/task/*/status 2>/dev/null | awk '/^voluntary/{s+=$2} END{print s}')"; done
for p in "${pids[@]}"; do wait $p; done
head -1 /proc/stat; grep -E "^ctxt" /proc/stat; cat /proc/loadavg
grep -E "(256.0 KB|1.0 MB) :" $R/u_rank1.txt
