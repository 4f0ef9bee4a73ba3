#!/usr/bin/env bash
# What a two-GPU machine has still to run (GPU 0 → GPU 1), in bounded steps:
#   bash benchmarks/two_gpu_rest.sh WHEEL OUTDIR STEP...
# STEPs (each under its own limit; the summary is written as it goes, and
# everything is packed into OUTDIR/two_gpu.tgz after each step):
#   nets     the benchmark on the socket net and on the plugin net (the TCPX
#            stand-in), rounds alternated: send / write / read at 64 KiB …
#            256 MiB pipelined and one at a time, KV blocks scattered and as
#            one message                                     (~6 minutes)
#   nixl     NIXL VRAM GPU 0 → GPU 1 through TCPX_P2P beside UCX and our
#            API, WRITE / READ, 64 KiB … 256 MiB and 4,096 × 32 KiB lists;
#            needs NIXL_WHEEL (a nixl-cu13 wheel, folder or tarball)   (~5)
#   vllm     NIXL GPU 0 → GPU 1 at vLLM's descriptor counts (131,072 × 4 KiB
#            and × 16 KiB, READ and WRITE, prep times, telemetry) (~4)
#   uccl     UCCL's own tests, import changed only; needs UCCL_TESTS (a
#            folder of their p2p/tests files, or several joined by ':') (~4)
#   uccl_bench UCCL's benchmark_uccl.py, import changed only, sync and
#            async; needs UCCL_BENCH (the file)                 (~2)
#   sendrecv blocking send / recv in UCCL's benchmark loop
#            (benchmarks/sendrecv_loop.py), 64 KiB … 256 MiB     (~2)
# Split the steps over calls where a command may run 10 minutes at most:
# `nets`, then `nixl uccl`.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 OUTDIR=$2
shift 2
O=$(mktemp -d)/two_gpu
mkdir -p "$O" "$OUTDIR"
. benchmarks/device_env.sh "$WHEEL"
EMU=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())')
{ date -u +%FT%TZ; nvidia-smi -L; } > "$O/device.txt" 2>&1
S="$O/summary.txt"
cp "$O/device.txt" "$S"
pack() {
  cp "$S" "$OUTDIR/summary.txt"
  tar -C "$(dirname "$O")" -czf "$OUTDIR/two_gpu.tgz" two_gpu
}
run() { # run NAME LIMIT CMD...: output to NAME.txt, its table into the summary
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$O/$name.txt" 2>&1
  local rc=$?
  { echo; echo "== $name (status $rc; 124: over its limit of $limit s)"; grep -v '^\S* gpu \[' "$O/$name.txt" | tail -20; } >> "$S"
  pack
}
B="python3 -m tcpx_p2p.bench pair --memory gpu --gpus 0,1"
PLUGIN="env TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU"
for st in "$@"; do
  case $st in
    nets)
      for round in 1 2; do
        for net in socket plugin; do
          pre=""; [ $net = plugin ] && pre=$PLUGIN
          run "${net}_pipelined_$round" 75 $pre $B --op send,write,read --sizes 64K,1M,16M,256M --json "$O/${net}_pipelined_$round.json"
        done
      done
      for net in socket plugin; do
        pre=""; [ $net = plugin ] && pre=$PLUGIN
        run "${net}_blocking" 60 $pre $B --inflight 1 --op write,read,send --sizes 64K,1M,16M,256M --rounds 2
        run "${net}_kv_scattered" 40 $pre $B --inflight 1 --op write --kv-blocks 4096 --block-size 32K --kv-layout scattered
        run "${net}_kv_one" 30 $pre $B --inflight 1 --op write --sizes 128M
      done ;;
    nixl)
      [ -n "${NIXL_WHEEL:-}" ] || { echo "nixl: NIXL_WHEEL not set, skipped" >> "$S"; continue; }
      timeout 280 bash benchmarks/nixl_bench.sh "$WHEEL" "$NIXL_WHEEL" "$O/nixl" --gpus 0,1 > "$O/nixl.txt" 2>&1
      { echo; echo "== nixl (status $?)"; grep -v INFO "$O/nixl.txt" | tail -16; } >> "$S"
      pack ;;
    vllm)
      # vLLM's descriptor counts: one transfer of 131,072 blocks of 4 KiB and
      # of 16 KiB, READ (vLLM's pull) and WRITE, beside one descriptor of the
      # same bytes; prep times apart; agents made with capture_telemetry.
      [ -n "${NIXL_WHEEL:-}" ] || { echo "vllm: NIXL_WHEEL not set, skipped" >> "$S"; continue; }
      timeout 300 bash benchmarks/nixl_bench.sh "$WHEEL" "$NIXL_WHEEL" "$O/vllm" --gpus 0,1 --sizes 256M \
        --kv 131072x4K,131072x16K --backends TCPX_P2P --telemetry --notifs 0 --rounds 3 --bytes-per-row 12G > "$O/vllm.txt" 2>&1
      { echo; echo "== vllm (status $?)"; grep -v INFO "$O/vllm.txt" | tail -20; } >> "$S"
      pack ;;
    uccl)
      # UCCL_TESTS: one folder of UCCL's test files, or several joined by ':'
      # (v0.1.1's and main's).
      [ -n "${UCCL_TESTS:-}" ] || { echo "uccl: UCCL_TESTS not set, skipped" >> "$S"; continue; }
      IFS=: read -ra dirs <<< "$UCCL_TESTS"
      for d in "${dirs[@]}"; do
        tag=$(basename "$d")
        UCCL_TEST_LIMIT=60 timeout 280 bash benchmarks/uccl_own_tests.sh "$d" "$O/uccl_$tag" > /dev/null 2>&1
        { echo; echo "== uccl $tag (status $?)"; grep -v '^    ' "$O/uccl_$tag/summary.txt"; } >> "$S"
      done
      pack ;;
    uccl_bench)
      # UCCL's own benchmark_uccl.py (UCCL_BENCH), import changed only, as
      # UCCL runs it (two ranks of torch.distributed), rank r on GPU r.
      [ -n "${UCCL_BENCH:-}" ] || { echo "uccl_bench: UCCL_BENCH not set, skipped" >> "$S"; continue; }
      sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' "$UCCL_BENCH" > "$O/benchmark_uccl.py"
      for api in sync async; do
        flag=""; [ $api = async ] && flag=--async-api
        pids=() port=$((29500 + RANDOM % 500))
        for r in 0 1; do
          MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
            timeout 200 python3 "$O/benchmark_uccl.py" --local-gpu-idx $r --iters 50 \
            --sizes 65536,1048576,16777216,268435456 $flag > "$O/uccl_bench_${api}_rank$r.txt" 2>&1 &
          pids+=($!)
          [ $r = 0 ] && sleep 0.1
        done
        rcs=""; for p in "${pids[@]}"; do wait "$p"; rcs+=" $?"; done
        { echo; echo "== uccl_bench $api (exit codes:$rcs)"; grep -E "GB/s|Gbps|us|error|Error" "$O/uccl_bench_${api}_rank0.txt" | tail -12; } >> "$S"
      done
      pack ;;
    sendrecv)
      run sendrecv 240 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus 0,1 --sizes 64K,1M,16M,256M --rounds 5 --json "$O/sendrecv_loop.json" ;;
    *) echo "unknown step $st" >&2 ;;
  esac
done
cat "$S"
