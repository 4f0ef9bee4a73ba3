"""The same-host net between two processes: endpoints made with
TCPX_P2P_SAME_HOST_NET=1 and connected with `connect` / `accept` carry their
data over it (cross-memory attach for host memory, CUDA IPC for GPU memory)
through the ordinary engine. Every byte checked; host memory everywhere, GPU
memory where CUDA and torch are present (the peer on GPU 1 where there are
two)."""

import contextlib
import hashlib
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import peer_ops  # noqa: E402
from conftest import PEER_GPU, Peer, connect  # noqa: E402

ON = {"TCPX_P2P_SAME_HOST_NET": "1"}


def _has_net():
    from tcpx_p2p import p2p

    return hasattr(p2p.Endpoint, "conn_net")


# A build from before the same-host net (an older wheel in a device round).
pytestmark = pytest.mark.skipif(not _has_net(), reason="this build has no same-host net")


def digest(b):
    return hashlib.sha256(b).hexdigest()


def endpoint(env):
    """This process's endpoint (GPU 0 on a GPU machine), made with `env`."""
    from tcpx_p2p import p2p

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return p2p.Endpoint(0)
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


@contextlib.contextmanager
def net_pair(device):
    """This process's endpoint, its buffers, and a peer process, connected
    over the same-host net: (endpoint, buffers, peer, our connection, the
    peer's). The peer is closed at the end."""
    ep = endpoint(ON)
    bufs = peer_ops.Buffers(device, 0)
    peer = Peer(device, PEER_GPU, ON)
    try:
        cid, pcid = connect(ep, peer)
        yield ep, bufs, peer, cid, pcid
    finally:
        peer.close()


GUARD = 4096


def guarded_write(ep, peer, bufs, cid, pcid, n, seed):
    """Writes `n` bytes of ours into a range the peer advertised between
    two untouched guards; checks the bytes and the guards. Returns the
    advertisement and our source buffer."""
    tb, tptr = peer.call("alloc", n + 2 * GUARD)
    ok, tmr = peer.ep("reg", tptr, n + 2 * GUARD)
    ok, meta = peer.ep("advertise", pcid, tmr, tptr + GUARD, n)
    assert ok
    sb, sptr = bufs.alloc(n, seed=seed)
    ok, smr = ep.reg(sptr, n)
    assert ep.write(cid, smr, sptr, n, meta), ep.last_error()
    assert peer.call("digest", tb, GUARD, n) == bufs.digest(sb), f"write of {n}"
    assert peer.call("data", tb, 0, GUARD) == bytes(GUARD)
    assert peer.call("data", tb, GUARD + n, GUARD) == bytes(GUARD)
    return tb, meta, sb, smr, sptr


def test_send_recv_and_write_read(device):
    with net_pair(device) as (ep, bufs, peer, cid, pcid):
        assert ep.conn_net(cid) == "same-host"
        assert peer.ep("conn_net", pcid) == "same-host"
        # Two-sided, both ways, sizes across the copy's thread split.
        for i, n in enumerate([1, 4096, (1 << 20) + 7, 9 << 20]):
            sb, sptr = bufs.alloc(n, seed=i)
            ok, smr = ep.reg(sptr, n)
            rb, rptr = peer.call("alloc", n)
            ok, rmr = peer.ep("reg", rptr, n)
            ok, rx = peer.ep("recv_async", pcid, rmr, rptr, n)
            assert ok
            assert ep.send(cid, smr, sptr, n), ep.last_error()
            assert peer.ep("wait", rx), "receive failed"
            assert peer.call("digest", rb) == bufs.digest(sb), f"send of {n}"
        n = 3 << 20
        pb, pptr = peer.call("alloc", n, 77)
        ok, pmr = peer.ep("reg", pptr, n)
        rb, rptr = bufs.alloc(n)
        ok, rmr = ep.reg(rptr, n)
        ok, rx = ep.recv_async(cid, rmr, rptr, n)
        assert ok
        assert peer.ep("send", pcid, pmr, pptr, n)
        assert ep.wait(rx), ep.last_error()
        assert bufs.digest(rb) == peer.call("digest", pb), "send back"
        # One-sided, with guards around the advertised range; small ones
        # ride the control connection, the rest the net.
        for i, n in enumerate([1000, (1 << 20) + 3, 16 << 20]):
            tb, meta, sb, smr, sptr = guarded_write(ep, peer, bufs, cid, pcid, n, 20 + i)
            rb, rptr = bufs.alloc(n)
            ok, rmr = ep.reg(rptr, n)
            assert ep.read(cid, rmr, rptr, n, meta), ep.last_error()
            assert bufs.digest(rb) == bufs.digest(sb), f"read of {n}"
            # A descriptor moved before the range is refused, nothing written.
            forged = bytearray(meta)
            addr = int.from_bytes(forged[0:8], "little")
            forged[0:8] = (addr - GUARD).to_bytes(8, "little")
            assert not ep.write(cid, smr, sptr, n, bytes(forged))
            assert peer.call("data", tb, 0, GUARD) == bytes(GUARD), "forged write wrote"


