#!/usr/bin/env bash
# Blocking 4 KiB / 64 KiB writes, host memory, loopback: the old build
# (OLD: a folder holding an unpacked wheel's tcpx_p2p/) and this checkout's
# editable install alternated four times. Usage: OLD=DIR OUT=DIR bash blocking.sh
set -u
cd "$(dirname "$0")/../../.." && . .venv/bin/activate
mkdir -p "$OUT"
for i in 1 2 3 4; do
  for v in base new; do
    if [ $v = base ]; then export PYTHONPATH=$OLD; else unset PYTHONPATH; fi
    python -m tcpx_p2p.bench pair --memory host --op write --inflight 1 --sizes 4096,65536 --iters 5000 --rounds 1 \
      --port 2979$i --json "$OUT/b-$v-$i.json" 2>&1 | grep -E "^write " | sed "s/^/$v-$i: /"
  done
done
