"""tcpx-p2p-bench peers: what one endpoint pays for many peers.

    tcpx-p2p-bench peers [--peers 256] [--procs 8] [--msg 1M]
                         [--busy 64] [--busy-size 16M] [--memory host|gpu]

One endpoint (the target, in a process of its own) accepts --peers peers,
which live in --procs client processes (each client process holds
peers/procs endpoints, one per peer). Measured on the target:

1. connect: time from the first connect to the last accept; the target's
   threads, descriptors and RSS before any peer and with every peer
   connected and idle (per peer: the growth divided by the peer count).
2. deliver: every peer sends a --msg message (its own pattern); the
   target receives each and checks it byte for byte.
3. many at once: the first --busy peers each send --busy-size at once
   into the target; aggregate GB/s beside one peer sending the same alone
   (the same peer, just before). Every byte is checked.
4. out to many at once: the target sends --busy-size to each of the same
   peers at once, beside to one alone (timed until the last peer has it).
   Every byte is checked.

In both, the target's peak thread count while the bytes move is
reported: the I/O workers the work took (the peers' own threads are
in their processes).

The JSON (--json or --out) keeps every figure; the exit status is non-zero
if a check failed or a peer process failed.
"""

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import sys
import time

from ._buffers import Buffer, fmt_size, parse_size, pattern

TIMEOUT = 120.0


def busy_seed(i):
    """Peer `i`'s seed for its many-at-once message (its deliver message
    uses `i`)."""
    return 10_000 + i


# The seed of what the target sends out to many peers at once.
OUT_SEED = 77_777


def counts():
    """(threads, descriptors, RSS bytes) of this process."""
    threads = len(os.listdir("/proc/self/task"))
    fds = len(os.listdir("/proc/self/fd"))
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return threads, fds, rss


def thread_names():
    """This process's threads by name (how many of each)."""
    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n = f.read().strip()
        except OSError:
            continue
        names[n] = names.get(n, 0) + 1
    return dict(sorted(names.items(), key=lambda kv: -kv[1]))


class PeakThreads:
    """Samples this process's thread count (every 2 ms, on a thread of
    its own, which is left out of the count) while the block runs: the
    peak is what the I/O core took for the work, not for the peers."""

    def __init__(self):
        import threading

        self.peak = 0
        self.names = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            n = len(os.listdir("/proc/self/task")) - 1
            if n > self.peak:
                self.peak, self.names = n, thread_names()
            self._stop.wait(0.002)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def _client(first, count, meta, msg, busy, busy_size, gpu, env, ctl):
    """Peers first..first+count-1, one endpoint each."""
    os.environ.update(env)
    from tcpx_p2p import p2p

    try:
        eps, conns = [], []
        for i in range(first, first + count):
            ep = p2p.Endpoint(local_gpu_idx=gpu if gpu is not None else 0)
            ok, conn = ep.add_remote_endpoint(meta)
            if not ok:
                raise RuntimeError(f"peer {i}: connect: {ep.last_error()}")
            eps.append(ep)
            conns.append(conn)
        ctl.send(("connected", count))
        # deliver: every peer's message, its own pattern (the target tells
        # the peers apart by their digests)
        bufs = []
        for k, i in enumerate(range(first, first + count)):
            buf = Buffer(msg, gpu)
            buf.fill(i)
            ok, mr = eps[k].reg(buf.ptr, msg)
            if not ok or not eps[k].send(conns[k], mr, buf.ptr, msg):
                raise RuntimeError(f"peer {i}: send: {eps[k].last_error()}")
            bufs.append((buf, mr))
        ctl.send(("delivered", count))
        # many at once: the busy peers among ours
        mine = [k for k, i in enumerate(range(first, first + count)) if i < busy]
        big = {}
        for k in mine:
            i = first + k
            buf = Buffer(busy_size, gpu)
            buf.fill(busy_seed(i))
            ok, mr = eps[k].reg(buf.ptr, busy_size)
            if not ok:
                raise RuntimeError(f"peer {i}: reg: {eps[k].last_error()}")
            big[k] = (buf, mr)
        inbox = {}
        while True:
            cmd = ctl.recv()
            if cmd[0] == "stop":
                break
            ks = [k for k in mine if first + k in cmd[1]]
            if cmd[0] == "take":
                # out to many: receive the target's message on each peer
                # named, say when posted, then when each landed (the
                # clock is the host's monotonic one, shared by processes)
                # and what landed.
                ids = []
                for k in ks:
                    if k not in inbox:
                        buf = Buffer(busy_size, gpu)
                        ok, mr = eps[k].reg(buf.ptr, busy_size)
                        if not ok:
                            raise RuntimeError(f"peer {first + k}: reg: {eps[k].last_error()}")
                        inbox[k] = (buf, mr)
                    buf, mr = inbox[k]
                    buf.clear()
                    ok, tid = eps[k].recv_async(conns[k], mr, buf.ptr, busy_size)
                    if not ok:
                        raise RuntimeError(f"peer {first + k}: recv: {eps[k].last_error()}")
                    ids.append((k, tid))
                ctl.send(("ready", len(ids)))
                landed = {}
                for k, tid in ids:
                    if not eps[k].wait(tid, TIMEOUT):
                        raise RuntimeError(f"peer {first + k}: recv: {eps[k].last_error()}")
                    landed[first + k] = time.monotonic()
                digests = {first + k: inbox[k][0].digest() for k, _ in ids}
                ctl.send(("took", (landed, digests)))
                continue
            ids = []
            for k in ks:
                buf, mr = big[k]
                ok, tid = eps[k].send_async(conns[k], mr, buf.ptr, busy_size)
                if not ok:
                    raise RuntimeError(f"peer {first + k}: send: {eps[k].last_error()}")
                ids.append((k, tid))
            for k, tid in ids:
                if not eps[k].wait(tid, TIMEOUT):
                    raise RuntimeError(f"peer {first + k}: send: {eps[k].last_error()}")
            ctl.send(("sent", len(ids)))
        ctl.send(("done", 0))
    except Exception as e:  # reported to the target's process, which fails the run
        ctl.send(("error", str(e)))