def test_a_peer_that_dies_fails_what_waits(device):
    with net_pair(device) as (ep, bufs, peer, cid, _pcid):
        n = 1 << 20
        rb, rptr = bufs.alloc(n)
        ok, rmr = ep.reg(rptr, n)
        ok, rx = ep.recv_async(cid, rmr, rptr, n)
        assert ok
        peer.kill()
        t0 = time.time()
        assert not ep.wait(rx, 30.0)
        assert time.time() - t0 < 30


def test_one_side_without_it_is_refused():
    ep = endpoint(ON)
    peer = Peer("cpu", None, {"TCPX_P2P_SAME_HOST_NET": "0"})
    try:
        ip, port, _ = ep.parse_metadata(peer.metadata)
        peer.pipe.send(("ep", ("accept", ())))
        ok, _cid = ep.connect(ip, 0, port)
        assert not ok
        assert "net" in ep.last_error()
    finally:
        peer.close()


@pytest.mark.parametrize(
    "writer_pulls,target_pulls",
    [("1", "1"), ("0", "1"), ("1", "0")],
    ids=["both-pull", "writer-sends", "target-cannot-pull"],
)
def test_one_sided_transfers_are_copied_by_the_target_or_sent_as_each_side_allows(
    device, writer_pulls, target_pulls
):
    """A write the target copies from the writer itself (the writer offers
    it, the target pulls) and one sent as before (either side with
    TCPX_P2P_SAME_HOST_PULL=0) land the same bytes, single and scattered
    over several items; reads (copied by the reader, whose memory it is)
    bring them back."""
    ep = endpoint(dict(ON, TCPX_P2P_SAME_HOST_PULL=writer_pulls))
    bufs = peer_ops.Buffers(device, 0)
    peer = Peer(device, PEER_GPU, dict(ON, TCPX_P2P_SAME_HOST_PULL=target_pulls))
    try:
        cid, pcid = connect(ep, peer)
        for i, n in enumerate([(1 << 20) + 3, 9 << 20]):
            _tb, meta, sb, _smr, _sptr = guarded_write(ep, peer, bufs, cid, pcid, n, 40 + i)
            # Read back into a guarded buffer of ours.
            rb, rptr = bufs.alloc(n + 2 * GUARD)
            ok, rmr = ep.reg(rptr, n + 2 * GUARD)
            assert ep.read(cid, rmr, rptr + GUARD, n, meta), ep.last_error()
            assert bufs.digest(rb, GUARD, n) == bufs.digest(sb), f"read of {n}"
            assert bufs.data(rb, 0, GUARD) == bytes(GUARD)
            assert bufs.data(rb, GUARD + n, GUARD) == bytes(GUARD)
        # 64 blocks of 64 KiB, the target's in reverse order (no two runs
        # contiguous on both sides): one write of 64 runs.
        nblk, bs = 64, 64 << 10
        tb, tptr = peer.call("alloc", nblk * bs)
        ok, tmr = peer.ep("reg", tptr, nblk * bs)
        metas = []
        for k in range(nblk):
            ok, m = peer.ep("advertise", pcid, tmr, tptr + (nblk - 1 - k) * bs, bs)
            assert ok
            metas.append(m)
        sb, sptr = bufs.alloc(nblk * bs, seed=50)
        ok, smr = ep.reg(sptr, nblk * bs)
        ptrs = [sptr + k * bs for k in range(nblk)]
        assert ep.writev(cid, [smr] * nblk, ptrs, [bs] * nblk, metas, nblk), ep.last_error()
        for k in range(nblk):
            assert peer.call("digest", tb, (nblk - 1 - k) * bs, bs) == bufs.digest(sb, k * bs, bs), f"block {k}"
        rb, rptr = bufs.alloc(nblk * bs)
        ok, rmr = ep.reg(rptr, nblk * bs)
        rptrs = [rptr + k * bs for k in range(nblk)]
        assert ep.readv(cid, [rmr] * nblk, rptrs, [bs] * nblk, metas, nblk), ep.last_error()
        assert bufs.digest(rb) == bufs.digest(sb), "scattered read back"
    finally:
        peer.close()


