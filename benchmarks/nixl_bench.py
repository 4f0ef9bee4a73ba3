"""NIXL with the TCPX_P2P backend beside NIXL's UCX backend and beside our
own Python API, in one run: two processes (initiator and target) on one GPU
(or on host memory; UCX in a pair of its own, after ours), one-sided WRITE and READ of one descriptor per size,
KV-shaped lists (many small descriptors vs one descriptor of the same
bytes), and how soon a transfer's notification arrives compared with a
notification round trip. Prints a table; writes nixl_bench.json to --out
(default $OUT, else the current folder).

    python benchmarks/nixl_bench.py --memory gpu            # on the device
    python benchmarks/nixl_bench.py --memory host --sizes 64K,1M,16M

NIXL finds both plugins through one folder (NIXL_PLUGIN_DIR replaces its
default): this script makes one with links to our plugin and to the wheel's
UCX plugin, and puts the wheel's library folders on LD_LIBRARY_PATH of the
two processes it starts (the UCX plugin finds its libraries relative to its
own file otherwise). Every row is measured in --rounds rounds, each round
over all rows, and the table gives each cell's median (the JSON keeps every
round). Bytes are checked once per row, in the first round, before timing.
"""

import argparse
import atexit
import glob
import hashlib
import importlib
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def thread_faults():
    """Page faults (minor and major) of the calling thread so far."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_minflt + r.ru_majflt


def parse_size(s):
    s = s.strip().upper().rstrip("B").rstrip("I")
    return int(float(s[:-1]) * UNITS[s[-1]]) if s[-1] in UNITS else int(s)


def fmt_size(n):
    for u, v in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= v and n % v == 0:
            return f"{n // v}{u}"
    return str(n)


def nixl_module():
    why = []
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            return importlib.import_module(name + "._api"), name
        except ImportError as e:
            why.append(f"{name}: {e}")
    raise ImportError("no NIXL wheel (nixl-cu13 / nixl-cu12) imports: " + "; ".join(why))


def plugin_env(want_ucx):
    """NIXL_PLUGIN_DIR with our plugin (and the wheel's UCX plugin), and the
    LD_LIBRARY_PATH the UCX plugin needs there."""
    import tcpx_p2p

    _, name = nixl_module()
    mod = importlib.import_module(name)
    site = os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__)))
    libs = os.path.join(site, f".{name}.mesonpy.libs")
    d = tempfile.mkdtemp(prefix="nixl-plugins-")
    os.symlink(os.path.join(tcpx_p2p.nixl_plugin_dir(), "libplugin_TCPX_P2P.so"), os.path.join(d, "libplugin_TCPX_P2P.so"))
    env = {"NIXL_PLUGIN_DIR": d}
    ucx = os.path.join(libs, "plugins", "libplugin_UCX.so")
    if want_ucx and os.path.isfile(ucx):
        os.symlink(ucx, os.path.join(d, "libplugin_UCX.so"))
        paths = [libs, os.path.join(site, f"{name}.libs")] + glob.glob(os.path.join(site, "*.libs"))
        old = os.environ.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(paths + ([old] if old else [])))
    return env


class Mem:
    """Buffers in GPU memory (torch, one GPU) or host memory (numpy)."""

    def __init__(self, kind, gpu):
        self.kind, self.gpu = kind, gpu
        self.keep = []
        if kind == "gpu":
            import torch

            self.torch = torch
            torch.cuda.set_device(gpu)
        else:
            import numpy

            self.np = numpy

    @property
    def nixl_type(self):
        return "VRAM" if self.kind == "gpu" else "DRAM"

    @property
    def dev(self):
        """The device id of NIXL descriptors of this memory: the GPU's
        ordinal; for host memory 0, or with `--gpus` this role's number
        (NIXL keeps DRAM device ids as given), so that a host run checks
        that remote descriptors carry the peer's id, as a two-GPU run needs."""
        return self.gpu

    def alloc(self, n):
        if self.kind == "gpu":
            t = self.torch.zeros(n, dtype=self.torch.uint8, device=f"cuda:{self.gpu}")
            self.keep.append(t)
            return t, t.data_ptr()
        a = self.np.zeros(n, dtype=self.np.uint8)
        self.keep.append(a)
        return a, int(a.ctypes.data)

    def fill(self, buf, seed):
        if self.kind == "gpu":
            g = self.torch.Generator(device=f"cuda:{self.gpu}").manual_seed(seed)
            buf.copy_(self.torch.randint(0, 256, buf.shape, dtype=self.torch.uint8, device=buf.device, generator=g))
            self.torch.cuda.synchronize()
        else:
            buf[:] = self.np.random.default_rng(seed).integers(0, 256, len(buf), dtype=self.np.uint8)

    def zero(self, buf):
        buf.zero_() if self.kind == "gpu" else buf.fill(0)
        if self.kind == "gpu":
            self.torch.cuda.synchronize()


def gpu_of(a, role):
    """The GPU of `role` (initiator / target): `--gpus A,B` names the
    initiator's and the target's, else both use `--gpu`."""
    if a.gpus:
        ini, tgt = (int(g) for g in a.gpus.split(","))
        return tgt if role == "target" else ini
    return a.gpu


class Side:
    """One process: a NIXL agent with the backends asked for, and our own
    Python endpoint."""

    def __init__(self, role, a):
        api, _ = nixl_module()
        self.role, self.a = role, a
        gpu = gpu_of(a, role)
        self.mem = Mem(a.memory, gpu if (a.memory == "gpu" or a.gpus) else 0)
        self.name = role
        # vLLM passes capture_telemetry=True; --telemetry does the same.
        conf = api.nixl_agent_config(True, False, 0, capture_telemetry=a.telemetry, backends=[])
        self.agent = api.nixl_agent(role, conf)
        self.backends = []
        for b in a.backends.split(","):
            if b == "api":
                continue
            params = {}
            if b == "TCPX_P2P":
                if a.memory == "gpu":
                    params["gpu"] = str(gpu)
                if a.tcpx_params:
                    params.update(kv.split("=", 1) for kv in a.tcpx_params.split(","))
            try:
                self.agent.create_backend(b, params)
                self.backends.append(b)
            except Exception as e:  # reported; the run goes on without it
                print(f"{role}: backend {b} not created: {e}", file=sys.stderr, flush=True)
        self.ep = None
        if "api" in a.backends.split(","):
            from tcpx_p2p import p2p

            self.ep = p2p.Endpoint(gpu if a.memory == "gpu" else None)
        self.buf, self.ptr = self.mem.alloc(a.region)
        for bk in list(self.backends):
            try:
                self.agent.register_memory([(self.ptr, a.region, self.mem.dev, "")], self.mem.nixl_type, backends=[bk])
            except Exception as e:  # e.g. a UCX without CUDA support: measured without it
                print(f"{role}: {bk} cannot register {self.mem.nixl_type}: {e}", file=sys.stderr, flush=True)
                self.backends.remove(bk)
        self.mr = None
        if self.ep is not None:
            ok, self.mr = self.ep.reg(self.ptr, a.region)
            assert ok, self.ep.last_error()
        self.conn = None
        self.handles = {}
        self.post_cpu = {}
        self.post_faults = {}

    # set-up
    def usable(self):
        return self.backends + (["api"] if self.ep is not None else [])

    def metadata(self):
        """(NIXL agent metadata, buffer address, device id of its
        registration, our endpoint's metadata)."""
        return self.agent.get_agent_metadata(), self.ptr, self.mem.dev, (self.ep.get_metadata() if self.ep else b"")

    def add_remote(self, md):
        return self.agent.add_remote_agent(md)

    def api_connect(self, md):
        ok, self.conn = self.ep.add_remote_endpoint(md)
        assert ok, self.ep.last_error()

    def api_accept(self):
        ok, _, _, self.conn = self.ep.accept()
        assert ok, self.ep.last_error()

    def api_advertise(self, offs, size):
        metas = []
        for o in offs:
            ok, m = self.ep.advertise(self.conn, self.mr, self.ptr + o, size)
            assert ok, self.ep.last_error()
            metas.append(m)
        return metas

    # buffer contents
    def fill(self, seed):
        self.mem.fill(self.buf, seed) if seed is not None else self.mem.zero(self.buf)

    def block_digest(self, offs, size):
        """One digest of the blocks at offs, in that order."""
        if self.mem.kind == "gpu":
            self.mem.torch.cuda.synchronize()
            host = self.buf.cpu().numpy()
        else:
            host = self.buf
        h = hashlib.sha256()
        for o in offs:
            h.update(host[o : o + size].tobytes())
        return h.hexdigest()

    # NIXL transfers
    def prep(self, key, backend, peer, peer_ptr, peer_dev, offs, roffs, size, op, notif=b""):
        """A prepared transfer: the local descriptors carry this process's
        device id, the remote ones the peer's (as the peer registered them)."""
        dev = self.mem.dev
        t0 = time.perf_counter()
        local = self.agent.prep_xfer_dlist("", [(self.ptr + o, size, dev) for o in offs], self.mem.nixl_type, backends=[backend])
        remote = self.agent.prep_xfer_dlist(peer, [(peer_ptr + o, size, peer_dev) for o in roffs], self.mem.nixl_type, backends=[backend])
        t1 = time.perf_counter()
        idx = list(range(len(offs)))
        h = self.agent.make_prepped_xfer(op, local, idx, remote, idx, notif, backends=[backend])
        t2 = time.perf_counter()
        self.handles[key] = (h, local, remote)
        # Seconds in prep_xfer_dlist (both lists, descriptor tuples built
        # included) and in make_prepped_xfer: vLLM pays them per request.
        return t1 - t0, t2 - t1

    def release(self, key):
        h, local, remote = self.handles.pop(key)
        self.agent.release_xfer_handle(h)
        self.agent.release_dlist_handle(local)
        self.agent.release_dlist_handle(remote)

    def post_wait(self, key, notif=b""):
        h = self.handles[key][0]
        # The posting thread's CPU time in the call that posts (NIXL's and
        # the backend's work on it): unlike its wall time, not lengthened
        # by the I/O threads that start moving the first bytes meanwhile.
        # Its page faults too: memory the call touches for the first time
        # (lists the allocator handed back to the kernel and takes again).
        f0, c0 = thread_faults(), time.thread_time()
        st = self.agent.transfer(h, notif) if notif else self.agent.transfer(h)
        self.post_cpu.setdefault(key, []).append(time.thread_time() - c0)
        self.post_faults.setdefault(key, []).append(thread_faults() - f0)
        while st == "PROC":
            if self.a.poll_sleep_us:
                time.sleep(self.a.poll_sleep_us * 1e-6)
            st = self.agent.check_xfer_state(h)
        if st != "DONE":
            raise RuntimeError(f"transfer {key}: {st}")

    def time_nixl(self, key, iters):
        self.post_wait(key)  # warm-up
        self.post_cpu[key] = []
        self.post_faults[key] = []
        t = time.perf_counter()
        for _ in range(iters):
            self.post_wait(key)
        return time.perf_counter() - t

    def time_pairs(self, a, b, iters):
        """Transfers `a` and `b` one after the other, `iters` times (after
        one of each to warm up): the seconds of each, in pairs."""
        self.post_wait(a)
        self.post_wait(b)
        pairs = []
        for _ in range(iters):
            t0 = time.perf_counter()
            self.post_wait(a)
            t1 = time.perf_counter()
            self.post_wait(b)
            pairs.append((t1 - t0, time.perf_counter() - t1))
        return pairs

    def posting_cpu_ms(self, key):
        """The median CPU time of the posting call over `key`'s timed
        transfers, in ms (see `post_wait`)."""
        v = self.post_cpu.get(key) or [float("nan")]
        return statistics.median(v) * 1e3

    def posting_faults(self, key):
        """The median count of page faults in the posting call (see
        `post_wait`)."""
        v = self.post_faults.get(key) or [float("nan")]
        return statistics.median(v)

    def telemetry(self, key):
        """NIXL's own account of the handle's last transfer (with --telemetry)."""
        t = self.agent.get_xfer_telemetry(self.handles[key][0])
        return {
            "total_bytes": t.totalBytes,
            "desc_count": t.descCount,
            "post_us": t.postDuration,
            "xfer_us": t.xferDuration,
        }

    # our own Python API
    def api_once(self, op, offs, size, metas):
        n = len(offs)
        ptrs = [self.ptr + o for o in offs]
        if n == 1:
            f = self.ep.write if op == "WRITE" else self.ep.read
            ok = f(self.conn, self.mr, ptrs[0], size, metas[0])
        else:
            f = self.ep.writev if op == "WRITE" else self.ep.readv
            ok = f(self.conn, [self.mr] * n, ptrs, [size] * n, metas, n)
        if not ok:
            raise RuntimeError(self.ep.last_error())

    def time_api(self, op, offs, size, metas, iters):
        self.api_once(op, offs, size, metas)
        t = time.perf_counter()
        for _ in range(iters):
            self.api_once(op, offs, size, metas)
        return time.perf_counter() - t

    # notifications
    def notif_times(self, count, sender, timeout=60):
        """Target: when each of `count` notifications from sender arrived."""
        seen, deadline = [], time.monotonic() + timeout
        while len(seen) < count and time.monotonic() < deadline:
            for m in self.agent.get_new_notifs().get(sender, []):
                seen.append((m.decode(), time.perf_counter()))
            if self.a.poll_sleep_us:
                time.sleep(self.a.poll_sleep_us * 1e-6)
        return seen

    def notified_writes(self, key, count, gap):
        """Initiator: `count` transfers, each with a notification; when each ended here."""
        done = []
        for i in range(count):
            self.post_wait(key, f"n{i}".encode())
            done.append((f"n{i}", time.perf_counter()))
            time.sleep(gap)
        return done

    def notify(self, peer, msg):
        # nixl_agent.send_notif(backend=...) passes the handle where a list
        # is expected (1.5.1): call the binding with the list.
        self.agent.agent.genNotif(peer, msg, [self.agent.backends[self.a.notif_backend]])

    def echo(self, peer, count, timeout=60):
        """Target: answers each notification from peer with one back."""
        n, deadline = 0, time.monotonic() + timeout
        while n < count and time.monotonic() < deadline:
            for m in self.agent.get_new_notifs().get(peer, []):
                if m.startswith(b"p"):  # only pings: anything older is not answered
                    self.notify(peer, m)
                    n += 1
            if self.a.poll_sleep_us:
                time.sleep(self.a.poll_sleep_us * 1e-6)
        return n

    def ping(self, peer, count):
        """Initiator: notification round trips to an echoing peer (seconds each)."""
        rtts = []
        self.agent.get_new_notifs()  # nothing older counts
        for i in range(count):
            want = f"p{i}".encode()
            t = time.perf_counter()
            self.notify(peer, want)
            while want not in self.agent.get_new_notifs().get(peer, []):
                if self.a.poll_sleep_us:
                    time.sleep(self.a.poll_sleep_us * 1e-6)
            rtts.append(time.perf_counter() - t)
        return rtts


def serve(pipe, role, a, env):
    os.environ.update(env)
    try:
        side = Side(role, a)
        pipe.send(("ok", None))
    except Exception:
        pipe.send(("err", traceback.format_exc()))
        return
    while True:
        msg = pipe.recv()
        if msg is None:
            return
        op, args = msg
        try:
            pipe.send(("ok", getattr(side, op)(*args)))
        except Exception:
            pipe.send(("err", traceback.format_exc()))


class Proc:
    def __init__(self, role, a, env):
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, role, a, env), daemon=True)
        self.proc.start()
        self.get(300)

    def send(self, op, *args):
        self.pipe.send((op, args))

    def get(self, timeout=600):
        if not self.pipe.poll(timeout):
            raise TimeoutError("no answer")
        st, res = self.pipe.recv()
        if st != "ok":
            raise RuntimeError(res)
        return res

    def __getattr__(self, op):
        def call(*args):
            self.send(op, *args)
            return self.get()

        return call

    def close(self):
        try:
            self.pipe.send(None)
        except OSError:
            pass
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()


