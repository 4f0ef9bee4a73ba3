"""Many-descriptor NIXL transfers in a loop (host memory, TCPX_P2P): per
iteration, the time agent.transfer takes to return (post) and to DONE."""
import datetime, multiprocessing as mp, os, random, statistics, sys, time
import numpy as np
import tcpx_p2p
os.environ["NIXL_PLUGIN_DIR"] = tcpx_p2p.nixl_plugin_dir()
os.environ.setdefault("TCPX_P2P_IFNAME", "lo")
from nixl_cu12._api import nixl_agent, nixl_agent_config

def agent(name):
    a = nixl_agent(name, nixl_agent_config(True, False, 0, capture_telemetry=True, backends=[]))
    a.create_backend("TCPX_P2P", {})
    return a

def target(pipe, region):
    a = agent("target")
    buf = np.ones(region, dtype=np.uint8)
    a.register_memory([(buf.ctypes.data, region, 0, "")], "DRAM")
    pipe.send((a.get_agent_metadata(), buf.ctypes.data))
    a.add_remote_agent(pipe.recv())
    pipe.recv()
    c0 = os.times()
    pipe.recv()
    c1 = os.times()
    pipe.send((c1.user + c1.system) - (c0.user + c0.system))

def main():
    n, size, iters, op = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    region = n * size
    ctx = mp.get_context("spawn")
    p, c = ctx.Pipe()
    t = ctx.Process(target=target, args=(c, region)); t.start()
    a = agent("ini")
    buf = np.ones(region, dtype=np.uint8)
    a.register_memory([(buf.ctypes.data, region, 0, "")], "DRAM")
    md, rptr = p.recv()
    a.add_remote_agent(md)
    p.send(a.get_agent_metadata())
    perm = list(range(n)); random.Random(5).shuffle(perm)
    l = a.prep_xfer_dlist("", [(buf.ctypes.data + i * size, size, 0) for i in range(n)], "DRAM")
    r = a.prep_xfer_dlist("target", [(rptr + q * size, size, 0) for q in perm], "DRAM")
    idx = list(range(n))
    t0 = time.perf_counter()
    h = a.make_prepped_xfer(op, l, idx, r, idx, b"")
    prep_ms = (time.perf_counter() - t0) * 1e3
    posts, totals = [], []
    a.transfer(h)
    while a.check_xfer_state(h) == "PROC":
        pass
    p.send("go")
    c0 = os.times()
    for i in range(iters):
        if os.environ.get("LOOP_MARK"):  # a clock mark for first_bytes.py
            print(f"MARK {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%S.%f')}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        st = a.transfer(h)
        t1 = time.perf_counter()
        while st == "PROC":
            time.sleep(0.0002)
            st = a.check_xfer_state(h)
        t2 = time.perf_counter()
        assert st == "DONE", st
        if True:
            posts.append(t1 - t0); totals.append(t2 - t0)
    c1 = os.times()
    p.send(None)
    tcpu = p.recv()
    icpu = ((c1.user + c1.system) - (c0.user + c0.system)) / iters * 1e3
    tcpu = tcpu / iters * 1e3
    mp_ = statistics.median(posts) * 1e3; mt = statistics.median(totals) * 1e3
    print(f"{op} {n}x{size}: post {mp_:.1f} ms, total {mt:.1f} ms, {region / statistics.median(totals) / 1e9:.2f} GB/s (median of {iters}); CPU per transfer: initiator {icpu:.0f} ms, target {tcpu:.0f} ms; make_prepped_xfer {prep_ms:.1f} ms")
    t.join()

if __name__ == "__main__":
    main()
