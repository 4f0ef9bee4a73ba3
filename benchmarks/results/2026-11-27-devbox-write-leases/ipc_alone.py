#!/usr/bin/env python3
"""One way alone, in a loop: blocking `write_ipc` (or `read_ipc`) of SIZE
bytes of host memory into (from) one `advertise_ipc` record, on a
connection of the same-host net (`net`: connect / accept with
TCPX_P2P_SAME_HOST_NET=1) or on a same-host connection (`local`:
connect_local / accept_local). Prints p50 and p10 in µs.
Usage: ipc_alone.py net|local write|read SIZE [ITERS]. The peer is a
second process (the tests' Peer)."""
import ctypes
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ["TCPX_P2P_SAME_HOST_NET"] = "1"


def main():
    from conftest import Peer, connect
    from tcpx_p2p import p2p

    way, op, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    iters = int(sys.argv[4]) if len(sys.argv) > 4 else 1000
    ep = p2p.Endpoint(0)
    peer = Peer("cpu", None, {"TCPX_P2P_SAME_HOST_NET": "1"})
    try:
        if way == "net":
            cid, pcid = connect(ep, peer)
        else:
            peer.pipe.send(("ep", ("accept_local", (30.0,))))
            ok, cid = ep.connect_local(peer.metadata)
            assert ok, ep.last_error()
            ok, _bdf, pcid = peer._reply()
            assert ok
        tb, tptr = peer.call("alloc", n, 5)
        ok, info = peer.ep("advertise_ipc", pcid, tptr, n)
        assert ok
        buf = (ctypes.c_char * n)()
        ptr = ctypes.addressof(buf)
        fn = ep.read_ipc if op == "read" else ep.write_ipc
        for _ in range(max(20, iters // 10)):
            assert fn(cid, ptr, n, info), ep.last_error()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            assert fn(cid, ptr, n, info), ep.last_error()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(f"{way} {op}_ipc {n} p50 {ts[len(ts) // 2] * 1e6:.1f} p10 {ts[len(ts) // 10] * 1e6:.1f}", flush=True)
    finally:
        peer.close()


if __name__ == "__main__":
    main()
