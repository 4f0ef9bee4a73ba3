#!/usr/bin/env bash
# Two builds on one machine, alternated (machine-to-machine variance is as large
# as most changes): bash benchmarks/ab_compare.sh OLD_WHEEL NEW_WHEEL OUTDIR [ROUNDS]
# Each round runs, for each wheel in turn, GPU → GPU latency and throughput
# at AB_SIZES (default 4K,64K,1M) and, unless AB_KV=0, a scattered
# 4,096 × 32 KiB KV writev. AB_MEMORY=host measures host memory instead
# (no KV), AB_ARGS adds bench options (e.g. --reference for raw TCP's
# figures beside each run), AB_MORE="tag=WHEEL[@VAR=V,VAR=V] ..." alternates
# more builds (or one build with other settings),
# AB_NET=plugin runs the plugin net through each wheel's own TCPX stand-in.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=$1 NEW=$2 O=$3 ROUNDS=${4:-2}
MEM=${AB_MEMORY:-gpu}
mkdir -p "$O"
for r in $(seq 1 "$ROUNDS"); do
  for tw in "old=$OLD" "new=$NEW" ${AB_MORE:-}; do
    tag=${tw%%=*} w=${tw#*=} set_env=""
    case $w in *@*) set_env=${w#*@} w=${w%%@*};; esac
    (
      for kv in ${set_env//,/ }; do export "${kv?}"; done
      . benchmarks/device_env.sh "$w"
      B="python3 -m tcpx_p2p.bench pair --memory $MEM"
      if [ "${AB_NET:-socket}" = plugin ]; then
        TCPX_P2P_PLUGIN_PATH=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())')
        export TCPX_P2P_PLUGIN_PATH
        B="$B --net plugin"
      fi
      # shellcheck disable=SC2086
      timeout 90 $B --sizes "${AB_SIZES:-4K,64K,1M}" ${AB_ARGS:-} --json "$O/${tag}_r${r}_lat.json" > "$O/${tag}_r${r}_lat.txt" 2>/dev/null
      [ "${AB_KV:-1}" = 0 ] || [ "$MEM" = host ] || timeout 60 $B --op write --kv-blocks 4096 --block-size 32K --json "$O/${tag}_r${r}_kv.json" > "$O/${tag}_r${r}_kv.txt" 2>/dev/null
    )
    echo "== $tag round $r"; grep -E "^(send|write) |one-way" "$O/${tag}_r${r}_lat.txt" "$O/${tag}_r${r}_kv.txt" 2>/dev/null | sed 's/^[^:]*://'
  done
done
