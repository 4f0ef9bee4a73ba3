#!/usr/bin/env bash
# Drives Google's real GPUDirect-TCPX plugin with this engine's plugin net,
# on a GPU machine without A3 hardware: host memory over loopback, beside
# the stand-in in the same run.
#
#   benchmarks/tcpx_real_plugin.sh SRC_DIR OUTDIR
#
# SRC_DIR: a checkout of google/nccl-plugin-gpudirecttcpx (commit 4b8ea7f,
# v3.1.9), fetched elsewhere and carried to the machine; it is built here
# and never copied into this repository.
#
# What it needs on the machine (it has nvcc, CMake and CUDA, no internet):
#   NCCL_SRC=DIR   an NCCL 2.19.x / 2.20.x source tree (headers only: nccl.h
#                  is generated from src/nccl.h.in when build/include lacks it)
#   DEBS_DIR=DIR   optional: .deb files installed with dpkg -i before the
#                  build, for what CMake cannot find: Abseil and protobuf for
#                  Ubuntu 24.04 (libabsl-dev, libabsl20220623t64,
#                  libprotobuf-dev, libprotobuf32t64, libprotoc32t64,
#                  protobuf-compiler, libutf8-range-dev if split out)
#   PY=PYTHON      a Python with the tcpx_p2p package installed (./run's
#                  .venv/bin/python by default)
#
# What it does (each step logs under OUTDIR; RESULTS.json sums it up):
#   1. builds the plugin (cmake, NET_GPUDIRECTTCPX_EXPORT=nccl) -> libnccl-net.so
#   2. starts a stand-in for the rx rule manager: unix sockets
#      PREFIX/rx_rule_manager and PREFIX/rx_rule_uninstall that answer
#      every request (2-byte big-endian length + protobuf) with "Ok."
#      (00 05 0a 03 4f 6b 2e), and count them
#   3. tcpx-p2p-bench pair --net plugin --memory host over lo, send, write
#      and read at 4 KiB ... 64 MiB (windows of 16 requests per comm), with
#      the real plugin and with the stand-in, one after the other
#   4. one connection set-up with the plugin's default 5 s flow-steering
#      wait, timed
# The real plugin runs with its GPU receive pool not imported
# (NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT=0): its device handle then has
# no bounce buffer and the engine's plugin net lands host receives straight
# in their buffers; GPU memory cannot move without A3's devmem TCP.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "${1:?usage: $0 SRC_DIR OUTDIR}" && pwd)
out=${2:?usage: $0 SRC_DIR OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PY:-$here/.venv/bin/python}
log() { echo "[tcpx_real_plugin] $*" | tee -a "$out/steps.log" >&2; }
fail() {
  log "FAILED: $*"
  printf '{"ok": false, "failed_step": "%s"}\n' "$*" >"$out/RESULTS.json"
  exit 1
}

command -v nvidia-smi >/dev/null && nvidia-smi -L >"$out/gpus.txt" 2>&1 || fail "no GPU (the plugin's init calls cuInit and exits without one)"
"$PY" -c "import tcpx_p2p" 2>"$out/python.log" || fail "no tcpx_p2p package for $PY (run ./run demo first, or set PY)"