def lift_limits(peers):
    """Every peer comes from this host's one address, and the target's
    defaults hold 32 connections per address (docs/SECURITY.md): raise
    the bounds to the peer count (unless set), and the descriptor limit to
    its hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    for k in ("MAX_CONNS", "MAX_CONNS_PER_IP"):
        os.environ.setdefault(f"TCPX_P2P_{k}", str(max(peers, 32)))
    for k in ("MAX_HANDSHAKES", "MAX_HANDSHAKES_PER_IP", "MAX_HANDSHAKES_PER_SUBNET"):
        os.environ.setdefault(f"TCPX_P2P_{k}", str(max(peers, 64)))
    for k in ("MAX_STREAMS_TOTAL", "MAX_STREAMS_PER_IP"):
        os.environ.setdefault(f"TCPX_P2P_{k}", str(max(peers * 64, 2048)))


def run(a):
    gpu = peer_gpu = None
    if a.memory == "gpu":
        from tcpx_p2p import cuda_device_count

        if cuda_device_count() == 0:
            raise RuntimeError("--memory gpu: no GPU found")
        gpus = [int(x) for x in a.gpus.split(",")]
        if cuda_device_count() < 2:
            gpus = [gpus[0], gpus[0]]
        gpu, peer_gpu = gpus[0], gpus[-1]
    os.environ.setdefault("TCPX_P2P_IFNAME", "lo")
    lift_limits(a.peers)
    from tcpx_p2p import p2p

    msg = parse_size(a.msg)
    busy_size = parse_size(a.busy_size)
    busy = min(a.busy, a.peers)
    procs = max(1, min(a.procs, a.peers))
    before = counts()
    ep = p2p.Endpoint(local_gpu_idx=gpu if gpu is not None else 0)
    with_ep = counts()
    meta = ep.get_metadata()
    env = {k: v for k, v in os.environ.items() if k.startswith("TCPX_P2P_")}
    ctx = mp.get_context("spawn")
    per = [a.peers // procs + (1 if p < a.peers % procs else 0) for p in range(procs)]
    children, pipes, first = [], [], 0
    t0 = time.perf_counter()
    for n in per:
        mine, theirs = ctx.Pipe()
        c = ctx.Process(target=_client, args=(first, n, meta, msg, busy, busy_size, peer_gpu, env, theirs), daemon=True)
        c.start()
        children.append(c)
        pipes.append(mine)
        first += n
    failures = []

    early = [[] for _ in pipes]  # messages read while accepting

    def expect(tag):
        for k, p in enumerate(pipes):
            if early[k]:
                got = early[k].pop(0)
            elif not p.poll(TIMEOUT):
                raise RuntimeError(f"a client process did not answer ({tag}) within {TIMEOUT:.0f} s")
            else:
                got = p.recv()
            if got[0] == "error":
                raise RuntimeError(got[1])
            if got[0] != tag:
                raise RuntimeError(f"a client process said {got[0]!r}, expected {tag!r}")

    conns = []
    waited = 0.0
    while len(conns) < a.peers:
        ok, ip, _, conn = ep.accept(timeout=1.0)
        if ok:
            conns.append(conn)
            waited = 0.0
            continue
        waited += 1.0
        for k, p in enumerate(pipes):  # a client that failed says so
            while p.poll():
                got = p.recv()
                if got[0] == "error":
                    raise RuntimeError(got[1])
                early[k].append(got)
        if waited > TIMEOUT:
            raise RuntimeError(f"accept of peer {len(conns)}: {ep.last_error()}")
    connect_s = time.perf_counter() - t0
    expect("connected")
    time.sleep(0.5)  # let the handshakes' threads settle
    idle = counts()
    res = {
        "peers": a.peers,
        "client_processes": procs,
        "memory": a.memory,
        "gpus": [gpu, peer_gpu] if gpu is not None else None,
        "net": ep.net_name(),
        "cores": os.cpu_count(),
        "connect_all_s": round(connect_s, 3),
        "before": dict(zip(("threads", "fds", "rss"), before)),
        "endpoint_alone": dict(zip(("threads", "fds", "rss"), with_ep)),
        "all_connected_idle": dict(zip(("threads", "fds", "rss"), idle)),
        "thread_names_all_connected": thread_names(),
    }
    res["per_peer"] = {
        "threads": (idle[0] - with_ep[0]) / a.peers,
        "fds": (idle[1] - with_ep[1]) / a.peers,
        "rss_MiB": (idle[2] - with_ep[2]) / a.peers / 2**20,
    }
    # deliver: one message from every peer, checked: each peer's pattern
    # has its own digest
    peer_by_digest = {hashlib.sha256(pattern(msg, i)).hexdigest(): i for i in range(a.peers)}
    buf = Buffer(msg, gpu)
    ok, mr = ep.reg(buf.ptr, msg)  # the target's one receive buffer, reused
    if not ok:
        raise RuntimeError(ep.last_error())
    peer_of = {}
    t1 = time.perf_counter()
    for conn in conns:
        if not ep.recv(conn, mr, buf.ptr, msg):
            raise RuntimeError(f"recv from conn {conn}: {ep.last_error()}")
        i = peer_by_digest.get(buf.digest())
        if i is None or i in peer_of.values():
            failures.append(f"conn {conn}: a message that is no peer's (or a second one of peer {i})")
            continue
        peer_of[conn] = i
    expect("delivered")
    res["deliver_s"] = round(time.perf_counter() - t1, 3)
    res["delivered_checked"] = len(peer_of)
    # Streams that landed the last messages keep their workers for the
    # linger (5 ms by default) before handing them back: counted after it.
    time.sleep(0.1)
    res["after_deliver"] = dict(zip(("threads", "fds", "rss"), counts()))
    res["thread_names_after_deliver"] = thread_names()
    ep.dereg(mr)
    if busy:
        res["busy"] = many_at_once(ep, a, busy, busy_size, gpu, peer_of, pipes, expect, failures)
        res["busy_out"] = out_to_many(ep, busy, busy_size, gpu, peer_of, pipes, expect, failures)
    for p in pipes:
        p.send(("stop",))
    expect("done")
    for c in children:
        c.join(30)
        if c.exitcode != 0:
            failures.append(f"client process {c.pid} exited with {c.exitcode}")
    return res, failures


def many_at_once(ep, a, busy, busy_size, gpu, peer_of, pipes, expect, failures):
    """Peer 0 alone, then the first `busy` peers at once, each sending
    busy_size into a buffer of its own; every byte checked."""
    conn_of = {i: c for c, i in peer_of.items()}
    want = {i: hashlib.sha256(pattern(busy_size, busy_seed(i))).hexdigest() for i in range(busy)}
    bufs = {}
    for i in range(busy):
        buf = Buffer(busy_size, gpu)
        ok, mr = ep.reg(buf.ptr, busy_size)
        if not ok:
            raise RuntimeError(ep.last_error())
        bufs[i] = (buf, mr)

    def round_of(peers):
        ids = []
        for i in peers:
            buf, mr = bufs[i]
            ok, tid = ep.recv_async(conn_of[i], mr, buf.ptr, busy_size)
            if not ok:
                raise RuntimeError(f"recv from peer {i}: {ep.last_error()}")
            ids.append((i, tid))
        t = time.perf_counter()
        with PeakThreads() as peak:
            for p in pipes:
                p.send(("go", peers))
            for i, tid in ids:
                if not ep.wait(tid, TIMEOUT):
                    raise RuntimeError(f"recv from peer {i}: {ep.last_error()}")
            dt = time.perf_counter() - t
        peaks.append((peak.peak, peak.names))
        expect("sent")
        for i in peers:
            if bufs[i][0].digest() != want[i]:
                failures.append(f"peer {i}: {fmt_size(busy_size)} differs")
            bufs[i][0].clear()
        return len(peers) * busy_size / dt / 1e9

    peaks = []
    first = warm_up(round_of, busy, peaks)
    alone = [round_of([0]) for _ in range(3)]
    together = [round_of(list(range(busy))) for _ in range(3)]
    for _, mr in bufs.values():
        ep.dereg(mr)
    return rounds_summary(busy, busy_size, first, alone, together, peaks, "one_peer_alone_GBps", "all_at_once_GBps")


def warm_up(round_of, busy, peaks):
    """A first round alone and two first rounds at once, kept apart from
    the timed ones: a connection opens its streams as its messages want
    them, and a stream's first GPU message makes the pinned staging it
    takes (milliseconds per stream), which a serving fleet pays once per
    stream, not per transfer. Measured on 2 x H100, sending 16 MiB to 8
    peers at once read 0.45-0.61, then 3.1-3.6, then 12.6-13.2 GB/s in its
    first three rounds."""
    first = (round_of([0]), [round_of(list(range(busy))) for _ in range(2)], max(peaks, key=lambda p: p[0]))
    peaks.clear()
    return first


def rounds_summary(busy, busy_size, first, alone, together, peaks, alone_key, together_key):
    """Three rounds alone and three at once after the first ones
    (`first`, see `warm_up`): the medians, their ratio, and the peak
    threads (`peaks`: (count, names) per timed round, alone first)."""
    alone, together = sorted(alone), sorted(together)
    return {
        "peers_at_once": busy,
        "size": busy_size,
        "first_round_alone_GBps": first[0],
        "first_rounds_together_GBps": first[1],
        "peak_threads_first_rounds": first[2][0],
        "thread_names_at_peak_first_rounds": first[2][1],
        alone_key: alone[1],
        together_key: together[1],
        "ratio": together[1] / alone[1],
        "rounds_alone": alone,
        "rounds_together": together,
        "peak_threads_alone": max(p for p, _ in peaks[:3]),
        "peak_threads_together": max(p for p, _ in peaks[3:]),
        "thread_names_at_peak_together": max(peaks[3:], key=lambda p: p[0])[1],
    }


def out_to_many(ep, busy, busy_size, gpu, peer_of, pipes, expect, failures):
    """To peer 0 alone, then to the first `busy` peers at once, the same
    busy_size message (one registered buffer); timed from the first send
    to the last peer's landing, every byte checked by its peer."""
    conn_of = {i: c for c, i in peer_of.items()}
    src = Buffer(busy_size, gpu)
    src.fill(OUT_SEED)
    want = hashlib.sha256(pattern(busy_size, OUT_SEED)).hexdigest()
    ok, mr = ep.reg(src.ptr, busy_size)
    if not ok:
        raise RuntimeError(ep.last_error())
    peaks = []

    def round_of(peers):
        for p in pipes:
            p.send(("take", peers))
        expect("ready")
        t = time.monotonic()
        with PeakThreads() as peak:
            ids = []
            for i in peers:
                ok, tid = ep.send_async(conn_of[i], mr, src.ptr, busy_size)
                if not ok:
                    raise RuntimeError(f"send to peer {i}: {ep.last_error()}")
                ids.append((i, tid))
            for i, tid in ids:
                if not ep.wait(tid, TIMEOUT):
                    raise RuntimeError(f"send to peer {i}: {ep.last_error()}")
            landed, digests = {}, {}
            for p in pipes:
                if not p.poll(TIMEOUT):
                    raise RuntimeError(f"a client process did not answer (took) within {TIMEOUT:.0f} s")
                got = p.recv()
                if got[0] == "error":
                    raise RuntimeError(got[1])
                if got[0] != "took":
                    raise RuntimeError(f"a client process said {got[0]!r}, expected 'took'")
                landed.update(got[1][0])
                digests.update(got[1][1])
        peaks.append((peak.peak, peak.names))
        for i in peers:
            if digests.get(i) != want:
                failures.append(f"out to peer {i}: {fmt_size(busy_size)} differs")
        dt = max(landed.values()) - t
        return len(peers) * busy_size / dt / 1e9

    first = warm_up(round_of, busy, peaks)
    alone = [round_of([0]) for _ in range(3)]
    together = [round_of(list(range(busy))) for _ in range(3)]
    ep.dereg(mr)
    return rounds_summary(busy, busy_size, first, alone, together, peaks, "to_one_peer_alone_GBps", "to_all_at_once_GBps")


