"""Runs a script (argv[1:]) with tcpx_p2p's Endpoint.recv/send wrapped:
per call its wall time and the calling thread's scheduler figures
(/proc/thread-self/schedstat: ns on CPU, ns waiting on a run queue,
slices); at each new size (before its first call) every thread's
figures, so a size's deltas per thread can be read. Written as JSON
lines to $SCHED_OUT."""
import json, os, runpy, sys, time

OUT = open(os.environ["SCHED_OUT"], "w")

def me():
    a = open("/proc/thread-self/schedstat").read().split()
    return int(a[0]), int(a[1]), int(a[2])

def all_threads():
    d = {}
    for t in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{t}/comm").read().strip()
            run, wait, sl = open(f"/proc/self/task/{t}/schedstat").read().split()
            st = open(f"/proc/self/task/{t}/status").read().split("\n")
            nv = [l for l in st if l.startswith("nonvoluntary_ctxt_switches")][0].split()[1]
            vo = [l for l in st if l.startswith("voluntary_ctxt_switches")][0].split()[1]
            d[t] = [comm, int(run), int(wait), int(sl), int(vo), int(nv)]
        except (OSError, IndexError):
            pass
    return d

def steal():
    f = open("/proc/stat").readline().split()
    return [int(x) for x in f[1:9]]

from tcpx_p2p import p2p
Orig = p2p.Endpoint
last = {"size": None}

def wrap(name):
    def f(self, *a, **k):
        size = a[3] if len(a) > 3 else None
        if size != last["size"]:
            last["size"] = size
            OUT.write(json.dumps({"snap": size, "op": name, "t": time.perf_counter(), "cpu": steal(), "threads": all_threads()}) + "\n")
        r0, w0, s0 = me()
        t0 = time.perf_counter()
        out = getattr(self._e, name)(*a, **k)
        t1 = time.perf_counter()
        r1, w1, s1 = me()
        OUT.write(json.dumps({"op": name, "size": size, "t0": t0, "us": (t1 - t0) * 1e6, "run_us": (r1 - r0) / 1e3, "rq_us": (w1 - w0) / 1e3, "slices": s1 - s0}) + "\n")
        return out
    return f

class Endpoint:
    parse_metadata = staticmethod(Orig.parse_metadata)
    def __init__(self, *a, **k):
        self._e = Orig(*a, **k)
    def __getattr__(self, n):
        return getattr(self._e, n)
    recv = wrap("recv")
    send = wrap("send")

p2p.Endpoint = Endpoint
import atexit
atexit.register(lambda: (OUT.write(json.dumps({"snap": "end", "t": time.perf_counter(), "cpu": steal(), "threads": all_threads()}) + "\n"), OUT.flush()))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
