#!/bin/bash
# main vs try on the 2-core box, host memory, 1 MiB cut in 8 parts of 128 KiB, receiver lagging 20 ms; with two CPU hogs and without.
export TCPX_P2P_MIN_PART=131072 TCPX_P2P_IFNAME=lo
cd "$(dirname "$0")/../../.."
py_main=${PY_MAIN:-.venv/bin/python}; py_try=${PY_TRY:?the other build's python}
run() { local b=$1 tag=$2; local py; eval "py=\$py_$b"
  $py benchmarks/sendrecv_loop.py --sizes 256K,1M --iters 10 --rounds 20 --lag 20 --json ${OUT:-/tmp/devcmp}/${tag}_$b.json 2>&1 | awk -v t="$tag $b" 'NR>1{print t, $1, "recv_us_p50", $3, "GB/s", $4, "slowest", $5}'; }
mkdir -p ${OUT:-/tmp/devcmp}
for round in 1 2 3; do
  python3 -c "while True: pass" & h1=$!; python3 -c "while True: pass" & h2=$!
  if [ $((round % 2)) = 1 ]; then order="main try"; else order="try main"; fi
  for b in $order; do run $b hogs$round; done
  kill $h1 $h2; wait $h1 $h2 2>/dev/null
  for b in $order; do run $b quiet$round; done
done
