#!/usr/bin/env bash
# A bounded GPU round (each step under its own time limit; everything is
# re-packed into OUTDIR/round.tar.gz after each step, so a cut-off run still
# returns what it did): bash benchmarks/gpu_quick.sh WHEEL BIN_DIR OUTDIR [STEPS]
# STEPS: any of socket,plugin,unpack,nccl,bench,kv,lat,copy (default all
# but scale); scale: GPU pairs at once (needs 4+ GPUs); plugin16: the plugin
# net at 16/256 MiB through the bench with 4 MiB and 2 MiB chunks; latbreak:
# where a 64 KiB message's time goes (benchmarks/lat_breakdown.py); copylat:
# one small staged copy's latency, several ways; host: host memory → host
# memory with the raw-TCP reference; tune: staging slice / depth and socket
# buffer sizes at 16 / 256 MiB; streams: 8 / 12 / 16 streams per comm
# (STREAM_COUNTS) at 16 / 256 MiB; split: where the I/O threads' time goes
# (TCPX_P2P_LOG=debug, benchmarks/time_split.py); contention: staged copies
# beside the other GPU's copies and CPU memory copies. tune takes TUNE_SETTINGS.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 BIN=$2 O=$3 STEPS=${4:-socket,plugin,unpack,nccl,bench,kv,lat,copy}
R=$(mktemp -d)/round
mkdir -p "$R" "$O"
. benchmarks/device_env.sh "$WHEEL"
EMU=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())')
PT="python3 -m pytest -p no:cacheprovider -p timeout --timeout 60 -v"
{ date -u +%FT%TZ; nvidia-smi -L; } > "$R/device.txt" 2>&1
pack() { tail -${2:-2} "$R/$1" | tee -a "$R/summary.txt"; tar -C "$(dirname "$R")" -czf "$O/round.tar.gz" round; cp "$R/summary.txt" "$O/summary.txt"; }
has() { case ",$STEPS," in *",$1,"*) return 0;; *) return 1;; esac; }
# GB/s of the runs $R/PREFIX_<setting>_r<round>.json, per setting and size.
summarize() {
  python3 - "$R" "$1" <<'PY'
import glob, json, os, sys, collections
acc = collections.defaultdict(list)
pre = sys.argv[2] + "_"
for f in sorted(glob.glob(os.path.join(sys.argv[1], pre + "*_r*.json"))):
    name = os.path.basename(f).rsplit("_r", 1)[0][len(pre):]
    for r in json.load(open(f))["rows"]:
        acc[(name, r["size"])].append(r["GBps"])
for (name, size), v in sorted(acc.items()):
    print(f"{name:<40} {size >> 20:>4} MiB  " + "  ".join(f"{x:6.2f}" for x in v) + f"   mean {sum(v) / len(v):6.2f}")
PY
}
has socket && { timeout 150 $PT tests/test_api.py -k cuda > "$R/tests_socket_cuda.txt" 2>&1; pack tests_socket_cuda.txt 1; }
has plugin && { TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU timeout 150 $PT tests/test_api.py -k cuda > "$R/tests_plugin_cuda.txt" 2>&1; pack tests_plugin_cuda.txt 1; }
has unpack && { BIN_DIR=$BIN timeout 90 bash benchmarks/gpu_plugin_check.sh "$R/gpu_plugin_check.json" > "$R/gpu_plugin_check.txt" 2>&1; pack gpu_plugin_check.txt 30; }
has nccl && { NCCL_EMU_CHECK_TIMEOUT=${NCCL_EMU_CHECK_TIMEOUT:-45} NCCL_EMU_CHECK_TRACE=1 timeout 100 python3 benchmarks/nccl_emu_check.py "$R/nccl" --plugin "$BIN/libnccl_net_emu.so" > "$R/nccl_emu_check.txt" 2>&1; pack nccl_emu_check.txt 12; }
has bench && { timeout 150 python3 -m tcpx_p2p.bench pair --memory gpu --sizes 64K,1M,16M,256M --reference --json "$R/bench_gpu_send.json" > "$R/bench_gpu_send.txt" 2>/dev/null; pack bench_gpu_send.txt 7; }
has host && { timeout 150 python3 -m tcpx_p2p.bench pair --memory host --sizes 4K,64K,1M,16M,256M --reference --json "$R/bench_host_send.json" > "$R/bench_host_send.txt" 2>/dev/null; pack bench_host_send.txt 8; }
B="python3 -m tcpx_p2p.bench pair --memory gpu"
if has kv; then
  # 4096 x 32 KiB: scattered (a paged cache's block table) and contiguous
  # blocks, beside the same bytes as one message; scattered once more with
  # one driver call per copy (no batch copies).
  for lay in scattered contiguous; do
    for op in write send; do
      f=bench_kv_${op}_$lay
      timeout 60 $B --op $op --kv-blocks 4096 --block-size 32K --kv-layout $lay --json "$R/$f.json" > "$R/$f.txt" 2>/dev/null; pack $f.txt 4
    done
  done
  TCPX_P2P_COPY_BATCH=0 timeout 60 $B --op write --kv-blocks 4096 --block-size 32K --json "$R/bench_kv_write_scattered_nobatch.json" > "$R/bench_kv_write_scattered_nobatch.txt" 2>/dev/null; pack bench_kv_write_scattered_nobatch.txt 4
  timeout 40 $B --op write --sizes 128M --json "$R/bench_kv_one_message.json" > "$R/bench_kv_one_message.txt" 2>/dev/null; pack bench_kv_one_message.txt 3
