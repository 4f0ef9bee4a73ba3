#!/usr/bin/env python3
"""Let NCCL judge the TCPX stand-in (crates/nccl-net-emu).

Two processes (torch.multiprocessing spawn, no torchrun), GPU 0 and GPU 1,
PyTorch's NCCL loading libnccl_net_emu.so as its net plugin with P2P and
SHM off, so the two GPUs talk through the plugin. For each mode of the
stand-in -- plain (payload straight into NCCL's GPU buffers) and UNPACK
(bounce pages + loadMeta, unpacked by NCCL's own kernel) -- it runs
send/recv and all_reduce at several sizes and checks every result.

    python3 benchmarks/nccl_emu_check.py LOGDIR [--plugin PATH] [--modes plain,unpack]

LOGDIR receives, per mode: NCCL's debug logs (nccl.<mode>.<host>.<pid>.log),
each rank's stderr (<mode>.rank<r>.stderr) and results (<mode>.rank<r>.json),
and summary.json for the whole run. The exit status is 0 only if every
check passed in every mode. Settings follow reference/ncclnet-and-tcpx.md
section 9.
"""

import argparse
import glob
import json
import os
import re
import socket
import sys
import time
import traceback

SIZES = [int(x) for x in os.environ.get("NCCL_EMU_CHECK_SIZES", "1024,1048576,67108864").split(",")]
MODE_TIMEOUT_S = int(os.environ.get("NCCL_EMU_CHECK_TIMEOUT", "420"))


def default_plugin():
    try:
        import tcpx_p2p  # noqa: PLC0415

        p = tcpx_p2p.emulator_plugin_path()
        if p and os.path.isfile(p):
            return p
    except Exception:  # noqa: BLE001
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    for prof in ("release", "debug"):
        p = os.path.join(here, "..", "target", prof, "libnccl_net_emu.so")
        if os.path.isfile(p):
            return os.path.abspath(p)
    return None


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def mode_env(mode, plugin, logdir):
    return {
        "NCCL_NET_PLUGIN": plugin,
        "NCCL_NET": "NcclNetEmu",
        "NCCL_NET_EMU_UNPACK": "1" if mode == "unpack" else "0",
        # As on A3: TCPX's chunk size must be set (its default 0 never sends);
        # the flow-steering wait shortened from TCPX's 5 s per accept.
        "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
        "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "1000",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_NET_GDR_LEVEL": "SYS",
        "NCCL_PROTO": "Simple",
        "NCCL_ALGO": "Ring",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_LOCAL_REGISTER": "0",
        "NCCL_GRAPH_REGISTER": "0",
        "NCCL_COLLNET_ENABLE": "0",
        "NCCL_IB_DISABLE": "1",
        "NCCL_NET_EMU_TRACE": os.environ.get("NCCL_EMU_CHECK_TRACE", "0"),
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
        "NCCL_DEBUG_FILE": os.path.join(logdir, f"nccl.{mode}.%h.%p.log"),
    }


