"""How soon a notification attached to a one-sided write reaches the target,
beside a control round trip (two processes on one host, host memory).

For each size the writer posts `write_async_with_notif` and waits for it;
the target spins on `get_notifs`. Both read the same clock
(CLOCK_MONOTONIC is host-wide), so the script reports, as medians:

  write_us    post -> the writer sees the write done (target has every byte)
  notif_us    post -> the target sees the notification
  after_us    notif_us - write_us (the notification's own trip)
  rtt_us      a notification and its answer (one control round trip)

The target: a notification within one round trip of the last byte; the
last byte lands before the target's WriteDone leaves, so after_us plus the
WriteDone trip (about rtt_us / 2) is what that target bounds.

    python benchmarks/notif_latency.py [--sizes 4K,1M,16M] [--iters 50] [--json OUT]
"""

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import time

os.environ.setdefault("TCPX_P2P_IFNAME", "lo")


def size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


_pending = []


def next_notif(ep, deadline=30.0):
    """The next notification (spinning), and when it was seen."""
    end = time.monotonic() + deadline
    while not _pending:
        got = ep.get_notifs()
        now = time.monotonic_ns()
        if not got:
            os.sched_yield()  # leave the engine's threads a core on small machines
        _pending.extend((n, now) for n in got)
        if time.monotonic() > end:
            raise TimeoutError("notification did not come")
    return _pending.pop(0)


def target(pipe, maxsize, iters, sizes):
    from tcpx_p2p import p2p

    ep = p2p.Endpoint(-1)
    pipe.send(ep.get_metadata())
    ok, _ip, _gpu, conn = ep.accept()
    assert ok
    buf = (ctypes.c_char * maxsize)()
    ok, mr = ep.reg(ctypes.addressof(buf), maxsize)
    ok, meta = ep.advertise(conn, mr, ctypes.addressof(buf), maxsize)
    pipe.send(meta)
    # round trips: answer each ping
    for _ in range(iters):
        next_notif(ep)
        ep.send_notif(conn, b"pong")
    # notifications after writes: report when each came
    for _ in sizes:
        seen = []
        for _ in range(iters):
            seen.append(next_notif(ep)[1])
        pipe.send(seen)
    pipe.recv()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,1M,16M")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args()
    sizes = [size(s) for s in a.sizes.split(",")]
    from tcpx_p2p import p2p

    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, max(sizes), a.iters, sizes), daemon=True)
    proc.start()
    ep = p2p.Endpoint(-1)
    ip, port, _ = ep.parse_metadata(pipe.recv())
    ok, conn = ep.connect(ip, -1, port)
    assert ok, ep.last_error()
    meta = pipe.recv()
    src = (ctypes.c_char * max(sizes))()
    ok, mr = ep.reg(ctypes.addressof(src), max(sizes))

    rtts = []
    for _ in range(a.iters):
        t0 = time.monotonic_ns()
        ep.send_notif(conn, b"ping")
        next_notif(ep)
        rtts.append(time.monotonic_ns() - t0)
    rtt_us = statistics.median(rtts) / 1e3

    rows = []
    for n in sizes:
        posts, dones = [], []
        for _ in range(a.iters):
            t0 = time.monotonic_ns()
            ok, x = ep.write_async_with_notif(conn, mr, ctypes.addressof(src), n, meta, b"done")
            assert ok, ep.last_error()
            assert ep.wait(x, 60), ep.last_error()
            posts.append(t0)
            dones.append(time.monotonic_ns())
            time.sleep(0.002)  # let the target see this one before the next
        seen = pipe.recv()
        write_us = statistics.median(d - p for p, d in zip(posts, dones)) / 1e3
        notif_us = statistics.median(s - p for p, s in zip(posts, seen)) / 1e3
        after_us = statistics.median(s - d for d, s in zip(dones, seen)) / 1e3
        rows.append(dict(size=n, write_us=write_us, notif_us=notif_us, after_us=after_us, rtt_us=rtt_us))
        print(f"{n:>10} B  write {write_us:9.1f} us  notif {notif_us:9.1f} us  "
              f"after {after_us:7.1f} us  rtt {rtt_us:7.1f} us")
    pipe.send(None)
    proc.join(10)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(net=ep.net_name(), iters=a.iters, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
