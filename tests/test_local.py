"""Same-host calls (UCCL v0.1.1's `connect_local`, `accept_local`,
`advertise_ipc`, `write_ipc`, `read_ipc`, their vector and async forms,
`send_ipc`, `recv_ipc`) between two processes of this host, in UCCL's shape:
the calls and keywords its tests use. Host memory everywhere; GPU memory
(CUDA IPC) where CUDA and torch are present: two processes on one GPU, and
on two GPUs where there are two."""

import hashlib
import multiprocessing as mp
import os
import random
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import peer_ops  # noqa: E402
from conftest import Peer  # noqa: E402


def _cuda_gpus():
    try:
        from tcpx_p2p import cuda_device_count

        n = cuda_device_count()
        if n == 0:
            return 0
        import torch  # noqa: F401

        return n
    except ImportError:
        return 0


CUDA_GPUS = _cuda_gpus()
needs_gpu = pytest.mark.skipif(CUDA_GPUS < 1, reason="needs CUDA and torch")
needs_2gpu = pytest.mark.skipif(CUDA_GPUS < 2, reason="needs two GPUs")


def sha(b):
    return hashlib.sha256(b).hexdigest()


class Side:
    """This process's endpoint and buffers."""

    def __init__(self, device="cpu", gpu=0):
        from tcpx_p2p import p2p

        self.ep = p2p.Endpoint(gpu if device == "cuda" else None)
        self.bufs = peer_ops.Buffers(device, gpu)


@pytest.fixture
def pair(request):
    """(this side, a peer process, our conn id, the peer's conn id) over a
    same-host connection made by metadata; `request.param`: (our device,
    our GPU, the peer's device, the peer's GPU)."""
    dev, gpu, pdev, pgpu = getattr(request, "param", ("cpu", 0, "cpu", 0))
    peer = Peer(pdev, pgpu if pdev == "cuda" else None)
    me = Side(dev, gpu)
    try:
        cid, pcid = connect_local(me.ep, peer, peer.metadata)
        yield me, peer, cid, pcid
    finally:
        peer.close()


def connect_local(ep, peer, target):
    peer.pipe.send(("ep", ("accept_local", (30.0,))))
    ok, cid = ep.connect_local(target)
    assert ok, ep.last_error()
    ok2, _bdf, pcid = peer._reply()
    assert ok2, f"the peer's accept_local failed: {peer.ep('last_error')}"
    return cid, pcid


def wait_all(ep, ids):
    for x in ids:
        done = False
        deadline = time.time() + 60
        while not done:
            ok, done = ep.poll_async(x)
            assert ok, ep.last_error()
            assert time.time() < deadline, "transfer did not end"


# ---------------------------------------------------------------- host memory


def _any_cuda():
    try:
        from tcpx_p2p import cuda_device_count

        return cuda_device_count() > 0
    except ImportError:
        return False


@pytest.mark.skipif(_any_cuda(), reason="GPU index labels without a GPU only exist where CUDA is absent")
def test_connect_local_by_index_and_metadata():
    # Host-only endpoints take index 0 (other indices name GPUs that must
    # exist); this process's own endpoint is host-only without an index.
    label = random.randint(20_000, 60_000)
    peer = Peer("cpu", 0)
    try:
        me = Side()
        cid, pcid = connect_local(me.ep, peer, 0)
        assert cid >= 0 and pcid >= 0
        assert cid in me.ep.conn_ids()
        # UCCL's keyword, and the peer's report of who connected.
        peer.pipe.send(("ep", ("accept_local", (30.0,))))
        ok, cid2 = me.ep.connect_local(remote_gpu_bdf=peer.metadata)
        assert ok, me.ep.last_error()
        ok, bdf, pcid2 = peer._reply()
        assert ok and isinstance(bdf, str) and pcid2 != pcid
        assert me.ep.remove_remote_endpoint(cid2)
        # The keyword UCCL's own same-host tests use.
        peer.pipe.send(("ep", ("accept_local", (30.0,))))
        ok, cid3 = me.ep.connect_local(remote_gpu_idx=0)
        assert ok, me.ep.last_error()
        ok, _bdf, _pcid3 = peer._reply()
        assert ok
        assert me.ep.remove_remote_endpoint(cid3)
        # Nobody there: an error, not a hang.
        ok, _ = me.ep.connect_local(label + 1)
        assert not ok and "no endpoint listens" in me.ep.last_error()
        ok, _bdf, _c = me.ep.accept_local(0.2)
        assert not ok
    finally:
        peer.close()


