#!/bin/bash
# The core figures, old (6566d2a) beside final (ed7b3ed: the control reader waiting its linger in one call again), alternated twice.
OUT=$1
W() { ls .device/w/$1/*.whl; }
ROUNDS=2 timeout 450 bash benchmarks/gpu_round.sh "old=$(W old) final=$(W final)" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^writex|^[0-9]+ |^send|^kv|KV" $OUT/core/summary.txt | head -60
