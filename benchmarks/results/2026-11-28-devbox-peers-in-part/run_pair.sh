#!/bin/bash
# Host send beside raw TCP, the two builds alternated, three rounds.
OLD=${1:?folder of the old build unpacked}; NEW=${2:?folder of the new build unpacked}
for r in 1 2 3; do
  for b in old new; do
    pkg=$OLD; [ $b = new ] && pkg=$NEW
    TCPX_P2P_NET=socket PYTHONPATH=$pkg timeout 900 python3 -m tcpx_p2p.bench pair --memory host \
      --sizes 4K,64K,1M,16M,256M --reference --out host-$b-$r > host-$b-$r.txt 2>&1
    echo "$b $r rc=$?"
  done
done
