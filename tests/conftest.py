"""Fixtures for the end-to-end tests: peers in other processes, buffers in
host or GPU memory. Every test runs over the net named by TCPX_P2P_NET
(socket by default; the suite is run once per net)."""

import multiprocessing as mp
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import peer_ops  # noqa: E402

os.environ.setdefault("TCPX_P2P_IFNAME", "lo")


def _gpus():
    try:
        from tcpx_p2p import cuda_device_count

        if cuda_device_count() < 1:
            return 0
        import torch  # noqa: F401

        return cuda_device_count()
    except ImportError:
        return 0


GPUS = _gpus()
# With one GPU both processes use it (every GPU path but the cross-GPU copy is
# the same); with two or more, this process takes GPU 0 and each peer GPU 1.
# TCPX_P2P_TEST_GPUS=1 forces the one-GPU layout on a bigger machine.
if GPUS and os.environ.get("TCPX_P2P_TEST_GPUS") == "1":
    GPUS = 1
PEER_GPU = 1 if GPUS >= 2 else 0
DEVICES = ["cpu"] + (["cuda"] if GPUS >= 1 else [])


class Peer:
    """An endpoint in another process, driven by RPC."""

    def __init__(self, device, gpu, env=None):
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        e = {k: v for k, v in os.environ.items() if k.startswith("TCPX_P2P_")}
        e.update(env or {})
        self.proc = ctx.Process(target=peer_ops.serve, args=(child, device, gpu, e), daemon=True)
        self.proc.start()
        self.metadata = self._reply(60)

    def _reply(self, timeout=120):
        if not self.pipe.poll(timeout):
            raise TimeoutError("peer did not answer")
        status, res = self.pipe.recv()
        if status != "ok":
            raise RuntimeError(f"peer failed:\n{res}")
        return res

    def call(self, op, *args, timeout=120):
        self.pipe.send((op, args))
        return self._reply(timeout)

    def ep(self, name, *args, timeout=120):
        return self.call("ep", name, args, timeout=timeout)

    def kill(self):
        self.proc.kill()
        self.proc.join(10)

    def close(self):
        peer_ops.stop_child(self.proc, self.pipe, 10)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def local(device):
    """This process's endpoint (GPU 0 on a GPU machine) and its buffers."""
    from tcpx_p2p import p2p

    ep = p2p.Endpoint(0)
    return ep, peer_ops.Buffers(device, 0)


@pytest.fixture
def peers(device):
    """Factory of peer processes (GPU 1 with two GPUs, else GPU 0); all closed at the end."""
    made = []

    def make(env=None):
        p = Peer(device, PEER_GPU, env)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def connect(ep, peer):
    """Connects `ep` to `peer`; returns (our conn id, the peer's conn id)."""
    ip, port, _ = ep.parse_metadata(peer.metadata)
    peer.pipe.send(("ep", ("accept", ())))
    ok, cid = ep.connect(ip, PEER_GPU, port)
    assert ok, ep.last_error()
    ok2, _ip, _gpu, pcid = peer._reply()
    assert ok2
    return cid, pcid
