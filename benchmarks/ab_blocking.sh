#!/usr/bin/env bash
# Two builds on one machine, alternated round by round, one transfer at a
# time and eight in flight, GPU → GPU (both sides on GPU 0 with one GPU):
#   bash benchmarks/ab_blocking.sh OLD_WHEEL NEW_WHEEL OUTDIR [ROUNDS]
# Each round, for each wheel in turn:
#   blocking  write / read / send at AB_SIZES (default 1M,2M,16M,64M)
#   inflight8 write / send at 16M and 256M (nothing slower)
#   kv        4,096 × 32 KiB scattered writev beside one 128 MiB write
# AB_STEPS picks some of them (default "blocking inflight8 kv").
# The table rows of every run go to OUTDIR/summary.txt (each tagged with
# build and round); the raw output to OUTDIR/ab_blocking.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=$1 NEW=$2 O=$3 ROUNDS=${4:-2}
SIZES=${AB_SIZES:-1M,2M,16M,64M}
W=$(mktemp -d)/ab_blocking
mkdir -p "$W" "$O"
S="$O/summary.txt"
{ date -u +%FT%TZ; nvidia-smi -L; } > "$S" 2>&1
for r in $(seq 1 "$ROUNDS"); do
  for tw in "old=$OLD" "new=$NEW"; do
    tag=${tw%%=*} w=${tw#*=}
    (
      . benchmarks/device_env.sh "$w"
      pair_gpus
      B="python3 -m tcpx_p2p.bench pair --memory gpu --gpus $GPUS"
      run() { # run NAME LIMIT ARGS...
        local name=${tag}_r${r}_$1 limit=$2
        shift 2
        timeout "$limit" $B "$@" --out "$W/$name" > "$W/$name.txt" 2> "$W/$name.err"
        echo "== $name (status $?)"
        grep -E '^(write|read|send)' "$W/$name.txt"
      }
      for st in ${AB_STEPS:-blocking inflight8 kv}; do
        case $st in
          blocking) run blocking 120 --inflight 1 --op write,read,send --sizes "$SIZES" --rounds 1 ;;
          inflight8) run inflight8 90 --inflight 8 --op write,send --sizes 16M,256M --rounds 1 ;;
          kv)
            run kv_scattered 45 --inflight 1 --op write --kv-blocks 4096 --block-size 32K --kv-layout scattered --rounds 1
            run kv_one_message 30 --inflight 1 --op write --sizes 128M --rounds 1 ;;
        esac
      done
    ) >> "$S"
  done
done
tar -czf "$O/ab_blocking.tar.gz" -C "$(dirname "$W")" ab_blocking
echo "wrote $S and $O/ab_blocking.tar.gz"
