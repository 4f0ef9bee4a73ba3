#!/usr/bin/env bash
# The GPU round: every device measurement and GPU test of the engine, in
# bounded steps, on a machine with one GPU (both processes on GPU 0) or more
# (GPU 0 -> GPU 1):
#   bash benchmarks/gpu_round.sh BUILDS OUTDIR STEP...
# BUILDS: one wheel (built elsewhere with `maturin build --release`), or
# several builds alternated on this machine as "TAG=WHEEL[@VAR=V,VAR=V] ..."
# in one argument: each step runs for each build in turn, ROUNDS times
# (default 1), so builds or settings are compared only beside each other,
# e.g. "old=old.whl new=new.whl" or
# "a=x.whl@TCPX_P2P_STAGING_SLICE=1M b=x.whl@TCPX_P2P_STAGING_SLICE=256K".
# STEPs (space- or comma-separated; each under its own limit; OUTDIR/summary.txt
# is written as it goes and everything is packed into OUTDIR/round.tgz after
# each step, so a cut-off round still returns what it did):
#   suites   the GPU cases of the end-to-end tests (test_api -k cuda,
#            test_uccl_compat, test_hostile_args) over the socket net and the
#            plugin net (the TCPX stand-in), the benchmark's GPU cases
#            (test_bench -k gpu), and the demo. SUITE_NETS picks the nets
#            (default "socket plugin"), SUITE_LIMIT each file group's limit
#            in seconds (default 420): on 2 x H200 each test of the plugin
#            net takes about 10 s, so one net is about one 10-minute call
#            (SUITE_NETS=socket, then SUITE_NETS=plugin)     (~8 a net)
#   core     the figures a change of the engine's core must keep, socket
#            net, GPU 0 -> GPU 1: 256 MiB write pipelined, write 4 KiB /
#            64 KiB one at a time (p50), KV 4,096 x 32 KiB, blocking send /
#            recv 256 MiB (benchmarks/sendrecv_loop.py); alternate two builds
#            ("old=A.whl new=B.whl") with ROUNDS=2 to compare them     (~3)
#   peers    one endpoint, many peers (tcpx-p2p-bench peers): 8 peers on
#            GPU 1 sending 16 MiB each into GPU 0 at once beside one alone,
#            and 64 peers in host memory (threads, descriptors, RSS)   (~2)
#   nets     the benchmark on both nets: send / write / read 64 KiB … 256 MiB
#            pipelined (two rounds) and one at a time (4 KiB … 256 MiB), KV
#            blocks 4,096 × 32 KiB scattered beside one 128 MiB message (~6)
#   host     host memory → host memory beside raw TCP (--reference), and
#            one at a time; the one step that runs without a GPU     (~2)
#   scale    pairs of GPUs at once (1, 2, 4 that fit; needs 2+ GPUs)
#            beside raw TCP and NCCL per pair, both nets              (~5)
#   nccl     NCCL itself loads the stand-in (benchmarks/nccl_emu_check.py;
#            needs torch with NCCL and 2 GPUs)                        (~2)
#   local    the same-host path: tests/test_local.py and
#            tests/test_same_host_net.py (skipped by builds without the
#            same-host net), then benchmarks/local_bench.py on one GPU,
#            host memory, and across GPUs 0 and 1 where there are two; with
#            TCPX_P2P_SAME_HOST_NET=1 (e.g. "new=B.whl@TCPX_P2P_SAME_HOST_NET=1")
#            its `tcp` rows ride the same-host net                    (~7)
#   nixl     NIXL VRAM → VRAM through TCPX_P2P beside UCX and our API,
#            WRITE / READ 64 KiB … 256 MiB and 4,096 × 32 KiB lists
#            (benchmarks/nixl_bench.py; NIXL_ARGS adds its options, e.g.
#            --one-process); needs NIXL_WHEEL (a nixl-cu13 wheel, a folder
#            it was installed into, or a tarball of that folder, such as
#            benchmarks/nixl_pack.py makes to fit a call)              (~5)
#   vllm     NIXL at vLLM's descriptor counts (131,072 × 4 KiB and × 16 KiB,
#            READ and WRITE, prep times, telemetry, each list also timed
#            against one descriptor in turn); needs NIXL_WHEEL   (~5)
#   uccl     UCCL's own tests, import changed only; needs UCCL_TESTS (a
#            folder of their p2p/tests files, or several joined by ':') (~4)
#   uccl_bench UCCL's benchmark_uccl.py, import changed only, sync and
#            async, with its default sizes and iterations and with 4 sizes
#            x 50 iterations; needs UCCL_BENCH (the file) and 2 GPUs  (~3)
#   unit     the Rust unit tests with their GPU cases, from a test binary
#            built elsewhere (UNIT_TESTS: the file `cargo test -p tcpx-p2p
#            --lib --no-run` names), then its hostile-sender test into GPU
#            memory for FUZZ_SECS seconds (default 60) for each seed of
#            FUZZ_SEEDS (default "1 2 3"); one build          (~1 + 1 a seed)
#   sendrecv blocking send / recv in UCCL's benchmark loop
#            (benchmarks/sendrecv_loop.py), 64 KiB … 256 MiB          (~2)
#   uccl_shape the same loop in UCCL's own shape (--shape uccl: buffers
#            made as its benchmark makes them, ten calls after one
#            warm-up), 64 KB … 100 MB, through ours, plain TCP (--via raw)
#            and, with 2 GPUs, NCCL's socket transport (--via nccl), in
#            turn, three times                                        (~4)
#   trace    where one blocking GPU transfer's time goes: send 4K / 64K / 1M
#            and write 64K / 1M traced (TCPX_P2P_LOG=trace), split by
#            benchmarks/lat_breakdown.py                              (~3)
#   h2d      small host → GPU copies, by how they are made
#            (benchmarks/h2d_small.py, one process)                   (~1)
#   split    where the socket net's I/O threads spend their time, GPU and
#            host memory, 16 and 256 MiB (benchmarks/time_split.py)   (~2)
# A command limited to 10 minutes runs a few steps per call: `suites`, then
# `nets`, then `nixl uccl`.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILDS=$1 OUTDIR=$2
shift 2
STEPS=$(echo "$*" | tr ',' ' ')
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
O=$(mktemp -d)/round
mkdir -p "$O"
S="$O/summary.txt"
{ date -u +%FT%TZ; nvidia-smi -L; uptime; echo "builds: $BUILDS"; } > "$S" 2>&1
pack() {
  cp "$S" "$OUTDIR/summary.txt"
  tar -C "$(dirname "$O")" -czf "$OUTDIR/round.tgz" round
}
# One build alone is untagged; several tag every file and summary line.
multi=0; case $BUILDS in *=*) multi=1;; esac

