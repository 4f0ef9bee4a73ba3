"""Load: many peer processes, each with several concurrent one-sided
transfers of mixed sizes into this endpoint, every byte checked by the
peer; throughput and resident memory logged every 10 s; memory must stay
flat. TCPX_P2P_SOAK_PEERS / _SECONDS scale it (CI: 32 peers, 45 s;
benchmarks/soak.sh runs 5 minutes and keeps the log)."""

import ctypes
import json
import os
import time

from conftest import PEER_GPU, Peer

from tcpx_p2p import p2p


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_soak_many_peers(monkeypatch):
    peers_n = int(os.environ.get("TCPX_P2P_SOAK_PEERS", "32"))
    seconds = float(os.environ.get("TCPX_P2P_SOAK_SECONDS", "45"))
    per, slot = 8, 512 << 10
    monkeypatch.setenv("TCPX_P2P_STREAMS", "2")
    ep = p2p.Endpoint(0)
    region = (ctypes.c_char * (peers_n * per * slot))()
    base = ctypes.addressof(region)
    ok, mr = ep.reg(base, peers_n * per * slot)
    assert ok
    peers = [Peer("cpu", PEER_GPU, {"TCPX_P2P_STREAMS": "2"}) for _ in range(peers_n)]
    try:
        work = []
        for i, p in enumerate(peers):
            ip, port, _ = ep.parse_metadata(ep.get_metadata())
            p.pipe.send(("ep", ("connect", (ip, 0, port))))
            ok, pc = p._reply()
            assert ok
            ok, _ip, _g, cid = ep.accept(30)
            assert ok
            metas = []
            for j in range(per):
                ok, d = ep.advertise(cid, mr, base + (i * per + j) * slot, slot)
                assert ok
                metas.append(d.hex())
            work.append((p, pc, metas))
        log = []
        t0 = time.time()
        rss0 = rss()
        for i, (p, pc, metas) in enumerate(work):
            p.pipe.send(("soak", (pc, metas, slot, seconds, 1000 + i)))
        done = {}
        next_log = t0
        while len(done) < len(work):
            for i, (p, _, _) in enumerate(work):
                if i not in done and p.pipe.poll(0.05):
                    status, res = p.pipe.recv()
                    assert status == "ok", res
                    done[i] = res
            if time.time() >= next_log:
                log.append({"t": round(time.time() - t0, 1), "rss_MiB": rss() >> 20, "peers_done": len(done)})
                print(json.dumps(log[-1]), flush=True)
                next_log += 10
            assert time.time() - t0 < seconds + 120, "soak did not end"
        took = time.time() - t0
        moved = sum(r[0] for r in done.values())
        rounds = sum(r[1] for r in done.values())
        errors = sum(r[2] for r in done.values())
        rss1 = rss()
        summary = {
            "peers": peers_n,
            "concurrent_per_peer": per,
            "seconds": round(took, 1),
            "bytes_moved": moved,
            "GBps": round(moved / took / 1e9, 3),
            "rounds": rounds,
            "errors": errors,
            "rss_start_MiB": rss0 >> 20,
            "rss_end_MiB": rss1 >> 20,
            "log": log,
        }
        print(json.dumps(summary))
        out = os.environ.get("TCPX_P2P_SOAK_JSON")
        if out:
            with open(out, "w") as f:
                json.dump(summary, f, indent=1)
        assert errors == 0, summary
        assert rounds >= peers_n, summary
        assert rss1 - rss0 < 64 << 20, summary
    finally:
        for p in peers:
            p.close()
