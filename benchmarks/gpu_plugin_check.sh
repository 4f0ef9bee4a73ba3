#!/usr/bin/env bash
# GPU checks of the plugin path, for a machine with 1-2 GPUs (run on 2 x H200):
#
#   1. the unpack kernel vs the CPU copy on random fragment lists
#      (1 B - 4 KiB, unaligned offsets), byte for byte;
#   2. the kernel's GB/s beside a device-to-device memcpy of the same bytes;
#   3. the engine over the plugin net (the stand-in in UNPACK mode, bounce
#      pool on the GPU, so receives go through the kernel) with GPU buffers,
#      plus every plugin rule test;
#   4. GPU -> GPU throughput over the plugin net beside the socket net,
#      16 MiB and 256 MiB.
#
# Usage: benchmarks/gpu_plugin_check.sh [OUT.json]
#   Writes one JSON file: $1, else $OUT/gpu_plugin_check.json, else
#   ./gpu_plugin_check.json. Logs of each step go next to it (*.log).
#
# Binaries: with cargo on the machine they are built here
# (`cargo test --release --workspace --no-run`). Without cargo, build them
# elsewhere and point BIN_DIR at a folder holding:
#   unit                 the tcpx-p2p-gpu lib test binary (target/release/deps/tcpx_p2p_gpu-<hash>)
#   plugin               the tests/plugin.rs binary    (target/release/deps/plugin-<hash>)
#   libnccl_net_emu.so   the stand-in                  (target/release/libnccl_net_emu.so)
# (`benchmarks/gpu_plugin_check.sh --stage DIR` does that copy, stripped,
# on the build machine.)
set -uo pipefail
cd "$(dirname "$0")/.."

find_bins() {
  # Prints "unit plugin emu" paths from a cargo JSON build.
  cargo test --release --workspace --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
unit = plugin = emu = ""
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact":
        continue
    t = m.get("target", {})
    exe = m.get("executable")
    if exe and t.get("name") == "tcpx_p2p_gpu" and "lib" in t.get("kind", []):
        unit = exe
    elif exe and t.get("name") == "plugin" and "test" in t.get("kind", []):
        plugin = exe
    elif t.get("name") == "nccl_net_emu":
        for f in m.get("filenames", []):
            if f.endswith(".so"):
                emu = f
print(unit, plugin, emu)'
}

if [ "${1:-}" = "--stage" ]; then
  dir="${2:?usage: $0 --stage DIR}"
  mkdir -p "$dir"
  read -r unit plugin emu < <(find_bins)
  [ -n "$unit" ] && [ -n "$plugin" ] && [ -n "$emu" ] || { echo "build failed" >&2; exit 1; }
  cp "$unit" "$dir/unit" && cp "$plugin" "$dir/plugin" && cp "$emu" "$dir/libnccl_net_emu.so"
  strip --strip-debug "$dir/unit" "$dir/plugin" "$dir/libnccl_net_emu.so" 2>/dev/null || true
  ls -la "$dir"
  exit 0
fi

out="${1:-}"
if [ -z "$out" ]; then
  out="${OUT:-.}/gpu_plugin_check.json"
fi
mkdir -p "$(dirname "$out")"
logs="$(dirname "$out")"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [ -n "${BIN_DIR:-}" ]; then
  unit="$BIN_DIR/unit"; plugin="$BIN_DIR/plugin"; emu="$BIN_DIR/libnccl_net_emu.so"
elif command -v cargo >/dev/null 2>&1; then
  read -r unit plugin emu < <(find_bins)
else
  echo "no cargo here: set BIN_DIR (see the header of $0)" >&2
  exit 2
fi
for f in "$unit" "$plugin" "$emu"; do
  [ -n "$f" ] && [ -e "$f" ] || { echo "missing binary: '$f'" >&2; exit 2; }
done
chmod +x "$unit" "$plugin" 2>/dev/null || true
export NCCL_NET_EMU_PATH="$(cd "$(dirname "$emu")" && pwd)/$(basename "$emu")"
export TCPX_P2P_LOG="${TCPX_P2P_LOG:-info}"

step() { # name, log, command...
  local name="$1" log="$2"; shift 2
  echo "== $name" >&2
  "$@" >"$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "FAIL (rc $rc)"
  elif ! grep -q "test result: ok. [1-9]" "$log"; then
    echo "FAIL (no test ran)"
  else
    echo pass
  fi
}

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader >"$logs/gpu_plugin_check.gpus.log" 2>&1
else
  echo "no nvidia-smi" >"$logs/gpu_plugin_check.gpus.log"
fi

s1=$(step "unpack kernel vs CPU (unit)" "$logs/gpu_plugin_check.unit.log" \
  "$unit" --exact unpack::tests::gpu_unpack_matches_host_unpack --nocapture)
s2=$(step "unpack kernel check + bandwidth" "$logs/gpu_plugin_check.unpack.log" \
  env UNPACK_CHECK_OUT="$tmp/unpack.json" "$unit" --ignored --exact unpack::tests::gpu_unpack_check_and_bandwidth --nocapture)
s3=$(step "engine over the plugin net (rules, host and GPU buffers)" "$logs/gpu_plugin_check.plugin.log" \
  "$plugin" --test-threads=1 --nocapture)
s4=$(step "GPU->GPU throughput plugin vs socket" "$logs/gpu_plugin_check.throughput.log" \
  env PLUGIN_BENCH_OUT="$tmp/throughput.json" "$plugin" --ignored --exact gpu_throughput_plugin_vs_socket --nocapture)

python3 - "$out" "$tmp" "$s1" "$s2" "$s3" "$s4" "$logs" <<'EOF'
import json, os, sys
out, tmp, s1, s2, s3, s4, logs = sys.argv[1:8]
def load(name):
    p = os.path.join(tmp, name)
    try:
        with open(p) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001
        return {"missing": str(e)}
gpus = open(os.path.join(logs, "gpu_plugin_check.gpus.log")).read().strip().splitlines()
res = {
    "gpus": gpus,
    "steps": {
        "unpack_kernel_vs_cpu": s1,
        "unpack_check_and_bandwidth": s2,
        "plugin_tests": s3,
        "throughput": s4,
    },
    "unpack": load("unpack.json"),
    "throughput": load("throughput.json"),
}
res["ok"] = all(v == "pass" for v in res["steps"].values())
with open(out, "w") as f:
    json.dump(res, f, indent=2)
print(json.dumps(res, indent=2))
sys.exit(0 if res["ok"] else 1)
EOF
