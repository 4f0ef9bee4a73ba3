#!/bin/bash
# write_ipc / read_ipc on a connection of the same-host net beside the same
# calls on a same-host connection (connect_local), between the same two
# processes, host memory, on the 2-core box: this build (write leases)
# beside the build before it (OLD_PY: a Python whose tcpx_p2p is that
# build's wheel), alternated, three rounds. The loop is the one the
# leased-read results used (../2026-11-27-devbox-same-host-leases/ipc_loop.py).
set -u
cd "$(dirname "$0")/../../.."
OUTDIR=${1:-$(dirname "$0")}
NEW_PY=${NEW_PY:-.venv/bin/python}
OLD_PY=${OLD_PY:?set OLD_PY to the python of the old build}
LOOP=benchmarks/results/2026-11-27-devbox-same-host-leases/ipc_loop.py
for r in 1 2 3; do
  for b in new old; do
    if [ "$b" = new ]; then PY=$NEW_PY; else PY=$OLD_PY; fi
    echo "== $b round $r"
    timeout 600 "$PY" "$LOOP" 4096,65536,262144,1048576,4194304,16777216 2>&1
  done
done > "$OUTDIR/ipc_loop.txt"
# Each way alone in a loop (ipc_alone.py), builds alternated, two rounds.
for r in 1 2; do
  for size in 4096 65536 1048576 16777216; do
    for way in net local; do
      for b in new old; do
        if [ "$b" = new ]; then PY=$NEW_PY; else PY=$OLD_PY; fi
        echo "$b $(timeout 300 "$PY" "$OUTDIR/ipc_alone.py" $way write $size 500 2>&1 | tail -1)"
      done
    done
  done
done > "$OUTDIR/alone.txt"
