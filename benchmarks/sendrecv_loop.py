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
"""

import argparse
import hashlib
import json
import multiprocessing as mp
import os
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

    def __init__(self, n, gpu):
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
            self.buf = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{gpu}")
            # The zeroing runs on torch's stream, unordered with the
            # engine's copies: it must be done before a receive can land.
            torch.cuda.synchronize()
            self.ptr = self.buf.data_ptr()

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


def side(rank, chan, a, out):
    try:
        from tcpx_p2p import p2p

        gpus = [int(g) for g in a.gpus.split(",")] if a.gpus else None
        gpu = gpus[rank] if gpus else None
        ep = p2p.Endpoint(gpu)
        if rank == 1:
            chan.send(bytes(ep.get_metadata()))
            ok, _, _, conn = ep.accept()
        else:
            ip, port, r_gpu = p2p.Endpoint.parse_metadata(chan.recv())
            ok, conn = ep.connect(ip, r_gpu, remote_port=port)
        assert ok, ep.last_error()
        res = {}
        for n in a.sizes:
            b = Buf(n, gpu)
            ok, mr = ep.reg(b.ptr, n)
            assert ok, ep.last_error()
            call = ep.send if rank == 0 else ep.recv
            if rank == 0:
                b.fill(n % 251)
            # The first message: bytes checked on both sides, and against
            # the sender's pattern where they differ.
            assert call(conn, mr, b.ptr, n), ep.last_error()
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
                t = time.perf_counter()
                for i in range(iters):
                    if rank == 1 and a.check_all:
                        b.zero()
                    c = time.perf_counter()
                    assert call(conn, mr, b.ptr, n), ep.last_error()
                    each.append(time.perf_counter() - c)
                    if rank == 1 and a.check_all:
                        bad = where_differ(b.bytes(), want)
                        if bad:
                            raise AssertionError(f"size {n}, round {len(res[n]['us']) + 1}, message {i + 1}: {bad}")
                # (With --check-all the checks are left out of the time.)
                total = sum(each) if a.check_all else time.perf_counter() - t
                res[n]["us"].append(total / iters * 1e6)
                res[n].setdefault("slowest_us", []).append(max(each) * 1e6)
            res[n]["iters"] = iters
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
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    if a.memory == "gpu" and not a.gpus:
        a.gpus = "0,0"
    if a.memory == "host":
        a.gpus = ""
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
        each = " ".join(f"{x:.1f}" for x in r["us"])
        # With --lag the sender's loop runs ahead of the receiver's: the
        # receiver's time is the row's.
        per = mr if a.lag else max(ms, mr)
        print(f"{n:>8} {ms:9.1f} {mr:9.1f} {n / per / 1e3:7.2f} {slow:9.1f}  {each}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"memory": a.memory, "gpus": a.gpus, "lag_ms": a.lag, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
