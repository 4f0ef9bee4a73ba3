#!/usr/bin/env bash
# NIXL through TCPX_P2P on one GPU, with both agents in two processes (as
# nixl_bench.sh) and in one process (one CUDA context: no switching between
# two processes' contexts, as with one process per GPU), alternated:
#   bash benchmarks/nixl_processes.sh WHEEL NIXL_WHEEL OUTDIR [ROUNDS] [nixl_bench.py args]
# Results: OUTDIR/{one,two}-N/nixl_bench.{json,txt}, and OUTDIR/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 NIXL_WHEEL=$2 O=$3 ROUNDS=${4:-2}
shift 3; [ $# -gt 0 ] && shift
mkdir -p "$O"
for r in $(seq 1 "$ROUNDS"); do
  for mode in two one; do
    extra=(); [ $mode = one ] && extra=(--one-process)
    bash benchmarks/nixl_bench.sh "$WHEEL" "$NIXL_WHEEL" "$O/$mode-$r" "${extra[@]}" "$@" > /dev/null 2>&1
    echo "$mode process(es), round $r: exit $?"
  done
done > "$O/runs.txt"
python3 - "$O" <<'PY' | tee "$O/summary.txt"
import glob, json, os, sys
def ratio(a, b):
    return f"{a / b:6.2f}" if a and b else "   n/a"
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-*/nixl_bench.json"))):
    d = json.load(open(f))
    rows = {(r["shape"], r["op"]): r for r in d["rows"]}
    out = [os.path.basename(os.path.dirname(f))]
    for (shape, op), r in rows.items():
        if shape.startswith("256M"):
            out.append(f"256M {op} {r.get('TCPX_P2P') or 0:.2f} GB/s, /UCX {ratio(r.get('TCPX_P2P'), r.get('UCX'))}, /api {ratio(r.get('TCPX_P2P'), r.get('api'))}")
    for op in ("WRITE", "READ"):
        many = [r for (s, o), r in rows.items() if o == op and s.startswith("KV") and not s.startswith("KV as")]
        one = [r for (s, o), r in rows.items() if o == op and s.startswith("KV as")]
        if many and one:
            out.append(f"KV {op} many/one {ratio(many[0].get('TCPX_P2P'), one[0].get('TCPX_P2P'))}")
    print(" | ".join(out))
PY
