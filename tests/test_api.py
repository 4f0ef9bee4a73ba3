"""End-to-end tests of the UCCL-compatible API: two (or more) processes,
real sockets on loopback, bytes checked by SHA-256."""

import hashlib
import os
import socket
import time

import pytest
from conftest import connect
from peer_ops import pattern

from tcpx_p2p import cuda_device_count, p2p

SIZES = [1, 4096, 1 << 20, 256 << 20]


def digest(b):
    return hashlib.sha256(b).hexdigest()


# ------------------------------------------------------------------ module


def test_module_surface():
    for name in ["Endpoint", "XferDesc", "FloatType", "get_oob_ip"]:
        assert hasattr(p2p, name)
    assert p2p.get_oob_ip() == "127.0.0.1"  # TCPX_P2P_IFNAME=lo in conftest
    assert p2p.FloatType.kBFloat16 != p2p.FloatType.kFloat16
    d = p2p.XferDesc(1, 2, 3)
    assert (d.addr, d.size, d.mr_id, d.lkeys, d.rkeys) == (1, 2, 3, [], [])


def test_metadata_forms():
    ep = p2p.Endpoint(0)
    md = ep.get_metadata()
    ip, port, gpu = p2p.Endpoint.parse_metadata(md)
    assert ip == "127.0.0.1" and port > 0 and isinstance(gpu, str)
    assert md[:4] == bytes([127, 0, 0, 1]) and int.from_bytes(md[4:6], "big") == port
    # The older form ends with an i32 GPU index (10 bytes for IPv4, 22 for IPv6).
    old = bytes([10, 0, 0, 7]) + (4242).to_bytes(2, "big") + (3).to_bytes(4, "little")
    assert p2p.Endpoint.parse_metadata(old) == ("10.0.0.7", 4242, 3)
    old6 = bytes(15) + b"\x01" + (80).to_bytes(2, "big") + (1).to_bytes(4, "little")
    assert p2p.Endpoint.parse_metadata(old6) == ("::1", 80, 1)
    for bad in [b"", b"\x01\x02", md + b"x", md[:-1]]:
        with pytest.raises(p2p.InvalidArgumentError):
            p2p.Endpoint.parse_metadata(bad)


# --------------------------------------------------------------- two-sided


