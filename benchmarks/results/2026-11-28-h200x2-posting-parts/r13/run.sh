#!/bin/bash
# The core figures, today's start (old: 1af04da) beside today's end (new), alternated twice.
OUT=$1
W() { ls .device/r13/$1/*.whl; }
ROUNDS=2 timeout 540 bash benchmarks/gpu_round.sh "old=$(W old) new=$(W new)" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^writex|^[0-9]+ |^send|^kv|KV" $OUT/core/summary.txt | head -60