def worker(rank, world, port, mode, logdir):
    # Everything this process (and NCCL, and the plugin) prints on stderr.
    err = open(os.path.join(logdir, f"{mode}.rank{rank}.stderr"), "w")  # noqa: SIM115
    os.dup2(err.fileno(), 2)
    result = {"mode": mode, "rank": rank, "checks": [], "ok": False}
    try:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            device_id=dev,
        )
        ok = True
        for n in SIZES:
            # send/recv: rank 0 -> rank 1, then back.
            want = ((torch.arange(n, device=dev, dtype=torch.int64) * 7 + n) % 251).to(torch.uint8)
            for src, dst in ((0, 1), (1, 0)):
                if rank == src:
                    dist.send(want, dst)
                    good = True
                else:
                    got = torch.zeros(n, dtype=torch.uint8, device=dev)
                    dist.recv(got, src)
                    torch.cuda.synchronize()
                    good = bool(torch.equal(got, want))
                result["checks"].append({"op": f"send/recv {src}->{dst}", "bytes": n, "ok": good})
                ok &= good
            # all_reduce (sum) of float32, exact in fp32.
            m = n // 4
            base = (torch.arange(m, device=dev, dtype=torch.int64) % 13).to(torch.float32)
            x = base * (rank + 1)
            torch.cuda.synchronize()
            t0 = time.time()
            dist.all_reduce(x)
            torch.cuda.synchronize()
            secs = time.time() - t0
            good = bool(torch.equal(x, base * sum(r + 1 for r in range(world))))
            result["checks"].append({"op": "all_reduce", "bytes": n, "ok": good, "seconds": round(secs, 6)})
            ok &= good
        dist.barrier()
        torch.cuda.synchronize()
        dist.destroy_process_group()
        result["ok"] = ok
    except Exception:  # noqa: BLE001
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr, flush=True)
    with open(os.path.join(logdir, f"{mode}.rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=2)
    if not result["ok"]:
        sys.exit(1)


def scan_logs(logdir, mode):
    """What NCCL's logs say about the plugin and the connections."""
    text = ""
    for p in sorted(glob.glob(os.path.join(logdir, f"nccl.{mode}.*.log"))):
        with open(p, errors="replace") as f:
            text += f.read()
    for p in sorted(glob.glob(os.path.join(logdir, f"{mode}.rank*.stderr"))):
        with open(p, errors="replace") as f:
            text += f.read()
    lines = text.splitlines()

    def grep(pat, limit=6):
        rx = re.compile(pat)
        return [ln.strip() for ln in lines if rx.search(ln)][:limit]

    return {
        "plugin_loaded": grep(r"(?i)(net plugin|NET/Plugin).*(NcclNetEmu|nccl_net_emu)|Using network NcclNetEmu"),
        "using_network": grep(r"(?i)using network"),
        "emu_lines": grep(r"NET/EMU", 10),
        "connections": grep(r"via NET/NcclNetEmu", 8),
        "gdrdma_connections": len(grep(r"via NET/NcclNetEmu.*GDRDMA", 10000)),
        "unpack_mentions": grep(r"(?i)unpack", 8),
        "rule_violations": grep(r"TCPX RULE VIOLATION", 20),
        "warnings": grep(r"NCCL WARN", 20),
    }


def run_mode(mode, plugin, logdir):
    import torch.multiprocessing as mp  # noqa: PLC0415

    os.environ.update(mode_env(mode, plugin, logdir))
    port = free_port()
    t0 = time.time()
    ctx = mp.spawn(worker, args=(2, port, mode, logdir), nprocs=2, join=False)
    status = "ok"
    try:
        while not ctx.join(timeout=5):
            if time.time() - t0 > MODE_TIMEOUT_S:
                status = f"timeout after {MODE_TIMEOUT_S} s"
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                break
    except Exception as e:  # noqa: BLE001  (a rank failed)
        status = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    ranks = []
    for r in range(2):
        p = os.path.join(logdir, f"{mode}.rank{r}.json")
        if os.path.isfile(p):
            with open(p) as f:
                ranks.append(json.load(f))
        else:
            ranks.append({"rank": r, "ok": False, "error": "no result written"})
    logs = scan_logs(logdir, mode)
    ok = (
        status == "ok"
        and all(r.get("ok") for r in ranks)
        and not logs["rule_violations"]
        # NCCL must really have gone through the plugin.
        and len(logs["connections"]) > 0
    )
    if mode == "unpack":
        # NCCL must have taken the UNPACK path on GPU-direct connections.
        ok = ok and logs["gdrdma_connections"] > 0
    return {
        "mode": mode,
        "ok": ok,
        "status": status,
        "seconds": round(time.time() - t0, 1),
        "ranks": ranks,
        "logs": logs,
        "env": mode_env(mode, plugin, logdir),
    }


def nccl_version(torch):
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001
        return None
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logdir")
    ap.add_argument("--plugin", default=None, help="path of libnccl_net_emu.so")
    ap.add_argument("--modes", default="plain,unpack")
    a = ap.parse_args()
    os.makedirs(a.logdir, exist_ok=True)
    logdir = os.path.abspath(a.logdir)
    plugin = a.plugin or default_plugin()
    if not plugin or not os.path.isfile(plugin):
        print("libnccl_net_emu.so not found: pass --plugin PATH", file=sys.stderr)
        return 2
    plugin = os.path.abspath(plugin)
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        print("PyTorch is not installed here", file=sys.stderr)
        return 2

    summary = {
        "plugin": plugin,
        "torch": torch.__version__,
        "nccl": nccl_version(torch),
        "gpus": torch.cuda.device_count(),
        "modes": [],
    }
    if torch.cuda.device_count() < 2:
        summary["error"] = "needs 2 GPUs"
        print(json.dumps(summary, indent=2))
        return 2
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        res = run_mode(mode, plugin, logdir)
        summary["modes"].append(res)
        print(f"{mode}: {'PASS' if res['ok'] else 'FAIL'} ({res['status']}, {res['seconds']} s)", flush=True)
    summary["ok"] = all(m["ok"] for m in summary["modes"])
    with open(os.path.join(logdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "modes"}, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
