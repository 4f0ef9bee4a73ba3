"""The same-host net between two processes: endpoints made with
TCPX_P2P_SAME_HOST_NET=1 and connected with `connect` / `accept` carry their
data over it (cross-memory attach for host memory, CUDA IPC for GPU memory)
through the ordinary engine. Every byte checked; host memory everywhere, GPU
memory where CUDA and torch are present (the peer on GPU 1 where there are
two)."""

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
    ep = endpoint(ON)
    bufs = peer_ops.Buffers(device, 0)
    peer = Peer(device, PEER_GPU, ON)
    try:
        cid, pcid = connect(ep, peer)
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
    finally:
        peer.close()


def test_a_peer_that_dies_fails_what_waits(device):
    ep = endpoint(ON)
    bufs = peer_ops.Buffers(device, 0)
    peer = Peer(device, PEER_GPU, ON)
    try:
        cid, _pcid = connect(ep, peer)
        n = 1 << 20
        rb, rptr = bufs.alloc(n)
        ok, rmr = ep.reg(rptr, n)
        ok, rx = ep.recv_async(cid, rmr, rptr, n)
        assert ok
        peer.kill()
        t0 = time.time()
        assert not ep.wait(rx, 30.0)
        assert time.time() - t0 < 30
    finally:
        peer.close()


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
