#!/bin/bash
# Round 5: which GPU test outlived the suites' limits, and whether the build before the held ends (w6) does the same: pytest -v with faulthandler_timeout on the plugin net's CUDA cases (w7, then w6) and on the socket net's UCCL-compat / hostile-argument cases (w7)
set -u
D=${FILES:?a folder with the wheels w6/ and w7/}
for run in "w7 plugin api" "w6 plugin api" "w7 socket compat"; do
  set -- $run
  ( . benchmarks/device_env.sh "$(ls $D/$1/*.whl)" >/dev/null 2>&1 || exit 1
    EMU=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())')
    pre="env TCPX_P2P_NET=socket"; [ $2 = plugin ] && pre="env TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=$EMU"
    files="tests/test_api.py -k cuda"; [ $3 = compat ] && files="tests/test_uccl_compat.py tests/test_hostile_args.py"
    timeout 125 $pre python3 -m pytest -p no:cacheprovider -v -rs -o faulthandler_timeout=40 --durations=8 $files > $OUT/$1_$2_$3.txt 2>&1
    echo "$run exit $?"
    grep -E "PASSED|FAILED|SKIPPED|ERROR|Timeout|passed|failed" $OUT/$1_$2_$3.txt | sed 's/^tests\///' | cut -c1-110 | tail -40 )
done
