"""tcpx-p2p-bench: throughput and latency of the engine, beside references
measured in the same run.

    tcpx-p2p-bench pair   [options]          both sides on this host (two processes)
    tcpx-p2p-bench server [options]          the passive side of a two-host run
    tcpx-p2p-bench client HOST [options]     the active side (it sends / writes / reads)
    tcpx-p2p-bench peers  [options]          one endpoint, many peers: threads, descriptors,
                                             memory per peer, and many peers sending at once
                                             (see `tcpx-p2p-bench peers --help`)

References (--reference): raw TCP with the same number of streams (host
memory, our Rust reference client/server), and with GPU memory on a
machine with two GPUs, NCCL's socket transport through PyTorch at its
default and at its best thread × socket setting.

Blocking mode (--inflight N; 1 = one transfer at a time): microseconds per
transfer with p50 / p99, beside the floor measured in the same run: raw
TCP's round trip of the same bytes one way and 8 bytes back, plus for GPU
memory one staged copy out of the GPU and one in.

A reference that cannot run (one GPU for NCCL, no PyTorch) is skipped with
a line saying why; one that fails or does not answer within
--reference-timeout seconds ends that reference, never the benchmark.
TCPX_P2P_BENCH_REFERENCE_FAULT=NAME=fail|hang[,...] (NAME: raw_tcp, nccl,
gpu_copy) makes a reference fail or hang, to test that handling.
"""

import argparse
import json
import multiprocessing as mp
import os
import socket
import queue
import statistics
import sys
import threading
import time

from ._buffers import Buffer, block_offsets, fmt_size, parse_size

DEFAULT_SIZES = "64K,1M,16M,256M"
CTL_PORT = 18515


# ---------------------------------------------------------------- utilities


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


def reference_fault(name):
    """The fault TCPX_P2P_BENCH_REFERENCE_FAULT asks of reference `name`
    ("fail", "hang" or "die"), or None."""
    for item in os.environ.get("TCPX_P2P_BENCH_REFERENCE_FAULT", "").split(","):
        k, _, v = item.strip().partition("=")
        if k == name:
            return v or "fail"
    return None