run() { # run NAME LIMIT CMD...: output to $P$NAME.txt, its last lines into the summary
  local name=$P$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$O/$name.txt" 2>&1
  local rc=$?
  { echo; echo "== $name (status $rc; 124: over its limit of $limit s)"; grep -Ev '^\S* (gpu|host) \[' "$O/$name.txt" | tail -"${TAIL:-20}"; } >> "$S"
  pack
}

nixl_path() { # puts NIXL_WHEEL's package on PYTHONPATH
  case "$NIXL_WHEEL" in
  *.whl) python3 -m pip install -q --no-index --no-deps --target "$SITE" "$NIXL_WHEEL" ;;
  *.tar*|*.tgz)
    local n; n=$(mktemp -d); tar -C "$n" -xf "$NIXL_WHEEL" || return 1
    # The folder holding the package itself (not its .libs or .data).
    export PYTHONPATH=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")"):$PYTHONPATH ;;
  *) export PYTHONPATH=$NIXL_WHEEL:$PYTHONPATH ;;
  esac
}

step() { # step NAME: one step for the build whose environment is set
  local B="python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS"
  local PLUGIN="env TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU"
  local PT="python3 -m pytest -p no:cacheprovider -q -rs" pre net
  case $1 in
    suites)
      local lim=${SUITE_LIMIT:-420}
      for net in ${SUITE_NETS:-socket plugin}; do
        pre="env TCPX_P2P_NET=socket"; [ $net = plugin ] && pre=$PLUGIN
        TAIL=3 run "suite_${net}_cuda" "$lim" $pre $PT tests/test_api.py -k cuda
        TAIL=3 run "suite_${net}_uccl_compat" "$lim" $pre $PT tests/test_uccl_compat.py tests/test_hostile_args.py
      done
      # The benchmark's GPU cases: its blocking floor's copies, and
      # --reference on one GPU printing its table with NCCL skipped.
      TAIL=3 run suite_bench_gpu 200 $PT tests/test_bench.py -k gpu
      TAIL=4 run demo 90 python3 -m tcpx_p2p.demo --size 256M --iters 16 ;;
    core)
      run core_pipelined 90 $B --op write --sizes 256M --json "$O/${P}core_pipelined.json"
      run core_blocking 90 $B --inflight 1 --op write --sizes 4K,64K --rounds 2 --out "$O/${P}core_blocking"
      run core_kv 60 $B --inflight 1 --op write --kv-blocks 4096 --block-size 32K --out "$O/${P}core_kv"
      run core_sendrecv 120 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus "$GPUS" --sizes 256M --rounds 3 --json "$O/${P}core_sendrecv.json" ;;
    peers)
      TAIL=12 run peers_gpu 150 python3 -m tcpx_p2p.bench peers --memory gpu --gpus "$GPUS" --peers 8 --procs 2 --busy 8 --busy-size 16M --json "$O/${P}peers_gpu.json"
      TAIL=12 run peers_host 150 python3 -m tcpx_p2p.bench peers --peers 64 --procs 4 --busy 16 --busy-size 16M --json "$O/${P}peers_host.json" ;;
    nets)
      for round in 1 2; do
        for net in socket plugin; do
          pre=""; [ $net = plugin ] && pre=$PLUGIN
          run "${net}_pipelined_$round" 75 $pre $B --op send,write,read --sizes 64K,1M,16M,256M --json "$O/$P${net}_pipelined_$round.json"
        done
      done
      for net in socket plugin; do
        pre=""; [ $net = plugin ] && pre=$PLUGIN
        run "${net}_blocking" 90 $pre $B --inflight 1 --op write,read,send --sizes 4K,64K,1M,16M,256M --rounds 2 --out "$O/$P${net}_blocking"
        run "${net}_kv_scattered" 40 $pre $B --inflight 1 --op write --kv-blocks 4096 --block-size 32K --kv-layout scattered
        run "${net}_kv_one" 30 $pre $B --inflight 1 --op write --sizes 128M
      done ;;
    host)
      run host_pipelined 150 python3 -m tcpx_p2p.bench pair --memory host --sizes 4K,64K,1M,16M,256M --reference --json "$O/${P}host_pipelined.json"
      run host_blocking 120 python3 -m tcpx_p2p.bench pair --memory host --inflight 1 --op write,read,send --sizes 4K,64K,1M,16M --rounds 2 --out "$O/${P}host_blocking" ;;
    scale)
      # Pairs of GPUs i -> i + n/2 at once, k in SCALE_PAIRS (default 1 2 4,
      # those that fit), one process per GPU, with the references.
      local p=$((NGPU / 2)) k g
      for net in socket plugin; do
        pre=""; [ $net = plugin ] && pre=$PLUGIN
        for k in ${SCALE_PAIRS:-1 2 4}; do
          [ "$k" -le "$p" ] || continue
          g=$(seq -s, 0 $((k - 1))),$(seq -s, $p $((p + k - 1)))
          TAIL=$((2 * k + 6)) run "scale_${net}_${k}pairs" 150 $pre python3 -m tcpx_p2p.bench pair --memory gpu --pairs "$k" --gpus "$g" \
            --sizes 16M,256M --reference --json "$O/${P}scale_${net}_${k}pairs.json"
        done
      done ;;
    nccl)
      TAIL=12 run nccl_emu_check 100 env NCCL_EMU_CHECK_TIMEOUT=${NCCL_EMU_CHECK_TIMEOUT:-45} \
        python3 benchmarks/nccl_emu_check.py "$O/${P}nccl" --plugin "$EMU" ;;
    local)
      TAIL=3 run local_tests 300 $PT tests/test_local.py tests/test_same_host_net.py
      run local_one_gpu 300 python3 benchmarks/local_bench.py --device gpu --gpu 0 --out "$O/${P}local_one_gpu"
      run local_host 120 python3 benchmarks/local_bench.py --device cpu --out "$O/${P}local_host"
      [ "$NGPU" -ge 2 ] && run local_two_gpus 300 python3 benchmarks/local_bench.py --device gpu --gpu 0 --peer-gpu 1 --out "$O/${P}local_two_gpus" ;;
    nixl|vllm)
      [ -n "${NIXL_WHEEL:-}" ] || { echo "$1: NIXL_WHEEL not set, skipped" >> "$S"; return; }
      nixl_path || { echo "$1: NIXL_WHEEL not usable, skipped" >> "$S"; return; }
      if [ "$1" = nixl ]; then
        # shellcheck disable=SC2086
        TAIL=16 run nixl 280 python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out "$O/${P}nixl" ${NIXL_ARGS:-}
      else
        # vLLM's descriptor counts: one transfer of 131,072 blocks of 4 KiB
        # and of 16 KiB, READ (vLLM's pull) and WRITE, beside one descriptor
        # of the same bytes; prep times apart; agents made with
        # capture_telemetry.
        run vllm 300 python3 benchmarks/nixl_bench.py --memory gpu --gpus "$GPUS" --out "$O/${P}vllm" --sizes 256M \
          --kv 131072x4K,131072x16K --backends TCPX_P2P --telemetry --paired --notifs 0 --rounds 3 --bytes-per-row 12G
      fi ;;
    uccl)
      [ -n "${UCCL_TESTS:-}" ] || { echo "uccl: UCCL_TESTS not set, skipped" >> "$S"; return; }
      local dirs d tag
      IFS=: read -ra dirs <<< "$UCCL_TESTS"
      for d in "${dirs[@]}"; do
        tag=$(basename "$d")
        UCCL_TEST_LIMIT=60 timeout 280 bash benchmarks/uccl_own_tests.sh "$d" "$O/${P}uccl_$tag" > /dev/null 2>&1
        { echo; echo "== ${P}uccl $tag (status $?)"; grep -v '^    ' "$O/${P}uccl_$tag/summary.txt"; } >> "$S"
      done
      pack ;;
    uccl_bench)
      # UCCL's own benchmark_uccl.py (UCCL_BENCH), import changed only, as
      # UCCL runs it (two ranks of torch.distributed), rank r on GPU r.
      [ -n "${UCCL_BENCH:-}" ] || { echo "uccl_bench: UCCL_BENCH not set, skipped" >> "$S"; return; }
      [ "$NGPU" -ge 2 ] || { echo "uccl_bench: needs 2 GPUs, skipped" >> "$S"; return; }
      sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' "$UCCL_BENCH" > "$O/benchmark_uccl.py"
      # Each API twice: as UCCL's users run it (its default sizes, 256 B
      # to 100 MB, 10 iterations after one warm-up: a fresh connection's
      # first messages count), and four sizes at 50 iterations.
      local api flag pids port r rcs p args tag
      for api in sync async; do
        for args in "" "--iters 50 --sizes 65536,1048576,16777216,268435456"; do
          flag=""; [ $api = async ] && flag=--async-api
          tag=${P}uccl_bench_${api}; [ -z "$args" ] && tag=${tag}_defaults
          pids=() port=$((29500 + RANDOM % 500))
          for r in 0 1; do
            # shellcheck disable=SC2086  # $args is a list of options
            MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r \
              timeout 200 python3 "$O/benchmark_uccl.py" --local-gpu-idx $r $args \
              $flag > "$O/${tag}_rank$r.txt" 2>&1 &
            pids+=($!)
            [ $r = 0 ] && sleep 0.1
          done
          rcs=""; for p in "${pids[@]}"; do wait "$p"; rcs+=" $?"; done
          { echo; echo "== $tag (exit codes:$rcs) ${args:-its default sizes and iterations}"; grep -E "GB/s|Gbps|us|error|Error" "$O/${tag}_rank0.txt" | tail -12; } >> "$S"
        done
      done
      pack ;;
    unit)
      [ -n "${UNIT_TESTS:-}" ] || { echo "unit: UNIT_TESTS not set, skipped" >> "$S"; return; }
      TAIL=3 run unit 200 "$UNIT_TESTS" -q
      local seed secs=${FUZZ_SECS:-60}
      for seed in ${FUZZ_SEEDS:-1 2 3}; do
        TAIL=3 run "unit_fuzz_gpu_$seed" $((secs + 60)) env TCPX_P2P_FUZZ_SECS="$secs" TCPX_P2P_FUZZ_SEED="$seed" \
          "$UNIT_TESTS" fuzz_tests::a_hostile_senders_parts_land_only_inside_open_gpu_receives --nocapture
      done ;;
    sendrecv)
      run sendrecv 240 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus "$GPUS" --sizes 64K,1M,16M,256M --rounds 5 --json "$O/${P}sendrecv_loop.json" ;;
    uccl_shape)
      local i v
      for i in 1 2 3; do
        for v in engine raw nccl; do
          [ "$v" = nccl ] && [ "$NGPU" -lt 2 ] && continue
          run "uccl_shape_${v}_$i" 90 python3 benchmarks/sendrecv_loop.py --memory gpu --gpus "$GPUS" --shape uccl --via "$v" \
            --sizes 64K,256K,1M,10M,100M --rounds 6 --json "$O/${P}uccl_shape_${v}_$i.json"
        done
      done ;;
    trace)
      # Tracing costs a few µs per event: the split between steps is what
      # this is for, not the sums.
      local op size f
      for op in send write; do
        for size in 4K 64K 1M; do
          [ $op = write ] && [ $size = 4K ] && continue
          f=${P}trace_${op}_$size
          TCPX_P2P_LOG=trace timeout 60 $B --inflight 1 --op $op --sizes $size --iters 100 --rounds 1 > "$O/$f.table" 2> "$O/$f.log"
          TAIL=16 run "trace_${op}_$size" 30 python3 benchmarks/lat_breakdown.py "$O/$f.log" --json "$O/$f.json"
          gzip -f "$O/$f.log"
        done
      done ;;
    h2d) TAIL=30 run h2d_small 90 python3 benchmarks/h2d_small.py --json "$O/${P}h2d_small.json" ;;
    split)
      local mem size f
      for mem in gpu host; do
        for size in 16M 256M; do
          f=${P}split_${mem}_$size
          TCPX_P2P_LOG=debug timeout 60 python3 -m tcpx_p2p.bench pair --memory $mem --gpus "$GPUS" --sizes $size --seconds 4 > "$O/$f.table" 2> "$O/$f.log"
          TAIL=6 run "split_${mem}_$size" 30 python3 benchmarks/time_split.py "$O/$f.log" --json "$O/$f.json"
          gzip -f "$O/$f.log"
        done
      done ;;
    *) echo "unknown step $1" >> "$S" ;;
  esac
}

[ $multi = 1 ] || BUILDS="=$BUILDS"
for round in $(seq "$ROUNDS"); do
  for st in $STEPS; do
    for b in $BUILDS; do
      tag=${b%%=*} w=${b#*=} settings=""
      case $w in *@*) settings=${w#*@} w=${w%%@*};; esac
      (
        for kv in ${settings//,/ }; do export "${kv?}"; done
        . benchmarks/device_env.sh "$w"
        pair_gpus
        if [ "$NGPU" -lt 1 ] && [ "$st" != host ]; then echo "$st: no GPU here, skipped" >> "$S"; exit 0; fi
        EMU=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())')
        P=""
        [ $multi = 1 ] && P="${tag}_"
        [ "$ROUNDS" -gt 1 ] && P="${P}r${round}_"
        step "$st"
      )
    done
  done
done
pack
cat "$S"
