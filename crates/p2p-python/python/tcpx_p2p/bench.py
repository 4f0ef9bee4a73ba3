"""tcpx-p2p-bench: throughput and latency of the engine, beside references
measured in the same run.

    tcpx-p2p-bench pair   [options]          both sides on this host (two processes)
    tcpx-p2p-bench server [options]          the passive side of a two-host run
    tcpx-p2p-bench client HOST [options]     the active side (it sends / writes / reads)

References (--reference): raw TCP with the same number of streams (host
memory, our Rust reference client/server), and with GPU memory on a
machine with two GPUs, NCCL's socket transport through PyTorch at its
default and at its best thread × socket setting.
"""

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

from ._buffers import Buffer, block_offsets, fmt_size, parse_size

DEFAULT_SIZES = "64K,1M,16M,256M"
CTL_PORT = 18515


# ----------------------------------------------------------------- helpers


class Ctl:
    """JSON lines over the benchmark's control socket."""

    def __init__(self, sock):
        # A reply written while the previous message waits for its delayed
        # ACK would be held by Nagle's algorithm (tens of ms inside a timed
        # run: 4 KiB throughput read 0.2 GB/s instead of 0.6 on a 2-core box).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.f = sock.makefile("rwb")

    def send(self, **msg):
        self.f.write(json.dumps(msg).encode() + b"\n")
        self.f.flush()

    def recv(self):
        line = self.f.readline()
        if not line:
            raise ConnectionError("benchmark peer went away")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"peer: {msg['error']}")
        return msg


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total, label=""):
        self.total, self.done, self.label = max(total, 1), 0, label
        self.tty = sys.stderr.isatty()

    def step(self, what=""):
        self.done += 1
        w = 30
        k = int(w * self.done / self.total)
        line = f"\r{self.label} [{'#' * k}{'.' * (w - k)}] {self.done}/{self.total} {what:<24}"
        if self.tty:
            sys.stderr.write(line)
            sys.stderr.flush()
        elif self.done == self.total or self.done == 1:
            sys.stderr.write(line.strip() + "\n")

    def close(self):
        if self.tty:
            sys.stderr.write("\n")


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def set_env(opts):
    """Engine settings travel as environment variables (read at Endpoint creation)."""
    for k, env in (("streams", "TCPX_P2P_STREAMS"), ("chunk", "TCPX_P2P_CHUNK"), ("channels", "TCPX_P2P_CHANNELS"), ("net", "TCPX_P2P_NET")):
        if opts.get(k):
            os.environ[env] = str(opts[k])


