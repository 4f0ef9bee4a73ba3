"""Bad networks, with our own test hosts: the peer runs in a network
namespace joined to this one by a veth pair (addresses of the benchmark
range 198.18.0.0/15, owned by these namespaces only). Loss comes from
nftables (`numgen random` drops in the test host), a slow deeply-buffered
link from `tc tbf`, and the link is taken down and brought back. (This
kernel has no sch_netem, so a fixed added delay cannot be made here.)
Transfers either complete with the right bytes or fail with a clear error —
never succeed with wrong bytes. Needs root, iproute2 and nft (skipped
otherwise)."""

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
import time
import uuid

import pytest
from conftest import PEER_GPU, Peer
from peer_ops import pattern

from tcpx_p2p import p2p

HERE, THERE = "198.18.7.1", "198.18.7.2"


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _can_netns():
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "nft")):
        return False
    name = f"tcpxprobe{uuid.uuid4().hex[:6]}"
    ok = sh("ip", "netns", "add", name, check=False).returncode == 0
    if ok:
        sh("ip", "netns", "del", name, check=False)
    return ok


pytestmark = pytest.mark.skipif(not _can_netns(), reason="needs root, iproute2 and network namespaces")


@pytest.fixture
def link():
    """A test host: namespace + veth pair; yields (ns, our interface)."""
    tag = uuid.uuid4().hex[:6]
    ns, here, there = f"tcpx{tag}", f"tx{tag}a", f"tx{tag}b"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", there, "netns", ns)
        sh("ip", "addr", "add", f"{HERE}/30", "dev", here)
        sh("ip", "link", "set", here, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{THERE}/30", "dev", there)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", there, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, here, there
    finally:
        sh("ip", "link", "del", here, check=False)
        sh("ip", "netns", "del", ns, check=False)


def shape(ns, dev, *args):
    """A tc qdisc on both ends of the link."""
    sh("tc", "qdisc", "replace", "dev", dev[0], "root", *args)
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev[1], "root", *args)


def loss(ns, percent):
    """Drops `percent` % of packets entering and leaving the test host."""
    nft = ("ip", "netns", "exec", ns, "nft")
    sh(*nft, "add", "table", "inet", "lossy")
    for chain, hook in (("in", "input"), ("out", "output")):
        sh(*nft, f"add chain inet lossy {chain} {{ type filter hook {hook} priority 0; }}")
        sh(*nft, "add", "rule", "inet", "lossy", chain, "numgen", "random", "mod", "100", "<", str(percent), "drop")


def pair(monkeypatch, ns, here, there, deadline_ms="10000"):
    monkeypatch.setenv("TCPX_P2P_IFNAME", here)
    monkeypatch.setenv("NCCL_NET_EMU_IFNAME", here)  # the stand-in plugin, when the suite runs over it
    monkeypatch.setenv("TCPX_P2P_DEADLINE_MS", deadline_ms)
    ep = p2p.Endpoint(0)
    peer = Peer(
        "cpu",
        PEER_GPU,
        {"TEST_NETNS": ns, "TCPX_P2P_IFNAME": there, "NCCL_NET_EMU_IFNAME": there, "TCPX_P2P_DEADLINE_MS": deadline_ms},
    )
    ip, port, _ = ep.parse_metadata(peer.metadata)
    assert ip == THERE
    peer.pipe.send(("ep", ("accept", ())))
    ok, cid = ep.connect(ip, PEER_GPU, port)
    assert ok, ep.last_error()
    ok, _, _, pcid = peer._reply()
    assert ok
    return ep, peer, cid, pcid


def send_checked(ep, peer, cid, pcid, n, seed, timeout=120):
    """Sends n bytes; returns (ok, error). Asserts bytes are right when ok."""
    src = (ctypes.c_char * n).from_buffer_copy(pattern(n, seed))
    ptr = ctypes.addressof(src)
    ok, mr = ep.reg(ptr, n)
    rb, rptr = peer.call("alloc", n)
    ok, rmr = peer.ep("reg", rptr, n)
    ok, rx = peer.ep("recv_async", pcid, rmr, rptr, n)
    ok, tx = ep.send_async(cid, mr, ptr, n)
    sent = ep.wait(tx, timeout)
    got = peer.ep("wait", rx, float(timeout), timeout=timeout + 30)
    if sent and got:
        assert peer.call("digest", rb) == hashlib.sha256(pattern(n, seed)).hexdigest(), "success with wrong bytes"
        return True, ""
    return False, ep.last_error() or peer.ep("last_error")


def test_slow_buffered_link(monkeypatch, link):
    ns, here, there = link
    # 400 Mbit/s with up to 50 ms of queueing each way.
    shape(ns, (here, there), "tbf", "rate", "400mbit", "burst", "256kb", "latency", "50ms")
    ep, peer, cid, pcid = pair(monkeypatch, ns, here, there)
    try:
        t = time.time()
        ok, err = send_checked(ep, peer, cid, pcid, 16 << 20, 1)
        assert ok, err
        print(f"16 MiB over a 400 Mbit/s link in {time.time() - t:.2f} s")
        # a one-sided write across the delay, too
        assert send_checked(ep, peer, cid, pcid, 1000, 2)[0]
    finally:
        peer.close()


def test_loss_1pct(monkeypatch, link):
    ns, here, there = link
    loss(ns, 1)
    ep, peer, cid, pcid = pair(monkeypatch, ns, here, there)
    try:
        for i, n in enumerate([1, 64 << 10, 16 << 20]):
            ok, err = send_checked(ep, peer, cid, pcid, n, 10 + i)
            assert ok, err
    finally:
        peer.close()


def test_link_down_3s_then_up(monkeypatch, link):
    ns, here, there = link
    # slow enough that the flap lands mid-transfer
    shape(ns, (here, there), "tbf", "rate", "200mbit", "burst", "256kb", "latency", "100ms")
    ep, peer, cid, pcid = pair(monkeypatch, ns, here, there)
    try:
        def flap():
            time.sleep(0.5)
            sh("ip", "link", "set", here, "down")
            time.sleep(3)
            sh("ip", "link", "set", here, "up")

        th = threading.Thread(target=flap)
        th.start()
        t = time.time()
        ok, err = send_checked(ep, peer, cid, pcid, 48 << 20, 5)
        th.join()
        took = time.time() - t
        # Either outcome is allowed; success implies the bytes were checked.
        print(f"link flap: ok={ok} in {took:.1f} s {err}")
        if not ok:
            assert err, "a failure must say why"
    finally:
        peer.close()


def test_link_down_for_good_fails_within_deadline(monkeypatch, link):
    ns, here, there = link
    ep, peer, cid, pcid = pair(monkeypatch, ns, here, there, deadline_ms="3000")
    try:
        n = 1 << 20
        buf = (ctypes.c_char * n)()
        ptr = ctypes.addressof(buf)
        ok, mr = ep.reg(ptr, n)
        ok, rx = ep.recv_async(cid, mr, ptr, n)
        sh("ip", "link", "set", here, "down")
        t = time.time()
        assert not ep.wait(rx, 30)
        took = time.time() - t
        assert took < 8, took
        assert "unresponsive" in ep.last_error() or "connection" in ep.last_error()
        print(f"link down: pending receive failed after {took:.1f} s: {ep.last_error()}")
    finally:
        sh("ip", "link", "set", here, "up", check=False)
        peer.close()