SIZES = [1, 4096, 65536 + 7, (1 << 20) + 3, 16 << 20]


def test_write_read_ipc_host(pair):
    me, peer, cid, pcid = pair
    for i, n in enumerate(SIZES):
        bid, dst = peer.call("alloc", n + 64)
        ok, info = peer.ep("advertise_ipc", pcid, dst, n + 64)
        assert ok and len(info) > 0
        sid, src = me.bufs.alloc(n, seed=i)
        assert me.ep.write_ipc(cid, src, n, info), me.ep.last_error()
        assert peer.call("digest", bid, 0, n) == me.bufs.digest(sid)
        # Into the middle of the advertised range, async.
        ok, x = me.ep.write_ipc_async(conn_id=cid, ptr=src, size=n, info=info)
        assert ok, me.ep.last_error()
        wait_all(me.ep, [x])
        # Read back, blocking and async.
        rid, back = me.bufs.alloc(n)
        assert me.ep.read_ipc(cid, back, n, info), me.ep.last_error()
        assert me.bufs.digest(rid) == me.bufs.digest(sid)
        rid2, back2 = me.bufs.alloc(n)
        ok, x = me.ep.read_ipc_async(cid, back2, n, info)
        assert ok
        wait_all(me.ep, [x])
        assert me.bufs.digest(rid2) == me.bufs.digest(sid)


def test_writev_readv_ipc_host(pair):
    me, peer, cid, pcid = pair
    sizes = [4096, 1, 300_000, 65536, 12345]
    dsts = [peer.call("alloc", n) for n in sizes]
    ok, infos = peer.ep("advertisev_ipc", pcid, [p for _, p in dsts], sizes)
    assert ok and len(infos) == len(sizes)
    srcs = [me.bufs.alloc(n, seed=100 + i) for i, n in enumerate(sizes)]
    assert me.ep.writev_ipc(cid, [p for _, p in srcs], sizes, infos), me.ep.last_error()
    for (bid, _), (sid, _) in zip(dsts, srcs):
        assert peer.call("digest", bid) == me.bufs.digest(sid)
    backs = [me.bufs.alloc(n) for n in sizes]
    assert me.ep.readv_ipc(conn_id=cid, ptr_v=[p for _, p in backs], size_v=sizes, info_v=infos)
    for (b, _), (s, _) in zip(backs, srcs):
        assert me.bufs.digest(b) == me.bufs.digest(s)
    # Async forms, new contents.
    srcs2 = [me.bufs.alloc(n, seed=200 + i) for i, n in enumerate(sizes)]
    ok, x = me.ep.writev_ipc_async(cid, [p for _, p in srcs2], sizes, infos)
    assert ok
    wait_all(me.ep, [x])
    backs2 = [me.bufs.alloc(n) for n in sizes]
    ok, y = me.ep.readv_ipc_async(cid, [p for _, p in backs2], sizes, infos)
    assert ok
    wait_all(me.ep, [y])
    for (b, _), (s, _), (d, _) in zip(backs2, srcs2, dsts):
        assert me.bufs.digest(b) == me.bufs.digest(s) == peer.call("digest", d)
    # Mismatched lists are refused.
    assert not me.ep.writev_ipc(cid, [srcs[0][1]], sizes, infos)


