#!/usr/bin/env bash
# Where one blocking GPU transfer's time goes, and what the staging slice
# does to it, on a one-GPU (or larger) machine:
#   bash benchmarks/gpu_probe.sh WHEEL OUTDIR [STEP...]
# STEPs (default: trace slices):
#   trace4k  traced blocking GPU → GPU send 4K and 64K only
#   trace    traced blocking GPU → GPU send 4K / 64K / 1M and write 64K / 1M
#            (default inline threshold), split by benchmarks/lat_breakdown.py
#   slices   blocking write and send at 1M / 16M / 256M, then 8 in flight at
#            16M / 256M, with TCPX_P2P_STAGING_SLICE 1M and SLICE_B (default
#            256K), the two alternated over ROUNDS (default 2) rounds
#   knobs    blocking write and send at 1M / 16M for each pair of
#            TCPX_P2P_MIN_PART in PARTS (default "128K 256K 512K") and
#            TCPX_P2P_STAGING_SLICE in KSLICES (default "1M 256K"), the
#            pairs alternated over ROUNDS rounds
#   parts    TCPX_P2P_MIN_PART 128K against 256K, alternated over ROUNDS
#            rounds: GPU blocking write / send 256K and 1M, GPU 8 in flight
#            1M and 4M, host blocking and 8 in flight write 1M
#   rule     the default cut against TCPX_P2P_MIN_PART=128K (on 16 to 31
#            cores: the cut before parts grew with the square root of the
#            size), alternated over ROUNDS rounds: GPU blocking write / read
#            / send 64K-16M, GPU and host 8 in flight 256K-2M
#   h2d      benchmarks/h2d_small.py: small host → GPU copies, by how made
# Everything goes into OUTDIR/gpu_probe.tar.gz plus OUTDIR/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 O=$2
shift 2
STEPS=${*:-trace slices}
SLICE_B=${SLICE_B:-256K} ROUNDS=${ROUNDS:-2}
W=$(mktemp -d)/gpu_probe
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
  { echo; echo "== $name (status $rc; 124: ran over its limit of $limit s)"; grep -E '^(op|write|read|send) ' "$W/$name.txt"; } >> "$S"
}

for st in $STEPS; do
  case $st in
    trace4k)
      MEMORY=gpu GPUS=$GPUS OP=send ITERS=100 timeout 100 bash benchmarks/lat_breakdown_run.sh "$W/trace" "4K 64K" 64K >> "$W/trace.log" 2>&1
      for f in "$W"/trace/*.txt; do { echo; echo "== $(basename "$f")"; cat "$f"; } >> "$S"; done ;;
    trace)
      MEMORY=gpu GPUS=$GPUS OP=send ITERS=100 timeout 150 bash benchmarks/lat_breakdown_run.sh "$W/trace" "4K 64K 1M" 64K >> "$W/trace.log" 2>&1
      MEMORY=gpu GPUS=$GPUS OP=write ITERS=100 timeout 100 bash benchmarks/lat_breakdown_run.sh "$W/trace" "64K 1M" 64K >> "$W/trace.log" 2>&1
      for f in "$W"/trace/*.txt; do { echo; echo "== $(basename "$f")"; cat "$f"; } >> "$S"; done ;;
    slices)
      for r in $(seq "$ROUNDS"); do
        for sl in 1M "$SLICE_B"; do
          step "blocking-slice$sl-r$r" 75 env TCPX_P2P_STAGING_SLICE="$sl" \
            $B --inflight 1 --op write,send --sizes 1M,16M,256M --rounds 1
          step "inflight8-slice$sl-r$r" 60 env TCPX_P2P_STAGING_SLICE="$sl" \
            $B --inflight 8 --op write,send --sizes 16M,256M --rounds 1
        done
      done ;;
    knobs)
      for r in $(seq "$ROUNDS"); do
        for mp in ${PARTS:-128K 256K 512K}; do
          for sl in ${KSLICES:-1M 256K}; do
            step "knob-part$mp-slice$sl-r$r" 45 env TCPX_P2P_MIN_PART="$mp" TCPX_P2P_STAGING_SLICE="$sl" \
              $B --inflight 1 --op write,send --sizes 1M,16M --rounds 1
          done
        done
      done ;;
    parts)
      H="python3 -m tcpx_p2p.bench pair --memory host"
      for r in $(seq "$ROUNDS"); do
        for mp in 128K 256K; do
          E="env TCPX_P2P_MIN_PART=$mp"
          step "parts$mp-gpu-blocking-r$r" 40 $E $B --inflight 1 --op write,send --sizes 256K,1M --rounds 1
          step "parts$mp-gpu-inflight8-r$r" 40 $E $B --inflight 8 --op write,send --sizes 1M,4M --rounds 1
          step "parts$mp-host-blocking-r$r" 30 $E $H --inflight 1 --op write --sizes 1M --rounds 1
          step "parts$mp-host-inflight8-r$r" 30 $E $H --inflight 8 --op write --sizes 1M --rounds 1
        done
      done ;;
    rule)
      H="python3 -m tcpx_p2p.bench pair --memory host"
      for r in $(seq "$ROUNDS"); do
        for mp in default 128K; do
          E=env
          [ "$mp" = default ] || E="env TCPX_P2P_MIN_PART=$mp"
          step "rule-$mp-gpu-blocking-r$r" 90 $E $B --inflight 1 --op write,read,send --sizes 64K,256K,512K,1M,2M,16M --rounds 1
          step "rule-$mp-gpu-inflight8-r$r" 60 $E $B --inflight 8 --op write,send --sizes 256K,1M,2M --rounds 1
          step "rule-$mp-host-inflight8-r$r" 40 $E $H --inflight 8 --op write --sizes 256K,1M,2M --rounds 1
        done
      done ;;
    h2d)
      timeout 90 python3 benchmarks/h2d_small.py --json "$W/h2d_small.json" > "$W/h2d_small.txt" 2>&1
      { echo; echo "== h2d_small (status $?)"; cat "$W/h2d_small.txt"; } >> "$S" ;;
    *) echo "unknown step $st" >> "$S" ;;
  esac
done
tar -czf "$O/gpu_probe.tar.gz" -C "$(dirname "$W")" gpu_probe
echo "wrote $O/gpu_probe.tar.gz and $S"