class Reference:
    """One reference measured beside ours (raw TCP, NCCL, the GPU copies).
    Each call runs under a deadline; the first failure or missed deadline
    ends this reference (later calls return None at once), never the
    benchmark. `status` is "ok", "skipped: why" or "failed: why"."""

    def __init__(self, name, timeout):
        self.name, self.timeout, self.status = name, timeout, "ok"

    @property
    def usable(self):
        return self.status == "ok"

    def _end(self, status):
        if self.usable:
            self.status = status
            print(f"{self.name} reference {status}", file=sys.stderr)

    def skip(self, why):
        self._end(f"skipped: {why}")

    def fail(self, why):
        self._end(f"failed: {why}")

    def call(self, fn, *args):
        """fn(*args) on a daemon thread, waited for at most `timeout`
        seconds; None when this reference has ended or ends now."""
        if not self.usable:
            return None
        box = {}
        fault = reference_fault(self.name)

        def target():
            try:
                if fault == "hang":
                    threading.Event().wait()
                if fault:
                    raise RuntimeError("failure injected by TCPX_P2P_BENCH_REFERENCE_FAULT")
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported as this reference's failure
                box["error"] = e

        t = threading.Thread(target=target, name=f"bench-ref-{self.name}", daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            self.fail(f"no answer within {self.timeout:g} s")
        elif "error" in box:
            e = box["error"]
            self.fail(f"{type(e).__name__}: {e}")
        else:
            return box["value"]
        return None


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
            elif cmd == "echo":
                # Blocking send/recv: each message received is answered with
                # `ack` bytes, so the sender times one transfer and its news.
                # The answer goes from host memory: on one GPU shared by
                # both sides, small copies into the GPU made by the two
                # processes in turn cost ~150 us each (a context switch;
                # benchmarks/h2d_small.py), which a GPU answer would add.
                nblk, bs = len(blocks), buf.n // max(len(blocks), 1)
                ack = min(m["ack"], buf.n)
                note = Buffer(max(ack, 1))
                ok, note_mr = ep.reg(note.ptr, note.n)
                if not ok:
                    raise RuntimeError(ep.last_error())
                try:
                    for _ in range(m["iters"]):
                        ok = ep.recvv(conn, [mr] * nblk, blocks, [bs] * nblk, nblk)
                        if not ok or not ep.send(conn, note_mr, note.ptr, ack):
                            raise RuntimeError(ep.last_error())
                finally:
                    ep.dereg(note_mr)
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
    rows add the pairs' GB/s for each size and, with several pairs, give
    beside it pair 0 measured alone first in the same layout (`alone_GBps`,
    and `scaling`: the sum over the pair alone)."""
    import threading

    n = len(client_gpus)
    alone = {}
    if n > 1 and not a.no_alone:
        one, _, _ = run_pairs(a, client_gpus[:1], server_gpus[:1])
        alone = {(r["op"], r["size"]): r for r in one if r["op"] != "sum"}
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
    ops = list(dict.fromkeys(r["op"] for r in rows))
    for op, size in [(o, z) for o in ops for z in sorted({r["size"] for r in rows})]:
        same = [r for r in rows if (r["op"], r["size"]) == (op, size)]
        if not same:
            continue
        rows.append({
            "op": "sum", "of_op": op, "size": size, "batch": same[0]["batch"], "iters": same[0]["iters"],
            "GBps": round(sum(r["GBps"] for r in same), 3), "Gbps": round(sum(r["Gbps"] for r in same), 2),
            "lat_avg_us": None, "lat_p50_us": None, "lat_p99_us": None, "verified": all(r["verified"] for r in same),
            "pairs": n, "per_pair_GBps": [r["GBps"] for r in same],
        })
        if (op, size) in alone:
            one = alone[(op, size)]
            rows[-1].update(
                alone_GBps=one["GBps"],
                alone_verified=one["verified"],
                scaling=round(rows[-1]["GBps"] / one["GBps"], 3) if one["GBps"] else None,
            )
        if all("raw_tcp_GBps" in r for r in same):
            raw = sum(r["raw_tcp_GBps"] for r in same)
            rows[-1].update(raw_tcp_GBps=round(raw, 3), ratio_vs_raw_tcp=round(rows[-1]["GBps"] / raw, 3) if raw else 0)
    return rows, net, streams


# ------------------------------------------------------------------ client


class Refs:
    """The references of one client: raw TCP (throughput and the blocking
    floor, against the server's raw-TCP port) and the GPU copy floor."""

    def __init__(self, a, host, raw_port, streams):
        self.raw = (host, raw_port, streams)
        self.raw_tcp = Reference("raw_tcp", a.reference_timeout)
        self.gpu_copy = Reference("gpu_copy", a.reference_timeout)

    def note(self, row, *names):
        """Marks a row with each named reference that has ended."""
        for name in names:
            ref = getattr(self, name)
            if not ref.usable:
                row[f"{name}_reference"] = ref.status


class Transfer:
    """One row's buffers, registration and remote descriptors, and one
    blocking transfer of them."""

    def __init__(self, ep, ctl, conn, a, op, gpu, size, nblk):
        self.ep, self.ctl, self.conn, self.op = ep, ctl, conn, op
        self.bs, self.nblk, self.total = size, nblk, size * nblk
        self.layout = a.kv_layout if nblk > 1 else "contiguous"
        ctl.send(cmd="prepare", nblk=nblk, block=size, layout=self.layout)
        self.metas = [bytes.fromhex(x) for x in ctl.recv()["metas"]]
        self.src = Buffer(self.total, gpu)
        ok, self.mr = ep.reg(self.src.ptr, self.total)
        if not ok:
            raise RuntimeError(ep.last_error())
        self.offs = block_offsets(nblk, size, self.layout, seed=1)
        self.blocks = [self.src.ptr + o for o in self.offs]
        self.mrs, self.sizes = [self.mr] * nblk, [size] * nblk

    def once(self):
        ep, conn, n = self.ep, self.conn, self.nblk
        if self.op == "send":
            self.ctl.send(cmd="recv", iters=1)
            self.ctl.recv()
            ok = ep.sendv(conn, self.mrs, self.blocks, self.sizes, n)
            self.ctl.recv()
        elif self.op == "write":
            ok = ep.writev(conn, self.mrs, self.blocks, self.sizes, self.metas, n)
        else:
            ok = ep.readv(conn, self.mrs, self.blocks, self.sizes, self.metas, n)
        if not ok:
            raise RuntimeError(ep.last_error())

    def post(self):
        """One transfer posted (not waited for); its id."""
        ep, conn, n = self.ep, self.conn, self.nblk
        if self.op == "send":
            ok, x = ep.sendv_async(conn, self.mrs, self.blocks, self.sizes, n)
        elif self.op == "write":
            ok, x = ep.writev_async(conn, self.mrs, self.blocks, self.sizes, self.metas, n)
        else:
            ok, x = ep.readv_async(conn, self.mrs, self.blocks, self.sizes, self.metas, n)
        if not ok:
            raise RuntimeError(self.ep.last_error())
        return x

    def wait(self, x):
        if not self.ep.wait(x):
            raise RuntimeError(self.ep.last_error())

    def verify(self):
        """One transfer of a seeded pattern; the receiver's SHA-256 must match."""
        ctl = self.ctl
        if self.op == "read":
            ctl.send(cmd="fill", seed=7)
            ctl.recv()
            self.src.clear()
        else:
            self.src.fill(7)
            ctl.send(cmd="fill", seed=None)
            ctl.recv()
        self.once()
        ctl.send(cmd="digest")
        if ctl.recv()["digest"] != self.src.digest_blocks(self.offs, self.bs):
            raise RuntimeError(f"{self.op} of {fmt_size(self.bs)} x {self.nblk}: the bytes that arrived differ from those sent")
        return True

    def close(self):
        self.ep.dereg(self.mr)


def measure(ep, ctl, conn, a, op, gpu, size, nblk, refs):
    """One row: verify once, then time throughput and latency."""
    tr = Transfer(ep, ctl, conn, a, op, gpu, size, nblk)
    bs, total = tr.bs, tr.total
    iters = a.iters or auto_iters(total, op)
    layout, mr, src = tr.layout, tr.mr, tr.src
    once = tr.once
    verified = tr.verify()

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
        if op == "send":
            ctl.send(cmd="recv", iters=iters)
            ctl.recv()
            t0 = time.perf_counter()
        ids = [tr.post() for _ in range(iters)]
        for x in ids:
            tr.wait(x)
        if op == "send":
            ctl.recv()
        return total * iters / (time.perf_counter() - t0) / 1e9

    from tcpx_p2p import _native

    ip, port, streams = refs.raw
    use_raw = a.reference

    def raw_timed():
        t = refs.raw_tcp.call(_native.rawtcp_run, ip, port, streams, total, iters, False)
        return None if t is None else total * iters / t[0] / 1e9

    # Ours and raw TCP alternated, round by round; the row keeps the median
    # of each (a busy or noisy machine moves single runs by 10-20 %).
    ours, raws = [], []
    for _ in range(max(1, a.rounds)):
        ours.append(timed())
        if use_raw:
            v = raw_timed()
            if v is not None:
                raws.append(v)
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
    if use_raw and raws:
        raw = statistics.median(raws)
        row["raw_tcp_GBps"] = round(raw, 3)
        # From the unrounded figures: small sizes on a busy machine move
        # well under 0.001 GB/s.
        row["ratio_vs_raw_tcp"] = round(gbps / raw, 3) if raw > 0 else None
        if len(raws) > 1:
            row["raw_tcp_rounds_GBps"] = [round(x, 3) for x in raws]
        if nblk == 1 and op == "send":
            pp = refs.raw_tcp.call(_native.rawtcp_run, ip, port, 1, total, min(iters, 200), True)
            if pp is not None:
                row["raw_tcp_pingpong_half_rtt_p50_us"] = round(pct(pp, 50) / 2 * 1e6, 1)
                if gpu is not None and bs <= (16 << 20):
                    # What GPU memory adds to a one-way trip at best: one copy
                    # out of the GPU and one into the other, each waited for.
                    cp = refs.gpu_copy.call(staged_copy_us, src, bs)
                    if cp is not None:
                        row["gpu_copy_out_in_p50_us"] = cp[0]
                        row["floor_one_way_us"] = round(row["raw_tcp_pingpong_half_rtt_p50_us"] + cp[0], 1)
    if use_raw:
        refs.note(row, "raw_tcp", "gpu_copy")
    tr.close()
    return row


def blocking_iters(total):
    """Transfers timed per row in --inflight mode: enough for a p99 at
    small sizes, about 512 MiB at large ones, at least 20."""
    return int(max(20, min(1000, (512 << 20) // max(total, 1))))


def raw_floor(refs, size, iters, min_part=128 << 10):
    """The blocking floor over raw TCP, measured now: `size` bytes one way
    and a few bytes back. Two measurements of it, the faster kept:
    half a ping-pong of `size` bytes plus half a ping-pong of 8 bytes (no
    set-up inside the timing: right for small messages), and from 1 MiB up
    also single runs of `size` bytes answered by the server's 1-byte
    acknowledgement (each run connects first, untimed, and starts its
    threads inside the timing, which large messages hide). A message above
    `min_part` is tried on one stream and on as many as ours would cut it
    into (up to our streams). Returns a dict (one-way-and-back samples in
    s, the 8-byte part, streams, method) or None when raw TCP failed."""
    from tcpx_p2p import _native

    ip, port, streams = refs.raw
    n = iters + 3
    back = refs.raw_tcp.call(_native.rawtcp_run, ip, port, 1, 8, max(n, 50), True)
    if back is None:
        return None
    back = pct(back[3:], 50) / 2
    best = None
    for s in sorted({1, max(1, min(streams, size // min_part))}):
        rt = refs.raw_tcp.call(_native.rawtcp_run, ip, port, s, max(size, 1), n, True)
        if rt is None:
            return None
        cand = [{"samples": [x / 2 + back for x in rt[3:]], "streams": s, "method": "ping-pong"}]
        if size >= (1 << 20):
            shots = []
            for _ in range(min(iters, 20)):
                d = refs.raw_tcp.call(_native.rawtcp_run, ip, port, s, size, 1, False)
                if d is None:
                    return None
                shots.append(d[0])
            cand.append({"samples": shots, "streams": s, "method": "one-shot"})
        for c in cand:
            if best is None or pct(c["samples"], 50) < pct(best["samples"], 50):
                best = c
    best["back"] = back
    return best


def measure_inflight(ep, ctl, conn, a, op, gpu, size, nblk, refs):
    """One row of the blocking mode: `a.inflight` transfers in flight at a
    time (1: each waited for before the next is posted), microseconds per
    transfer and each transfer's p50 / p99, beside the floor measured in the
    same run, alternated with ours round by round.

    send with one in flight: the receiver answers each message with 8 bytes
    (through the engine, from and to host memory), so a transfer is timed to
    its news on the sender, as a write is (it returns once the bytes are in
    the target's memory).

    With `a.gap` (ms, one in flight) each transfer waits that long, untimed,
    before it is posted: it starts after idle time, as a serving system's
    transfers do between requests, when the engine's threads have gone to
    sleep. The floor is still raw TCP's back-to-back round trip."""
    tr = Transfer(ep, ctl, conn, a, op, gpu, size, nblk)
    verified = tr.verify()
    iters = a.iters or blocking_iters(tr.total)
    warm = min(10, iters)
    n_in = max(1, a.inflight)
    ack = min(8, tr.total)
    # The answer to a blocking send lands in host memory (see "echo").
    note, note_mr = None, None
    if op == "send" and n_in == 1:
        note = Buffer(ack)
        ok, note_mr = ep.reg(note.ptr, note.n)
        if not ok:
            raise RuntimeError(ep.last_error())

    gap = a.gap / 1e3 if n_in == 1 else 0.0

    def idle():
        """The untimed wait before a transfer (--gap); the seconds it took."""
        if not gap:
            return 0.0
        t = time.perf_counter()
        time.sleep(gap)
        return time.perf_counter() - t

    def timed():
        """Per-transfer seconds (post to completion) and the wall time of
        `iters` transfers, after `warm` untimed ones (the --gap waits left
        out)."""
        lats = []
        slept = 0.0
        if op == "send" and n_in == 1:
            ctl.send(cmd="echo", iters=warm + iters, ack=ack)
            for i in range(warm + iters):
                if i == warm:
                    t0, slept = time.perf_counter(), 0.0
                slept += idle()
                t = time.perf_counter()
                tr.wait(tr.post())
                if not ep.recv(conn, note_mr, note.ptr, ack):
                    raise RuntimeError(ep.last_error())
                lats.append(time.perf_counter() - t)
            wall = time.perf_counter() - t0 - slept
            ctl.recv()
            return lats[warm:], wall
        if op == "send":
            ctl.send(cmd="recv", iters=warm + iters)
            ctl.recv()
        pending = []  # (id, posted at), oldest first
        t0 = None
        for i in range(warm + iters):
            if i == warm:
                while pending:  # the warm-up drains before the clock starts
                    tr.wait(pending.pop(0)[0])
                t0, slept = time.perf_counter(), 0.0
            if len(pending) >= n_in:
                x, t = pending.pop(0)
                tr.wait(x)
                if i >= warm:
                    lats.append(time.perf_counter() - t)
            slept += idle()
            # Timed from before the post: a post may move data itself (an
            # inline write sends its bytes in the call).
            t = time.perf_counter()
            pending.append((tr.post(), t))
        while pending:
            x, t = pending.pop(0)
            tr.wait(x)
            lats.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0 - slept
        if op == "send":
            ctl.recv()
        return lats, wall

    ours, walls, floors = [], [], []
    back, fstreams, method = None, None, None
    copies = None
    rounds = max(1, a.rounds)
    for _ in range(rounds):
        lats, wall = timed()
        ours += lats
        walls.append(wall)
        f = raw_floor(refs, tr.total, iters)
        if f is not None:
            floors += f["samples"]
            back = f["back"] if back is None else min(back, f["back"])
            fstreams, method = f["streams"], f["method"]
    if note_mr is not None:
        ep.dereg(note_mr)
    if gpu is not None:
        copies = refs.gpu_copy.call(staged_copy_us, tr.src, tr.total, max(20, min(200, (1 << 30) // max(tr.total, 1))))
    us = lambda v: round(v * 1e6, 1)  # noqa: E731
    per = statistics.median(walls) / iters
    row = {
        "op": op,
        "size": tr.bs,
        "batch": nblk,
        "layout": tr.layout,
        "iters": iters,
        "rounds": rounds,
        "inflight": n_in,
        "gap_ms": a.gap if gap else 0,
        "us_per_transfer": us(per),
        "GBps": round(tr.total / per / 1e9, 3),
        "Gbps": round(tr.total / per / 1e9 * 8, 2),
        "lat_avg_us": us(statistics.mean(ours)),
        "lat_p50_us": us(pct(ours, 50)),
        "lat_p99_us": us(pct(ours, 99)),
        "verified": verified,
    }
    if floors:
        # Each sample is one way and back already (see raw_floor).
        row["raw_tcp_streams"] = fstreams
        row["raw_tcp_method"] = method
        row["raw_tcp_8B_back_p50_us"] = us(back)
        row["raw_tcp_p50_us"] = us(pct(floors, 50))
        row["raw_tcp_p99_us"] = us(pct(floors, 99))
        floor50, floor99 = pct(floors, 50), pct(floors, 99)
        if copies is not None:
            row["gpu_copy_out_in_p50_us"], row["gpu_copy_out_in_p99_us"] = copies
            floor50 += copies[0] / 1e6
            floor99 += copies[1] / 1e6
        row["floor_p50_us"] = us(floor50)
        row["floor_p99_us"] = us(floor99)
        if n_in == 1:
            row["p50_vs_floor"] = round(pct(ours, 50) / floor50, 2) if floor50 > 0 else None
        else:  # each transfer's time includes its wait behind the others
            row["per_transfer_vs_floor"] = round(per / floor50, 2) if floor50 > 0 else None
    refs.note(row, "raw_tcp", "gpu_copy")
    tr.close()
    return row


def staged_copy_us(src, n, iters=200):
    """p50 and p99 (µs) of a device→pinned-host plus a pinned-host→device
    copy of `n` bytes, each waited for (the least any TCP path from GPU to
    GPU adds where the copies do not overlap the network)."""
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
    return round(pct(ts[10:], 50) * 1e6, 1), round(pct(ts[10:], 99) * 1e6, 1)


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
    refs = Refs(a, host, hello["raw_port"], streams)
    sizes = [parse_size(x) for x in a.sizes.split(",")] if not a.kv_blocks else [parse_size(a.block_size)]
    nblk = a.kv_blocks or 1
    ops = a.op.split(",")
    rows = []
    bar = None if quiet else Progress(len(sizes) * len(ops), f"{a.op} {'gpu' if gpu is not None else 'host'}")
    one_row = measure_inflight if a.inflight else measure
    for op in ops:
        for size in sizes:
            if barrier is not None:
                barrier.wait()  # pairs measure each size at the same time
            t0, c0 = time.perf_counter(), os.times()
            row = one_row(ep, ctl, conn, a, op, gpu, size, nblk, refs)
            c1 = os.times()
            # CPU of this process (all its threads) per second of wall time.
            row["process_cpu"] = round((c1.user + c1.system - c0.user - c0.system) / (time.perf_counter() - t0), 2)
            rows.append(row)
            if bar:
                bar.step(f"{op} {fmt_size(size)}")
    if bar:
        bar.close()
    ctl.send(cmd="bye")
    ctl.recv()
    return rows, ep.net_name(), streams


# ---------------------------------------------------------- NCCL reference


def _nccl_rank(pair, rank, port, gpus, sizes, iters, env, q, barrier, timeout):
    os.environ.update(env)
    fault = reference_fault("nccl")
    try:
        if fault:
            # Rank 1 fails, hangs or dies at once; rank 0 waits for it as a
            # rank whose peer is gone waits inside NCCL.
            if rank == 0:
                threading.Event().wait()
            if fault == "die":
                os._exit(1)
            if fault == "hang":
                threading.Event().wait()
            raise RuntimeError("failure injected by TCPX_P2P_BENCH_REFERENCE_FAULT")
        import datetime

        import torch
        import torch.distributed as dist

        torch.cuda.set_device(gpus[rank])
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=timeout),
        )
        out = {}
        for size in sizes:
            t = torch.ones(size, dtype=torch.uint8, device=f"cuda:{gpus[rank]}")
            n = iters[size]
            for _ in range(2):  # warm-up
                dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
            torch.cuda.synchronize()
            dist.barrier()
            barrier.wait(timeout)  # all pairs time each size together
            t0 = time.perf_counter()
            for _ in range(n):
                dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
            torch.cuda.synchronize()
            dist.barrier()
            out[size] = size * n / (time.perf_counter() - t0) / 1e9
        if rank == 0:
            q.put((pair, "ok", out))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which ends the reference
        q.put((pair, "err", f"rank {rank} on GPU {gpus[rank]}: {type(e).__name__}: {e}"))
        raise


def run_ranks(procs, q, want, timeout):
    """Starts `procs` and collects `want` (pair, "ok", result) answers from
    `q` within `timeout` seconds. An error answer, a process that exits
    without answering, or the deadline ends the wait with an exception.
    Every process still running at the end is killed: nothing outlives the
    reference, nothing is waited for without a deadline."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no result within {timeout:g} s")
            try:
                pair, status, res = q.get(timeout=min(0.2, left))
            except queue.Empty:
                gone = [p for p in procs if p.exitcode not in (None, 0)]
                if gone:
                    raise RuntimeError(f"a rank exited with status {gone[0].exitcode} without a result") from None
                if all(p.exitcode is not None for p in procs):
                    raise RuntimeError("the ranks ended without a result") from None
                continue
            if status != "ok":
                raise RuntimeError(res)
            got[pair] = res
        return got
    finally:
        end = time.monotonic() + 10  # ranks that answered tear down NCCL
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def nccl_reference(sizes, iters, pairs, nthreads, nsocks, timeout=300):
    """NCCL's socket transport over loopback, one send/recv process group
    per GPU pair, all pairs at once: a {size: GB/s} dict per pair. Raises
    if a rank fails or the pairs do not finish within `timeout` seconds."""
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
        ps += [
            ctx.Process(target=_nccl_rank, args=(i, r, port, gpus, sizes, iters, env, q, barrier, timeout), daemon=True)
            for r in range(2)
        ]
    res = run_ranks(ps, q, len(pairs), timeout)
    return [res[i] for i in range(len(pairs))]


def nccl_unavailable(pairs):
    """Why NCCL's reference cannot run on these GPU pairs, or None."""
    for c, s in pairs:
        if c == s:
            return f"both ranks on GPU {c} (NCCL needs a GPU per rank and stops with 'Duplicate GPU detected')"
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed"
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - a broken install is a reason to skip
        return f"PyTorch does not import ({type(e).__name__}: {e})"
    if not dist.is_available() or not dist.is_nccl_available():
        return "this PyTorch has no NCCL"
    need = max(max(p) for p in pairs) + 1
    if torch.cuda.device_count() < need:
        return f"PyTorch sees {torch.cuda.device_count()} GPUs, the pairs need {need}"
    return None


def add_nccl_reference(rows, pairs, timeout=300):
    """`--reference` on GPUs: NCCL's default and best socket settings with
    the same pairs, sizes and iterations, beside each send row (`sum` rows
    beside the pairs' sum). Returns the reference's status: "ok",
    "skipped: why" or "failed: why" (printed on stderr when not ok)."""
    ref = Reference("nccl", timeout)
    why = nccl_unavailable(pairs)
    if why:
        ref.skip(why)
        return ref.status
    rows = [r for r in rows if "send" in (r["op"], r.get("of_op"))]
    sizes = sorted({r["size"] for r in rows})
    iters = {r["size"]: r["iters"] for r in rows}
    for key, (nthreads, nsocks) in (("default", (0, 0)), ("best", (4, 4))):
        try:
            res = nccl_reference(sizes, iters, pairs, nthreads, nsocks, timeout)
        except Exception as e:  # noqa: BLE001 - ends the reference, never the benchmark
            ref.fail(f"{key} settings: {type(e).__name__}: {e}")
            return ref.status
        for r in rows:
            s = r["size"]
            if r["op"] == "sum":
                v = sum(x[s] for x in res)
                r[f"nccl_{key}_per_pair_GBps"] = [round(x[s], 3) for x in res]
            else:
                v = res[r.get("pair", 0)][s]
            r[f"nccl_{key}_GBps"] = round(v, 3)
            r[f"ratio_vs_nccl_{key}"] = round(r["GBps"] / v, 3) if v > 0 else None
    return ref.status


# -------------------------------------------------------------------- main


def print_table(rows, title, out=sys.stdout):
    if any("inflight" in r for r in rows):
        return print_inflight_table(rows, title, out)
    p = lambda *x: print(*x, file=out)  # noqa: E731
    p(title)
    hdr = f"{'op':<6}{'size':>8}{'batch':>7}{'GB/s':>9}{'Gbps':>9}{'lat avg':>10}{'p50':>9}{'p99':>9}"
    extra = any("raw_tcp_GBps" in r for r in rows)
    nccl = any("nccl_default_GBps" in r for r in rows)
    if extra:
        hdr += f"{'rawTCP':>9}{'ratio':>7}"
    if nccl:
        hdr += f"{'NCCLdef':>9}{'NCCLbest':>9}{'x best':>8}"
    p(hdr)
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    g = lambda v, w: f"{'-':>{w}}" if v is None else f"{v:>{w}.2f}"  # noqa: E731
    for r in rows:
        op = r["op"] if "pair" not in r else f"{r['op']}#{r['pair']}"
        line = f"{op:<6}{fmt_size(r['size']):>8}{r['batch']:>7}{r['GBps']:>9.2f}{r['Gbps']:>9.1f}{f(r['lat_avg_us']):>10}{f(r['lat_p50_us']):>9}{f(r['lat_p99_us']):>9}"
        if extra:
            line += g(r.get("raw_tcp_GBps"), 9) + g(r.get("ratio_vs_raw_tcp"), 7)
        if nccl:
            line += g(r.get("nccl_default_GBps"), 9) + g(r.get("nccl_best_GBps"), 9) + g(r.get("ratio_vs_nccl_best"), 8)
        p(line)
    p("(latency in microseconds: half a round trip for send, one blocking call for write/read)")
    for r in rows:
        if r["op"] == "sum" and "alone_GBps" in r:
            each = " + ".join(f"{x:.2f}" for x in r["per_pair_GBps"])
            p(
                f"  {r['of_op']} {fmt_size(r['size'])}: {r['pairs']} pairs at once {each} = {r['GBps']:.2f} GB/s; "
                f"one pair alone {r['alone_GBps']:.2f} GB/s; {r['scaling']}x"
            )
    layouts = sorted({r["layout"] for r in rows if r.get("batch", 1) > 1})
    if layouts:
        p(f"(KV blocks {', '.join(layouts)} in their pools)")
    for r in rows:
        if "raw_tcp_pingpong_half_rtt_p50_us" in r:
            floor = ""
            if "floor_one_way_us" in r:
                floor = f"; + GPU copy out and in {r['gpu_copy_out_in_p50_us']:.1f} = floor {r['floor_one_way_us']:.1f}"
            p(f"  {fmt_size(r['size'])} one-way p50 {f(r['lat_p50_us'])} us vs raw TCP half round trip {r['raw_tcp_pingpong_half_rtt_p50_us']:.1f}{floor}")


def print_inflight_table(rows, title, out=sys.stdout):
    """The blocking mode's table: per-transfer microseconds beside the floor."""
    p = lambda *x: print(*x, file=out)  # noqa: E731
    f = lambda v, w: f"{'-':>{w}}" if v is None else f"{v:>{w}.1f}"  # noqa: E731
    gpu = any("gpu_copy_out_in_p50_us" in r for r in rows)
    p(title)
    hdr = f"{'op':<9}{'size':>7}{'inflt':>6}{'us/xfer':>10}{'p50':>9}{'p99':>9}{'GB/s':>8}{'rawTCP':>9}"
    if gpu:
        hdr += f"{'copies':>8}"
    hdr += f"{'floor':>9}{'fl p99':>9}{'p50/fl' if all(r['inflight'] == 1 for r in rows) else 'xfer/fl':>8}  raw TCP as"
    p(hdr)
    for r in rows:
        op = r["op"] if r.get("batch", 1) == 1 else f"{r['op']}x{r['batch']}"
        line = f"{op:<9}{fmt_size(r['size']):>7}{r['inflight']:>6}{r['us_per_transfer']:>10.1f}{r['lat_p50_us']:>9.1f}{r['lat_p99_us']:>9.1f}{r['GBps']:>8.2f}"
        line += f(r.get("raw_tcp_p50_us"), 9)
        if gpu:
            line += f(r.get("gpu_copy_out_in_p50_us"), 8)
        line += f(r.get("floor_p50_us"), 9) + f(r.get("floor_p99_us"), 9)
        ratio = r.get("p50_vs_floor", r.get("per_transfer_vs_floor"))
        line += f"{'-':>8}" if ratio is None else f"{ratio:>8.2f}"
        if "raw_tcp_method" in r:
            line += f"  {r['raw_tcp_method']}, {r['raw_tcp_streams']} stream{'s' if r['raw_tcp_streams'] > 1 else ''}"
        p(line)
    p("(microseconds. us/xfer: wall time per transfer; p50 / p99: each transfer, posted to done;")
    p(" send is timed to the receiver's 8-byte answer (host memory); opxN: N blocks of that size per transfer;")
    p(" xfer/fl: us/xfer over the floor, with several in flight. rawTCP: raw TCP moving the same")
    p(" bytes one way and a few back, p50: the faster of half a ping-pong of them + half one of")
    p(" 8 bytes, and from 1 MiB single acknowledged runs, on 1 stream and on as many as ours;")
    p(" floor = rawTCP + one staged copy out of the GPU and one in)" if gpu else " floor = rawTCP)")


def default_out_dir(a):
    """Where --inflight writes when neither --json nor --out is given:
    benchmarks/results/<date>-<host>-blocking/ under the working directory
    when it has benchmarks/results (a checkout), else nowhere."""
    import platform

    base = os.path.join("benchmarks", "results")
    if not os.path.isdir(base):
        return None
    return os.path.join(base, f"{time.strftime('%Y-%m-%d')}-{platform.node() or 'host'}-blocking")


LOAD_AT_START = list(os.getloadavg())


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["peers"]:
        from . import bench_peers

        return bench_peers.main(args[1:])
    ap = argparse.ArgumentParser(prog="tcpx-p2p-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["pair", "server", "client"])
    ap.add_argument("host", nargs="?", help="server host (client mode)")
    ap.add_argument("--port", type=int, default=CTL_PORT, help="control port of the server")
    ap.add_argument("--net", choices=["socket", "plugin"], default=None)
    ap.add_argument("--memory", choices=["host", "gpu"], default="host")
    ap.add_argument("--gpus", default="0,1", help="GPU of each side (pair mode), e.g. 0,1; with --pairs N, N client GPUs then N server GPUs (e.g. 0,1,2,3,4,5,6,7)")
    ap.add_argument("--pairs", type=int, default=1, help="pair mode: this many pairs at once")
    ap.add_argument("--single-process", action="store_true", help="pair mode: one process per side drives all its GPUs")
    ap.add_argument("--no-alone", action="store_true", help="with --pairs N > 1: skip measuring pair 0 alone first (the sum rows' baseline)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--iters", type=int, default=0, help="iterations per size (0 = auto)")
    ap.add_argument("--seconds", type=float, default=0, help="time each size for about this long (instead of --iters)")
    ap.add_argument("--op", default="send", help="send, write or read, or several in turn (e.g. write,read,send)")
    ap.add_argument(
        "--inflight",
        type=int,
        default=0,
        help="blocking mode: this many transfers in flight at a time (1: one at a time), microseconds per transfer beside the floor measured in the same run",
    )
    ap.add_argument(
        "--gap",
        type=float,
        default=0,
        help="with --inflight 1: wait this many ms (untimed) before each transfer, so that each starts after idle time, as between a serving system's requests",
    )
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
        help="time each size this many times, alternated with raw TCP under --reference (with the floor under --inflight), and keep the medians (default: 3 with --reference or --inflight, else 1)",
    )
    ap.add_argument("--reference-timeout", type=float, default=300, help="seconds a reference may take before it is ended (default 300)")
    ap.add_argument("--json", default=None, help="write results to this file")
    ap.add_argument(
        "--out",
        default=None,
        help="write the JSON and the table into this folder (--inflight without --json or --out: benchmarks/results/DATE-HOST-blocking/ when run from a checkout)",
    )
    a = ap.parse_args(argv)
    for op in a.op.split(","):
        if op not in ("send", "write", "read"):
            ap.error(f"--op: {op!r} is not send, write or read")
    if a.inflight < 0:
        ap.error("--inflight: at least 1 (0: the throughput mode)")
    if a.inflight and (a.pairs > 1 or a.single_process):
        ap.error("--inflight measures one pair")
    if a.gap < 0 or (a.gap and a.inflight != 1):
        ap.error("--gap: ms (at least 0) before each transfer of --inflight 1")
    if a.rounds is None:
        a.rounds = 3 if a.reference or a.inflight else 1
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
    references = {}
    if a.reference or a.inflight:  # the blocking floor is raw TCP's
        references["raw_tcp"] = next((r["raw_tcp_reference"] for r in rows if "raw_tcp_reference" in r), "ok")
    if a.memory == "gpu" and (a.inflight or a.reference):
        references["gpu_copy"] = next((r["gpu_copy_reference"] for r in rows if "gpu_copy_reference" in r), "ok")
    if a.reference and a.memory == "gpu" and a.mode == "pair" and "send" in a.op.split(",") and not a.kv_blocks and not a.inflight:
        pairs = [[c, s] for c, s in zip(cg, sg)] if a.pairs > 1 or a.single_process else [gpus[:2]]
        references["nccl"] = add_nccl_reference(rows, pairs, a.reference_timeout)
    title = f"tcpx-p2p-bench {a.mode}: net={net} memory={a.memory} streams={streams} op={a.op}"
    if a.inflight:
        title += f" inflight={a.inflight} rounds={a.rounds}"
    if a.gap:
        title += f" gap={a.gap:g}ms"
    if a.pairs > 1 or a.single_process:
        title += f" pairs={a.pairs} layout={'single-process' if a.single_process else 'multi-process'}"
    print_table(rows, title)
    for name, status in references.items():
        if status != "ok":
            print(f"reference {name}: {status}")
    out_dir = a.out or (default_out_dir(a) if a.inflight and not a.json else None)
    if a.json or out_dir:
        import io
        import platform

        doc = {
            "tool": "tcpx-p2p-bench",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            # What else the machine was doing: 1, 5 and 15 minute load
            # averages at the start and at the end of the run.
            "loadavg": {"start": LOAD_AT_START, "end": list(os.getloadavg())},
            "args": vars(a),
            "net": net,
            "streams": streams,
            "references": references,
            "rows": rows,
        }
        paths = [a.json] if a.json else []
        if out_dir:
            stem = f"bench-{a.op.replace(',', '-')}-{a.memory}" + (f"-inflight{a.inflight}" if a.inflight else "")
            stem += time.strftime("-%H%M%S")
            os.makedirs(out_dir, exist_ok=True)
            paths.append(os.path.join(out_dir, stem + ".json"))
            table = io.StringIO()
            print_table(rows, title, table)
            with open(os.path.join(out_dir, stem + ".txt"), "w") as f:
                f.write(table.getvalue())
        for path in paths:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
        print(f"results: {', '.join(paths)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