def test_send_recv_ipc_host(pair):
    me, peer, cid, pcid = pair
    sizes = [10, 1 << 20, 65536]
    rids = []
    for n in sizes:
        bid, p = peer.call("alloc", n)
        ok, x = peer.ep("recv_ipc_async", pcid, p, n)
        assert ok
        rids.append((bid, x))
    sids = []
    for i, n in enumerate(sizes):
        sid, p = me.bufs.alloc(n, seed=300 + i)
        sids.append(sid)
        if i == 1:
            assert me.ep.send_ipc(cid, p, n), me.ep.last_error()
        else:
            ok, x = me.ep.send_ipc_async(cid, p, n)
            assert ok
            wait_all(me.ep, [x])
    for (bid, x), sid in zip(rids, sids):
        assert peer.ep("wait", x, 30.0)
        assert peer.call("digest", bid) == me.bufs.digest(sid)
    # Blocking recv on the peer, send from here; the other way round too.
    bid, p = peer.call("alloc", 5000)
    peer.pipe.send(("ep", ("recv_ipc", (pcid, p, 5000))))
    sid, s = me.bufs.alloc(5000, seed=7)
    assert me.ep.send_ipc(cid, s, 5000)
    assert peer._reply() is True
    assert peer.call("digest", bid) == me.bufs.digest(sid)
    pb, ps = peer.call("alloc", 777, 8)
    rid, r = me.bufs.alloc(777)
    ok, x = me.ep.recv_ipc_async(cid, r, 777)
    assert ok
    assert peer.ep("send_ipc", pcid, ps, 777)
    wait_all(me.ep, [x])
    assert me.bufs.digest(rid) == peer.call("digest", pb)
    # A send from memory the target cannot reach fails its receive too,
    # and moves nothing.
    bid, p = peer.call("alloc", 100)
    before = peer.call("digest", bid)
    ok, x = peer.ep("recv_ipc_async", pcid, p, 100)
    assert ok
    assert not me.ep.send_ipc(cid, 4096, 100)
    assert not peer.ep("wait", x, 30.0)
    assert peer.call("digest", bid) == before


def test_registered_calls_on_a_local_connection(pair):
    """`write`/`read` (64-byte descriptors) and `send`/`recv` of registered
    memory take the same-host path on a local connection."""
    me, peer, cid, pcid = pair
    n = 3 << 20
    bid, dst = peer.call("alloc", n)
    ok, pmr = peer.ep("reg", dst, n)
    assert ok
    ok, meta = peer.ep("advertise", pcid, pmr, dst, n)
    assert ok and len(meta) == 64
    sid, src = me.bufs.alloc(n, seed=11)
    ok, mr = me.ep.reg(src, n)
    assert ok
    assert me.ep.write(cid, mr, src, n, meta), me.ep.last_error()
    assert peer.call("digest", bid) == me.bufs.digest(sid)
    rid, back = me.bufs.alloc(n)
    ok, rmr = me.ep.reg(back, n)
    ok, x = me.ep.read_async(cid, rmr, back, n, meta)
    assert ok
    wait_all(me.ep, [x])
    assert me.bufs.digest(rid) == me.bufs.digest(sid)
    # Two-sided with registered buffers.
    ok, y = peer.ep("recv_async", pcid, pmr, dst, 1000)
    assert ok
    sid2, src2 = me.bufs.alloc(1000, seed=12)
    ok, mr2 = me.ep.reg(src2, 1000)
    assert me.ep.send(cid, mr2, src2, 1000), me.ep.last_error()
    assert peer.ep("wait", y, 30.0)
    assert peer.call("digest", bid, 0, 1000) == me.bufs.digest(sid2)
    # Deregistered on the peer: the descriptor is stale, nothing moves.
    before = peer.call("digest", bid)
    assert peer.ep("dereg", pmr)
    assert not me.ep.write(cid, mr, src, n, meta)
    assert "stale" in me.ep.last_error()
    assert peer.call("digest", bid) == before