def sub(meta, off, n):
    """The peer's descriptor `meta` narrowed to `n` bytes at `off` in it."""
    d = bytearray(meta)
    addr = int.from_bytes(d[0:8], "little")
    d[0:8] = (addr + off).to_bytes(8, "little")
    d[8:12] = n.to_bytes(4, "little")
    return bytes(d)


def test_reads_of_a_leased_advertisement_need_no_request_until_it_is_deregistered(device):
    """A granted read leases the advertisement it names: later reads of
    any range inside it copy straight from the target's memory with no
    request, so they complete with the target process stopped, and they
    see what the target's memory holds now. Deregistering the region
    revokes the lease (the reader answers), and a read after that is
    refused: the lease is gone with the record."""
    import signal

    with net_pair(device) as (ep, bufs, peer, cid, pcid):
        n = 1 << 20
        tb, tptr = peer.call("alloc", n + 2 * GUARD, 59)
        ok, tmr = peer.ep("reg", tptr, n + 2 * GUARD)
        ok, meta = peer.ep("advertise", pcid, tmr, tptr + GUARD, n)
        assert ok
        rb, rptr = bufs.alloc(n + 2 * GUARD)
        ok, rmr = ep.reg(rptr, n + 2 * GUARD)
        dst = rptr + GUARD
        # The first read is offered and granted; the grant leases `meta`.
        assert ep.read(cid, rmr, dst, n, meta), ep.last_error()
        assert bufs.digest(rb, GUARD, n) == peer.call("digest", tb, GUARD, n)
        # New bytes in the target's memory (a write it pulls itself).
        sb, sptr = bufs.alloc(n, seed=61)
        ok, smr = ep.reg(sptr, n)
        assert ep.write(cid, smr, sptr, n, meta), ep.last_error()
        peer_ops.stopped(peer.proc.pid)
        try:
            for off, m in [(0, 4096), (3 * 4096 + 5, 70_000), (n - 100, 100), (0, n)]:
                ok, x = ep.read_async(cid, rmr, dst + off, m, sub(meta, off, m))
                assert ok, ep.last_error()
                assert ep.wait(x, 20.0), f"leased read of {m} at {off}: {ep.last_error()}"
                assert bufs.digest(rb, GUARD + off, m) == bufs.digest(sb, off, m), f"{m} at {off}"
            # A range running past the advertisement is no lease's: it is
            # asked for, and waits for the stopped target.
            ok, past = ep.read_async(cid, rmr, dst, n, sub(meta, 8, n))
            assert ok
            time.sleep(0.5)
            assert ep.poll_async(past) == (True, False), "a read past the lease ended with the target stopped"
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        # The target answers it now: refused, nothing read past the guards.
        assert not ep.wait(past, 20.0)
        assert bufs.data(rb, 0, GUARD) == bytes(GUARD)
        assert bufs.data(rb, GUARD + n, GUARD) == bytes(GUARD)
        # Deregistration revokes the lease and waits for its answer; the
        # record is gone, so a read of it is asked for, and refused.
        assert peer.ep("dereg", tmr), "dereg of a leased region"
        assert not ep.read(cid, rmr, dst, 4096, sub(meta, 0, 4096))
        assert "refused" in ep.last_error() or "descriptor" in ep.last_error(), ep.last_error()
        # The connection goes on: a new record, read and leased again.
        ok, tmr = peer.ep("reg", tptr, n + 2 * GUARD)
        ok, meta = peer.ep("advertise", pcid, tmr, tptr + GUARD, n)
        assert ep.read(cid, rmr, dst, n, meta), ep.last_error()
        assert bufs.digest(rb, GUARD, n) == bufs.digest(sb)
        assert peer.ep("dereg", tmr)


