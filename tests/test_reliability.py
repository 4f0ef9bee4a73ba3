"""Reliability: liveness deadlines, who may connect, clean close without
leaks. Host memory; peers in other processes."""

import os
import signal
import socket
import struct
import time

import pytest
from conftest import PEER_GPU, Peer, connect
from peer_ops import pattern, stopped

from tcpx_p2p import p2p


def fresh_endpoint(monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return p2p.Endpoint(0)


def test_stopped_peer_fails_transfers_within_deadline(monkeypatch):
    ep = fresh_endpoint(monkeypatch, TCPX_P2P_KEEPALIVE_MS="200", TCPX_P2P_DEADLINE_MS="2000")
    peer = Peer("cpu", PEER_GPU)
    try:
        cid, pcid = connect(ep, peer)
        buf = bytearray(1 << 20)
        import ctypes

        cbuf = (ctypes.c_char * len(buf)).from_buffer(buf)
        ptr = ctypes.addressof(cbuf)
        ok, mr = ep.reg(ptr, len(buf))
        ok, rx = ep.recv_async(cid, mr, ptr, len(buf))
        assert ok
        # A hung peer: alive for TCP, silent for us.
        stopped(peer.proc.pid)
        t = time.time()
        assert not ep.wait(rx, 30)
        took = time.time() - t
        assert 1.5 < took < 6, took
        assert "unresponsive" in ep.last_error()
        # The id keeps answering with the reason.
        assert not ep.send(cid, mr, ptr, 10)
        assert "unresponsive" in ep.last_error()
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        peer.close()


def test_auth_token(monkeypatch):
    ep = fresh_endpoint(monkeypatch, TCPX_P2P_AUTH_TOKEN="s3cret")
    ip, port, _ = ep.parse_metadata(ep.get_metadata())
    wrong = Peer("cpu", PEER_GPU, {"TCPX_P2P_AUTH_TOKEN": "other"})
    none = Peer("cpu", PEER_GPU, {"TCPX_P2P_AUTH_TOKEN": ""})
    right = Peer("cpu", PEER_GPU, {"TCPX_P2P_AUTH_TOKEN": "s3cret"})
    try:
        for p in (wrong, none):
            ok, _ = p.ep("connect", ip, 0, port)
            assert not ok
            err = p.ep("last_error")
            assert "auth" in err or "refused" in err, err
        ok, cid = right.ep("connect", ip, 0, port)
        assert ok, right.ep("last_error")
        ok, _ip, _g, acc = ep.accept(10)
        assert ok
        # The refused peers never became connections.
        assert ep.conn_ids() == [acc]
    finally:
        for p in (wrong, none, right):
            p.close()


def test_handshake_version_mismatch_is_refused():
    ep = p2p.Endpoint(0)
    ip, port, _ = ep.parse_metadata(ep.get_metadata())
    s = socket.create_connection((ip, port), timeout=10)
    body = struct.pack("<QHi", 0x3150325058504354, 99, 0) + b"\x00" * 40
    s.sendall(struct.pack("<I", len(body)) + body)
    # The endpoint answers with a refusal frame (type 0, then its reason as
    # u16 length + text), then closes.
    frame = b""
    while len(frame) < 4 or len(frame) < 4 + struct.unpack("<I", frame[:4])[0]:
        more = s.recv(4096)
        assert more, "closed before the refusal frame was complete"
        frame += more
    n = struct.unpack("<I", frame[:4])[0]
    assert 1 <= n <= 1 + 2 + 256 and frame[4] == 0
    reason = frame[7 : 4 + n].decode() if n > 1 else ""
    assert n == 1 or "version" in reason, reason
    s.close()
    garbage = socket.create_connection((ip, port), timeout=10)
    garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" * 10)
    garbage.close()
    # Still serving.
    peer = Peer("cpu", PEER_GPU)
    try:
        connect(ep, peer)
    finally:
        peer.close()


def _proc_stats():
    fds = len(os.listdir("/proc/self/fd"))
    threads = rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return fds, threads, rss


def test_connect_transfer_close_cycles_leak_nothing(record_property):
    cycles = int(os.environ.get("TCPX_P2P_TEST_CYCLES", "1000"))
    ep = p2p.Endpoint(0)
    peer = Peer("cpu", PEER_GPU)
    import ctypes

    n = 64 << 10
    src = (ctypes.c_char * n).from_buffer_copy(pattern(n, 1))
    ptr = ctypes.addressof(src)
    ok, mr = ep.reg(ptr, n)
    try:
        rb, rptr = peer.call("alloc", n)
        ok, rmr = peer.ep("reg", rptr, n)

        def cycle():
            cid, pcid = connect(ep, peer)
            ok, rx = peer.ep("recv_async", pcid, rmr, rptr, n)
            assert ep.send(cid, mr, ptr, n), ep.last_error()
            assert peer.ep("wait", rx)
            assert ep.remove_remote_endpoint(cid)

        for _ in range(20):  # warm up allocators and thread caches
            cycle()
        time.sleep(0.5)
        before = _proc_stats()
        t = time.time()
        for _ in range(cycles):
            cycle()
        took = time.time() - t
        # Our closes are synchronous (threads joined); the peer's side ends
        # its connections as their closes arrive: wait for that (bounded)
        # rather than for a fixed time.
        deadline = time.monotonic() + 60
        while len(peer.ep("conn_ids")) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        after = _proc_stats()
        while (after[0] > before[0] + 2 or after[1] > before[1] + 2) and time.monotonic() < deadline:
            time.sleep(0.05)
            after = _proc_stats()
        record_property("cycles", cycles)
        record_property("before_fds_threads_rss", before)
        record_property("after_fds_threads_rss", after)
        print(f"{cycles} cycles in {took:.1f} s; fds {before[0]}->{after[0]}, threads {before[1]}->{after[1]}, rss {before[2] >> 20}->{after[2] >> 20} MiB")
        assert after[0] <= before[0] + 2, (before, after)
        assert after[1] <= before[1] + 2, (before, after)
        assert after[2] <= before[2] + (32 << 20), (before, after)
        assert peer.call("digest", rb) == __import__("hashlib").sha256(pattern(n, 1)).hexdigest()
        # The peer let go of its side too.
        assert len(peer.ep("conn_ids")) <= 1
    finally:
        peer.close()