def test_send_recv_sizes(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    for i, n in enumerate(SIZES):
        sb, sptr = bufs.alloc(n, seed=i)
        ok, smr = ep.reg(sptr, n)
        assert ok
        rb, rptr = peer.call("alloc", n)
        ok, rmr = peer.ep("reg", rptr, n)
        assert ok
        ok, rx = peer.ep("recv_async", pcid, rmr, rptr, n)
        assert ok
        assert ep.send(cid, smr, sptr, n), ep.last_error()
        assert peer.ep("wait", rx), "receive failed"
        assert peer.call("digest", rb) == digest(pattern(n, i)), f"size {n}"
        assert ep.dereg(smr) and peer.ep("dereg", rmr)
        bufs.free(sb)
        peer.call("free", rb)


def test_recv_blocking_and_send_async(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    n = 1 << 20
    sb, sptr = peer.call("alloc", n, 5)
    ok, smr = peer.ep("reg", sptr, n)
    rb, rptr = bufs.alloc(n)
    ok, rmr = ep.reg(rptr, n)
    ok, tx = peer.ep("send_async", pcid, smr, sptr, n)
    assert ok
    assert ep.recv(cid, rmr, rptr, n), ep.last_error()
    assert bufs.digest(rb) == digest(pattern(n, 5))
    deadline = time.time() + 30
    while True:
        ok, done = peer.ep("poll_async", tx)
        assert ok
        if done:
            break
        assert time.time() < deadline
        time.sleep(0.01)
    # Once reported done, the id is forgotten.
    assert peer.ep("poll_async", tx) == (False, False)


def test_kv_blocks_sendv_recvv(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    nblk, bs = 64, 32 << 10
    sb, sptr = bufs.alloc(nblk * bs, seed=11)
    ok, smr = ep.reg(sptr, nblk * bs)
    rb, rptr = peer.call("alloc", nblk * bs)
    ok, rmr = peer.ep("reg", rptr, nblk * bs)
    # Blocks scattered: the receiver puts block i at slot (i*7) % nblk.
    sptrs = [sptr + i * bs for i in range(nblk)]
    rptrs = [rptr + ((i * 7) % nblk) * bs for i in range(nblk)]
    ok, rx = peer.ep("recvv_async", pcid, [rmr] * nblk, rptrs, [bs] * nblk, nblk)
    assert ok
    assert ep.sendv(cid, [smr] * nblk, sptrs, [bs] * nblk, nblk), ep.last_error()
    assert peer.ep("wait", rx)
    src = pattern(nblk * bs, 11)
    got = peer.call("data", rb)
    for i in range(nblk):
        j = (i * 7) % nblk
        assert got[j * bs : (j + 1) * bs] == src[i * bs : (i + 1) * bs], f"block {i}"
    # The async vector forms too.
    ok, tx = ep.sendv_async(cid, [smr] * 2, sptrs[:2], [bs] * 2, 2)
    assert ok
    assert peer.ep("recvv", pcid, [rmr] * 2, rptrs[:2], [bs] * 2, 2)
    assert ep.wait(tx)


def test_small_messages_received_one_at_a_time(local, peers):
    """Many small messages sent before any receive is posted, received one
    by one (each receive posted only after the previous one completed),
    large ones in between: small GPU parts share staged copies and complete
    late, which must never hold back the receive that would let the next
    one be posted."""
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    sizes = [32 << 10] * 24 + [1 << 20] + [4096] * 12 + [300 << 10] + [100] + [32 << 10] * 8
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    sb, sptr = peer.call("alloc", total, 31)
    ok, smr = peer.ep("reg", sptr, total)
    rb, rptr = bufs.alloc(total)
    ok, rmr = ep.reg(rptr, total)
    txs = []
    for off, n in zip(offs, sizes):
        ok, tx = peer.ep("send_async", pcid, smr, sptr + off, n)
        assert ok
        txs.append(tx)
    for off, n in zip(offs, sizes):
        assert ep.recv(cid, rmr, rptr + off, n), ep.last_error()
    for tx in txs:
        assert peer.ep("wait", tx)
    src = pattern(total, 31)
    got = bufs.data(rb)
    for i, (off, n) in enumerate(zip(offs, sizes)):
        assert got[off : off + n] == src[off : off + n], f"message {i} ({n} bytes)"


def test_large_messages_back_to_back(local, peers):
    """Large messages sent back to back, small ones between them, all posted
    at once: each stream stages the next part's windows while writing this
    one's, and the receiver reads the next window while earlier ones are
    still being copied -- across part and message boundaries, with parts of
    several windows on both sides (the receiver's slices are smaller than
    its parts and fewer than a part's windows, so slots are reused within a
    part)."""
    ep, bufs = local
    peer = peers({"TCPX_P2P_STREAMS": "2", "TCPX_P2P_STAGING_SLICE": "256K", "TCPX_P2P_STAGING_DEPTH": "2"})
    cid, pcid = connect(ep, peer)
    sizes = [(5 << 20) + 4097, 4096, 9 << 20, (3 << 20) + 1, 100, (12 << 20) + 12345, 700_001, 17 << 20]
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    rb, rptr = peer.call("alloc", total)
    ok, rmr = peer.ep("reg", rptr, total)
    rxs = []
    for off, n in zip(offs, sizes):
        ok, rx = peer.ep("recv_async", pcid, rmr, rptr + off, n)
        assert ok
        rxs.append(rx)
    sb, sptr = bufs.alloc(total, seed=37)
    ok, smr = ep.reg(sptr, total)
    txs = []
    for off, n in zip(offs, sizes):
        ok, tx = ep.send_async(cid, smr, sptr + off, n)
        assert ok, ep.last_error()
        txs.append(tx)
    for tx in txs:
        assert ep.wait(tx), ep.last_error()
    for i, rx in enumerate(rxs):
        assert peer.ep("wait", rx), f"receive {i} failed"
    src = pattern(total, 37)
    for i, (off, n) in enumerate(zip(offs, sizes)):
        assert peer.call("digest", rb, off, n) == digest(src[off : off + n]), f"message {i} ({n} bytes)"


# --------------------------------------------------------------- one-sided


def test_write_read_advertised(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    n = 1 << 20
    tb, tptr = peer.call("alloc", n + 8192)
    ok, tmr = peer.ep("reg", tptr, n + 8192)
    ok, meta = peer.ep("advertise", pcid, tmr, tptr + 4096, n)
    assert ok and len(meta) == 64
    sb, sptr = bufs.alloc(n, seed=3)
    ok, smr = ep.reg(sptr, n)
    # write completes only once the bytes are in the target's region
    assert ep.write(cid, smr, sptr, n, meta), ep.last_error()
    assert peer.call("digest", tb, 4096, n) == digest(pattern(n, 3))
    assert peer.call("data", tb, 0, 4096) == bytes(4096), "nothing outside the advertised range"
    assert peer.call("data", tb, 4096 + n, 4096) == bytes(4096)
    rb, rptr = bufs.alloc(n)
    ok, rmr = ep.reg(rptr, n)
    assert ep.read(cid, rmr, rptr, n, meta), ep.last_error()
    assert bufs.digest(rb) == digest(pattern(n, 3))
    # async forms, many transfers through the same advertisement
    ids = []
    for _ in range(4):
        ok, x = ep.write_async(cid, smr, sptr, n, meta)
        assert ok
        ids.append(x)
        ok, x = ep.read_async(cid, rmr, rptr, n, meta)
        assert ok
        ids.append(x)
    for x in ids:
        assert ep.wait(x), ep.last_error()
    # a part of the advertised range is fine
    assert ep.write(cid, smr, sptr, 1000, meta)


def test_cancel_ends_a_write_whole_or_not_at_all(local, peers):
    """cancel() right after posting: a write the peer has not cleared yet is
    called back (nothing lands), one already moving runs to its end
    (everything lands); the id is forgotten and the connection goes on."""
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    n = 1 << 20
    sb, sptr = bufs.alloc(n, seed=6)
    ok, smr = ep.reg(sptr, n)
    outcomes = set()
    for i in range(6):
        tb, tptr = peer.call("alloc", n)
        ok, tmr = peer.ep("reg", tptr, n)
        ok, meta = peer.ep("advertise", pcid, tmr, tptr, n)
        ok, x = ep.write_async(cid, smr, sptr, n, meta)
        assert ok, ep.last_error()
        assert ep.cancel(x, 30.0), ep.last_error()
        assert ep.poll_async(x) == (False, False), "the id is forgotten once ended"
        # The peer's side ends too: its region can be deregistered.
        deadline = time.monotonic() + 30
        while not peer.ep("dereg", tmr):
            assert time.monotonic() < deadline, "the target still holds the region"
            time.sleep(0.01)
        got = peer.call("digest", tb)
        assert got in (digest(pattern(n, 6)), digest(bytes(n))), "a part of a write landed"
        outcomes.add(got == digest(pattern(n, 6)))
    # Still in step.
    tb, tptr = peer.call("alloc", n)
    ok, tmr = peer.ep("reg", tptr, n)
    ok, meta = peer.ep("advertise", pcid, tmr, tptr, n)
    assert ep.write(cid, smr, sptr, n, meta), ep.last_error()
    assert peer.call("digest", tb) == digest(pattern(n, 6))
    assert not ep.cancel(10**9), "an unknown id"
    assert "unknown transfer" in ep.last_error()


# One-sided transfers up to TCPX_P2P_INLINE_MAX (default 64 KiB) carry their
# data on the control connection; larger ones go through the net.
INLINE_MAX = 64 << 10


@pytest.mark.parametrize("n", [INLINE_MAX - 1, INLINE_MAX, INLINE_MAX + 1])
def test_write_read_at_the_inline_threshold(local, peers, n):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    guard = 4096
    tb, tptr = peer.call("alloc", n + 2 * guard)
    ok, tmr = peer.ep("reg", tptr, n + 2 * guard)
    ok, meta = peer.ep("advertise", pcid, tmr, tptr + guard, n)
    assert ok
    sb, sptr = bufs.alloc(n, seed=n % 251)
    ok, smr = ep.reg(sptr, n)
    assert ep.write(cid, smr, sptr, n, meta), ep.last_error()
    assert peer.call("digest", tb, guard, n) == digest(pattern(n, n % 251))
    assert peer.call("data", tb, 0, guard) == bytes(guard)
    assert peer.call("data", tb, guard + n, guard) == bytes(guard)
    rb, rptr = bufs.alloc(n + guard)
    ok, rmr = ep.reg(rptr, n + guard)
    assert ep.read(cid, rmr, rptr, n, meta), ep.last_error()
    assert bufs.digest(rb, 0, n) == digest(pattern(n, n % 251))
    assert bufs.data(rb, n, guard) == bytes(guard), "a read lands only its own bytes"
    # Two items whose sum straddles the threshold: one scattered message.
    half = n // 2
    rest = n - half
    ok, metas = peer.ep("advertisev", pcid, [tmr] * 2, [tptr + guard + half, tptr + guard], [rest, half], 2)
    assert ok
    sb2, sptr2 = bufs.alloc(n, seed=7)
    ok, smr2 = ep.reg(sptr2, n)
    assert ep.writev(cid, [smr2] * 2, [sptr2, sptr2 + rest], [rest, half], metas, 2), ep.last_error()
    src = pattern(n, 7)
    got = peer.call("data", tb, guard, n)
    assert got[half:] == src[:rest] and got[:half] == src[rest:]
    ok, x = ep.readv_async(cid, [rmr] * 2, [rptr, rptr + rest], [rest, half], metas, 2)
    assert ok and ep.wait(x), ep.last_error()
    assert bufs.digest(rb, 0, n) == digest(src)


def test_kv_blocks_writev_readv(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    nblk, bs = 64, 32 << 10
    tb, tptr = peer.call("alloc", nblk * bs)
    ok, tmr = peer.ep("reg", tptr, nblk * bs)
    tptrs = [tptr + i * bs for i in range(nblk)]
    ok, metas = peer.ep("advertisev", pcid, [tmr] * nblk, tptrs, [bs] * nblk, nblk)
    assert ok and len(metas) == nblk
    sb, sptr = bufs.alloc(nblk * bs, seed=21)
    ok, smr = ep.reg(sptr, nblk * bs)
    sptrs = [sptr + i * bs for i in range(nblk)]
    # write block i into remote slot nblk-1-i
    assert ep.writev(cid, [smr] * nblk, sptrs, [bs] * nblk, metas[::-1], nblk), ep.last_error()
    src = pattern(nblk * bs, 21)
    got = peer.call("data", tb)
    for i in range(nblk):
        j = nblk - 1 - i
        assert got[j * bs : (j + 1) * bs] == src[i * bs : (i + 1) * bs]
    rb, rptr = bufs.alloc(nblk * bs)
    ok, rmr = ep.reg(rptr, nblk * bs)
    rptrs = [rptr + i * bs for i in range(nblk)]
    ok, x = ep.readv_async(cid, [rmr] * nblk, rptrs, [bs] * nblk, metas[::-1], nblk)
    assert ok
    assert ep.wait(x), ep.last_error()
    assert bufs.data(rb) == src
    ok, x = ep.writev_async(cid, [smr] * 2, sptrs[:2], [bs] * 2, metas[:2], 2)
    assert ok and ep.wait(x)
    assert ep.readv(cid, [rmr] * 2, rptrs[:2], [bs] * 2, metas[:2], 2)


def test_writev_readv_of_more_blocks_than_one_request_carries(local, peers):
    """vLLM-sized lists through UCCL's writev / readv: more blocks than one
    request may carry (65,536) go in parts under one call, the connection
    lives, and every block lands in its slot."""
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    nblk, bs = 70_001, 16
    tb, tptr = peer.call("alloc", nblk * bs)
    ok, tmr = peer.ep("reg", tptr, nblk * bs)
    slot = [(i * 7919) % nblk for i in range(nblk)]
    tptrs = [tptr + j * bs for j in slot]
    ok, metas = peer.ep("advertisev", pcid, [tmr] * nblk, tptrs, [bs] * nblk, nblk)
    assert ok and len(metas) == nblk
    sb, sptr = bufs.alloc(nblk * bs, seed=23)
    ok, smr = ep.reg(sptr, nblk * bs)
    sptrs = [sptr + i * bs for i in range(nblk)]
    assert ep.writev(cid, [smr] * nblk, sptrs, [bs] * nblk, metas, nblk), ep.last_error()
    src = pattern(nblk * bs, 23)
    got = peer.call("data", tb)
    placed = bytearray(nblk * bs)
    for i, j in enumerate(slot):
        placed[j * bs : (j + 1) * bs] = src[i * bs : (i + 1) * bs]
    assert digest(got) == digest(bytes(placed))
    rb, rptr = bufs.alloc(nblk * bs)
    ok, rmr = ep.reg(rptr, nblk * bs)
    rptrs = [rptr + i * bs for i in range(nblk)]
    assert ep.readv(cid, [rmr] * nblk, rptrs, [bs] * nblk, metas, nblk), ep.last_error()
    assert digest(bufs.data(rb)) == digest(src)
    # The connection still serves small calls.
    assert ep.writev(cid, [smr], sptrs[:1], [bs], metas[:1], 1), ep.last_error()


def test_kv_blocks_in_runs(local, peers):
    """writev/readv join blocks that are back to back on both sides into one
    message (a run): runs of every length, runs longer than a chunk, breaks
    on either side, and two adjacent target regions (never joined), each
    block checked byte for byte."""
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    nblk, bs = 1400, 8 << 10
    # Target: two regions back to back in one allocation.
    half = nblk // 2 * bs
    tb, tptr = peer.call("alloc", nblk * bs)
    ok, tmr0 = peer.ep("reg", tptr, half)
    ok, tmr1 = peer.ep("reg", tptr + half, nblk * bs - half)
    tptrs = [tptr + i * bs for i in range(nblk)]
    tmrs = [tmr0 if p < tptr + half else tmr1 for p in tptrs]
    ok, metas = peer.ep("advertisev", pcid, tmrs, tptrs, [bs] * nblk, nblk)
    assert ok and len(metas) == nblk, peer.ep("last_error")
    # Source block i goes to target slot dest[i]: long in-order stretches
    # (one over 8 MiB, one over the target's region boundary), reversed
    # stretches, and one local gap.
    dest = list(range(0, 1100)) + list(range(1399, 1099, -1))
    sb, sptr = bufs.alloc((nblk + 1) * bs, seed=23)
    ok, smr = ep.reg(sptr, (nblk + 1) * bs)
    slots = list(range(500)) + list(range(501, nblk + 1))  # skips slot 500
    sptrs = [sptr + k * bs for k in slots]
    assert ep.writev(cid, [smr] * nblk, sptrs, [bs] * nblk, [metas[d] for d in dest], nblk), ep.last_error()
    src = pattern((nblk + 1) * bs, 23)
    got = peer.call("data", tb)
    for i, d in enumerate(dest):
        k = slots[i]
        assert got[d * bs : (d + 1) * bs] == src[k * bs : (k + 1) * bs], f"block {i}"
    # Read them back, into the same layout of a cleared buffer.
    rb, rptr = bufs.alloc((nblk + 1) * bs)
    ok, rmr = ep.reg(rptr, (nblk + 1) * bs)
    rptrs = [rptr + k * bs for k in slots]
    assert ep.readv(cid, [rmr] * nblk, rptrs, [bs] * nblk, [metas[d] for d in dest], nblk), ep.last_error()
    back = bufs.data(rb)
    for k in slots:
        assert back[k * bs : (k + 1) * bs] == src[k * bs : (k + 1) * bs], f"slot {k}"
    assert back[500 * bs : 501 * bs] == bytes(bs)


# Block sizes on either side of the gathering limits (items up to 256 KiB
# share a request of up to a chunk, 8 MiB on the socket net; larger ones are
# chunked).
MIXED = [1, 4097, 32 << 10, 100_000, 256 << 10, (256 << 10) + 1, 3, 5000] * 6 + [9 << 20] + [
    32 << 10
] * 200


def mixed_layout(sizes, gap, reverse):
    """Offsets of blocks laid out with `gap` bytes between them, in order or
    in reverse order (no two blocks adjacent, so no runs form)."""
    order = list(reversed(range(len(sizes)))) if reverse else list(range(len(sizes)))
    offs, at = [0] * len(sizes), 0
    for i in order:
        offs[i] = at
        at += sizes[i] + gap
    return offs, at


def test_kv_blocks_of_mixed_sizes(local, peers):
    """sendv/recvv, writev and readv of blocks of many sizes, small ones
    gathered into shared requests and large ones chunked, each block
    scattered and checked byte for byte."""
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    n = len(MIXED)
    soffs, stotal = mixed_layout(MIXED, 64, reverse=False)
    roffs, rtotal = mixed_layout(MIXED, 128, reverse=True)
    sb, sptr = bufs.alloc(stotal, seed=31)
    ok, smr = ep.reg(sptr, stotal)
    src = pattern(stotal, 31)
    sptrs = [sptr + o for o in soffs]

    def check(got, offs, what):
        for i, sz in enumerate(MIXED):
            assert got[offs[i] : offs[i] + sz] == src[soffs[i] : soffs[i] + sz], f"{what}: block {i} ({sz} bytes)"

    rb, rptr = peer.call("alloc", rtotal)
    ok, rmr = peer.ep("reg", rptr, rtotal)
    rptrs = [rptr + o for o in roffs]
    ok, rx = peer.ep("recvv_async", pcid, [rmr] * n, rptrs, MIXED, n)
    assert ok
    assert ep.sendv(cid, [smr] * n, sptrs, MIXED, n), ep.last_error()
    assert peer.ep("wait", rx), peer.ep("last_error")
    check(peer.call("data", rb), roffs, "sendv")

    tb, tptr = peer.call("alloc", rtotal)
    ok, tmr = peer.ep("reg", tptr, rtotal)
    ok, metas = peer.ep("advertisev", pcid, [tmr] * n, [tptr + o for o in roffs], MIXED, n)
    assert ok, peer.ep("last_error")
    assert ep.writev(cid, [smr] * n, sptrs, MIXED, metas, n), ep.last_error()
    check(peer.call("data", tb), roffs, "writev")

    bb, bptr = bufs.alloc(stotal)
    ok, bmr = ep.reg(bptr, stotal)
    assert ep.readv(cid, [bmr] * n, [bptr + o for o in soffs], MIXED, metas, n), ep.last_error()
    check(bufs.data(bb), soffs, "readv")


@pytest.mark.skipif(
    os.environ.get("TCPX_P2P_NET", "socket") != "socket",
    reason="the socket net gathers blocks; plugins take one block per request",
)
def test_sendv_recvv_block_sizes_must_match(local, peers):
    """Blocks gathered into one message must be scattered into blocks of the
    same sizes: a receive of other sizes fails and says why, rather than
    placing bytes across block boundaries."""
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    bs = 32 << 10
    sb, sptr = bufs.alloc(4 * bs, seed=5)
    ok, smr = ep.reg(sptr, 4 * bs)
    rb, rptr = peer.call("alloc", 4 * bs)
    ok, rmr = peer.ep("reg", rptr, 4 * bs)
    ok, rx = peer.ep("recvv_async", pcid, [rmr] * 2, [rptr, rptr + 2 * bs], [2 * bs] * 2, 2)
    assert ok
    ep.sendv(cid, [smr] * 4, [sptr + i * bs for i in range(4)], [bs] * 4, 4)
    assert not peer.ep("wait", rx)
    assert "block sizes must match" in peer.ep("last_error")


class FakeTensor:
    """Anything with data_ptr/numel/element_size registers like a tensor."""

    def __init__(self, ptr, numel, esize):
        self.ptr, self.n, self.es = ptr, numel, esize

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.n

    def element_size(self):
        return self.es


def test_register_memory_and_transfer(local, peers, device):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    n = 256 << 10
    if device == "cuda":
        import torch

        t = torch.zeros(n // 4, dtype=torch.float32, device="cuda:0")
        torch.cuda.synchronize()  # the zeroing must not run after the read lands
        tensors = [t]
        lb = None
    else:
        lb, lptr = bufs.alloc(n, seed=9)
        tensors = [FakeTensor(lptr, n // 4, 4)]
    descs = ep.register_memory(tensors)
    assert len(descs) == 1 and descs[0].size == n
    # The peer registers its buffer and hands us its serialized descriptors.
    pb, pptr = peer.call("alloc", n, 13)
    ok, pmr = peer.ep("reg", pptr, n)
    # (the peer exports through register_memory in real use; here the same
    # through the wire format it produces)
    blob = ep.get_serialized_descs(descs)
    back = p2p.Endpoint.deserialize_descs(blob)
    assert [(d.addr, d.size, d.mr_id, d.rkeys) for d in back] == [
        (d.addr, d.size, d.mr_id, d.rkeys) for d in descs
    ]
    # Now the other way: we read and write the peer's exported region.
    remote = peer_export(peer, pptr, n)
    ok, x = ep.transfer(cid, "read", descs, remote)
    assert ok, ep.last_error()
    assert ep.wait(x), ep.last_error()
    if lb is not None:
        assert bufs.digest(lb) == digest(pattern(n, 13))
    ok, x = ep.transfer(cid, "write", descs, remote)
    assert ok and ep.wait(x)
    assert peer.call("digest", pb) == digest(pattern(n, 13))
    # Misuse raises, as in UCCL (a RuntimeError).
    with pytest.raises(RuntimeError, match="op_name"):
        ep.transfer(cid, "fetch", descs, remote)
    ep.deregister_memory(descs)


def peer_export(peer, ptr, n):
    """The peer registers `ptr` as a tensor and serializes its descriptors."""
    peer.pipe.send(("ep", ("register_memory", ([FakeTensor(ptr, n, 1)],))))
    descs = peer._reply()
    peer.pipe.send(("ep", ("get_serialized_descs", (descs,))))
    return p2p.Endpoint.deserialize_descs(peer._reply())


# ------------------------------------------------------------ concurrency


def test_many_async_one_connection(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    k, n = 32, 300_000
    rb, rptr = peer.call("alloc", k * n)
    ok, rmr = peer.ep("reg", rptr, k * n)
    rx = []
    for i in range(k):
        ok, x = peer.ep("recv_async", pcid, rmr, rptr + i * n, n)
        assert ok
        rx.append(x)
    sb, sptr = bufs.alloc(k * n, seed=4)
    ok, smr = ep.reg(sptr, k * n)
    tx = []
    for i in range(k):
        ok, x = ep.send_async(cid, smr, sptr + i * n, n)
        assert ok
        tx.append(x)
    for x in tx:
        assert ep.wait(x)
    for x in rx:
        assert peer.ep("wait", x)
    assert peer.call("digest", rb) == digest(pattern(k * n, 4))


def test_many_connections(local, peers):
    ep, bufs = local
    ps = [peers() for _ in range(3)]
    n = 2 << 20
    conns = [connect(ep, p) for p in ps]
    work = []
    for i, (p, (cid, pcid)) in enumerate(zip(ps, conns)):
        rb, rptr = p.call("alloc", n)
        ok, rmr = p.ep("reg", rptr, n)
        ok, rx = p.ep("recv_async", pcid, rmr, rptr, n)
        sb, sptr = bufs.alloc(n, seed=100 + i)
        ok, smr = ep.reg(sptr, n)
        ok, tx = ep.send_async(cid, smr, sptr, n)
        assert ok
        work.append((p, rb, rx, tx, i))
    for p, rb, rx, tx, i in work:
        assert ep.wait(tx)
        assert p.ep("wait", rx)
        assert p.call("digest", rb) == digest(pattern(n, 100 + i))
    assert ep.conn_id_of_rank(0) == conns[0][0]
    assert ep.conn_id_of_rank(99) == -1


def test_add_remove_remote_endpoint(local, peers):
    ep, bufs = local
    peer = peers()
    ok, c1 = ep.add_remote_endpoint(peer.metadata)
    assert ok, ep.last_error()
    ok, c2 = ep.add_remote_endpoint(peer.metadata)
    assert ok and c1 == c2, "cached per peer"
    assert ep.remove_remote_endpoint(c1)
    assert not ep.remove_remote_endpoint(c1)
    ok, c3 = ep.add_remote_endpoint(peer.metadata)
    assert ok and c3 != c1
    # connect by PCI bus id string works as well as by index
    ip, port, gpu = ep.parse_metadata(peer.metadata)
    ok, c4 = ep.connect(ip, gpu, port)
    assert ok


# -------------------------------------------------------------- bad input


def test_bad_input_is_refused_clearly(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    b, ptr = bufs.alloc(4096, seed=1)
    ok, mr = ep.reg(ptr, 4096)
    assert ok

    def refused(ret, words):
        ok = ret if isinstance(ret, bool) else ret[0]
        assert not ok
        err = ep.last_error().lower()
        assert any(w in err for w in words), err

    refused(ep.send(999, mr, ptr, 10), ["unknown connection"])
    refused(ep.send_async(cid, 12345, ptr, 10), ["unknown memory region"])
    refused(ep.send(cid, mr, 0, 10), ["null pointer"])
    refused(ep.send(cid, mr, ptr + 4000, 200), ["outside"])
    refused(ep.recv_async(cid, mr, ptr - 10, 20), ["outside"])
    refused(ep.reg(0, 100), ["null"])
    refused(ep.reg(ptr, 0), ["size is 0"])
    refused(ep.dereg(987654), ["unknown memory region"])
    refused(ep.advertise(cid, 777, ptr, 10), ["unknown memory region"])
    refused(ep.advertise(cid, mr, ptr, 5000), ["outside"])
    with pytest.raises(p2p.InvalidArgumentError, match="64 bytes"):
        ep.write(cid, mr, ptr, 10, b"short")
    with pytest.raises(p2p.InvalidArgumentError, match="num_iovs"):
        ep.sendv(cid, [mr], [ptr], [10], 2)
    refused(ep.add_remote_endpoint(b"garbage!"), ["metadata"])
    refused(ep.poll_async(424242), ["unknown transfer"])
    refused(ep.regv([ptr, 0], [10, 10]), ["null"])
    # nobody listens on this port
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t = time.time()
    refused(ep.connect("127.0.0.1", 0, port), ["refused", "nobody listens"])
    assert time.time() - t < 5
    refused(ep.connect("not-an-ip", 0, 1234), ["not an ip"])
    # the connection still works after all that
    rb, rptr = peer.call("alloc", 4096)
    ok, rmr = peer.ep("reg", rptr, 4096)
    ok, rx = peer.ep("recv_async", pcid, rmr, rptr, 4096)
    assert ep.send(cid, mr, ptr, 4096)
    assert peer.ep("wait", rx)
    assert peer.call("digest", rb) == digest(pattern(4096, 1))


@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a GPU")
def test_gpu_registration_stays_inside_its_allocation():
    """GPU memory registers up to the end of its CUDA allocation (the
    caching allocator's segment) and not one byte past it, and a
    registration's kind is the GPU's (a host pointer stays host memory)."""
    import torch

    ep = p2p.Endpoint(0)
    t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
    seg = next(
        s
        for s in torch.cuda.memory_snapshot()
        if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]
    )
    base, size = seg["address"], seg["total_size"]
    ok, mr = ep.reg(base, size)
    assert ok, ep.last_error()
    ok, inner = ep.reg(t.data_ptr() + 4096, 8192)
    assert ok, ep.last_error()
    ok, _ = ep.reg(base + size - 4096, 8192)
    assert not ok
    assert "past the end of their gpu allocation" in ep.last_error().lower()
    assert ep.dereg(mr) and ep.dereg(inner)


def test_io_threads_pinned_where_asked(local, peers):
    """TCPX_P2P_CPU_AFFINITY pins the engine's own threads (not the
    application's) and the bytes still arrive; a bad value is refused."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    ep, bufs = local
    peer = peers({"TCPX_P2P_CPU_AFFINITY": str(cpus[-1])})
    cid, pcid = connect(ep, peer)
    n = 8 << 20
    b, ptr = bufs.alloc(n, seed=3)
    ok, mr = ep.reg(ptr, n)
    rb, rptr = peer.call("alloc", n)
    ok, rmr = peer.ep("reg", rptr, n)
    ok, rx = peer.ep("recv_async", pcid, rmr, rptr, n)
    assert ep.send(cid, mr, ptr, n), ep.last_error()
    assert peer.ep("wait", rx)
    assert peer.call("digest", rb) == digest(pattern(n, 3))
    threads = dict(peer.call("threads"))
    # The endpoint's I/O workers (streams, progress, control) and their poller.
    engine = {k: v for k, v in threads.items() if k.startswith("tcpx-io")}
    assert "tcpx-io" in engine and "tcpx-io-poll" in engine, threads
    assert all(v == [cpus[-1]] for v in engine.values()), engine
    assert threads["main"] == cpus  # the application's own thread: untouched
    os.environ["TCPX_P2P_CPU_AFFINITY"] = "sometimes"
    try:
        with pytest.raises(p2p.ConfigError, match="TCPX_P2P_CPU_AFFINITY"):
            p2p.Endpoint(0)
    finally:
        del os.environ["TCPX_P2P_CPU_AFFINITY"]


def test_forged_and_stale_descriptors(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    n = 64 << 10
    tb, tptr = peer.call("alloc", 3 * n)
    ok, tmr = peer.ep("reg", tptr, 3 * n)
    ok, meta = peer.ep("advertise", pcid, tmr, tptr + n, n)
    sb, sptr = bufs.alloc(3 * n, seed=8)
    ok, smr = ep.reg(sptr, 3 * n)

    def forge(addr=None, size=None, secret_flip=False):
        m = bytearray(meta)
        if addr is not None:
            m[0:8] = addr.to_bytes(8, "little")
        if size is not None:
            m[8:12] = size.to_bytes(4, "little")
        if secret_flip:
            m[48] ^= 0xFF
        return bytes(m)

    # a larger size claimed: refused by the target, nothing written
    assert not ep.write(cid, smr, sptr, 2 * n, forge(size=2 * n))
    assert "outside" in ep.last_error()
    # an address before the range
    assert not ep.write(cid, smr, sptr, n, forge(addr=tptr))
    # a forged secret
    assert not ep.write(cid, smr, sptr, n, forge(secret_flip=True))
    assert not ep.read(cid, smr, sptr, n, forge(secret_flip=True))
    assert "unknown or stale" in ep.last_error()
    assert peer.call("data", tb) == bytes(3 * n), "no forged write landed"
    # a descriptor advertised to another connection
    other = peers()
    ocid, _ = connect(ep, other)
    # `meta` belongs to the peer's connection pcid; a third party cannot use it
    ob, optr = other.call("alloc", n, 2)
    ok, omr = other.ep("reg", optr, n)
    ocid2, pcid2 = connect_peer_to_peer(other, peer)
    assert not other.ep("write", ocid2, omr, optr, n, meta)
    assert peer.call("data", tb) == bytes(3 * n)
    # stale after dereg
    assert ep.write(cid, smr, sptr, n, meta)
    assert peer.ep("dereg", tmr)
    assert not ep.write(cid, smr, sptr, n, meta)
    assert "unknown or stale" in ep.last_error()


def connect_peer_to_peer(a, b):
    ip, port, _ = p2p.Endpoint.parse_metadata(b.metadata)
    b.pipe.send(("ep", ("accept", ())))
    ok, cid = a.ep("connect", ip, 1, port)
    assert ok
    ok2, _ip, _g, bcid = b._reply()
    return cid, bcid


def test_peer_killed_fails_transfers(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    n = 1 << 20
    rb, rptr = bufs.alloc(n)
    ok, rmr = ep.reg(rptr, n)
    ok, rx = ep.recv_async(cid, rmr, rptr, n)
    assert ok
    t = time.time()
    peer.kill()
    assert not ep.wait(rx, 30)
    assert time.time() - t < 10
    assert "connection" in ep.last_error()
    # further calls on that connection fail at once; the endpoint still serves others
    assert not ep.send(cid, rmr, rptr, 10)
    other = peers()
    ocid, opcid = connect(ep, other)
    sb, sptr = other.call("alloc", n, 77)
    ok, smr = other.ep("reg", sptr, n)
    ok, tx = other.ep("send_async", opcid, smr, sptr, n)
    assert ep.recv(ocid, rmr, rptr, n)
    assert bufs.digest(rb) == digest(pattern(n, 77))
