#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 600) with the nightly
# toolchain and cargo-fuzz, keeping the corpus under fuzz/corpus/, and writes
# a summary (executions per target) to benchmarks/results/fuzz-<date>.txt.
#   bash fuzz/run.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")"
SECS=${1:-600}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
OUT=../benchmarks/results/fuzz-$(date +%Y-%m-%d).txt
echo "fuzz run $(date -u +%FT%TZ), ${SECS}s per target, $(nproc) cores" > "$OUT"
for t in ${TARGETS:-metadata fifo_item descs hello control handler rma_recvs notif proto_pair part_header same_host_net}; do
    mkdir -p corpus/$t
    log=$(mktemp)
    cargo +nightly fuzz run "$t" corpus/$t -- -max_total_time="$SECS" -rss_limit_mb=2048 -malloc_limit_mb=64 2>&1 | tee "$log" | tail -3
    echo "$t: $(grep -E '^Done|^#[0-9]+.*DONE' "$log" | tail -1)" >> "$OUT"
done
cat "$OUT"