class InProc:
    """A side in this process (`--one-process`): both agents then share one
    CUDA context, so the GPU does not switch between two processes' contexts
    for every copy (deployments run one process per GPU)."""

    def __init__(self, role, a, env):
        os.environ.update(env)
        self.side = Side(role, a)
        self.pending = None

    def send(self, op, *args):
        self.pending = getattr(self.side, op)(*args)

    def get(self, timeout=600):
        res, self.pending = self.pending, None
        return res

    def __getattr__(self, op):
        return getattr(self.side, op)

    def close(self):
        self.side = None


def fmt_gbps(v):
    return f"{v:7.2f}" if v is not None else "    n/a"


def iters_for(total, budget):
    return int(max(3, min(2000, budget / max(total, 1))))


def run_group(a, backends, env, cells, budget):
    """Measures `cells` with `backends` in one process pair (or one process):
    every cell once per round, the rounds one after the other, so a
    machine's slow spell lands in one round of each cell rather than in all
    of one cell. Returns {(shape, op, backend): [(GB/s, iters) per round]}
    and the notification figures (with TCPX_P2P)."""
    side = InProc if a.one_process else Proc
    tgt = side("target", a, env)
    ini = side("initiator", a, env)
    samples, notif = {}, {}
    try:
        usable = set(tgt.usable()) & set(ini.usable())
        dropped = [b for b in backends if b not in usable]
        if dropped:
            print(f"not measured (could not be set up): {', '.join(dropped)}", flush=True)
        backends = [b for b in backends if b in usable]
        t_md, t_ptr, t_dev, t_api = tgt.metadata()
        i_md, _, _, _ = ini.metadata()
        ini.add_remote(t_md)
        tgt.add_remote(i_md)
        if "api" in backends:
            ini.api_connect(t_api)
            tgt.api_accept()

        def measure(b, op, offs, roffs, size, check):
            """GB/s of one backend on one shape (with `check`, after checking
            the bytes once)."""
            total = len(offs) * size
            iters = iters_for(total, budget / a.rounds / (10 if b == "UCX" else 1))
            # The data's owner holds a pattern, the other side zeros.
            src, dst = (ini, tgt) if op == "WRITE" else (tgt, ini)
            if check:
                src.fill(11)
                dst.fill(None)
            metas = None
            if b == "api":
                metas = tgt.api_advertise(roffs, size)
                ini.api_once(op, offs, size, metas)
            else:
                prep_s = ini.prep("k", b, "target", t_ptr, t_dev, offs, roffs, size, op)
                ini.post_wait("k")
            # Each block where it was sent (initiator offs <-> target roffs).
            if check and tgt.block_digest(roffs, size) != ini.block_digest(offs, size):
                raise RuntimeError("the bytes that arrived differ from those sent")
            extra = {}
            if b == "api":
                secs = ini.time_api(op, offs, size, metas, iters)
            else:
                secs = ini.time_nixl("k", iters)
                extra = {
                    "prep_dlists_s": prep_s[0],
                    "make_prepped_s": prep_s[1],
                    "post_cpu_ms": ini.posting_cpu_ms("k"),
                    "post_faults": ini.posting_faults("k"),
                }
                if a.telemetry:
                    extra["telemetry"] = ini.telemetry("k")
                if a.paired and len(offs) > 1:
                    # Against one descriptor of the same bytes, transfer by
                    # transfer in turn: a machine's slow spell then slows
                    # both sides of a pair, not one row.
                    ini.prep("r", b, "target", t_ptr, t_dev, [0], [0], total, op)
                    extra["pairs"] = ini.time_pairs("k", "r", iters)
                    ini.release("r")
                ini.release("k")
            return total * iters / secs / 1e9, iters, extra

        for rnd in range(a.rounds):
            for shape, op, offs, roffs, size in cells:
                got = {}
                for b in backends:
                    if rnd > 0 and samples.get((shape, op, b)) is None:
                        continue  # failed in an earlier round
                    try:
                        got[b] = measure(b, op, offs, roffs, size, rnd == 0)
                        samples.setdefault((shape, op, b), []).append(got[b])
                    except Exception as e:  # one cell failed: say so, go on
                        print(f"{b} {op} {shape}: {str(e).strip().splitlines()[-1]}", flush=True)
                        samples[(shape, op, b)] = None
                        if b != "api":
                            try:
                                ini.release("k")
                            except Exception:
                                pass
                line = "  ".join(f"{b} {fmt_gbps(got[b][0] if b in got else None)} GB/s" for b in backends)
                print(f"round {rnd + 1} {shape:>16} {op:<5} {line}", flush=True)
        if a.notifs and "TCPX_P2P" in backends:
            # A 64 KiB write with a notification: when the target sees it,
            # against when the initiator saw the transfer end.
            ini.prep("n", "TCPX_P2P", "target", t_ptr, t_dev, [0], [0], 64 << 10, "WRITE")
            tgt.send("notif_times", a.notifs, "initiator")
            done = ini.notified_writes("n", a.notifs, 0.002)
            seen = dict(tgt.get())
            ini.release("n")
            after = [(seen[k] - t) * 1e6 for k, t in done if k in seen]
            tgt.send("echo", "initiator", a.notifs)
            rtts = [x * 1e6 for x in ini.ping("target", a.notifs)]
            tgt.get()
            notif = {
                "samples": len(after),
                "after_done_us_p50": statistics.median(after),
                "after_done_us_p99": sorted(after)[int(0.99 * (len(after) - 1))],
                "rtt_us_p50": statistics.median(rtts),
                "rtt_us_p99": sorted(rtts)[int(0.99 * (len(rtts) - 1))],
                "after_done_us": after,
                "rtt_us": rtts,
            }
            print(
                f"notification after a 64K write: p50 {notif['after_done_us_p50']:.1f} us after the initiator saw it end "
                f"(p99 {notif['after_done_us_p99']:.1f}); notification round trip p50 {notif['rtt_us_p50']:.1f} us",
                flush=True,
            )
    finally:
        ini.close()
        tgt.close()
    return {k: v for k, v in samples.items() if v}, notif


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", choices=["gpu", "host"], default="gpu")
    ap.add_argument("--gpu", type=int, default=0, help="the GPU both processes use")
    ap.add_argument("--gpus", default="", help="INITIATOR,TARGET: one GPU each (e.g. 0,1), instead of --gpu")
    ap.add_argument("--sizes", default="64K,1M,16M,256M")
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--kv", default="4096x32K", help="KV-shaped lists: COUNTxSIZE[,COUNTxSIZE...] (empty: none); vLLM-sized: 131072x4K,131072x16K")
    ap.add_argument("--backends", default="TCPX_P2P,UCX,api", help="NIXL backends and 'api' (our Python API)")
    ap.add_argument("--tcpx-params", default="", help="TCPX_P2P backend parameters, k=v,k=v")
    ap.add_argument("--bytes-per-row", default="4G", help="about this many bytes timed per row, over all rounds (UCX: a tenth)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all rows; a row gives each cell's median")
    ap.add_argument("--notifs", type=int, default=200, help="notification samples (0: none)")
    ap.add_argument("--poll-sleep-us", type=float, default=0, help="sleep between polls of check_xfer_state / get_new_notifs (0: spin)")
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="both agents in this process, sharing one CUDA context (no notification figures: they need two processes)",
    )
    ap.add_argument(
        "--shared-processes",
        action="store_true",
        help="NIXL's UCX backend in the same processes as ours (by default it gets a process pair of its own)",
    )
    ap.add_argument(
        "--paired",
        action="store_true",
        help="KV rows: also time each list against one descriptor of the same bytes transfer by transfer in turn, "
        "and report the median of the pairs' ratios (robust to a machine's slow spells)",
    )
    ap.add_argument("--telemetry", action="store_true", help="agents made with capture_telemetry=True (as vLLM does); rows keep NIXL's telemetry of their last transfer")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if a.one_process:
        a.notifs = 0
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    ops = [o.strip().upper() for o in a.ops.split(",") if o]
    kvs = []
    for spec in (x for x in a.kv.split(",") if x):
        c, s = spec.lower().split("x")
        kvs.append((int(c), parse_size(s)))
    backends = [b for b in a.backends.split(",") if b]
    a.region = max(sizes + [c * s for c, s in kvs])
    a.notif_backend = "TCPX_P2P"
    budget = parse_size(a.bytes_per_row)
    env = plugin_env("UCX" in backends)
    # The folder of links is this run's: gone when it ends (or starts again).
    atexit.register(shutil.rmtree, env["NIXL_PLUGIN_DIR"], True)
    if "UCX" in backends:
        env["UCX_TLS"] = os.environ.get("UCX_TLS", "tcp,cuda_copy" if a.memory == "gpu" else "tcp")
    env.setdefault("TCPX_P2P_IFNAME", os.environ.get("TCPX_P2P_IFNAME", "lo"))
    os.environ.update(env)  # spawned processes start with it (LD_LIBRARY_PATH)
    if a.one_process and "UCX" in backends and os.environ.get("NIXL_BENCH_REEXEC") != "1":
        # The loader reads LD_LIBRARY_PATH once, at start: start again with it.
        os.environ["NIXL_BENCH_REEXEC"] = "1"
        shutil.rmtree(env["NIXL_PLUGIN_DIR"], True)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + (argv if argv is not None else sys.argv[1:]))

    one_desc = set()

    def shapes():
        for s in sizes:
            yield f"{fmt_size(s)}", [0], [0], s
        for n, s in kvs:
            # Blocks land in another order on the target (as KV blocks do),
            # so NIXL cannot merge neighbouring descriptors.
            perm = list(range(n))
            random.Random(5).shuffle(perm)
            yield f"KV {n}x{fmt_size(s)}", [i * s for i in range(n)], [p * s for p in perm], s
            if n * s not in one_desc:  # lists of the same bytes share their reference row
                one_desc.add(n * s)
                yield f"KV as 1x{fmt_size(n * s)}", [0], [0], n * s

    cells = [(shape, op, offs, roffs, size) for shape, offs, roffs, size in shapes() for op in ops]
    samples, notif, measured = {}, {}, []
    # A user runs one backend; the others' threads (UCX's progress thread,
    # our spinning waits) would take cores from the one measured. Unless
    # --shared-processes, NIXL's UCX backend runs in a process pair of its
    # own, after ours (our NIXL backend and our Python API, idle in turn).
    groups = [backends]
    if "UCX" in backends and not a.shared_processes and len(backends) > 1:
        groups = [[b for b in backends if b != "UCX"], ["UCX"]]
    for group in groups:
        ga = argparse.Namespace(**vars(a))
        ga.backends = ",".join(group)
        got, n = run_group(ga, group, env, cells, budget)
        samples.update(got)
        notif = notif or n
        measured += [b for b in group if any(k[2] == b for k in got)]
    backends = [b for b in backends if b in measured]
    rows = []
    for shape, op, offs, roffs, size in cells:
        row = {"shape": shape, "op": op, "descs": len(offs), "bytes": len(offs) * size}
        for b in backends:
            got = samples.get((shape, op, b))
            row[b] = statistics.median(g[0] for g in got) if got else None
            row[f"{b}_rounds"] = [g[0] for g in got] if got else None
            row[f"{b}_iters"] = got[0][1] if got else None
            if got and got[0][2]:
                ex = [g[2] for g in got]
                row[f"{b}_prep_dlists_ms"] = statistics.median(e["prep_dlists_s"] for e in ex) * 1e3
                row[f"{b}_make_prepped_ms"] = statistics.median(e["make_prepped_s"] for e in ex) * 1e3
                row[f"{b}_post_cpu_ms"] = statistics.median(e["post_cpu_ms"] for e in ex)
                row[f"{b}_post_faults"] = statistics.median(e["post_faults"] for e in ex)
                if "telemetry" in ex[-1]:
                    row[f"{b}_telemetry"] = ex[-1]["telemetry"]
                pairs = [p for e in ex for p in e.get("pairs", [])]
                if pairs:
                    # Many ÷ one descriptor in GB/s is one's time ÷ many's.
                    row[f"{b}_paired_ratio"] = statistics.median(one / many for many, one in pairs)
                    row[f"{b}_pairs_s"] = pairs
        rows.append(row)

    print_table(rows, backends)
    device = "host memory"
    if a.memory == "gpu":
        import torch

        g_ini, g_tgt = gpu_of(a, "initiator"), gpu_of(a, "target")
        device = torch.cuda.get_device_name(g_ini)
        if g_ini != g_tgt:
            device = f"GPU {g_ini} -> GPU {g_tgt}: {device} / {torch.cuda.get_device_name(g_tgt)}"
    _, nixl_name = nixl_module()
    out = {
        "device": device,
        "processes": 1 if a.one_process else 2,
        "ucx_in_own_processes": len(groups) > 1,
        "memory": a.memory,
        "nixl": nixl_name,
        "ucx_tls": env.get("UCX_TLS"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
        "notification": notif,
        "args": vars(a),
    }
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "nixl_bench.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


def print_table(rows, backends):
    hdr = f"{'shape':>16} {'op':<5} {'descs':>5} " + " ".join(f"{b + ' GB/s':>14}" for b in backends)
    extra = []
    if "TCPX_P2P" in backends and "api" in backends:
        extra.append("ours/api")
    if "TCPX_P2P" in backends and "UCX" in backends:
        extra.append("ours/UCX")
    print()
    print(hdr + "".join(f"{e:>10}" for e in extra))
    for r in rows:
        line = f"{r['shape']:>16} {r['op']:<5} {r['descs']:>5} " + " ".join(f"{fmt_gbps(r[b]):>14}" for b in backends)
        if "ours/api" in extra:
            line += f"{ratio(r['TCPX_P2P'], r['api']):>10}"
        if "ours/UCX" in extra:
            line += f"{ratio(r['TCPX_P2P'], r['UCX']):>10}"
        print(line)
    for r in rows:
        for b in backends:
            if r["descs"] > 1 and r.get(f"{b}_prep_dlists_ms") is not None:
                tele = r.get(f"{b}_telemetry")
                tail = ""
                if tele:
                    tail = f"; telemetry: {tele['desc_count']} descs, {tele['total_bytes']} B, post {tele['post_us']} us, xfer {tele['xfer_us']} us"
                print(
                    f"{b} {r['op']} {r['shape']}: prep_xfer_dlist (both) {r[f'{b}_prep_dlists_ms']:.1f} ms, "
                    f"make_prepped_xfer {r[f'{b}_make_prepped_ms']:.1f} ms (once per request, not in GB/s); "
                    f"posting thread's CPU in the call that posts {r[f'{b}_post_cpu_ms']:.1f} ms "
                    f"({r[f'{b}_post_faults']:.0f} page faults){tail}"
                )
    # Each KV list beside one descriptor of the same bytes (the row after it).
    one_of = {(r["op"], r["bytes"]): r for r in rows if r["shape"].startswith("KV as")}
    for many in rows:
        one = one_of.get((many["op"], many["bytes"]))
        if not many["shape"].startswith("KV ") or many["shape"].startswith("KV as") or one is None:
            continue
        if "TCPX_P2P" not in backends:
            continue
        op = many["op"]
        r = ratio(many["TCPX_P2P"], one["TCPX_P2P"])
        each = ", ".join(ratio(x, y) for x, y in zip(many.get("TCPX_P2P_rounds") or [], one.get("TCPX_P2P_rounds") or []))
        print(f"{many['shape']} {op}: many descriptors / one descriptor of the same bytes = {r} (TCPX_P2P; rounds: {each})")
        if many.get("TCPX_P2P_paired_ratio") is not None:
            rs = sorted(one / m for m, one in many["TCPX_P2P_pairs_s"])
            q = lambda f: rs[int(f * (len(rs) - 1))]
            print(
                f"{many['shape']} {op}: paired, transfer by transfer in turn: median {many['TCPX_P2P_paired_ratio']:.2f} "
                f"(quartiles {q(0.25):.2f}-{q(0.75):.2f}, {len(rs)} pairs)"
            )


def ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b else "n/a"


if __name__ == "__main__":
    sys.exit(main())