def test_a_reader_that_does_not_answer_a_revoke_keeps_the_region_registered_for_a_bounded_wait(device):
    """The target's deregistration of a leased region waits for the
    reader's answer at most TCPX_P2P_DEREG_WAIT_MS, then refuses with the
    region still registered (no read may copy from memory its owner
    believes released); once the reader answers, it succeeds."""
    import signal

    ep = endpoint(dict(ON, TCPX_P2P_DEREG_WAIT_MS="300"))
    bufs = peer_ops.Buffers(device, 0)
    peer = Peer(device, PEER_GPU, ON)
    try:
        cid, pcid = connect(ep, peer)
        n = 256 << 10
        tb, tptr = bufs.alloc(n, seed=70)
        ok, tmr = ep.reg(tptr, n)
        ok, meta = ep.advertise(cid, tmr, tptr, n)
        assert ok
        rb, rptr = peer.call("alloc", n)
        ok, rmr = peer.ep("reg", rptr, n)
        # The peer's read is granted, and leases our advertisement.
        assert peer.ep("read", pcid, rmr, rptr, n, meta)
        assert peer.call("digest", rb) == bufs.digest(tb)
        peer_ops.stopped(peer.proc.pid)
        try:
            t0 = time.time()
            assert not ep.dereg(tmr), "dereg with the reader stopped"
            waited = time.time() - t0
            assert "still in use" in ep.last_error(), ep.last_error()
            assert 0.25 < waited < 10, waited
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        # The reader answers the revoke: the region goes now.
        deadline = time.time() + 20
        while not ep.dereg(tmr):
            assert time.time() < deadline, ep.last_error()
            time.sleep(0.05)
        # Its record is gone: the peer's read is refused.
        assert not peer.ep("read", pcid, rmr, rptr, 4096, sub(meta, 0, 4096))
    finally:
        peer.close()


def test_the_ipc_calls_run_on_a_connection_of_the_same_host_net(device):
    """`advertise_ipc`, `write_ipc` / `read_ipc` (and their `v` forms) and
    `send_ipc` / `recv_ipc` on a connection made by `connect` / `accept`
    with the same-host net: ordinary transfers over memory registered for
    the call, checked byte for byte; a read of an `advertise_ipc` range is
    leased after the first (it completes with the target stopped); a
    descriptor of another connection is refused; on a connection of
    another net the calls are refused with the reason."""
    with net_pair(device) as (ep, bufs, peer, cid, pcid):
        n = (1 << 20) + 5
        tb, tptr = peer.call("alloc", n + 2 * GUARD)
        ok, info = peer.ep("advertise_ipc", pcid, tptr + GUARD, n)
        assert ok, "advertise_ipc on the same-host net"
        sb, sptr = bufs.alloc(n, seed=80)
        assert ep.write_ipc(cid, sptr, n, info), ep.last_error()
        assert peer.call("digest", tb, GUARD, n) == bufs.digest(sb)
        assert peer.call("data", tb, 0, GUARD) == bytes(GUARD)
        assert peer.call("data", tb, GUARD + n, GUARD) == bytes(GUARD)
        rb, rptr = bufs.alloc(n)
        assert ep.read_ipc(cid, rptr, n, info), ep.last_error()
        assert bufs.digest(rb) == bufs.digest(sb)
        # Leased now: a read completes with the target stopped.
        rb2, rptr2 = bufs.alloc(n)
        peer_ops.stopped(peer.proc.pid)
        try:
            ok, x = ep.read_ipc_async(cid, rptr2, n, info)
            assert ok, ep.last_error()
            assert ep.wait(x, 20.0), ep.last_error()
        finally:
            import signal

            os.kill(peer.proc.pid, signal.SIGCONT)
        assert bufs.digest(rb2) == bufs.digest(sb)
        # Several ranges in one call, both ways.
        k, bs = 8, 64 << 10
        vb, vptr = peer.call("alloc", k * bs)
        ok, infos = peer.ep("advertisev_ipc", pcid, [vptr + i * bs for i in range(k)], [bs] * k)
        assert ok
        src, src_ptr = bufs.alloc(k * bs, seed=81)
        assert ep.writev_ipc(cid, [src_ptr + i * bs for i in range(k)], [bs] * k, infos), ep.last_error()
        assert peer.call("digest", vb) == bufs.digest(src)
        back, back_ptr = bufs.alloc(k * bs)
        assert ep.readv_ipc(cid, [back_ptr + i * bs for i in range(k)], [bs] * k, infos), ep.last_error()
        assert bufs.digest(back) == bufs.digest(src)
        # Two-sided.
        m = 300_001
        mb, mptr = peer.call("alloc", m)
        ok, rx = peer.ep("recv_ipc_async", pcid, mptr, m)
        assert ok
        xb, xptr = bufs.alloc(m, seed=82)
        assert ep.send_ipc(cid, xptr, m), ep.last_error()
        assert peer.ep("wait", rx)
        assert peer.call("digest", mb) == bufs.digest(xb)
        # A descriptor made for another connection of the same peers.
        cid2, pcid2 = connect(ep, peer)
        assert not ep.write_ipc(cid2, sptr, n, info)
        assert "another connection" in ep.last_error(), ep.last_error()