def auto_iters(total, op):
    budget = 2 << 30 if total >= (1 << 20) else 256 << 20
    return int(max(5, min(2000, budget // max(total, 1))))


# ------------------------------------------------------------------ server


def serve_session(ctl, gpu, bind_ip):
    from tcpx_p2p import _native, p2p

    plan = ctl.recv()
    set_env(plan)
    ep = p2p.Endpoint(gpu if gpu is not None else 0)
    raw_port = _native.rawtcp_serve(bind_ip)
    ctl.send(metadata=ep.get_metadata().hex(), raw_port=raw_port, net=ep.net_name())
    ok, _ip, _g, conn = ep.accept(60.0)
    if not ok:
        ctl.send(error=ep.last_error())
        return
    buf, mr, blocks = None, None, []
    while True:
        m = ctl.recv()
        cmd = m["cmd"]
        try:
            if cmd == "prepare":
                nblk, bs = m["nblk"], m["block"]
                if mr is not None:
                    ep.dereg(mr)
                buf = Buffer(nblk * bs, gpu)
                ok, mr = ep.reg(buf.ptr, nblk * bs)
                # Another permutation than the client's: blocks scattered
                # on both sides land in different slots.
                offs = block_offsets(nblk, bs, m.get("layout", "contiguous"), seed=2)
                blocks = [buf.ptr + o for o in offs]
                ok, metas = ep.advertisev(conn, [mr] * nblk, blocks, [bs] * nblk, nblk)
                if not ok:
                    raise RuntimeError(ep.last_error())
                ctl.send(metas=[x.hex() for x in metas])
            elif cmd == "fill":
                buf.fill(m["seed"]) if m["seed"] is not None else buf.clear()
                ctl.send(ok=True)
            elif cmd == "digest":
                ctl.send(digest=buf.digest_blocks(offs, bs))
            elif cmd == "recv":
                nblk, bs = len(blocks), buf.n // max(len(blocks), 1)
                ids = []
                for _ in range(m["iters"]):
                    ok, x = ep.recvv_async(conn, [mr] * nblk, blocks, [bs] * nblk, nblk)
                    if not ok:
                        raise RuntimeError(ep.last_error())
                    ids.append(x)
                ctl.send(posted=True)
                for x in ids:
                    if not ep.wait(x):
                        raise RuntimeError(ep.last_error())
                ctl.send(done=True)
            elif cmd == "pingpong":
                for _ in range(m["iters"]):
                    if not ep.recv(conn, mr, buf.ptr, buf.n) or not ep.send(conn, mr, buf.ptr, buf.n):
                        raise RuntimeError(ep.last_error())
                ctl.send(done=True)
            elif cmd == "bye":
                ctl.send(ok=True)
                return
        except Exception as e:  # report to the client, which prints it
            ctl.send(error=f"{type(e).__name__}: {e}")
            return


def server_main(port, gpu, bind_ip, once=False, ready=None, tag=None):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((bind_ip, port))
    ls.listen(4)
    if ready is not None:
        ready.put(ls.getsockname()[1] if tag is None else (tag, ls.getsockname()[1]))
    else:
        print(f"tcpx-p2p-bench server listening on {bind_ip}:{ls.getsockname()[1]}", file=sys.stderr)
    while True:
        s, _ = ls.accept()
        serve_session(Ctl(s), gpu, bind_ip)
        s.close()
        if once:
            return


def _pair_server(ready, gpu, env, tag=None):
    os.environ.update(env)
    server_main(0, gpu, "127.0.0.1", once=True, ready=ready, tag=tag)


def _pair_servers(ready, gpus, env):
    """The single-process layout's passive side: one endpoint per GPU, each
    served by a thread of this one process."""
    import threading

    os.environ.update(env)
    ts = [threading.Thread(target=server_main, args=(0, g, "127.0.0.1", True, ready, i)) for i, g in enumerate(gpus)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _pair_client(a, port, gpu, barrier, q, tag, env):
    os.environ.update(env)
    try:
        rows, net, streams = client_main(a, "127.0.0.1", port, gpu, barrier, quiet=True)
        q.put((tag, "ok", rows, net, streams))
    except Exception as e:  # reported by the parent
        q.put((tag, "err", f"{type(e).__name__}: {e}", None, None))


def run_pairs(a, client_gpus, server_gpus):
    """`--pairs N`: N pairs at once on this host, each pair i from client GPU
    i to server GPU i, in one process per endpoint or (`--single-process`)
    one process per side driving all its GPUs. Rows carry their pair; `sum`
    rows add the pairs' GB/s for each size."""
    import threading

    n = len(client_gpus)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    env = {k: v for k, v in os.environ.items() if k.startswith("TCPX_P2P_")}
    if a.single_process:
        servers = [ctx.Process(target=_pair_servers, args=(ready, server_gpus, env), daemon=True)]
    else:
        servers = [ctx.Process(target=_pair_server, args=(ready, g, env, i), daemon=True) for i, g in enumerate(server_gpus)]
    for p in servers:
        p.start()
    ports = dict(ready.get(timeout=120) for _ in range(n))
    results = {}
    if a.single_process:
        barrier = threading.Barrier(n)

        def one(i):
            try:
                results[i] = ("ok",) + client_main(a, "127.0.0.1", ports[i], client_gpus[i], barrier, quiet=True)
            except Exception as e:  # reported below
                results[i] = ("err", f"{type(e).__name__}: {e}")
                barrier.abort()

        ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        barrier = ctx.Barrier(n)
        q = ctx.Queue()
        clients = [ctx.Process(target=_pair_client, args=(a, ports[i], client_gpus[i], barrier, q, i, env)) for i in range(n)]
        for p in clients:
            p.start()
        for _ in range(n):
            tag, status, *rest = q.get(timeout=3600)
            results[tag] = (status, *rest)
        for p in clients:
            p.join(30)
    for p in servers:
        p.join(30)
    errors = [f"pair {i}: {r[1]}" for i, r in sorted(results.items()) if r[0] != "ok"]
    if errors:
        raise RuntimeError("; ".join(errors))
    rows, net, streams = [], results[0][2], results[0][3]
    for i in range(n):
        for r in results[i][1]:
            rows.append(dict(r, pair=i, gpus=[client_gpus[i], server_gpus[i]]))
    for size in sorted({r["size"] for r in rows}):
        same = [r for r in rows if r["size"] == size]
        rows.append({
            "op": "sum", "size": size, "batch": same[0]["batch"], "iters": same[0]["iters"],
            "GBps": round(sum(r["GBps"] for r in same), 3), "Gbps": round(sum(r["Gbps"] for r in same), 2),
            "lat_avg_us": None, "lat_p50_us": None, "lat_p99_us": None, "verified": all(r["verified"] for r in same),
            "pairs": n, "per_pair_GBps": [r["GBps"] for r in same],
        })
        if all("raw_tcp_GBps" in r for r in same):
            raw = sum(r["raw_tcp_GBps"] for r in same)
            rows[-1].update(raw_tcp_GBps=round(raw, 3), ratio_vs_raw_tcp=round(rows[-1]["GBps"] / raw, 3) if raw else 0)
    return rows, net, streams


# ------------------------------------------------------------------ client


def measure(ep, ctl, conn, a, gpu, size, nblk, raw):
    """One row: verify once, then time throughput and latency."""
    op = a.op
    bs = size
    total = bs * nblk
    iters = a.iters or auto_iters(total, op)
    layout = a.kv_layout if nblk > 1 else "contiguous"
    ctl.send(cmd="prepare", nblk=nblk, block=bs, layout=layout)
    metas = [bytes.fromhex(x) for x in ctl.recv()["metas"]]
    src = Buffer(total, gpu)
    ok, mr = ep.reg(src.ptr, total)
    offs = block_offsets(nblk, bs, layout, seed=1)
    blocks = [src.ptr + o for o in offs]
    mrs, sizes = [mr] * nblk, [bs] * nblk

    def once():
        if op == "send":
            ctl.send(cmd="recv", iters=1)
            ctl.recv()
            ok = ep.sendv(conn, mrs, blocks, sizes, nblk)
            ctl.recv()
        elif op == "write":
            ok = ep.writev(conn, mrs, blocks, sizes, metas, nblk)
        else:
            ok = ep.readv(conn, mrs, blocks, sizes, metas, nblk)
        if not ok:
            raise RuntimeError(ep.last_error())

    # Verify the bytes once.
    if op == "read":
        ctl.send(cmd="fill", seed=7)
        ctl.recv()
        src.clear()
        once()
        ctl.send(cmd="digest")
        verified = ctl.recv()["digest"] == src.digest_blocks(offs, bs)
    else:
        src.fill(7)
        ctl.send(cmd="fill", seed=None)
        ctl.recv()
        once()
        ctl.send(cmd="digest")
        verified = ctl.recv()["digest"] == src.digest_blocks(offs, bs)
    if not verified:
        raise RuntimeError(f"{op} of {fmt_size(bs)} x {nblk}: the bytes that arrived differ from those sent")

    once()  # warm-up
    if a.seconds:
        # As many iterations as fill the time asked for, from one more
        # transfer's time (which also pays a round trip: a few too few).
        t = time.perf_counter()
        once()
        iters = int(max(5, min(100_000, a.seconds / max(time.perf_counter() - t, 1e-6))))

    def timed():
        """GB/s of `iters` transfers, all posted at once (the engine keeps
        the windows)."""
        t0 = time.perf_counter()
        ids = []
        if op == "send":
            ctl.send(cmd="recv", iters=iters)
            ctl.recv()
            t0 = time.perf_counter()
        for _ in range(iters):
            if op == "send":
                ok, x = ep.sendv_async(conn, mrs, blocks, sizes, nblk)
            elif op == "write":
                ok, x = ep.writev_async(conn, mrs, blocks, sizes, metas, nblk)
            else:
                ok, x = ep.readv_async(conn, mrs, blocks, sizes, metas, nblk)
            if not ok:
                raise RuntimeError(ep.last_error())
            ids.append(x)
        for x in ids:
            if not ep.wait(x):
                raise RuntimeError(ep.last_error())
        if op == "send":
            ctl.recv()
        return total * iters / (time.perf_counter() - t0) / 1e9

    if raw is not None:
        from tcpx_p2p import _native

        ip, port, streams = raw

    def raw_timed():
        return total * iters / _native.rawtcp_run(ip, port, streams, total, iters, False)[0] / 1e9

    # Ours and raw TCP alternated, round by round; the row keeps the median
    # of each (a busy or noisy machine moves single runs by 10-20 %).
    ours, refs = [], []
    for _ in range(max(1, a.rounds)):
        ours.append(timed())
        if raw is not None:
            refs.append(raw_timed())
    gbps = statistics.median(ours)

    # Latency: one at a time (two-sided: half a round trip).
    lat_iters = min(iters, 200)
    lats = []
    if op == "send" and nblk == 1:
        ctl.send(cmd="pingpong", iters=lat_iters)
        for _ in range(lat_iters):
            t = time.perf_counter()
            if not ep.send(conn, mr, src.ptr, bs) or not ep.recv(conn, mr, src.ptr, bs):
                raise RuntimeError(ep.last_error())
            lats.append((time.perf_counter() - t) / 2)
        ctl.recv()
    elif op != "send":
        for _ in range(lat_iters):
            t = time.perf_counter()
            once()
            lats.append(time.perf_counter() - t)
    ep.dereg(mr)

    row = {
        "op": op,
        "size": bs,
        "batch": nblk,
        "layout": layout,
        "iters": iters,
        "GBps": round(gbps, 3),
        "Gbps": round(gbps * 8, 2),
        "lat_avg_us": round(statistics.mean(lats) * 1e6, 1) if lats else None,
        "lat_p50_us": round(pct(lats, 50) * 1e6, 1) if lats else None,
        "lat_p99_us": round(pct(lats, 99) * 1e6, 1) if lats else None,
        "verified": verified,
    }
    if len(ours) > 1:
        row["rounds_GBps"] = [round(x, 3) for x in ours]
    if raw is not None:
        row["raw_tcp_GBps"] = round(statistics.median(refs), 3)
        row["ratio_vs_raw_tcp"] = round(gbps / row["raw_tcp_GBps"], 3)
        if len(refs) > 1:
            row["raw_tcp_rounds_GBps"] = [round(x, 3) for x in refs]
        if nblk == 1 and op == "send":
            pp = _native.rawtcp_run(ip, port, 1, total, min(iters, 200), True)
            row["raw_tcp_pingpong_half_rtt_p50_us"] = round(pct(pp, 50) / 2 * 1e6, 1)
            if gpu is not None and bs <= (16 << 20):
                # What GPU memory adds to a one-way trip at best: one copy
                # out of the GPU and one into the other, each waited for.
                cp = staged_copy_us(src, bs)
                row["gpu_copy_out_in_p50_us"] = cp
                row["floor_one_way_us"] = round(row["raw_tcp_pingpong_half_rtt_p50_us"] + cp, 1)
    return row


def staged_copy_us(src, n, iters=200):
    """p50 of a device→pinned-host plus a pinned-host→device copy of `n`
    bytes, each waited for (the least any TCP path from GPU to GPU adds)."""
    import torch

    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = src.obj[:n]
    stream = torch.cuda.Stream(device=src.gpu)
    ts = []
    with torch.cuda.stream(stream):
        for _ in range(iters + 10):
            t = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            stream.synchronize()
            dev.copy_(host, non_blocking=True)
            stream.synchronize()
            ts.append(time.perf_counter() - t)
    return round(pct(ts[10:], 50) * 1e6, 1)


def client_main(a, host, port, gpu, barrier=None, quiet=False):
    from tcpx_p2p import p2p

    s = socket.create_connection((host, port), timeout=60)
    s.settimeout(None)
    ctl = Ctl(s)
    opts = {"streams": a.streams, "chunk": a.chunk, "channels": a.channels, "net": a.net}
    set_env(opts)
    ctl.send(**opts)
    hello = ctl.recv()
    ep = p2p.Endpoint(gpu if gpu is not None else 0)
    ok, conn = ep.add_remote_endpoint(bytes.fromhex(hello["metadata"]))
    if not ok:
        raise RuntimeError(f"connect: {ep.last_error()}")
    from tcpx_p2p import _native

    streams = _native.configured_streams()
    raw = (host, hello["raw_port"], streams) if a.reference else None
    sizes = [parse_size(x) for x in a.sizes.split(",")] if not a.kv_blocks else [parse_size(a.block_size)]
    nblk = a.kv_blocks or 1
    rows = []
    bar = None if quiet else Progress(len(sizes), f"{a.op} {'gpu' if gpu is not None else 'host'}")
    for size in sizes:
        if barrier is not None:
            barrier.wait()  # pairs measure each size at the same time
        t0, c0 = time.perf_counter(), os.times()
        row = measure(ep, ctl, conn, a, gpu, size, nblk, raw)
        c1 = os.times()
        # CPU of this process (all its threads) per second of wall time.
        row["process_cpu"] = round((c1.user + c1.system - c0.user - c0.system) / (time.perf_counter() - t0), 2)
        rows.append(row)
        if bar:
            bar.step(fmt_size(size))
    if bar:
        bar.close()
    ctl.send(cmd="bye")
    ctl.recv()
    return rows, ep.net_name(), streams


# ---------------------------------------------------------- NCCL reference


def _nccl_rank(pair, rank, port, gpus, sizes, iters, env, q, barrier):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(gpus[rank])
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for size in sizes:
        t = torch.ones(size, dtype=torch.uint8, device=f"cuda:{gpus[rank]}")
        n = iters[size]
        for _ in range(2):  # warm-up
            dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
        torch.cuda.synchronize()
        dist.barrier()
        barrier.wait()  # all pairs time each size together
        t0 = time.perf_counter()
        for _ in range(n):
            dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
        torch.cuda.synchronize()
        dist.barrier()
        out[size] = size * n / (time.perf_counter() - t0) / 1e9
    if rank == 0:
        q.put((pair, out))
    dist.destroy_process_group()


def nccl_reference(sizes, iters, pairs, nthreads, nsocks):
    """NCCL's socket transport over loopback, one send/recv process group
    per GPU pair, all pairs at once: a {size: GB/s} dict per pair."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(2 * len(pairs))
    env = {
        "NCCL_NET": "Socket",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
    }
    if nthreads:
        env["NCCL_SOCKET_NTHREADS"] = str(nthreads)
        env["NCCL_NSOCKS_PERTHREAD"] = str(nsocks)
    ps = []
    for i, gpus in enumerate(pairs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ps += [ctx.Process(target=_nccl_rank, args=(i, r, port, gpus, sizes, iters, env, q, barrier)) for r in range(2)]
    for p in ps:
        p.start()
    try:
        res = dict(q.get(timeout=600) for _ in pairs)
    finally:
        for p in ps:
            p.join(60)
    return [res[i] for i in range(len(pairs))]


def add_nccl_reference(rows, pairs):
    """`--reference` on GPUs: NCCL's default and best socket settings with
    the same pairs, sizes and iterations, beside each row (`sum` rows beside
    the pairs' sum)."""
    sizes = sorted({r["size"] for r in rows})
    iters = {r["size"]: r["iters"] for r in rows}
    d = nccl_reference(sizes, iters, pairs, 0, 0)
    b = nccl_reference(sizes, iters, pairs, 4, 4)
    for r in rows:
        s = r["size"]
        if r["op"] == "sum":
            dv, bv = sum(x[s] for x in d), sum(x[s] for x in b)
            r["nccl_default_per_pair_GBps"] = [round(x[s], 3) for x in d]
            r["nccl_best_per_pair_GBps"] = [round(x[s], 3) for x in b]
        else:
            i = r.get("pair", 0)
            dv, bv = d[i][s], b[i][s]
        r["nccl_default_GBps"] = round(dv, 3)
        r["nccl_best_GBps"] = round(bv, 3)
        r["ratio_vs_nccl_best"] = round(r["GBps"] / bv, 3)
        r["ratio_vs_nccl_default"] = round(r["GBps"] / dv, 3)


# -------------------------------------------------------------------- main


def print_table(rows, title):
    print(title)
    hdr = f"{'op':<6}{'size':>8}{'batch':>7}{'GB/s':>9}{'Gbps':>9}{'lat avg':>10}{'p50':>9}{'p99':>9}"
    extra = any("raw_tcp_GBps" in r for r in rows)
    nccl = any("nccl_default_GBps" in r for r in rows)
    if extra:
        hdr += f"{'rawTCP':>9}{'ratio':>7}"
    if nccl:
        hdr += f"{'NCCLdef':>9}{'NCCLbest':>9}{'x best':>8}"
    print(hdr)
    for r in rows:
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        op = r["op"] if "pair" not in r else f"{r['op']}#{r['pair']}"
        line = f"{op:<6}{fmt_size(r['size']):>8}{r['batch']:>7}{r['GBps']:>9.2f}{r['Gbps']:>9.1f}{f(r['lat_avg_us']):>10}{f(r['lat_p50_us']):>9}{f(r['lat_p99_us']):>9}"
        if extra:
            line += f"{r.get('raw_tcp_GBps', 0):>9.2f}{r.get('ratio_vs_raw_tcp', 0):>7.2f}"
        if nccl:
            line += f"{r.get('nccl_default_GBps', 0):>9.2f}{r.get('nccl_best_GBps', 0):>9.2f}{r.get('ratio_vs_nccl_best', 0):>8.2f}"
        print(line)
    print("(latency in microseconds: half a round trip for send, one blocking call for write/read)")
    layouts = sorted({r["layout"] for r in rows if r.get("batch", 1) > 1})
    if layouts:
        print(f"(KV blocks {', '.join(layouts)} in their pools)")
    for r in rows:
        if "raw_tcp_pingpong_half_rtt_p50_us" in r:
            floor = ""
            if "floor_one_way_us" in r:
                floor = f"; + GPU copy out and in {r['gpu_copy_out_in_p50_us']:.1f} = floor {r['floor_one_way_us']:.1f}"
            print(f"  {fmt_size(r['size'])} one-way p50 {f(r['lat_p50_us'])} us vs raw TCP half round trip {r['raw_tcp_pingpong_half_rtt_p50_us']:.1f}{floor}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tcpx-p2p-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["pair", "server", "client"])
    ap.add_argument("host", nargs="?", help="server host (client mode)")
    ap.add_argument("--port", type=int, default=CTL_PORT, help="control port of the server")
    ap.add_argument("--net", choices=["socket", "plugin"], default=None)
    ap.add_argument("--memory", choices=["host", "gpu"], default="host")
    ap.add_argument("--gpus", default="0,1", help="GPU of each side (pair mode), e.g. 0,1; with --pairs N, N client GPUs then N server GPUs (e.g. 0,1,2,3,4,5,6,7)")
    ap.add_argument("--pairs", type=int, default=1, help="pair mode: this many pairs at once")
    ap.add_argument("--single-process", action="store_true", help="pair mode: one process per side drives all its GPUs")
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--iters", type=int, default=0, help="iterations per size (0 = auto)")
    ap.add_argument("--seconds", type=float, default=0, help="time each size for about this long (instead of --iters)")
    ap.add_argument("--op", choices=["send", "write", "read"], default="send")
    ap.add_argument("--kv-blocks", type=int, default=0, help="vector of N KV blocks per transfer")
    ap.add_argument(
        "--kv-layout",
        choices=["scattered", "contiguous"],
        default="scattered",
        help="KV blocks: slots of a pool in a random order on each side (as a paged KV cache hands them out), or back to back",
    )
    ap.add_argument("--block-size", default="32K")
    ap.add_argument("--streams", type=int, default=None)
    ap.add_argument("--channels", type=int, default=None)
    ap.add_argument("--chunk", default=None)
    ap.add_argument("--reference", action="store_true", help="also measure raw TCP (and NCCL on GPUs)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="time each size this many times, alternated with raw TCP under --reference, and keep the medians (default: 3 with --reference, else 1)",
    )
    ap.add_argument("--json", default=None, help="write results to this file")
    a = ap.parse_args(argv)
    if a.rounds is None:
        a.rounds = 3 if a.reference else 1
    os.environ.setdefault("TCPX_P2P_IFNAME", "lo")
    gpus = [int(x) for x in a.gpus.split(",")]
    if a.memory == "gpu":
        from tcpx_p2p import cuda_device_count

        if cuda_device_count() == 0:
            sys.exit("--memory gpu: no GPU found")
        if len(gpus) == 1 or cuda_device_count() < 2:
            gpus = [gpus[0], gpus[0]]
    mine, theirs = (gpus[0], gpus[1]) if a.memory == "gpu" else (None, None)

    if a.mode == "server":
        server_main(a.port, theirs if a.memory == "gpu" else None, "0.0.0.0")
        return 0
    try:
        if a.mode == "pair" and (a.pairs > 1 or a.single_process):
            n = a.pairs
            if a.memory == "gpu":
                if len(gpus) < 2 * n:
                    sys.exit(f"--pairs {n} needs {2 * n} GPUs in --gpus")
                cg, sg = gpus[:n], gpus[n : 2 * n]
            else:
                cg, sg = [None] * n, [None] * n
            rows, net, streams = run_pairs(a, cg, sg)
        elif a.mode == "client":
            if not a.host:
                sys.exit("client mode needs the server's host")
            rows, net, streams = client_main(a, a.host, a.port, mine)
        else:
            ctx = mp.get_context("spawn")
            ready = ctx.Queue()
            env = {k: v for k, v in os.environ.items() if k.startswith("TCPX_P2P_")}
            srv = ctx.Process(target=_pair_server, args=(ready, theirs, env), daemon=True)
            srv.start()
            port = ready.get(timeout=60)
            rows, net, streams = client_main(a, "127.0.0.1", port, mine)
            srv.join(30)
    except (RuntimeError, ConnectionError, OSError) as e:
        print(f"tcpx-p2p-bench: {e}", file=sys.stderr)
        return 1
    if a.reference and a.memory == "gpu" and a.mode == "pair" and a.op == "send" and not a.kv_blocks:
        try:
            add_nccl_reference(rows, [[c, s] for c, s in zip(cg, sg)] if a.pairs > 1 or a.single_process else [gpus[:2]])
        except Exception as e:  # the reference is optional; say why it is missing
            print(f"NCCL reference skipped: {type(e).__name__}: {e}", file=sys.stderr)
    title = f"tcpx-p2p-bench {a.mode}: net={net} memory={a.memory} streams={streams} op={a.op}"
    if a.pairs > 1 or a.single_process:
        title += f" pairs={a.pairs} layout={'single-process' if a.single_process else 'multi-process'}"
    print_table(rows, title)
    if a.json:
        import platform

        doc = {
            "tool": "tcpx-p2p-bench",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": platform.node(),
            "args": vars(a),
            "net": net,
            "streams": streams,
            "rows": rows,
        }
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
