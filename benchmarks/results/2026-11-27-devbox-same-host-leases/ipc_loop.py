#!/usr/bin/env python3
"""`write_ipc` / `read_ipc` on a same-host connection (`connect_local`)
beside the same calls on a connection of the same-host net (`connect`
with TCPX_P2P_SAME_HOST_NET=1), between the same two processes, host
memory, their iterations taken in turn. Prints p50 µs per call and size."""
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

    sizes = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4096,65536,1048576,16777216").split(",")]
    ep = p2p.Endpoint(0)
    peer = Peer("cpu", None, {"TCPX_P2P_SAME_HOST_NET": "1"})
    try:
        net, pnet = connect(ep, peer)
        peer.pipe.send(("ep", ("accept_local", (30.0,))))
        ok, loc = ep.connect_local(peer.metadata)
        assert ok, ep.last_error()
        ok, _bdf, ploc = peer._reply()
        assert ok
        n_max = max(sizes)
        tb, tptr = peer.call("alloc", n_max, 3)
        ok, info_loc = peer.ep("advertise_ipc", ploc, tptr, n_max)
        ok2, info_net = peer.ep("advertise_ipc", pnet, tptr, n_max)
        assert ok and ok2
        buf = (ctypes.c_char * n_max)()
        ptr = ctypes.addressof(buf)
        for n in sizes:
            iters = max(20, min(2000, (256 << 20) // n))
            ways = [
                ("local write_ipc", lambda: ep.write_ipc(loc, ptr, n, info_loc)),
                ("net write_ipc", lambda: ep.write_ipc(net, ptr, n, info_net)),
                ("local read_ipc", lambda: ep.read_ipc(loc, ptr, n, info_loc)),
                ("net read_ipc", lambda: ep.read_ipc(net, ptr, n, info_net)),
            ]
            for _, f in ways:
                for _ in range(max(5, iters // 10)):
                    assert f(), ep.last_error()
            lat = {w: [] for w, _ in ways}
            for _ in range(iters):
                for w, f in ways:
                    t0 = time.perf_counter()
                    assert f(), ep.last_error()
                    lat[w].append(time.perf_counter() - t0)
            row = []
            for w, v in lat.items():
                v.sort()
                row.append(f"{w} {v[len(v) // 2] * 1e6:.1f}")
            print(f"{n:>9} B  " + " | ".join(row), flush=True)
    finally:
        peer.close()


if __name__ == "__main__":
    main()