def test_writes_into_an_advertise_ipc_record_need_no_request(device):
    """An advertise_ipc record is leased to the peer as it is made, for
    writes too: the peer's writes inside it copy straight into the
    target's memory, so they complete with the target process stopped. A
    write past the record is asked for, and refused once the target runs.
    A registry advertisement leased by a read is never written through
    its lease: a write to it waits for the target."""
    import signal

    with net_pair(device) as (ep, bufs, peer, cid, pcid):
        n = 1 << 20
        tb, tptr = peer.call("alloc", n + 2 * GUARD)
        ok, info = peer.ep("advertise_ipc", pcid, tptr + GUARD, n)
        assert ok, "advertise_ipc on the same-host net"
        # A registry advertisement, read once: leased for reads only.
        gb, gptr = peer.call("alloc", n, 93)
        ok, gmr = peer.ep("reg", gptr, n)
        ok, meta = peer.ep("advertise", pcid, gmr, gptr, n)
        rb, rptr = bufs.alloc(n)
        ok, rmr = ep.reg(rptr, n)
        assert ep.read(cid, rmr, rptr, n, meta), ep.last_error()
        # The first write: the lease came ahead of it on the control
        # connection, or (asked for) its answer comes after the lease.
        first, fptr = bufs.alloc(n, seed=90)
        assert ep.write_ipc(cid, fptr, n, info), ep.last_error()
        assert peer.call("digest", tb, GUARD, n) == bufs.digest(first)
        sb, sptr = bufs.alloc(n, seed=91)
        ok, smr = ep.reg(sptr, n)
        peer_ops.stopped(peer.proc.pid)
        try:
            for off, m in [(0, 4096), (3 * 4096 + 5, 70_001), (n - 100, 100), (0, n)]:
                ok, x = ep.write_ipc_async(cid, sptr + off, m, sub(info, off, m))
                assert ok, ep.last_error()
                assert ep.wait(x, 20.0), f"leased write of {m} at {off}: {ep.last_error()}"
            # Past the record: no lease's, asked for, waiting.
            ok, past = ep.write_ipc_async(cid, sptr, n, sub(info, 8, n))
            assert ok
            # Into the registry advertisement: its lease is for reads.
            ok, w = ep.write_async(cid, smr, sptr, 4096, meta)
            assert ok
            time.sleep(0.5)
            assert ep.poll_async(past) == (True, False), "a write past the record ended with the target stopped"
            assert ep.poll_async(w) == (True, False), "a write through a read lease ended with the target stopped"
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        assert not ep.wait(past, 20.0)
        assert ep.wait(w, 20.0), ep.last_error()
        assert peer.call("digest", tb, GUARD, n) == bufs.digest(sb)
        assert peer.call("data", tb, 0, GUARD) == bytes(GUARD)
        assert peer.call("data", tb, GUARD + n, GUARD) == bytes(GUARD)
        assert peer.call("digest", gb, 0, 4096) == bufs.digest(sb, 0, 4096)


def test_the_ipc_calls_are_refused_on_a_connection_of_another_net():
    ep = endpoint({"TCPX_P2P_SAME_HOST_NET": "0"})
    peer = Peer("cpu", None, {"TCPX_P2P_SAME_HOST_NET": "0"})
    try:
        cid, _pcid = connect(ep, peer)
        assert ep.conn_net(cid) != "same-host"
        buf = bytearray(4096)
        import ctypes

        ptr = ctypes.addressof((ctypes.c_char * 4096).from_buffer(buf))
        ok, _info = ep.advertise_ipc(cid, ptr, 4096)
        assert not ok
        assert "not a same-host connection" in ep.last_error(), ep.last_error()
    finally:
        peer.close()