def report(res, failures):
    b, e, i = res["before"], res["endpoint_alone"], res["all_connected_idle"]
    pp = res["per_peer"]
    print(f"tcpx-p2p-bench peers: {res['peers']} peers in {res['client_processes']} processes, net={res['net']} memory={res['memory']}, {res['cores']} cores")
    print(f"  connect: all {res['peers']} accepted in {res['connect_all_s']:.2f} s")
    print(f"  threads: {b['threads']} before, {e['threads']} with the endpoint, {i['threads']} with every peer connected ({pp['threads']:.2f} per peer)")
    print(f"  descriptors: {b['fds']} / {e['fds']} / {i['fds']} ({pp['fds']:.2f} per peer)")
    print(f"  RSS: {b['rss'] / 2**20:.1f} / {e['rss'] / 2**20:.1f} / {i['rss'] / 2**20:.1f} MiB ({pp['rss_MiB']:.3f} MiB per peer)")
    print(f"  threads by name, every peer connected: {res['thread_names_all_connected']}")
    print(f"  deliver: {res['delivered_checked']} of {res['peers']} messages checked in {res['deliver_s']:.2f} s; threads after: {res['after_deliver']['threads']}")
    if "busy" in res:
        bz = res["busy"]
        print(
            f"  many at once: {bz['peers_at_once']} peers x {fmt_size(bz['size'])}: {bz['all_at_once_GBps']:.2f} GB/s "
            f"beside one peer alone {bz['one_peer_alone_GBps']:.2f} GB/s (ratio {bz['ratio']:.2f}; medians of 3 "
            f"after first rounds, at once {', '.join(f'{x:.2f}' for x in bz['first_rounds_together_GBps'])}, alone {bz['first_round_alone_GBps']:.2f})"
        )
        print(
            f"  threads while receiving: at most {bz['peak_threads_alone']} from one peer, "
            f"{bz['peak_threads_together']} from {bz['peers_at_once']} at once, {bz['peak_threads_first_rounds']} in the first rounds "
            f"(by name at the steady peak: {bz['thread_names_at_peak_together']}; "
            f"at the first rounds' peak: {bz['thread_names_at_peak_first_rounds']})"
        )
    if "busy_out" in res:
        bo = res["busy_out"]
        print(
            f"  out to many at once: {bo['peers_at_once']} peers x {fmt_size(bo['size'])}: {bo['to_all_at_once_GBps']:.2f} GB/s "
            f"beside to one peer alone {bo['to_one_peer_alone_GBps']:.2f} GB/s (ratio {bo['ratio']:.2f}; medians of 3 "
            f"after first rounds, at once {', '.join(f'{x:.2f}' for x in bo['first_rounds_together_GBps'])}, alone {bo['first_round_alone_GBps']:.2f})"
        )
        print(
            f"  threads while sending: at most {bo['peak_threads_alone']} to one peer, "
            f"{bo['peak_threads_together']} to {bo['peers_at_once']} at once, {bo['peak_threads_first_rounds']} in the first rounds "
            f"(by name at the steady peak: {bo['thread_names_at_peak_together']}; "
            f"at the first rounds' peak: {bo['thread_names_at_peak_first_rounds']})"
        )
    for f in failures:
        print(f"  FAILED: {f}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tcpx-p2p-bench peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=256)
    ap.add_argument("--procs", type=int, default=8, help="client processes holding the peers")
    ap.add_argument("--msg", default="1M", help="each peer's message in the deliver phase")
    ap.add_argument("--busy", type=int, default=64, help="peers sending at once in the last phase (0: skip it)")
    ap.add_argument("--busy-size", default="16M")
    ap.add_argument("--memory", choices=["host", "gpu"], default="host")
    ap.add_argument("--gpus", default="0,1", help="--memory gpu: the target's GPU, then the peers' (one GPU: both on it)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="write peers.json into this folder")
    a = ap.parse_args(argv)
    if a.peers < 1:
        ap.error("--peers: at least 1")
    try:
        res, failures = run(a)
    except (RuntimeError, OSError) as e:
        print(f"tcpx-p2p-bench peers: {e}", file=sys.stderr)
        return 1
    res["failures"] = failures
    res["host"] = platform.node()
    report(res, failures)
    path = a.json or (os.path.join(a.out, "peers.json") if a.out else None)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
