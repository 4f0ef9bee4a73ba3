#!/usr/bin/env python3
"""Same-host path beside the loopback-TCP path and a plain copy.

Two processes on one host (on a GPU machine: on one GPU, or on two with
--peer-gpu). The target process advertises one buffer twice: with
`advertise_ipc` on a same-host connection and with `advertise` on a TCP
connection of the same endpoints (over loopback). This process then times,
per size, blocking `write_ipc` and `read_ipc`, blocking `write` and `read`
over the connection made by `connect` / `accept` (loopback TCP; with
TCPX_P2P_SAME_HOST_NET=1 on both, the same-host net, whose writes and reads
the target copies itself unless TCPX_P2P_SAME_HOST_PULL=0; on that net
also `write_ipc` and `read_ipc` on that connection, `net_write_ipc` /
`net_read_ipc`, into a second `advertise_ipc` record of the same buffer,
which the peer holds leased), and
a plain copy of the same size in one process (device-to-device `copy_` on a
GPU, `memmove` on the host; `--no-plain` leaves it out: across two GPUs
it gives this process a CUDA context on the target's GPU, which slows the
engine's small writes there): p50/p99 latency in µs and GB/s (size / p50).
The ways are timed in turn, iteration by iteration, so that all see the
same machine load.

    python benchmarks/local_bench.py --device cpu --out results/
    python benchmarks/local_bench.py --device gpu --gpu 0 --out "$OUT"

Writes local_bench_<device>.json under --out and prints a table.
"""

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import threading
import time

KIB, MIB = 1 << 10, 1 << 20


def parse_size(s):
    s = s.strip().upper()
    for suf, m in (("GB", 1 << 30), ("G", 1 << 30), ("MB", MIB), ("M", MIB), ("KB", KIB), ("K", KIB)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * m)
    return int(s)


class Buf:
    """`n` bytes of host (ctypes) or GPU (torch) memory filled with `fill`."""

    def __init__(self, n, device, gpu, fill=0):
        self.device = device
        if device == "gpu":
            import torch

            self.t = torch.full((n,), fill, dtype=torch.uint8, device=f"cuda:{gpu}")
            torch.cuda.synchronize(gpu)
            self.ptr = self.t.data_ptr()
        else:
            self.obj = (ctypes.c_char * n)()
            ctypes.memset(self.obj, fill, n)
            self.ptr = ctypes.addressof(self.obj)


def target(pipe, device, gpu, maxsize, env):
    os.environ.update(env)
    from tcpx_p2p import p2p

    ep = p2p.Endpoint(gpu if device == "gpu" else None)
    buf = Buf(maxsize, device, gpu)
    pipe.send(ep.get_metadata())
    got = {}
    th = threading.Thread(target=lambda: got.update(local=ep.accept_local()))
    th.start()
    ok, _ip, _g, tcp = ep.accept()
    th.join()
    ok2, _bdf, lc = got["local"]
    assert ok and ok2, ep.last_error()
    ok, info = ep.advertise_ipc(lc, buf.ptr, maxsize)
    assert ok, ep.last_error()
    ok, mr = ep.reg(buf.ptr, maxsize)
    ok2, meta = ep.advertise(tcp, mr, buf.ptr, maxsize)
    assert ok and ok2, ep.last_error()
    # The *_ipc calls on the engine's connection, where its net is the
    # same-host net (a build or net without them: None).
    net_info = None
    if getattr(ep, "conn_net", lambda _c: None)(tcp) == "same-host":
        ok, i = ep.advertise_ipc(tcp, buf.ptr, maxsize)
        net_info = bytes(i) if ok else None
    pipe.send((bytes(info), bytes(meta), net_info))
    pipe.recv()  # done


