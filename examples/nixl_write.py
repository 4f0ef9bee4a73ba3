"""Two NIXL agents in two processes, host memory (DRAM), our TCPX_P2P backend:
the writer WRITEs 4 MiB into the target's buffer with a notification, and the
target checks every byte once the notification has come.
Run: python examples/nixl_write.py"""

import hashlib
import multiprocessing as mp
import os
import time

import numpy as np

import tcpx_p2p

# Before the first agent is made, in every process that makes one.
os.environ["NIXL_PLUGIN_DIR"] = tcpx_p2p.nixl_plugin_dir()

try:  # the `nixl` meta-package, or the wheel for your CUDA
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

N = 4 << 20  # bytes
TIMEOUT_S = 30


def make_agent(name):
    # No listen thread: metadata goes through our pipe, so no port is bound
    # and any number of agents can run on one host.
    config = nixl_agent_config(enable_listen_thread=False, backends=[])
    agent = nixl_agent(name, config)
    agent.create_backend("TCPX_P2P", {})  # parameters: docs/NIXL.md
    return agent


def target(pipe):
    agent = make_agent("target")
    buf = np.zeros(N, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, N, 0, "")], "DRAM")
    pipe.send(agent.get_agent_metadata())
    agent.add_remote_agent(pipe.recv())
    where = agent.get_xfer_descs([(buf.ctypes.data, N, 0)], "DRAM")
    pipe.send(agent.get_serialized_descs(where))

    deadline = time.monotonic() + TIMEOUT_S
    notes = []
    while not notes:  # every byte is in buf once the notification shows
        notes = agent.get_new_notifs().get("writer", [])
        assert time.monotonic() < deadline, "no notification from the writer"
        time.sleep(0.001)
    print(f"target: notification {notes[0]!r}")
    pipe.send(hashlib.sha256(buf).hexdigest())


def main():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=target, args=(there,))
    peer.start()

    agent = make_agent("writer")
    src = np.random.default_rng(7).integers(0, 256, N, dtype=np.uint8)
    agent.register_memory([(src.ctypes.data, N, 0, "")], "DRAM")
    remote_name = agent.add_remote_agent(here.recv())
    here.send(agent.get_agent_metadata())
    remote = agent.deserialize_descs(here.recv())
    local = agent.get_xfer_descs([(src.ctypes.data, N, 0)], "DRAM")

    t0 = time.monotonic()
    handle = agent.initialize_xfer("WRITE", local, remote, remote_name, b"done")
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        assert time.monotonic() < t0 + TIMEOUT_S, "the write did not finish"
        state = agent.check_xfer_state(handle)
    assert state == "DONE", "the write failed"
    dt = time.monotonic() - t0
    print(f"writer: WRITE of {N} bytes in {dt * 1e3:.1f} ms ({N / dt / 1e9:.2f} GB/s)")
    agent.release_xfer_handle(handle)

    assert here.recv() == hashlib.sha256(src).hexdigest(), "bytes differ"
    peer.join(TIMEOUT_S)
    assert peer.exitcode == 0, f"target exited with {peer.exitcode}"
    print("nixl_write: OK")


if __name__ == "__main__":
    main()
