#!/bin/bash
# Is the device's CPU quota throttling both processes at once during UCCL's
# benchmark (multi-ms stalls where neither process logs anything)? cgroup
# cpu.max / cpu.stat around runs of benchmark_uccl.py (v0.1.1, import changed
# only, sync, defaults): default spinning, and with spinning off; CPU seconds
# used by each rank.
OUT=$1
W=$(ls .device/w/h0/*.whl)
. benchmarks/device_env.sh "$W" >/dev/null 2>&1
echo "nproc $(nproc)"; lscpu | grep -E "^CPU\(s\)|NUMA|Thread|Socket|Model name"
CG=/sys/fs/cgroup; [ -f $CG/cpu.max ] || CG=$(find /sys/fs/cgroup -maxdepth 3 -name cpu.max | head -1 | xargs dirname)
echo "cgroup $CG: cpu.max=$(cat $CG/cpu.max 2>/dev/null) cpuset=$(cat $CG/cpuset.cpus.effective 2>/dev/null)"
cat /proc/self/cgroup
R=$(mktemp -d)
sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' .device/benchmark_uccl_v011.py > $R/benchmark_uccl.py
cat > $R/ru.py <<'PY'
import resource, subprocess, sys, time
t = time.time(); rc = subprocess.call(sys.argv[2:]); w = time.time() - t
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"{sys.argv[1]}: wall {w:.1f} s, user {u.ru_utime:.1f} s, sys {u.ru_stime:.1f} s, rc {rc}", file=sys.stderr)
sys.exit(rc)
PY
stat() { grep -E "nr_periods|nr_throttled|throttled_usec" $CG/cpu.stat 2>/dev/null | tr '\n' ' '; }
ub() { local tag=$1; shift
  local port=$((29500 + RANDOM % 500)) pids=()
  echo "== $tag ($*) before: $(stat)"
  for r in 0 1; do
    env "$@" MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
      timeout 120 python3 $R/ru.py rank$r python3 $R/benchmark_uccl.py --local-gpu-idx $r > $R/${tag}_rank$r.txt 2> $R/${tag}_rank$r.err &
    pids+=($!); [ $r = 0 ] && sleep 0.1
  done
  for p in "${pids[@]}"; do wait $p; done
  echo "   after: $(stat)"; tail -qn1 $R/${tag}_rank*.err
  paste <(grep -E "GB/s" $R/${tag}_rank0.txt | sed 's/Gbps.*|  *\([0-9.]* GB\/s\)/\1/') <(grep -E "GB/s" $R/${tag}_rank1.txt | sed 's/.*Gbps |//')
}
ub default X=1
ub nospin TCPX_P2P_SPIN_US=0 TCPX_P2P_WAIT_SPIN_US=0
ub default2 X=1
ub nospin2 TCPX_P2P_SPIN_US=0 TCPX_P2P_WAIT_SPIN_US=0
tar -C $R -czf $OUT/r31.tgz .
