"""Per-message times of a blocking send/recv loop between two GPUs (rank 0
sends, rank 1 receives), UCCL's benchmark's shape: per size a new buffer is
made and registered on both sides, one untimed message, then N timed; every
call's own time is printed (us), so a row's first messages can be told from
its steady state."""
import multiprocessing as mp, os, sys, time
SIZES = [int(s) for s in os.environ.get("SIZES", "65536,1048576").split(",")]
N = int(os.environ.get("N", "30"))
def side(rank, chan, out):
    if os.environ.get("LOGDIR"):
        f = os.open(f"{os.environ['LOGDIR']}/rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, 2)
    import torch
    from tcpx_p2p import p2p
    torch.cuda.set_device(rank)
    ep = p2p.Endpoint(rank)
    if rank == 1:
        chan.send(bytes(ep.get_metadata())); ok, _, _, conn = ep.accept()
    else:
        ip, port, g = p2p.Endpoint.parse_metadata(chan.recv()); ok, conn = ep.connect(ip, g, remote_port=port)
    rows = []
    for n in SIZES:
        b = torch.ones(n, dtype=torch.uint8, device=f"cuda:{rank}"); p = b.data_ptr()
        ok, mr = ep.reg(p, n); assert ok
        # Both sides ready for this size before its first message.
        chan.send("ready"); chan.recv()
        call = ep.send if rank == 0 else ep.recv
        t = time.perf_counter(); assert call(conn, mr, p, n); first = (time.perf_counter() - t) * 1e6
        each = []
        for _ in range(N):
            t = time.perf_counter(); assert call(conn, mr, p, n); each.append((time.perf_counter() - t) * 1e6)
        rows.append((n, first, each))
    out.put((rank, rows))
if __name__ == "__main__":
    os.environ.setdefault("TCPX_P2P_IFNAME", "lo")
    ctx = mp.get_context("spawn"); c0, c1 = ctx.Pipe(); out = ctx.Queue()
    ps = [ctx.Process(target=side, args=(r, c, out)) for r, c in ((0, c0), (1, c1))]
    [p.start() for p in ps]
    res = dict(out.get(timeout=300) for _ in ps)
    [p.join(20) for p in ps]
    for r, name in ((0, "send"), (1, "recv")):
        for n, first, each in res[r]:
            s = sorted(each)
            print(f"{name} {n:>9}: untimed {first:8.0f} | timed p50 {s[len(s)//2]:7.0f} | first ten {' '.join(f'{x:.0f}' for x in each[:10])} | max {s[-1]:.0f}")
