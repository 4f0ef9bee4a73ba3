#!/bin/bash
# The core figures, old (6566d2a) beside new (62c8e6d: host sends wait for room in the poller, lingering workers count as free, a progress task holds no thread while its transfer is in flight; 8,192 blocks a gathered message), alternated twice.
OUT=$1
W() { ls .device/w/$1/*.whl; }
ROUNDS=2 timeout 560 bash benchmarks/gpu_round.sh "old=$(W old) new=$(W new)" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^writex|^[0-9]+ |^send|^kv|KV" $OUT/core/summary.txt | head -60
