#!/usr/bin/env bash
# UCCL's own P2P tests against tcpx-p2p, with only the import changed:
#   bash benchmarks/uccl_own_tests.sh UCCL_TESTS_DIR OUTDIR [FILE...]
# UCCL_TESTS_DIR: a folder holding UCCL's test files (p2p/tests of a UCCL
# checkout, any tag); their files are not part of this repository and are
# never changed in place: each is copied into OUTDIR with
# `from uccl import p2p` replaced by `from tcpx_p2p import p2p`, and run
# there, one at a time (with `torchrun --nproc_per_node=2` where its own
# docstring says so or it sets up torch.distributed from torchrun's
# environment), each under a time limit (UCCL_TEST_LIMIT, 120 s).
# FILEs default to every test_*.py that imports p2p (tests for RDMA-only or
# vendor-only parts of UCCL are left out). Several of UCCL's tests run their
# server and client as multiprocessing children and exit 0 whatever the
# children did, so a test is judged by every process it ran
# (benchmarks/uccl_judge.py): each runs under the judge, which records every
# process's exit code (multiprocessing children's included); a test passes
# only if every exit is 0 and no process printed a traceback or an
# AssertionError. OUTDIR/summary.txt: one line per file (pass / FAIL and
# why, and the last lines of its log); the script exits 1 if any failed.
set -uo pipefail
SRC=$1 O=$2
shift 2
LIMIT=${UCCL_TEST_LIMIT:-120}
mkdir -p "$O" && O=$(cd "$O" && pwd)
S="$O/summary.txt"
: > "$S"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  for f in "$SRC"/test_*.py; do
    case $(basename "$f") in *rdma*|*hygon*|*compress*|*_native*|test_util_*) continue ;; esac
    grep -q "from uccl import p2p" "$f" && files+=("$(basename "$f")")
  done
fi
JUDGE=$(cd "$(dirname "$0")" && pwd)/uccl_judge.py
failed=0
for name in "${files[@]}"; do
  src="$SRC/$name" dst="$O/$name"
  [ -f "$src" ] || { echo "$name: FAIL (missing in $SRC)" >> "$S"; failed=1; continue; }
  sed 's/^\(\s*\)from uccl import p2p/\1from tcpx_p2p import p2p/' "$src" > "$dst"
  rec="$O/$name.exits"
  rm -f "$rec"
  # Two ranks under torchrun: files that say so, and files that set up
  # torch.distributed from torchrun's environment (RANK, WORLD_SIZE, …).
  if grep -Eq 'torchrun|init_process_group\((backend=)?"[a-z]+"\)' "$dst"; then
    (cd "$O" && timeout "$LIMIT" torchrun --nproc_per_node=2 "$JUDGE" run "$rec" "$name" > "$name.log" 2>&1)
  else
    (cd "$O" && timeout "$LIMIT" python3 "$JUDGE" run "$rec" "$name" > "$name.log" 2>&1)
  fi
  rc=$?
  verdict=$(python3 "$JUDGE" verdict "$rc" "$O/$name.log" "$rec") || failed=1
  [ "$rc" = 124 ] && verdict="$verdict, limit $LIMIT s"
  { echo "$name: $verdict"; tail -3 "$O/$name.log" | sed 's/^/    /'; } >> "$S"
done
cat "$S"
exit $failed
