"""What a peer process does for the end-to-end tests: a small RPC server
around one tcpx_p2p Endpoint, driven by the test process over a
multiprocessing pipe. Buffers live in host memory (ctypes) or, on a GPU
machine, in CUDA memory (torch)."""

import ctypes
import functools
import hashlib
import os
import random
import signal
import time
import traceback


@functools.lru_cache(maxsize=4)
def pattern(n, seed):
    """Deterministic bytes for buffer contents (1 MiB random blocks)."""
    blk = 1 << 20
    return b"".join(
        random.Random(seed * 1_000_003 + i).randbytes(min(blk, n - i * blk)) for i in range((n + blk - 1) // blk)
    )


class Buffers:
    def __init__(self, device, gpu):
        self.device = device
        self.gpu = gpu
        self.bufs = {}
        self.next = 0

    def alloc(self, n, seed=None):
        if self.device == "cuda":
            import torch

            t = torch.zeros(max(n, 1), dtype=torch.uint8, device=f"cuda:{self.gpu}")
            if seed is not None and n:
                t[:n].copy_(torch.frombuffer(bytearray(pattern(n, seed)), dtype=torch.uint8))
            torch.cuda.synchronize(self.gpu)
            obj, ptr = t, t.data_ptr()
        else:
            obj = (ctypes.c_char * max(n, 1))()
            ptr = ctypes.addressof(obj)
            if seed is not None and n:
                ctypes.memmove(ptr, pattern(n, seed), n)
        self.next += 1
        self.bufs[self.next] = (obj, ptr, n)
        return self.next, ptr

    def data(self, bid, off=0, n=None):
        obj, ptr, size = self.bufs[bid]
        n = size - off if n is None else n
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize(self.gpu)
            return obj[off : off + n].cpu().numpy().tobytes()
        return ctypes.string_at(ptr + off, n)

    def digest(self, bid, off=0, n=None):
        return hashlib.sha256(self.data(bid, off, n)).hexdigest()

    def free(self, bid):
        self.bufs.pop(bid, None)


def stop_child(proc, pipe, grace):
    """Ends a peer process: asks it to stop (None on its pipe), waits
    `grace` seconds, then kills it."""
    if proc.is_alive():
        try:
            pipe.send(None)
        except (BrokenPipeError, OSError):
            pass
        proc.join(grace)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def stopped(pid, timeout=10.0):
    """Stops process `pid` (SIGSTOP) and returns once every thread of it
    has stopped: the signal is delivered asynchronously, and a thread still
    running could answer for the process."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.time() + timeout
    while True:
        states = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    states.append(f.read().rsplit(") ", 1)[1][0])
            except OSError:
                continue
        if states and all(st in "tT" for st in states):
            return
        assert time.time() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.001)


def enter_netns(name):
    """Moves this process into network namespace `name` (a test host)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def thread_cpus():
    """Each thread of this process: (name, the CPUs it may run on), the
    main thread named `main`."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            name = "main" if int(tid) == os.getpid() else name
            out.append((name, sorted(os.sched_getaffinity(int(tid)))))
        except OSError:  # the thread ended meanwhile
            pass
    return out


def serve(pipe, device, gpu, env):
    os.environ.update(env)
    if env.get("TEST_NETNS"):
        enter_netns(env["TEST_NETNS"])
    from tcpx_p2p import p2p

    # A CPU peer owns no GPU: index 0 names this machine's host memory.
    ep = p2p.Endpoint(gpu if device == "cuda" else 0)
    bufs = Buffers(device, gpu)
    pipe.send(("ok", ep.get_metadata()))
    while True:
        try:
            msg = pipe.recv()
        except EOFError:
            return
        if msg is None:
            return
        op, args = msg
        try:
            if op == "ep":
                name, a = args
                res = getattr(ep, name)(*a)
            elif op == "alloc":
                res = bufs.alloc(*args)
            elif op == "digest":
                res = bufs.digest(*args)
            elif op == "data":
                res = bufs.data(*args)
            elif op == "free":
                res = bufs.free(*args)
            elif op == "threads":
                res = thread_cpus()
            elif op == "soak":
                res = soak(ep, bufs, *args)
            elif op == "exit":
                os._exit(args[0] if args else 0)
            else:
                raise ValueError(f"unknown op {op}")
            pipe.send(("ok", res))
        except Exception:
            pipe.send(("err", traceback.format_exc()))


def soak(ep, bufs, conn, metas, slot, seconds, seed):
    """Load: rounds of len(metas) concurrent one-sided writes of random sizes
    into the peer's advertised slots, then reads back and compares every
    byte. Returns (bytes moved, rounds, errors)."""
    rng = random.Random(seed)
    k = len(metas)
    src_id, src = bufs.alloc(k * slot, seed)
    dst_id, dst = bufs.alloc(k * slot)
    ok, smr = ep.reg(src, k * slot)
    ok, dmr = ep.reg(dst, k * slot)
    metas = [bytes.fromhex(m) for m in metas]
    moved = rounds = errors = 0
    end = time.time() + seconds
    while time.time() < end:
        sizes = [rng.randint(1, slot) for _ in range(k)]
        ids = []
        for i in range(k):
            ok, x = ep.write_async(conn, smr, src + i * slot, sizes[i], metas[i])
            ids.append(x if ok else None)
        errors += sum(1 for x in ids if x is None or not ep.wait(x, 60))
        ids = []
        for i in range(k):
            ok, x = ep.read_async(conn, dmr, dst + i * slot, sizes[i], metas[i])
            ids.append(x if ok else None)
        errors += sum(1 for x in ids if x is None or not ep.wait(x, 60))
        for i in range(k):
            if bufs.data(dst_id, i * slot, sizes[i]) != bufs.data(src_id, i * slot, sizes[i]):
                errors += 1
        moved += 2 * sum(sizes)
        rounds += 1
    ep.dereg(smr)
    ep.dereg(dmr)
    return moved, rounds, errors
