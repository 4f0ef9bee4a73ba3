#!/usr/bin/env bash
# One transfer at a time, GPU → GPU, on a one-GPU (or larger) machine:
#   bash benchmarks/gpu_latency.sh WHEEL OUTDIR [STEP...]
# STEPs (default all, in this order; each under its own time limit, about
# 9 minutes in all -- split them over two calls where a command may run
# 10 minutes at most, e.g. `tests inline64K inline0` then `inline1M
# pipelined kv`):
#   tests      the end-to-end one-sided tests (inline and not; GPU memory)
#   inlineMAX  blocking run at TCPX_P2P_INLINE_MAX=MAX (64K, 1M, 0)
#   pipelined  --inflight 8, write and send, 16 and 256 MiB
#   kv         4,096 x 32 KiB scattered writev vs one 128 MiB write
# 1. blocking write / read / send, GPU → GPU, 4 KiB … 256 MiB, --inflight 1,
#    beside raw TCP and the staged copies measured in the same run, once per
#    TCPX_P2P_INLINE_MAX (64K: the default inline threshold; 1M: everything
#    up to 1 MiB inline; 0: inline off, every write and read through the net);
# 2. the pipelined figures beside them: --inflight 8 at 16 and 256 MiB;
# 3. KV blocks: 4,096 × 32 KiB scattered writev, one at a time, beside the
#    same bytes as one 128 MiB write.
# Both sides on GPU 0 with one GPU (GPU 0 → GPU 1 with two). Everything goes
# into OUTDIR as ONE tarball (gpu_latency.tar.gz) plus summary.txt (the
# tables), since the device returns only a few files. Each step has its own
# time limit; a step that fails or runs over is named in summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 O=$2
shift 2
STEPS=${*:-tests inline64K inline0 inline1M pipelined kv}
W=$(mktemp -d)/gpu_latency
mkdir -p "$W" "$O"
. benchmarks/device_env.sh "$WHEEL"
S="$O/summary.txt"
{ date -u +%FT%TZ; nvidia-smi -L; uptime; } > "$W/device.txt" 2>&1
cp "$W/device.txt" "$S"
pair_gpus
echo "GPUs: $NGPU, pair on $GPUS" >> "$S"
B="python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS"

step() { # step NAME LIMIT ARGS...: one bench run, its table appended to the summary
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" --out "$W/$name" > "$W/$name.txt" 2> "$W/$name.err"
  local rc=$?
  { echo; echo "== $name (status $rc; 124: ran over its limit of $limit s)"; grep -v '^\S* gpu \[' "$W/$name.txt" | tail -30; } >> "$S"
}

for st in $STEPS; do
  case $st in
    tests)
      timeout 150 python3 -m pytest -p no:cacheprovider -q tests/test_api.py -k "inline or register_memory or write_read" \
        > "$W/tests.txt" 2>&1
      { echo; echo "== tests/test_api.py -k 'inline or register_memory or write_read' (status $?)"; tail -3 "$W/tests.txt"; } >> "$S" ;;
    inline*)
      im=${st#inline}
      step "blocking_inline$im" 120 \
        env TCPX_P2P_INLINE_MAX="$im" $B --inflight 1 --op write,read,send --sizes 4K,64K,256K,1M,16M,256M --rounds 2 ;;
    pipelined) step pipelined8 150 $B --inflight 8 --op write,send --sizes 16M,256M --rounds 2 ;;
    kv)
      step kv_scattered 60 $B --inflight 1 --op write --kv-blocks 4096 --block-size 32K --kv-layout scattered
      step kv_one_message 45 $B --inflight 1 --op write --sizes 128M ;;
    *) echo "unknown step $st" >> "$S" ;;
  esac
done
tar -czf "$O/gpu_latency.tar.gz" -C "$(dirname "$W")" gpu_latency
echo "wrote $O/gpu_latency.tar.gz and $S"
