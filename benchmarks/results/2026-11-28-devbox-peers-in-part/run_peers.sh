#!/bin/bash
# The two builds alternated, three rounds: results in the current folder.
OLD=${1:?folder of the old build unpacked}; NEW=${2:?folder of the new build unpacked}
for r in 1 2 3; do
  for b in old new; do
    pkg=$OLD; [ $b = new ] && pkg=$NEW
    TCPX_P2P_NET=socket PYTHONPATH=$pkg timeout 900 python3 -m tcpx_p2p.bench peers \
      --peers 256 --procs 8 --busy 64 --out peers-$b-$r > peers-$b-$r.txt 2>&1
    echo "$b $r rc=$?"
  done
done