fi
has copylat && { timeout 60 "$BIN/unit" tests::copy_latency --ignored --exact --nocapture > "$R/copy_latency.txt" 2>&1; pack copy_latency.txt 6; }
has contention && { timeout 60 "$BIN/unit" tests::copy_contention --ignored --exact --nocapture > "$R/copy_contention.txt" 2>&1; pack copy_contention.txt 5; }
has copy && { timeout 60 "$BIN/unit" tests::copy_rates --ignored --exact --nocapture > "$R/copy_rates.txt" 2>&1; pack copy_rates.txt 8; }
if has plugin16; then
  for c in 4M 2M; do
    f=bench_plugin_chunk$c
    TCPX_P2P_PLUGIN_PATH=$EMU timeout 60 $B --net plugin --chunk $c --sizes 16M,256M --json "$R/$f.json" > "$R/$f.txt" 2>/dev/null; pack $f.txt 4
  done
  timeout 60 $B --net socket --sizes 16M,256M --json "$R/bench_socket_16_256.json" > "$R/bench_socket_16_256.txt" 2>/dev/null; pack bench_socket_16_256.txt 4
fi
if has lat; then
  for sp in ${LAT_SPINS:-0 50 300 1000}; do
    TCPX_P2P_SPIN_US=$sp timeout 40 $B --sizes 4K,64K --reference --json "$R/bench_lat_spin$sp.json" > "$R/bench_lat_spin$sp.txt" 2>/dev/null; pack bench_lat_spin$sp.txt 4
  done
fi
if has latbreak; then
  # Where a 64 KiB message's time goes (trace events of both sides), GPU
  # and host memory.
  for mem in gpu host; do
    f=latbreak_64k_$mem
    TCPX_P2P_LOG=trace timeout 60 python3 -m tcpx_p2p.bench pair --memory $mem --sizes 64K --iters 300 > "$R/$f.txt" 2> "$R/$f.log"
    python3 benchmarks/lat_breakdown.py "$R/$f.log" --json "$R/$f.json" >> "$R/$f.txt" 2>&1; pack $f.txt 16
  done
