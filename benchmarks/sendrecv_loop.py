"""Blocking send / recv in a loop, as UCCL's benchmark_uccl.py times it
(rank 0 calls `send` back to back, rank 1 `recv`; each side's time per
call is its loop's wall time over the iterations), through our Python API,
two processes on this host. Host memory, or GPU memory with --gpus A,B
(sender's and receiver's GPU). Each size is measured in --rounds rounds;
the table gives medians, the JSON every round. The bytes of each size's
first message are checked (SHA-256 on both sides, and against the
sender's pattern, saying where they differ); with --check-all the
receiver checks every message (its buffer zeroed before each call, the
checks left out of the time).

With --lag MS the receiver starts each round's loop that long after the
sender has started its own, as UCCL's server does while it sets up each
size: its first receives find their bytes waiting in the sockets (the
sender's sends end once their bytes are out of its buffer). The
receiver's slowest call of each round is shown beside its loop's time.

    python benchmarks/sendrecv_loop.py --sizes 64K,1M --rounds 5
    python benchmarks/sendrecv_loop.py --sizes 256K,1M --iters 10 --rounds 20 --lag 20
    python benchmarks/sendrecv_loop.py --memory gpu --gpus 0,1 --sizes 64K,1M,16M,256M

With --shape uccl each round is one of UCCL's sizes as its benchmark runs
it: the buffer made anew the way it makes it (`torch.ones(n // 4).cuda()`
for GPU memory, which from 256 KB up fills on PyTorch's OpenMP team and
leaves that team spinning), registered, one warm-up call, then --iters
calls (default 10) timed at once, with no barrier between warm-up and loop.
The sender's buffer then holds the pattern, the receiver's is zeroed (both
done before registering); the warm-up message and the last one are
checked.

With --via raw the same loop runs over the reference instead of our
engine: one plain TCP connection (Python sockets, Nagle off), a GPU buffer
staged through pinned host memory on each side (a synchronous copy out
before `sendall`, in after the last byte arrives). It has no threads to
hand work to, so it shows what the machine leaves for a transfer in the
same loop (NCCL refuses two ranks on one GPU).

    python benchmarks/sendrecv_loop.py --memory gpu --shape uccl --sizes 64K,256K,1M,10M --rounds 6
    python benchmarks/sendrecv_loop.py --memory gpu --shape uccl --via raw --sizes 64K,256K,1M,10M --rounds 6

With --via nccl the loop runs over NCCL's socket transport through
PyTorch (`torch.distributed` send / recv, each call waiting for its GPU
stream as UCCL's calls return once done), NCCL's shared-memory,
peer-to-peer and InfiniBand paths off so its bytes go over TCP on
loopback: the reference where two GPUs are lent (--gpus 0,1).

    python benchmarks/sendrecv_loop.py --memory gpu --gpus 0,1 --shape uccl --via nccl --sizes 64K,256K,1M,10M --rounds 6

With --sched each side reads its threads' scheduler accounts (Linux's
/proc/self/task/*/schedstat) before and after every round's timed calls
and reports, per group of threads of one name (the calling thread as
`caller`), the time they ran and the time they waited for a CPU while
runnable: where a loop is slow because its threads wait behind others
(PyTorch's OpenMP team spinning, say), the wait shows there.
"""

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import time

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s):
    s = s.strip().upper().rstrip("B")
    return int(s[:-1]) * UNITS[s[-1]] if s[-1] in UNITS else int(s)