def test_forged_and_stale_ipc_descriptors(pair):
    me, peer, cid, pcid = pair
    n = 1 << 16
    bid, dst = peer.call("alloc", 2 * n)
    ok, info = peer.ep("advertise_ipc", pcid, dst + n // 2, n)
    assert ok
    before = peer.call("digest", bid)
    sid, src = me.bufs.alloc(2 * n, seed=13)

    def refused(blob, size=n, ptr=src):
        assert not me.ep.write_ipc(cid, ptr, size, blob)
        assert peer.call("digest", bid) == before, "bytes moved"
        return me.ep.last_error()

    # The descriptor is the 64-byte one `advertise` gives: address 0..8,
    # length 8..12, token id 40..48, secret 48..56.
    # Wrong secret; other token id.
    forged = bytearray(info)
    forged[48] ^= 1
    assert "stale" in refused(bytes(forged))
    forged = bytearray(info)
    forged[40] ^= 0x40
    assert "stale" in refused(bytes(forged))
    # A range the record does not cover: address moved back, length grown.
    forged = bytearray(info)
    forged[0:8] = (dst).to_bytes(8, "little")
    assert "outside" in refused(bytes(forged))
    forged = bytearray(info)
    forged[8:12] = (2 * n).to_bytes(4, "little")
    assert "outside" in refused(bytes(forged), size=2 * n)
    # More than the descriptor says: refused before asking the peer.
    refused(info, size=n + 1)
    # Not a descriptor at all.
    refused(b"\0" * 56)
    refused(b"short")
    refused(bytes(64))
    # Reads are checked the same way and write nothing of ours.
    rid, back = me.bufs.alloc(2 * n)
    forged = bytearray(info)
    forged[0:8] = (dst).to_bytes(8, "little")
    assert not me.ep.read_ipc(cid, back, n, bytes(forged))
    assert me.bufs.data(rid) == bytes(2 * n)
    # Our own descriptor offered back to us.
    ok, mine = me.ep.advertise_ipc(cid, src, n)
    assert ok
    assert not me.ep.write_ipc(cid, src, n, mine)
    # Stale: the connection it was made for is gone; a new one refuses it.
    assert peer.ep("remove_remote_endpoint", pcid)
    time.sleep(0.2)
    cid2, _pcid2 = connect_local(me.ep, peer, peer.metadata)
    assert not me.ep.write_ipc(cid2, src, n, info)
    assert "stale" in me.ep.last_error()
    assert peer.call("digest", bid) == before
    # The good descriptor still works on a connection where it is valid.
    ok, info2 = peer.ep("advertise_ipc", _pcid2, dst + n // 2, n)
    assert me.ep.write_ipc(cid2, src, n, info2)
    assert peer.call("digest", bid, n // 2, n) == me.bufs.digest(sid, 0, n)


def test_auth_token_must_match():
    peer = Peer("cpu", None, {"TCPX_P2P_AUTH_TOKEN": "right"})
    try:
        os.environ["TCPX_P2P_AUTH_TOKEN"] = "wrong"
        try:
            me = Side()
        finally:
            del os.environ["TCPX_P2P_AUTH_TOKEN"]
        peer.pipe.send(("ep", ("accept_local", (3.0,))))
        ok, _ = me.ep.connect_local(peer.metadata)
        assert not ok
        assert "auth" in me.ep.last_error()
        ok, _bdf, _c = peer._reply()
        assert not ok
    finally:
        peer.close()


def test_peer_dies_fails_not_hangs(pair):
    me, peer, cid, pcid = pair
    n = 1 << 20
    bid, dst = peer.call("alloc", n)
    ok, info = peer.ep("advertise_ipc", pcid, dst, n)
    sid, src = me.bufs.alloc(n, seed=1)
    # A send waiting for a receive that will never be posted.
    ok, x = me.ep.send_ipc_async(cid, src, n)
    assert ok
    ok, done = me.ep.poll_async(x)
    assert ok and not done
    peer.kill()
    t0 = time.time()
    assert not me.ep.wait(x, 30.0)
    assert time.time() - t0 < 30
    assert not me.ep.write_ipc(cid, src, n, info)
    assert not me.ep.send_ipc(cid, src, n)
    assert "closed" in me.ep.last_error() or "lost" in me.ep.last_error().lower()


# ----------------------------------------------------------------- GPU memory


def _gpu_roundtrip(me, peer, cid, pcid):
    import torch

    for i, n in enumerate([4096, (1 << 20) + 5, 32 << 20]):
        bid, dst = peer.call("alloc", n)
        ok, info = peer.ep("advertise_ipc", pcid, dst, n)
        assert ok
        sid, src = me.bufs.alloc(n, seed=400 + i)
        assert me.ep.write_ipc(cid, src, n, info), me.ep.last_error()
        assert peer.call("digest", bid) == me.bufs.digest(sid)
        # Again (leased: no message), async, new contents.
        sid2, src2 = me.bufs.alloc(n, seed=500 + i)
        ok, x = me.ep.write_ipc_async(cid, src2, n, info)
        assert ok
        wait_all(me.ep, [x])
        assert peer.call("digest", bid) == me.bufs.digest(sid2)
        rid, back = me.bufs.alloc(n)
        assert me.ep.read_ipc(cid, back, n, info), me.ep.last_error()
        assert me.bufs.digest(rid) == me.bufs.digest(sid2)
        # The same record with a grown length (the descriptor's bytes
        # 8..12): the lease keeps the peer's range, so this goes to the
        # peer, which refuses it.
        forged = bytearray(info)
        forged[8:12] = (n + 4096).to_bytes(4, "little")
        bigid, big = me.bufs.alloc(n + 4096, seed=900)
        assert not me.ep.write_ipc(cid, big, n + 4096, bytes(forged))
        assert peer.call("digest", bid) == me.bufs.digest(sid2)
    # Host memory here into GPU memory there.
    host = peer_ops.Buffers("cpu", 0)
    hid, hsrc = host.alloc(65536, seed=600)
    bid, dst = peer.call("alloc", 65536)
    ok, info = peer.ep("advertise_ipc", pcid, dst, 65536)
    assert me.ep.write_ipc(cid, hsrc, 65536, info), me.ep.last_error()
    assert peer.call("digest", bid) == host.digest(hid)
    # Vectors and two-sided.
    sizes = [4096, 65536, 1 << 20]
    dsts = [peer.call("alloc", n) for n in sizes]
    ok, infos = peer.ep("advertisev_ipc", pcid, [p for _, p in dsts], sizes)
    srcs = [me.bufs.alloc(n, seed=700 + i) for i, n in enumerate(sizes)]
    assert me.ep.writev_ipc(cid, [p for _, p in srcs], sizes, infos), me.ep.last_error()
    for (b, _), (s, _) in zip(dsts, srcs):
        assert peer.call("digest", b) == me.bufs.digest(s)
    bid, p = peer.call("alloc", 1 << 20)
    ok, x = peer.ep("recv_ipc_async", pcid, p, 1 << 20)
    sid, s = me.bufs.alloc(1 << 20, seed=800)
    assert me.ep.send_ipc(cid, s, 1 << 20), me.ep.last_error()
    assert peer.ep("wait", x, 30.0)
    assert peer.call("digest", bid) == me.bufs.digest(sid)
    # Forged: outside the record, nothing moves.
    before = peer.call("digest", bid)
    ok, info = peer.ep("advertise_ipc", pcid, p + 4096, 4096)
    forged = bytearray(info)
    forged[0:8] = p.to_bytes(8, "little")
    assert not me.ep.write_ipc(cid, s, 4096, bytes(forged))
    assert peer.call("digest", bid) == before
    torch.cuda.synchronize()


@needs_gpu
@pytest.mark.parametrize("pair", [("cuda", 0, "cuda", 0)], indirect=True)
def test_gpu_two_processes_one_gpu(pair):
    _gpu_roundtrip(*pair)


@needs_2gpu
@pytest.mark.parametrize("pair", [("cuda", 0, "cuda", 1)], indirect=True)
def test_gpu_two_gpus(pair):
    _gpu_roundtrip(*pair)


def _cycles_in_a_fresh_process():
    """The body of test_connect_transfer_close_cycles_leak_nothing, run in a
    process of its own: the counts are the process's, and endpoints other
    tests left behind would move them."""
    import ctypes

    from tcpx_p2p import p2p

    a, b = p2p.Endpoint(None), p2p.Endpoint(None)
    src, dst = (ctypes.c_char * 4096)(), (ctypes.c_char * 4096)()
    ctypes.memset(src, 5, 4096)

    def counts():
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    def cycle():
        ok, c = a.connect_local(b.get_metadata())
        assert ok, a.last_error()
        ok, _bdf, cb = b.accept_local(10.0)
        assert ok
        ok, info = b.advertise_ipc(cb, ctypes.addressof(dst), 4096)
        assert a.write_ipc(c, ctypes.addressof(src), 4096, info), a.last_error()
        assert a.remove_remote_endpoint(c)

    def settled(want):
        # The I/O workers leave a few seconds after their last job.
        deadline = time.time() + 15
        while counts() != want and time.time() < deadline:
            time.sleep(0.05)
        return counts()

    before = counts()
    cycle()
    assert settled(before) == before
    for _ in range(200):
        cycle()
    assert settled(before) == before
    assert bytes(dst) == b"\x05" * 4096


def test_connect_transfer_close_cycles_leak_nothing():
    """200 same-host connections made, used and removed: the fds and
    threads of both endpoints come back to where they were once the I/O
    workers are idle again."""
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_cycles_in_a_fresh_process)
    p.start()
    p.join(240)
    if p.is_alive():
        p.kill()
    assert p.exitcode == 0, f"the cycles' process ended with {p.exitcode} (its traceback is above)"
