#!/bin/bash
# The core figures, old (78db7b8) beside new (ee84b47: pieces hold a region once per run, frames encoded in place, runs planned over the pieces, faster piece checks), alternated twice.
OUT=$1
W() { ls .device/w/$1/*.whl; }
ROUNDS=2 timeout 560 bash benchmarks/gpu_round.sh "old=$(W old) new=$(W new)" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^writex|^[0-9]+ |^send|^kv|KV" $OUT/core/summary.txt | head -60
