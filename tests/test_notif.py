"""Notifications end to end, two processes: sent alone both ways, attached to
a one-sided write (the target sees every byte once it sees the notification)
and to a read (the data's owner hears once the reader has every byte), not
sent for a refused write, the size limit, and unknown connections."""

import time

from peer_ops import pattern
from conftest import connect

NOTIF_MAX = 1 << 20


def wait_notifs(get, n, timeout=30):
    """Polls `get()` until `n` notifications came; returns them."""
    got = []
    end = time.time() + timeout
    while len(got) < n and time.time() < end:
        got += get()
        if len(got) < n:
            time.sleep(0.002)
    assert len(got) == n, f"got {got!r}, wanted {n}"
    return got


def test_notif_alone_both_ways(local, peers):
    ep, _ = local
    peer = peers({"TCPX_P2P_NAME": "peer-one"})
    cid, pcid = connect(ep, peer)
    assert ep.send_notif(cid, b"hello"), ep.last_error()
    assert ep.send_notif(cid, b""), ep.last_error()
    big = pattern(70_000, 3)
    assert ep.send_notif(cid, big), ep.last_error()
    got = wait_notifs(lambda: peer.ep("get_notifs"), 3)
    assert got == [(ep.name(), b"hello"), (ep.name(), b""), (ep.name(), big)]
    assert peer.ep("send_notif", pcid, b"back")
    assert wait_notifs(ep.get_notifs, 1) == [("peer-one", b"back")]
    assert ep.get_notifs() == []


def test_notif_after_write_lands(local, peers):
    ep, bufs = local
    peer = peers({"TCPX_P2P_NAME": "target"})
    cid, pcid = connect(ep, peer)
    n = 8 << 20
    tid, tptr = peer.call("alloc", n)
    ok, tmr = peer.ep("reg", tptr, n)
    assert ok
    ok, meta = peer.ep("advertise", pcid, tmr, tptr, n)
    assert ok
    sid, sptr = bufs.alloc(n, 11)
    ok, smr = ep.reg(sptr, n)
    assert ok
    ok, x = ep.write_async_with_notif(cid, smr, sptr, n, meta, b"kv ready")
    assert ok, ep.last_error()
    # No wait here: the target checks its bytes as soon as the notification shows.
    got = wait_notifs(lambda: peer.ep("get_notifs"), 1)
    assert got == [(ep.name(), b"kv ready")]
    assert peer.call("digest", tid) == bufs.digest(sid)
    assert ep.wait(x, 60), ep.last_error()


def test_notif_after_read_goes_to_owner(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    n = 4 << 20
    oid, optr = peer.call("alloc", n, 21)
    ok, omr = peer.ep("reg", optr, n)
    assert ok
    ok, meta = peer.ep("advertise", pcid, omr, optr, n)
    assert ok
    did, dptr = bufs.alloc(n)
    ok, dmr = ep.reg(dptr, n)
    assert ok
    ok, x = ep.read_async_with_notif(cid, dmr, dptr, n, meta, b"blocks freed")
    assert ok, ep.last_error()
    got = wait_notifs(lambda: peer.ep("get_notifs"), 1)
    assert got == [(ep.name(), b"blocks freed")]
    assert ep.wait(x, 60), ep.last_error()
    assert bufs.digest(did) == peer.call("digest", oid)


def test_refused_write_sends_no_notif(local, peers):
    ep, bufs = local
    peer = peers()
    cid, pcid = connect(ep, peer)
    tid, tptr = peer.call("alloc", 4096)
    ok, tmr = peer.ep("reg", tptr, 4096)
    ok, meta = peer.ep("advertise", pcid, tmr, tptr, 4096)
    forged = bytearray(meta)
    forged[48] ^= 0x5A  # the advertisement's secret
    sid, sptr = bufs.alloc(4096, 5)
    ok, smr = ep.reg(sptr, 4096)
    ok, x = ep.write_async_with_notif(cid, smr, sptr, 4096, bytes(forged), b"never")
    assert ok
    assert not ep.wait(x, 60)
    assert "refused" in ep.last_error()
    assert ep.send_notif(cid, b"after")
    assert wait_notifs(lambda: peer.ep("get_notifs"), 1) == [(ep.name(), b"after")]
    assert peer.call("data", tid) == bytes(4096)


def test_notif_limits_and_unknown_conn(local, peers):
    ep, _ = local
    peer = peers()
    cid, _ = connect(ep, peer)
    assert ep.send_notif(cid, bytes(NOTIF_MAX)), ep.last_error()
    assert not ep.send_notif(cid, bytes(NOTIF_MAX + 1))
    assert "exceeds the limit" in ep.last_error()
    assert not ep.send_notif(987654, b"x")
    assert "unknown connection" in ep.last_error()
    got = wait_notifs(lambda: peer.ep("get_notifs"), 1)
    assert got == [(ep.name(), bytes(NOTIF_MAX))]
