"""One endpoint, many peers: the endpoint's threads do not grow with its
peers (they run on its shared I/O workers), every peer's message arrives
intact, and many peers sending at once all land (tcpx-p2p-bench peers,
run end to end: target and peers in separate processes, real sockets)."""

import json
import os
import subprocess
import sys


def run_peers(tmp_path, peers, procs, busy):
    out = tmp_path / f"peers{peers}.json"
    r = subprocess.run(
        [sys.executable, "-m", "tcpx_p2p.bench", "peers", "--peers", str(peers), "--procs", str(procs),
         "--msg", "256K", "--busy", str(busy), "--busy-size", "2M", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TCPX_P2P_IFNAME": "lo"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["failures"] == [], res["failures"]
    assert res["delivered_checked"] == peers, res
    assert res["busy"]["peers_at_once"] == busy
    # Out to many: every peer checked what the target sent it (a mismatch
    # is in `failures`), and the figures are there.
    assert res["busy_out"]["peers_at_once"] == busy
    assert res["busy_out"]["to_all_at_once_GBps"] > 0
    # Timed rounds come after a first round of each shape, kept apart.
    for phase in ("busy", "busy_out"):
        assert all(x > 0 for x in res[phase]["first_rounds_together_GBps"])
        assert res[phase]["peak_threads_first_rounds"] > 0
        assert len(res[phase]["rounds_together"]) == 3
    return res


def ours(names):
    """Threads of the engine (a plugin's own, e.g. the stand-in's `emu-*`,
    are the plugin's: TCPX keeps threads per comm too)."""
    return sum(n for name, n in names.items() if not name.startswith("emu-"))


def test_threads_do_not_grow_with_peers_and_every_message_lands(tmp_path):
    res = run_peers(tmp_path, peers=48, procs=3, busy=8)
    alone = res["endpoint_alone"]["threads"]
    # 48 idle peers: their streams and connections wait without threads.
    # (One thread per stream and connection task would be 35 a peer.)
    cores = os.cpu_count() or 2
    assert ours(res["thread_names_all_connected"]) - alone <= 2 * cores + 4, res["thread_names_all_connected"]
    assert ours(res["thread_names_after_deliver"]) - alone <= 2 * cores + 4, res["thread_names_after_deliver"]


def test_a_peer_that_sent_before_its_receive_was_posted_holds_no_thread(tmp_path):
    # Every peer sends as soon as it is connected; the target posts its
    # receives one peer at a time after measuring: until then each peer's
    # message waits in its streams, idle, not in a thread each.
    res = run_peers(tmp_path, peers=24, procs=2, busy=2)
    names = res["thread_names_all_connected"]
    assert names.get("tcpx-io", 0) <= 2 * (os.cpu_count() or 2) + 2, names