def pattern(n, seed):
    """The `n` bytes a sender of seed `seed` sends."""
    return (bytes((i * 31 + seed) & 0xFF for i in range(256)) * (n // 256 + 1))[:n]


def where_differ(got, want):
    """Where `got` differs from `want`, in words: the first byte that
    differs, the 4 KiB pages that differ (as ranges of KiB), and what the
    first bad bytes are (zeros: never written)."""
    if got == want:
        return None
    first = next(i for i in range(len(want)) if got[i] != want[i])
    bad = [i for i in range(0, len(want), 4096) if got[i : i + 4096] != want[i : i + 4096]]
    runs = []
    for i in bad:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 4096
        else:
            runs.append([i, i + 4096])
    spans = ", ".join(f"{a >> 10}-{b >> 10}" for a, b in runs[:16]) + (" ..." if len(runs) > 16 else "")
    zeros = all(got[a:b] == bytes(b - a) for a, b in runs)
    return (
        f"first differing byte at {first} of {len(want)}; {len(bad)} of {(len(want) + 4095) // 4096} "
        f"4 KiB pages differ (KiB {spans}); there: {got[first:first + 16].hex()} "
        f"(wanted {want[first:first + 16].hex()})" + ("; all zeros (never written)" if zeros else "")
    )


class Buf:
    """`n` bytes of host memory (numpy-free: ctypes) or of one GPU (torch)."""

    def __init__(self, n, gpu, uccl=False):
        self.n, self.gpu = n, gpu
        if gpu is None:
            import ctypes

            self._c = ctypes
            self.buf = (ctypes.c_char * n)()
            self.ptr = ctypes.addressof(self.buf)
        else:
            import torch

            self.torch = torch
            torch.cuda.set_device(gpu)
            if uccl and n % 4 == 0:
                # As UCCL's benchmark makes it: filled on the CPU (on
                # PyTorch's OpenMP team from 65,536 floats up), then copied.
                self.buf = torch.ones(n // 4, dtype=torch.float32).cuda().view(torch.uint8)
            else:
                self.buf = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{gpu}")
            # The fill runs on torch's stream, unordered with the
            # engine's copies: it must be done before a receive can land.
            torch.cuda.synchronize()
            self.ptr = self.buf.data_ptr()

    def view(self):
        """The buffer's bytes as a writable memoryview (host memory)."""
        return memoryview(self.buf).cast("B")

    def fill(self, seed):
        data = pattern(self.n, seed)
        if self.gpu is None:
            self._c.memmove(self.ptr, data, self.n)
        else:
            t = self.torch.frombuffer(bytearray(data[: self.n]), dtype=self.torch.uint8)
            self.buf.copy_(t)
            self.torch.cuda.synchronize()

    def zero(self):
        if self.gpu is None:
            self._c.memset(self.ptr, 0, self.n)
        else:
            self.buf.zero_()
            self.torch.cuda.synchronize()

    def bytes(self):
        if self.gpu is None:
            return self._c.string_at(self.ptr, self.n)
        self.torch.cuda.synchronize()
        return self.buf.cpu().numpy().tobytes()

    def digest(self):
        return hashlib.sha256(self.bytes()).hexdigest()


class RawLink:
    """The reference: one plain TCP connection between the two ranks, GPU
    buffers staged through pinned host memory (see the module's doc)."""

    def __init__(self, rank, chan, cap, gpu):
        import socket

        if rank == 1:
            ls = socket.create_server(("127.0.0.1", 0))
            chan.send(ls.getsockname()[1])
            self.sock, _ = ls.accept()
            ls.close()
        else:
            self.sock = socket.create_connection(("127.0.0.1", chan.recv()))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host = None
        if gpu is not None:
            import torch

            self.host = torch.empty(cap, dtype=torch.uint8).pin_memory()
            self.host_view = memoryview(self.host.numpy()).cast("B")

    def reg(self, b):
        """Nothing to register: plain TCP reads and writes any memory."""

    def dereg(self, b):
        """Nothing registered."""

    def send(self, b):
        if b.gpu is None:
            self.sock.sendall(b.view())
            return
        # A copy to pageable-or-pinned host memory waits for the GPU.
        self.host[: b.n].copy_(b.buf)
        self.sock.sendall(self.host_view[: b.n])

    def recv(self, b):
        view = b.view() if b.gpu is None else self.host_view[: b.n]
        got = 0
        while got < b.n:
            k = self.sock.recv_into(view[got:], b.n - got)
            if k == 0:
                raise ConnectionError(f"the raw TCP reference's peer closed after {got} of {b.n} bytes")
            got += k
        if b.gpu is not None:
            b.buf.copy_(self.host[: b.n])
            b.torch.cuda.synchronize()


class NcclLink:
    """NCCL's socket transport through PyTorch (see the module's doc)."""

    def __init__(self, rank, chan, gpu):
        import socket

        import torch
        import torch.distributed as dist

        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            chan.send(port)
        else:
            port = chan.recv()
        for k, v in {"NCCL_NET": "Socket", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}.items():
            os.environ.setdefault(k, v)
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=torch.device("cuda", gpu))
        self.torch, self.dist = torch, dist

    def reg(self, b):
        """NCCL takes any buffer of its GPU."""

    def dereg(self, b):
        """Nothing registered."""

    def send(self, b):
        self.dist.send(b.buf, 1)
        self.torch.cuda.synchronize()

    def recv(self, b):
        self.dist.recv(b.buf, 0)
        self.torch.cuda.synchronize()


class EngineLink:
    """Our engine through its Python API (UCCL's `p2p.Endpoint`)."""

    def __init__(self, rank, chan, gpu):
        from tcpx_p2p import p2p

        self.ep = ep = p2p.Endpoint(gpu)
        if rank == 1:
            chan.send(bytes(ep.get_metadata()))
            ok, _, _, self.conn = ep.accept()
        else:
            ip, port, r_gpu = p2p.Endpoint.parse_metadata(chan.recv())
            ok, self.conn = ep.connect(ip, r_gpu, remote_port=port)
        assert ok, ep.last_error()
        self.mrs = {}

    def reg(self, b):
        ok, self.mrs[b.ptr] = self.ep.reg(b.ptr, b.n)
        assert ok, self.ep.last_error()

    def dereg(self, b):
        self.ep.dereg(self.mrs.pop(b.ptr))

    def send(self, b):
        assert self.ep.send(self.conn, self.mrs[b.ptr], b.ptr, b.n), self.ep.last_error()

    def recv(self, b):
        assert self.ep.recv(self.conn, self.mrs[b.ptr], b.ptr, b.n), self.ep.last_error()


def thread_times():
    """Every thread of this process: {tid: (name, ns run, ns waited runnable)}."""
    out = {}
    me = os.getpid()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = (int(x) for x in f.read().split()[:2])
        except (OSError, ValueError):
            continue  # the thread ended, or the kernel keeps no accounts
        out[int(tid)] = ("caller" if int(tid) == me else re.sub(r"[-_.]?\d+$", "", name), run, wait)
    return out


def add_sched(into, before, after):
    """Adds each thread group's run and wait (ms) and how many of its
    threads ran between two `thread_times` readings to `into`."""
    for tid, (name, run, wait) in after.items():
        _, r0, w0 = before.get(tid, (name, 0, 0))
        g = into.setdefault(name, {"run_ms": 0.0, "wait_ms": 0.0, "threads_ran": 0})
        g["run_ms"] += (run - r0) / 1e6
        g["wait_ms"] += (wait - w0) / 1e6
        g["threads_ran"] += run > r0


def print_sched(rank, n, sched, rounds):
    rows = sorted(sched.items(), key=lambda kv: -(kv[1]["run_ms"] + kv[1]["wait_ms"]))
    print(f"  rank {rank}, {n} B, per round: " + "; ".join(f"{k} run {v['run_ms'] / rounds:.2f} wait {v['wait_ms'] / rounds:.2f} ms ({v['threads_ran'] / rounds:.1f} ran)" for k, v in rows[:6] if v["run_ms"] or v["wait_ms"]))


def uccl_round(rank, link, n, gpu, iters, seed, sched=None):
    """One size as UCCL's benchmark runs it: the buffer made anew, one
    warm-up call, `iters` calls timed at once. Returns (time per call,
    slowest call, where the warm-up's bytes differ, where the last's do)."""
    b = Buf(n, gpu, uccl=True)
    if rank == 0:
        b.fill(seed)
    else:
        b.zero()
    link.reg(b)
    call = link.send if rank == 0 else link.recv
    call(b)
    want = pattern(n, seed)
    first = where_differ(b.bytes(), want) if rank == 1 else None
    if rank == 1:
        b.zero()
    each = []
    before = thread_times() if sched is not None else None
    t = time.perf_counter()
    for _ in range(iters):
        c = time.perf_counter()
        call(b)
        each.append(time.perf_counter() - c)
    total = time.perf_counter() - t
    if sched is not None:
        add_sched(sched, before, thread_times())
    last = where_differ(b.bytes(), want) if rank == 1 else None
    link.dereg(b)
    return total / iters * 1e6, max(each) * 1e6, first, last


def side(rank, chan, a, out):
    try:
        gpus = [int(g) for g in a.gpus.split(",")] if a.gpus else None
        gpu = gpus[rank] if gpus else None
        if a.via == "raw":
            link = RawLink(rank, chan, max(a.sizes), gpu)
        elif a.via == "nccl":
            link = NcclLink(rank, chan, gpu)
        else:
            link = EngineLink(rank, chan, gpu)
        res = {}
        for n in a.sizes:
            if a.shape == "uccl":
                r = res[n] = {"us": [], "slowest_us": [], "iters": a.iters or 10, "digest": "checked by the receiver"}
                for k in range(a.rounds):
                    chan.send("go") if rank == 0 else chan.recv()
                    chan.recv() if rank == 0 else chan.send("ready")
                    us, slow, first, last = uccl_round(rank, link, n, gpu, r["iters"], (n + k) % 251, r.setdefault("sched", {}) if a.sched else None)
                    if first or last:
                        raise AssertionError(f"size {n}, round {k + 1}: " + (f"warm-up message: {first}" if first else f"last message: {last}"))
                    r["us"].append(us)
                    r["slowest_us"].append(slow)
                continue
            b = Buf(n, gpu)
            link.reg(b)
            call = link.send if rank == 0 else link.recv
            if rank == 0:
                b.fill(n % 251)
            # The first message: bytes checked on both sides, and against
            # the sender's pattern where they differ.
            call(b)
            res.setdefault(n, {"digest": b.digest(), "us": []})
            want = pattern(n, n % 251)
            if rank == 1:
                res[n]["differ"] = where_differ(b.bytes(), want)
            iters = a.iters or max(20, min(5000, (256 << 20) // n))
            for _ in range(a.rounds):
                chan.send("go") if rank == 0 else chan.recv()
                chan.recv() if rank == 0 else chan.send("ready")
                if rank == 1 and a.lag:
                    time.sleep(a.lag / 1e3)
                each = []
                before = thread_times() if a.sched else None
                t = time.perf_counter()
                for i in range(iters):
                    if rank == 1 and a.check_all:
                        b.zero()
                    c = time.perf_counter()
                    call(b)
                    each.append(time.perf_counter() - c)
                    if rank == 1 and a.check_all:
                        bad = where_differ(b.bytes(), want)
                        if bad:
                            raise AssertionError(f"size {n}, round {len(res[n]['us']) + 1}, message {i + 1}: {bad}")
                # (With --check-all the checks are left out of the time.)
                total = sum(each) if a.check_all else time.perf_counter() - t
                if a.sched:
                    add_sched(res[n].setdefault("sched", {}), before, thread_times())
                res[n]["us"].append(total / iters * 1e6)
                res[n].setdefault("slowest_us", []).append(max(each) * 1e6)
            res[n]["iters"] = iters
            link.dereg(b)
            chan.send("size done") if rank == 0 else chan.recv()
        out.put((rank, "ok", res))
    except BaseException:
        import traceback

        out.put((rank, "err", traceback.format_exc()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", choices=["host", "gpu"], default="host")
    ap.add_argument("--gpus", default="", help="SENDER,RECEIVER GPUs (GPU memory)")
    ap.add_argument("--sizes", default="64K,1M")
    ap.add_argument("--iters", type=int, default=0, help="calls per round (0: by size)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lag", type=float, default=0, help="ms the receiver starts each round after the sender (0: together)")
    ap.add_argument("--check-all", action="store_true", help="the receiver checks every message against the sender's pattern (its buffer zeroed before each; checks not timed)")
    ap.add_argument("--shape", choices=["loop", "uccl"], default="loop", help="uccl: each round one size as UCCL's benchmark runs it (buffer made anew, one warm-up, --iters calls, default 10)")
    ap.add_argument("--via", choices=["engine", "raw", "nccl"], default="engine", help="raw: the same loop over one plain TCP connection (the reference); nccl: over NCCL's socket transport (two GPUs)")
    ap.add_argument("--sched", action="store_true", help="report each side's thread groups' run and CPU-wait time over the timed calls (Linux schedstat)")
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    if a.memory == "gpu" and not a.gpus:
        a.gpus = "0,0"
    if a.memory == "host":
        a.gpus = ""
    if a.via == "nccl" and (a.memory != "gpu" or len(set(a.gpus.split(","))) != 2):
        ap.error("--via nccl needs --memory gpu and two GPUs (--gpus 0,1): NCCL moves GPU memory and refuses two ranks on one GPU")
    if a.shape == "uccl" and a.lag:
        ap.error("--lag is for --shape loop (in UCCL's shape the receiver lags as it sets up)")
    os.environ.setdefault("TCPX_P2P_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    c0, c1 = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=side, args=(r, c, a, out)) for r, c in ((0, c0), (1, c1))]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, st, res = out.get(timeout=600)
        if st != "ok":
            print(f"rank {rank} failed:\n{res}", file=sys.stderr)
            for p in procs:
                p.kill()
            return 1
        got[rank] = res
    for p in procs:
        p.join(30)
    rows = []
    print(f"{'size':>8} {'send us':>9} {'recv us':>9} {'GB/s':>7} {'recv max':>9}  rounds (recv us)")
    for n in a.sizes:
        s, r = got[0][n], got[1][n]
        if s["digest"] != r["digest"] or r.get("differ"):
            print(f"size {n}: the bytes received differ from those sent: {r.get('differ')}", file=sys.stderr)
            return 1
        ms, mr = statistics.median(s["us"]), statistics.median(r["us"])
        slow = statistics.median(r["slowest_us"])
        rows.append(
            {
                "bytes": n,
                "iters": s["iters"],
                "send_us": s["us"],
                "recv_us": r["us"],
                "send_us_p50": ms,
                "recv_us_p50": mr,
                "recv_slowest_us": r["slowest_us"],
            }
        )
        if a.sched:
            rows[-1]["sched"] = {"send": s.get("sched", {}), "recv": r.get("sched", {})}
        each = " ".join(f"{x:.1f}" for x in r["us"])
        # With --lag (and in UCCL's shape, whose rows are its server's) the
        # sender's loop runs ahead of the receiver's: the receiver's time is
        # the row's.
        per = mr if a.lag or a.shape == "uccl" else max(ms, mr)
        print(f"{n:>8} {ms:9.1f} {mr:9.1f} {n / per / 1e3:7.2f} {slow:9.1f}  {each}")
        if a.sched:
            for rank, side_res in ((0, s), (1, r)):
                print_sched(rank, n, side_res.get("sched", {}), a.rounds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"memory": a.memory, "gpus": a.gpus, "lag_ms": a.lag, "shape": a.shape, "via": a.via, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
