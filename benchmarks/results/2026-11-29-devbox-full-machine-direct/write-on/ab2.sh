#!/bin/bash
# new = 80baf04 (the posting thread writes what the socket takes at once), new2 = the same writing on as room comes, up to 1 ms a message; 2-core box, host memory, HOGS cpu hogs
for r in 1 2 3; do
  for i in $(seq $HOGS); do (timeout 60 yes > /dev/null &); done
  for b in new new2; do
    echo "hogs=$HOGS $b r$r: $(PYTHONPATH=/tmp/site_$b python3 benchmarks/sendrecv_loop.py --shape uccl --sizes 64K,256K,1M,10M --rounds 6 --json $OUTD/ab2_${HOGS}_${b}_$r.json | awk 'NR>1{printf "%s ", $4}')"
  done
  pkill yes; sleep 1
done
