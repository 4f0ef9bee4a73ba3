#!/usr/bin/env bash
# Google's GPUDirect-TCPX ncclNet plugin, built from its public source on a
# GPU machine, driven by our engine's plugin net over loopback with host
# memory (no A3 NICs: the data path is the plugin's host-memory path; its
# flow-steering requests go to benchmarks/rx_rule_manager_standin.py).
#
#   bash benchmarks/tcpx_real_plugin.sh WHEEL DEPS OUTDIR [STEP...]
#
# DEPS is a folder that is not part of this repository, holding:
#   plugin.tgz  the plugin's source (git archive --prefix=tcpx/ of
#               google/nccl-plugin-gpudirecttcpx, commit 4b8ea7f, v3.1.9)
#   nccl.tgz    NCCL 2.19.3's src/ and makefiles/ (git archive --prefix=nccl/
#               v2.19.3-1 src makefiles): the headers the plugin builds with
#   absl.tgz    Abseil's source (git archive --prefix=absl/, 20240722.0):
#               the plugin uses absl/log, newer than the distributions' Abseil
#   debs/       protobuf 3.21 (Debian 12: libprotobuf-dev libprotobuf32
#               libprotoc32 protobuf-compiler), unpacked into a private prefix
# STEPs (default: all, in this order):
#   build   Abseil, then the plugin (CMake, nvcc sm_90) -> libnccl-net.so
#   smoke   one send, write and read of 4 KiB and 1 MiB, bytes checked
#   bench   send / write / read 4 KiB … 64 MiB, pipelined, the real plugin
#           beside the stand-in in the same run, and 64-block vectors
#   suite   the Python end-to-end API tests on host memory over the plugin
#   kill    the reliability tests: a peer killed or gone mid-transfer
#   setup   connection set-up with the default 5 s flow-steering wait
# OUTDIR gets build.log, one log per step, rxdm.log (what the plugin asked
# the rx rule manager) and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=$1 DEPS=$(realpath "$2") O=$(realpath -m "$3")
shift 3
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build smoke bench suite kill setup)
mkdir -p "$O"
S="$O/summary.txt"
: >"$S"
W=${TCPX_REAL_WORK:-/tmp/tcpx-real}
P=$W/prefix
LIB=$W/tcpx-build/libnccl-net.so
mkdir -p "$W" "$P"
. benchmarks/device_env.sh "$WHEEL"
{ date -u +%FT%TZ; nvidia-smi -L; nvcc --version | tail -1; cmake --version | head -1; } >"$O/device.txt" 2>&1
export LD_LIBRARY_PATH=$P/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

note() { echo "$*" | tee -a "$S"; }

