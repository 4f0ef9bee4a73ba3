#!/usr/bin/env python3
"""One way alone, in a loop: blocking `read` (or `write`) of SIZE bytes of
host memory over a connection on the same-host net, the same advertisement
every time, as an application re-reading one cache does. Prints p50 and p10
in µs. Usage: loop.py read|write SIZE [ITERS]. The peer is a second
process (the tests' Peer)."""
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

    op, n = sys.argv[1], int(sys.argv[2])
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    ep = p2p.Endpoint(0)
    peer = Peer("cpu", None, {"TCPX_P2P_SAME_HOST_NET": "1"})
    try:
        cid, pcid = connect(ep, peer)
        tb, tptr = peer.call("alloc", n, 5)
        ok, tmr = peer.ep("reg", tptr, n)
        ok, meta = peer.ep("advertise", pcid, tmr, tptr, n)
        buf = (ctypes.c_char * n)()
        ptr = ctypes.addressof(buf)
        ok, mr = ep.reg(ptr, n)
        fn = ep.read if op == "read" else ep.write
        for _ in range(max(20, iters // 10)):
            assert fn(cid, mr, ptr, n, meta), ep.last_error()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            assert fn(cid, mr, ptr, n, meta), ep.last_error()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(f"{op} {n} p50 {ts[len(ts) // 2] * 1e6:.1f} p10 {ts[len(ts) // 10] * 1e6:.1f}", flush=True)
    finally:
        peer.close()


if __name__ == "__main__":
    main()
