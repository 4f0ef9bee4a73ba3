#!/bin/bash
# Do longer spins keep the streams' threads awake through a slow message
# (the runs of slow messages in a row)? UCCL's benchmark_uccl.py (v0.1.1,
# import changed only), sync, defaults, HEAD (h0): default spins (300 us /
# a blocking call's 2.4 ms), TCPX_P2P_WAIT_SPIN_US=10000, and
# TCPX_P2P_SPIN_US=2000; alternated, twice.
OUT=$1
. benchmarks/device_env.sh "$(ls .device/w/h0/*.whl)" >/dev/null 2>&1
R=$(mktemp -d -p /dev/shm)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
cat > $R/ru.py <<'PY'
import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:]); u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"{sys.argv[1]} cpu {u.ru_utime + u.ru_stime:.1f} s", file=sys.stderr); sys.exit(rc)
PY
for round in 1 2; do
  for v in "X=1" "TCPX_P2P_WAIT_SPIN_US=10000" "TCPX_P2P_SPIN_US=2000"; do
    port=$((29500 + RANDOM % 500)); pids=()
    for r in 0 1; do
      env $v MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r timeout 120 python3 $R/ru.py rank$r python3 $R/benchmark_uccl.py --local-gpu-idx $r > $R/u_$r.txt 2> $R/u_$r.err &
      pids+=($!); [ $r = 0 ] && sleep 0.1
    done
    rcs=""; for p in "${pids[@]}"; do wait $p; rcs+=" $?"; done
    echo "== $v round $round (exit$rcs; $(grep -h cpu $R/u_*.err | tr '\n' ' ')) client | server"
    paste <(grep -E "GB/s" $R/u_0.txt | sed 's/Gbps.*|  *\([0-9.]* GB\/s\).*/\1/') <(grep -E "GB/s" $R/u_1.txt | sed 's/.*Gbps |  *\([0-9.]* GB\/s\).*/\1/') | sed -n '5,10p'
  done
done