build() {
  tar -C "$W" -xzf "$DEPS/plugin.tgz" && tar -C "$W" -xzf "$DEPS/nccl.tgz" && tar -C "$W" -xzf "$DEPS/absl.tgz" || return 1
  for d in "$DEPS"/debs/*.deb; do dpkg -x "$d" "$P" || return 1; done
  # The top CMakeLists.txt of commit 4b8ea7f opens with a C-style licence
  # comment, which CMake cannot parse: turn those lines into # comments
  # (in the extracted copy).
  sed -i '1,/\*\//s/^/# /' "$W/tcpx/CMakeLists.txt"
  # Its .proto files open with '#' licence lines, which protoc cannot parse:
  # make them '//' comments.
  sed -i 's|^#|//|' "$W"/tcpx/src/rx_buf_mgr_client/proto/*.proto
  # nccl.h from nccl.h.in, as NCCL's own makefile makes it.
  mkdir -p "$W/nccl/build/include"
  sed -e 's/${nccl:Major}/2/g' -e 's/${nccl:Minor}/19/g' -e 's/${nccl:Patch}/3/g' \
      -e 's/${nccl:Suffix}//g' -e 's/${nccl:Version}/21903/g' \
      "$W/nccl/src/nccl.h.in" >"$W/nccl/build/include/nccl.h"
  cp "$W/nccl/src/include/nccl_net.h" "$W/nccl/build/include/" 2>/dev/null
  cmake -S "$W/absl" -B "$W/absl-build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
    -DCMAKE_CXX_STANDARD=17 -DABSL_PROPAGATE_CXX_STD=ON -DABSL_BUILD_TESTING=OFF \
    -DCMAKE_INSTALL_PREFIX="$P/absl" >/dev/null &&
    cmake --build "$W/absl-build" -j "$(nproc)" >/dev/null && cmake --install "$W/absl-build" >/dev/null || return 1
  # What the plugin's CMake asks for beyond the plugin itself: GTest for its
  # unit tests (not built here) and protobuf>=22's utf8 targets (3.21 has
  # them inside libprotobuf): empty targets of those names.
  mkdir -p "$W/shim"
  cat >"$W/shim/GTestConfig.cmake" <<'EOF'
foreach(t GTest::gtest GTest::gtest_main GTest::gmock GTest::gmock_main)
  if(NOT TARGET ${t})
    add_library(${t} INTERFACE IMPORTED)
  endif()
endforeach()
EOF
  cat >"$W/shim/project.cmake" <<'EOF'
foreach(t utf8_range utf8_validity)
  if(NOT TARGET ${t})
    add_library(${t} INTERFACE IMPORTED GLOBAL)
  endif()
endforeach()
EOF
  # CUDA 13 gave cuCtxCreate a parameters argument (cuCtxCreate_v4); the
  # plugin calls the older three-argument form, which is the same call with
  # no parameters.
  cat >"$W/shim/cuda13.h" <<'EOF'
#include <cuda.h>
#if CUDA_VERSION >= 13000
#undef cuCtxCreate
#define cuCtxCreate(pctx, flags, dev) cuCtxCreate_v4((pctx), NULL, (flags), (dev))
#endif
EOF
  cmake -S "$W/tcpx" -B "$W/tcpx-build" -DNCCL_PATH="$W/nccl" -DNCCL_VERSION=2.19.3 \
    -DCMAKE_CUDA_FLAGS="-include $W/shim/cuda13.h" \
    -DNET_GPUDIRECTTCPX_EXPORT=nccl -DNCCL_INCLUDE_PATH="$W/nccl/build/include" \
    -Dabsl_DIR="$P/absl/lib/cmake/absl" -DGTest_DIR="$W/shim" -DCMAKE_PROJECT_INCLUDE="$W/shim/project.cmake" \
    -DProtobuf_INCLUDE_DIR="$P/usr/include" -DProtobuf_LIBRARY="$P/usr/lib/x86_64-linux-gnu/libprotobuf.so" \
    -DProtobuf_PROTOC_EXECUTABLE="$P/usr/bin/protoc" -DProtobuf_PROTOC_LIBRARY="$P/usr/lib/x86_64-linux-gnu/libprotoc.so" &&
    cmake --build "$W/tcpx-build" -j "$(nproc)" --target nccl-net || return 1
  [ -f "$LIB" ] && nm -D --defined-only "$LIB" | grep -i ncclNetPlugin
}

# The plugin's settings for loopback and host memory (docs/TCPX.md).
real_env() {
  export TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH=${PLUGIN:-$LIB} TCPX_P2P_IFNAME=lo
  export NCCL_GPUDIRECTTCPX_SOCKET_IFNAME=lo NCCL_GPUDIRECTTCPX_CTRL_DEV=lo
  export NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX=$W/rx NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT=0
  export NCCL_DYNAMIC_CHUNK_SIZE=524288 NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS=${FS_WAIT_US:-1000}
  # FS_WAIT_US=default: the plugin's own default wait (5 s).
  [ "${FS_WAIT_US:-}" = default ] && unset NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN} NCCL_DEBUG_SUBSYS=INIT,NET
}

rxdm() {
  python3 benchmarks/rx_rule_manager_standin.py "$W/rx" "$O/rxdm.log" &
  RXDM=$!
  sleep 0.5
}

step() { # step NAME LIMIT CMD...
  local name=$1 limit=$2
  shift 2
  (real_env; timeout "$limit" "$@") >"$O/$name.log" 2>&1
  local rc=$?
  note "== $name: exit $rc$([ $rc = 124 ] && echo " (over its limit of $limit s)")"
  grep -v -E '^\s*$' "$O/$name.log" | tail -14 | sed 's/^/    /' >>"$S"
  return $rc
}

B="python3 -m tcpx_p2p.bench pair --memory host"
for st in "${STEPS[@]}"; do
  case $st in
  build)
    (time build) >"$O/build.log" 2>&1
    rc=$?
    note "== build: exit $rc"
    tail -8 "$O/build.log" | sed 's/^/    /' >>"$S" ;;
  smoke)
    rxdm
    step smoke 120 $B --op send,write,read --sizes 4K,1M --iters 20 ;;
  bench)
    step bench_real 240 $B --op send,write,read --sizes 4K,64K,1M,16M,64M --rounds 2 --json "$O/bench_real.json"
    (PLUGIN=$(python3 -c 'import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())') \
      step bench_standin 240 $B --op send,write,read --sizes 4K,64K,1M,16M,64M --rounds 2 --json "$O/bench_standin.json")
    step bench_real_kv 120 $B --op write,read --kv-blocks 64 --block-size 256K --iters 20 ;;
  suite)
    step suite 400 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_api.py -k cpu ;;
  kill)
    step kill 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_reliability.py -k "not cuda" ;;
  setup)
    # The whole run's time, connection set-up included: with a 1 ms wait,
    # then with the plugin's default (5 s) flow-steering wait.
    step setup_1ms 120 bash -c "time $B --op write --sizes 1M --iters 5"
    FS_WAIT_US=default step setup_default 120 bash -c "time $B --op write --sizes 1M --iters 5" ;;
  *) echo "unknown step $st" >&2 ;;
  esac
done
[ -n "${RXDM:-}" ] && kill "$RXDM" 2>/dev/null
cat "$S"