# ---- 1. build
if [ -n "${DEBS_DIR:-}" ]; then
  log "installing the carried .deb files from $DEBS_DIR"
  dpkg -i "$DEBS_DIR"/*.deb >"$out/dpkg.log" 2>&1 || fail "dpkg -i of $DEBS_DIR (see dpkg.log)"
fi
nccl=${NCCL_SRC:?set NCCL_SRC to an NCCL 2.19/2.20 source tree}
nccl=$(cd "$nccl" && pwd)
if [ ! -f "$nccl/build/include/nccl.h" ]; then
  log "generating $nccl/build/include/nccl.h from src/nccl.h.in"
  # shellcheck disable=SC1090
  eval "$(sed -n 's/^\(NCCL_[A-Z]*\) *:*= *\(.*\)$/\1=\2/p' "$nccl/makefiles/version.mk")"
  ver=$(printf "%d%02d%02d" "$NCCL_MAJOR" "$NCCL_MINOR" "$NCCL_PATCH")
  mkdir -p "$nccl/build/include"
  sed -e "s/\${nccl:Major}/$NCCL_MAJOR/g" -e "s/\${nccl:Minor}/$NCCL_MINOR/g" \
    -e "s/\${nccl:Patch}/$NCCL_PATCH/g" -e "s/\${nccl:Suffix}/${NCCL_SUFFIX:-}/g" \
    -e "s/\${nccl:Version}/$ver/g" "$nccl/src/nccl.h.in" >"$nccl/build/include/nccl.h" || fail "generating nccl.h"
fi
ncclver=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$nccl/build/include/nccl.h" | paste -sd.)
log "building the plugin from $src against NCCL $ncclver"
export PATH=/usr/local/cuda/bin:$PATH
cmake -S "$src" -B "$out/build" -DNCCL_PATH="$nccl" -DNCCL_VERSION="$ncclver" \
  -DNET_GPUDIRECTTCPX_EXPORT=nccl -DNCCL_INCLUDE_PATH="$nccl/build/include" \
  -DCMAKE_CUDA_ARCHITECTURES=90 >"$out/cmake.log" 2>&1 || fail "cmake configure (see cmake.log)"
cmake --build "$out/build" -j "$(nproc)" >>"$out/cmake.log" 2>&1 || fail "cmake build (see cmake.log)"
real=$(find "$out/build" -name 'libnccl-net*.so' | head -1)
[ -n "$real" ] || fail "no libnccl-net*.so in $out/build"
nm -D "$real" | grep ncclNetPlugin >"$out/symbols.txt"
log "built $real ($(tr '\n' ' ' <"$out/symbols.txt"))"

# ---- 2. the rx rule manager stand-in
prefix="$out/rx"
mkdir -p "$prefix"
cat >"$out/rx_rule_manager_standin.py" <<'EOF'
# Answers the plugin's flow-steering requests with "Ok." and counts them.
import os, socket, sys, threading
prefix = sys.argv[1]
counts = {"rx_rule_manager": 0, "rx_rule_uninstall": 0}
lock = threading.Lock()
OK = bytes([0x00, 0x05, 0x0A, 0x03]) + b"Ok."

def serve_conn(c, name):
    with c:
        while True:
            head = c.recv(2, socket.MSG_WAITALL)
            if len(head) < 2:
                return
            n = int.from_bytes(head, "big")
            body = c.recv(n, socket.MSG_WAITALL) if n else b""
            if len(body) < n:
                return
            with lock:
                counts[name] += 1
                with open(os.path.join(prefix, "counts"), "w") as f:
                    f.write(repr(counts))
            c.sendall(OK)

def listen(name):
    path = os.path.join(prefix, name)
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(256)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve_conn, args=(c, name), daemon=True).start()

for n in counts:
    threading.Thread(target=listen, args=(n,), daemon=True).start()
threading.Event().wait()
EOF
python3 "$out/rx_rule_manager_standin.py" "$prefix" >"$out/rx_rule_manager.log" 2>&1 &
rxpid=$!
trap 'kill $rxpid 2>/dev/null' EXIT
sleep 1
[ -S "$prefix/rx_rule_manager" ] || fail "the rx rule manager stand-in did not start"

# ---- 3. the engine over the real plugin and over the stand-in, host memory
export TCPX_P2P_IFNAME=lo
tcpx_env=(
  NCCL_GPUDIRECTTCPX_SOCKET_IFNAME=lo
  NCCL_GPUDIRECTTCPX_CTRL_DEV=lo
  NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX="$prefix"
  NCCL_TCPX_RXMEM_IMPORT_USE_GPU_PCI_CLIENT=0
  NCCL_DYNAMIC_CHUNK_SIZE=524288
  NCCL_NSOCKS_PERTHREAD=2 NCCL_SOCKET_NTHREADS=1
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
)
emu=$("$PY" -c "import tcpx_p2p; print(tcpx_p2p.emulator_plugin_path())")
sizes=4K,64K,1M,4M,16M,64M
rows=()
for which in real emu; do
  lib=$real
  [ "$which" = emu ] && lib=$emu
  for op in send write read; do
    log "$which plugin, $op, host memory, $sizes"
    if env "${tcpx_env[@]}" NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS=1 \
      TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH="$lib" RUST_LOG=info \
      timeout 600 "$PY" -m tcpx_p2p.bench pair --net plugin --memory host --gpus 0,0 \
      --op "$op" --sizes "$sizes" --json "$out/$which.$op.json" >"$out/$which.$op.log" 2>&1; then
      rows+=("\"$which.$op\": \"ok\"")
    else
      rows+=("\"$which.$op\": \"failed (see $which.$op.log)\"")
      log "$which $op failed; last lines:"
      tail -5 "$out/$which.$op.log" | tee -a "$out/steps.log" >&2
    fi
  done
done

# ---- 4. set-up with the default flow-steering wait (5 s), real plugin
log "set-up with the default flow-steering wait"
t0=$(date +%s.%N)
env "${tcpx_env[@]}" TCPX_P2P_NET=plugin TCPX_P2P_PLUGIN_PATH="$real" \
  timeout 300 "$PY" -m tcpx_p2p.bench pair --net plugin --memory host --gpus 0,0 \
  --op send --sizes 4K --iters 1 --json "$out/setup_default_wait.json" >"$out/setup_default_wait.log" 2>&1
rc=$?
t1=$(date +%s.%N)
setup_s=$(python3 -c "print(round($t1 - $t0, 3))")
log "one pair with the 5 s default wait: rc $rc, $setup_s s end to end (set-up included)"

rules=$(cat "$prefix/counts" 2>/dev/null || echo '{}')
{
  echo "{"
  echo "  \"device\": \"$(head -1 "$out/gpus.txt" | sed 's/"//g')\","
  echo "  \"plugin\": \"$real\", \"nccl_headers\": \"$ncclver\","
  echo "  \"rx_rule_requests\": \"$rules\","
  echo "  \"default_wait_pair_s\": $setup_s, \"default_wait_rc\": $rc,"
  (IFS=,; echo "  ${rows[*]}")
  echo "}"
} >"$out/RESULTS.json"
log "results in $out/RESULTS.json"