fi
if has tune; then
  # Staging slice / depth and socket buffer sizes, GPU -> GPU 16 / 256 MiB,
  # each setting twice, the rounds alternated (machine drift hits all alike).
  for round in 1 2; do
    for c in ${TUNE_SETTINGS:-default STAGING_SLICE=256K STAGING_SLICE=512K STAGING_SLICE=2M STAGING_SLICE=512K,STAGING_DEPTH=8 SOCKBUF=8M SOCKBUF=32M}; do
      E=""; [ $c != default ] && E=$(echo "$c" | sed 's/^/TCPX_P2P_/; s/,/ TCPX_P2P_/g')
      f=tune_$(echo "$c" | tr ',=' '_-')_r$round
      env $E timeout 60 $B --sizes 16M,256M --json "$R/$f.json" > "$R/$f.txt" 2>/dev/null
    done
  done
  summarize tune > "$R/tune_summary.txt"
  pack tune_summary.txt 14
fi
if has split; then
  # Where the I/O threads' time goes (benchmarks/time_split.py), GPU and
  # host memory, 16 and 256 MiB.
  { lscpu; which perf nsys; } > "$R/host_cpu.txt" 2>&1
  for mem in gpu host; do
    for size in 16M 256M; do
      f=split_${mem}_$size
      TCPX_P2P_LOG=debug timeout 60 python3 -m tcpx_p2p.bench pair --memory $mem --sizes $size --seconds 4 > "$R/$f.txt" 2> "$R/$f.log"
      python3 benchmarks/time_split.py "$R/$f.log" --json "$R/$f.json" >> "$R/$f.txt" 2>&1; pack $f.txt 6
    done
  done
fi
if has streams; then
  # Streams per comm, GPU -> GPU 16 / 256 MiB, alternated twice.
  for round in 1 2; do
    for n in ${STREAM_COUNTS:-8 12 16}; do
      timeout 60 $B --streams $n --sizes 16M,256M --json "$R/streams_${n}_r$round.json" > "$R/streams_${n}_r$round.txt" 2>/dev/null
    done
  done
  summarize streams > "$R/streams_summary.txt"; pack streams_summary.txt 8
fi
if has scale; then
  # Pairs of GPUs i -> i+n/2 at once, k in SCALE_PAIRS (default 1 2 4, those
  # that fit), in both layouts; the multi-process runs with the references
  # (raw TCP per pair, NCCL's socket transport per pair, all pairs at once).
  # The largest count is run again with the I/O threads left unpinned
  # (TCPX_P2P_CPU_AFFINITY=off) to measure placement.
  n=$(nvidia-smi -L | wc -l); p=$((n / 2))
  { nvidia-smi topo -m; lscpu; } > "$R/topo.txt" 2>&1
  ks=""; for k in ${SCALE_PAIRS:-1 2 4}; do [ $k -le $p ] && ks="$ks $k"; done
  kmax=${ks##* }
  for net in ${SCALE_NETS:-socket plugin}; do
    E=""; [ $net = plugin ] && E="TCPX_P2P_PLUGIN_PATH=$EMU"
    for k in $ks; do
      g=$(seq -s, 0 $((k - 1))),$(seq -s, $p $((p + k - 1)))
      for lay in multi single; do
        for aff in gpu off; do
          [ $aff = off ] && [ $k != $kmax ] && continue
          [ $lay = single ] && [ $k = 1 ] && continue
          f=scale_${net}_${k}pairs_$lay; [ $aff = off ] && f=${f}_unpinned
          L=""; [ $lay = single ] && L=--single-process
          ref=""; [ $lay = multi ] && [ $aff = gpu ] && ref=--reference
          env $E TCPX_P2P_CPU_AFFINITY=$aff timeout 150 $B --net $net --pairs $k $L --gpus $g --sizes 16M,256M $ref --json "$R/$f.json" > "$R/$f.txt" 2>"$R/$f.err"; pack $f.txt $((2 * k + 4))
        done
      done
    done
  done
fi
true
