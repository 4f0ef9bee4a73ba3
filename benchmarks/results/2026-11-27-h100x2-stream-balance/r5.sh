#!/bin/bash
# Round 5: the spill (new = w3) beside the build this work started from (old = w1): NIXL at vLLM's descriptor counts, paired, one run each; the core figures alternated once; the CUDA suite of the Python API over both nets on the new build
set -u
D=${FILES:?a folder with the wheels w1/ and w3/}
n=$(mktemp -d); tar -C "$n" -xf "$NIXL_TGZ"
NIXL_PP=$(dirname "$(dirname "$(find "$n" -maxdepth 3 -path '*/nixl_cu1[0-9]/__init__.py' | head -1)")")
mkdir -p $OUT/v
for b in new old; do
  w=w1; [ $b = new ] && w=w3
  ( . benchmarks/device_env.sh "$(ls $D/$w/*.whl)" >/dev/null 2>&1 || exit 1
    export PYTHONPATH=$NIXL_PP:$PYTHONPATH
    timeout 120 python3 benchmarks/nixl_bench.py --memory gpu --gpus 0,1 --sizes "" --kv 131072x4K,131072x16K --backends TCPX_P2P --telemetry --notifs 0 --rounds 1 --paired --bytes-per-row 8G --out $OUT/v/$b > $OUT/v/$b.txt 2>&1; echo "$b exit $?" )
  grep -E "paired|same bytes|GB/s" $OUT/v/$b.txt | grep -v "^round"
done
ROUNDS=1 timeout 240 bash benchmarks/gpu_round.sh "old=$(ls $D/w1/*.whl) new=$(ls $D/w3/*.whl)" $OUT/core core > /dev/null 2>&1; echo "core exit $?"
grep -E "^== |^write|^[0-9]{6,}" $OUT/core/summary.txt | head -30
. benchmarks/device_env.sh "$(ls $D/w3/*.whl)" >/dev/null 2>&1 || exit 1
EMU=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())')
for net in socket plugin; do
  pre="env TCPX_P2P_NET=socket"; [ $net = plugin ] && pre="env TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU"
  timeout 110 $pre python3 -m pytest -p no:cacheprovider -q -rs tests/test_api.py -k cuda > $OUT/v/suite_$net.txt 2>&1; echo "suite $net exit $?"; tail -3 $OUT/v/suite_$net.txt
done
cd $OUT && tar czf v.tgz v && rm -rf v