def interleaved(fns, iters, warmup):
    """(p50, p99) of each function, their iterations taken in turn so that
    all see the same machine load."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    lat = [[] for _ in fns]
    for _ in range(iters):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            lat[k].append(time.perf_counter() - t0)
    out = []
    for v in lat:
        v.sort()
        out.append((v[len(v) // 2], v[min(len(v) - 1, int(len(v) * 0.99))]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--gpu", type=int, default=0, help="this process's GPU")
    ap.add_argument("--peer-gpu", type=int, default=None, help="the target's GPU (default: --gpu)")
    ap.add_argument("--sizes", default=None, help="comma list (default 64K..256M on GPU, 64K..64M on host)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per size (default: by size)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--skip-tcp-above", default="1G", help="largest size timed over TCP")
    ap.add_argument("--out", default=None, help="directory for local_bench_<device>.json")
    ap.add_argument(
        "--no-plain",
        action="store_true",
        help="leave out the plain copy (across two GPUs it gives this process a CUDA context on the peer's GPU)",
    )
    a = ap.parse_args()
    peer_gpu = a.gpu if a.peer_gpu is None else a.peer_gpu
    default = "64K,256K,1M,4M,16M,64M,256M" if a.device == "gpu" else "64K,256K,1M,4M,16M,64M"
    sizes = [parse_size(s) for s in (a.sizes or default).split(",")]
    maxsize = max(sizes)
    tcp_max = parse_size(a.skip_tcp_above)
    os.environ.setdefault("TCPX_P2P_IFNAME", "lo")
    env = {k: v for k, v in os.environ.items() if k.startswith("TCPX_P2P_")}

    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, a.device, peer_gpu, maxsize, env), daemon=True)
    proc.start()
    from tcpx_p2p import p2p

    ep = p2p.Endpoint(a.gpu if a.device == "gpu" else None)
    meta = pipe.recv()
    ok, lc = ep.connect_local(meta)
    assert ok, ep.last_error()
    ip, port, g = ep.parse_metadata(meta)
    ok, tcp = ep.connect(ip, g if isinstance(g, int) else peer_gpu, port)
    assert ok, ep.last_error()
    info, fifo, net_info = pipe.recv()
    src = Buf(maxsize, a.device, a.gpu, fill=7)
    dst = Buf(maxsize, a.device, a.gpu)
    ok, smr = ep.reg(src.ptr, maxsize)
    ok2, dmr = ep.reg(dst.ptr, maxsize)
    assert ok and ok2

    if a.device == "gpu":
        import torch

        # On one GPU a device-to-device copy; across two, a peer copy into
        # the target's GPU (what cudaMemcpyPeer does).
        far = (
            dst.t
            if peer_gpu == a.gpu or a.no_plain
            else torch.empty(maxsize, dtype=torch.uint8, device=f"cuda:{peer_gpu}")
        )

        def plain(n):
            def f():
                far[:n].copy_(src.t[:n])
                torch.cuda.synchronize(a.gpu)
                torch.cuda.synchronize(peer_gpu)

            return f

        plain_name = "cuda_d2d_copy" if peer_gpu == a.gpu else "cuda_peer_copy"
    else:

        def plain(n):
            return lambda: ctypes.memmove(dst.ptr, src.ptr, n)

        plain_name = "memmove"

    def check(ok):
        if not ok:
            raise RuntimeError(ep.last_error())

    rows = []
    for n in sizes:
        iters = a.iters or max(5, min(1000, (256 * MIB) // n))
        row = {"size": n, "iters": iters}
        cases = [
            ("write_ipc", lambda: check(ep.write_ipc(lc, src.ptr, n, info))),
            ("read_ipc", lambda: check(ep.read_ipc(lc, dst.ptr, n, info))),
        ]
        if not a.no_plain:
            cases.append((plain_name, plain(n)))
        if n <= tcp_max:
            cases.append(("tcp_write", lambda: check(ep.write(tcp, smr, src.ptr, n, fifo))))
            cases.append(("tcp_read", lambda: check(ep.read(tcp, dmr, dst.ptr, n, fifo))))
        if net_info is not None:
            cases.append(("net_write_ipc", lambda: check(ep.write_ipc(tcp, src.ptr, n, net_info))))
            cases.append(("net_read_ipc", lambda: check(ep.read_ipc(tcp, dst.ptr, n, net_info))))
        for name, (p50, p99) in zip([c[0] for c in cases], interleaved([c[1] for c in cases], iters, a.warmup)):
            row[name] = {"p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "GBps": n / p50 / 1e9}
        if "tcp_write" in row:
            row["write_ipc_vs_tcp"] = row["write_ipc"]["GBps"] / row["tcp_write"]["GBps"]
            row["read_ipc_vs_tcp"] = row["read_ipc"]["GBps"] / row["tcp_read"]["GBps"]
        if plain_name in row:
            row["write_ipc_vs_plain"] = row["write_ipc"]["GBps"] / row[plain_name]["GBps"]
        if "net_write_ipc" in row:
            # Above 1: the call on the same-host net's connection is faster.
            row["net_write_ipc_vs_local"] = row["write_ipc"]["p50_us"] / row["net_write_ipc"]["p50_us"]
            row["net_read_ipc_vs_local"] = row["read_ipc"]["p50_us"] / row["net_read_ipc"]["p50_us"]
        rows.append(row)
        tw = row.get("tcp_write", {})
        tr = row.get("tcp_read", {})
        nw = row.get("net_write_ipc", {})
        nr = row.get("net_read_ipc", {})
        net = (
            f" | net write_ipc {nw['p50_us']:9.1f} µs read_ipc {nr['p50_us']:9.1f} µs"
            if nw
            else ""
        )
        print(
            f"{n:>11} B  write_ipc {row['write_ipc']['p50_us']:9.1f} µs p50 {row['write_ipc']['p99_us']:9.1f} p99 "
            f"{row['write_ipc']['GBps']:8.2f} GB/s | read_ipc {row['read_ipc']['GBps']:8.2f} GB/s | "
            f"tcp {tw.get('GBps', float('nan')):7.2f} GB/s ({tw.get('p50_us', float('nan')):9.1f} µs) "
            f"read {tr.get('GBps', float('nan')):7.2f} GB/s ({tr.get('p50_us', float('nan')):9.1f} µs) | "
            f"{plain_name} {row.get(plain_name, {}).get('GBps', float('nan')):8.2f} GB/s{net}",
            flush=True,
        )
    pipe.send("done")
    proc.join(30)
    res = {
        "device": a.device,
        "gpu": a.gpu,
        "peer_gpu": peer_gpu,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "plain": plain_name,
        "settings": {k: v for k, v in env.items() if k in ("TCPX_P2P_SAME_HOST_NET", "TCPX_P2P_SAME_HOST_PULL")},
        "rows": rows,
    }
    if a.device == "gpu":
        import torch

        res["gpu_name"] = torch.cuda.get_device_name(a.gpu)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"local_bench_{a.device}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
