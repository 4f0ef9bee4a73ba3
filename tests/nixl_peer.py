"""One side of the NIXL end-to-end tests: a real ``nixl_agent`` (from the
nixl-cu12 wheel) with the TCPX_P2P backend, host buffers it registered, and
the calls the tests make on it. The test process drives one in-process side
and one in another process (``serve``, over a multiprocessing pipe)."""

import hashlib
import os
import random
import time
import traceback

BACKEND = "TCPX_P2P"


def pattern(n, seed):
    return random.Random(seed).randbytes(n)


def digest(b):
    return hashlib.sha256(b).hexdigest()


class Side:
    """A NIXL agent with DRAM buffers, named by index."""

    def __init__(self, name, port, params=None, telemetry=False):
        import numpy as np
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.np = np
        self.name = name
        if params:
            conf = nixl_agent_config(True, True, port, capture_telemetry=telemetry, backends=[])
            self.agent = nixl_agent(name, conf)
            self.agent.create_backend(BACKEND, params)
        else:
            conf = nixl_agent_config(True, True, port, capture_telemetry=telemetry, backends=[BACKEND])
            self.agent = nixl_agent(name, conf)
        self.bufs = []
        self.regs = []
        self.notifs = {}

    # buffers
    def alloc(self, n, seed=None):
        """A registered buffer of n bytes (a pattern from seed, else zeros): its index."""
        a = self.np.zeros(n, dtype=self.np.uint8)
        if seed is not None:
            a[:] = self.np.frombuffer(pattern(n, seed), dtype=self.np.uint8)
        self.bufs.append(a)
        self.regs.append(self.agent.register_memory([(self.addr(len(self.bufs) - 1), n, 0, "")], "DRAM"))
        return len(self.bufs) - 1

    def alloc_unregistered(self, n, seed=None):
        a = self.np.zeros(n, dtype=self.np.uint8)
        if seed is not None:
            a[:] = self.np.frombuffer(pattern(n, seed), dtype=self.np.uint8)
        self.bufs.append(a)
        self.regs.append(None)
        return len(self.bufs) - 1

    def addr(self, i):
        return int(self.bufs[i].ctypes.data)

    def digest(self, i, off=0, n=None):
        b = self.bufs[i]
        n = len(b) - off if n is None else n
        return digest(b[off : off + n].tobytes())

    def fill(self, i, seed):
        b = self.bufs[i]
        b[:] = self.np.frombuffer(pattern(len(b), seed), dtype=self.np.uint8) if seed is not None else 0

    def deregister(self, i):
        self.agent.deregister_memory(self.regs[i])
        self.regs[i] = None

    # metadata
    def metadata(self):
        return self.agent.get_agent_metadata()

    def add_remote(self, md):
        name = self.agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, name):
        self.agent.remove_remote_agent(name)

    def fetch_remote(self, name, port):
        self.agent.fetch_remote_metadata(name, "127.0.0.1", port)
        self.agent.send_local_metadata("127.0.0.1", port)
        deadline = time.monotonic() + 30
        while not self.agent.check_remote_metadata(name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no metadata from {name}")
            time.sleep(0.01)
        return True

    def has_remote(self, name):
        return self.agent.check_remote_metadata(name)

    # notifications
    def send_notif(self, to, msg):
        self.agent.send_notif(to, msg)

    def take_notifs(self, sender, count, timeout=30):
        """Waits for `count` messages from `sender` and returns them (in order)."""
        deadline = time.monotonic() + timeout
        while True:
            for k, v in self.agent.get_new_notifs().items():
                self.notifs.setdefault(k, []).extend(v)
            got = self.notifs.get(sender, [])
            if len(got) >= count:
                self.notifs[sender] = got[count:]
                return got[:count]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(got)} of {count} notifications from {sender}: {self.notifs}")
            time.sleep(0.002)

    def digest_on_notif(self, sender, msg, i, timeout=60):
        """Waits for the notification `msg` from sender, then at once digests
        buffer i: what a consumer that trusts the notification would see."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for k, v in self.agent.get_new_notifs().items():
                self.notifs.setdefault(k, []).extend(v)
            got = self.notifs.get(sender, [])
            if msg in got:
                got.remove(msg)
                return self.digest(i)
            time.sleep(0.0005)
        raise TimeoutError(f"no notification {msg!r} from {sender}: {self.notifs}")

    def notifs_now(self):
        for k, v in self.agent.get_new_notifs().items():
            self.notifs.setdefault(k, []).extend(v)
        return {k: list(v) for k, v in self.notifs.items() if v}

    # transfers
    def descs(self, pieces):
        """Transfer descriptors of (addr, len) pieces."""
        return self.agent.get_xfer_descs([(a, n, 0) for a, n in pieces], "DRAM")

    def xfer(self, op, local, remote, peer, notif=b"", timeout=60):
        """One transfer of (addr, len) pieces, waited for: "DONE" or "ERR" (or the exception's text)."""
        try:
            h = self.agent.initialize_xfer(op, self.descs(local), self.descs(remote), peer, notif)
        except Exception as e:  # NIXL raises on a request it refuses to build
            return f"refused: {type(e).__name__}: {e}"
        try:
            return self.wait(h, self.post(h), timeout)
        finally:
            self.agent.release_xfer_handle(h)

    def post(self, h, notif=None):
        """transfer(): "DONE", "PROC", or "ERR" (NIXL raises when a backend refuses to post)."""
        try:
            return self.agent.transfer(h, notif) if notif is not None else self.agent.transfer(h)
        except Exception:
            return "ERR"

    def wait(self, h, state, timeout=60):
        deadline = time.monotonic() + timeout
        while state == "PROC":
            if time.monotonic() > deadline:
                return "TIMEOUT"
            time.sleep(0.0005)
            try:
                state = self.agent.check_xfer_state(h)
            except Exception:  # NIXL raises on a failed transfer
                return "ERR"
        return state


def serve(pipe, name, port, params, env):
    os.environ.update(env)
    try:
        side = Side(name, port, params)
        pipe.send(("ok", None))
    except Exception:
        pipe.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            msg = pipe.recv()
        except EOFError:
            return
        if msg is None:
            return
        op, args, kwargs = msg
        try:
            pipe.send(("ok", getattr(side, op)(*args, **kwargs)))
        except Exception:
            pipe.send(("err", traceback.format_exc()))
