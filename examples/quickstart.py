"""Two processes, host buffers: a two-sided send/recv, then a one-sided write
into a range the receiver advertised. Run: python examples/quickstart.py
(GPU memory works the same way: pass torch_tensor.data_ptr() and its size.)"""

import hashlib
import multiprocessing as mp

import numpy as np

from tcpx_p2p import p2p  # was: from uccl import p2p

N = 1 << 20  # bytes


def receiver(pipe):
    ep = p2p.Endpoint(local_gpu_idx=0)  # host buffers work with or without a GPU
    pipe.send(ep.get_metadata())  # any side channel will do
    ok, ip, gpu, conn = ep.accept(timeout=30)
    assert ok, ep.last_error()

    buf = np.zeros(N, dtype=np.uint8)
    ok, mr = ep.reg(buf.ctypes.data, buf.nbytes)
    assert ok, ep.last_error()

    # Two-sided: matches the peer's send.
    assert ep.recv(conn, mr, buf.ctypes.data, N), ep.last_error()
    pipe.send(hashlib.sha256(buf).hexdigest())

    # One-sided: offer the buffer; the peer's write lands with no call here.
    buf[:] = 0
    ok, desc = ep.advertise(conn, mr, buf.ctypes.data, N)
    assert ok, ep.last_error()
    pipe.send(desc)
    assert pipe.recv() == "written"  # the writer's write() has returned
    pipe.send(hashlib.sha256(buf).hexdigest())
    ep.dereg(mr)


def main():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=receiver, args=(there,))
    peer.start()

    ep = p2p.Endpoint(local_gpu_idx=0)
    ok, conn = ep.add_remote_endpoint(here.recv())
    assert ok, ep.last_error()

    src = np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8)
    ok, mr = ep.reg(src.ctypes.data, src.nbytes)
    assert ok, ep.last_error()
    expect = hashlib.sha256(src).hexdigest()

    assert ep.send(conn, mr, src.ctypes.data, N), ep.last_error()
    assert here.recv() == expect, "send/recv: bytes differ"
    print(f"send/recv: {N} bytes, checked")

    desc = here.recv()
    assert ep.write(conn, mr, src.ctypes.data, N, desc), ep.last_error()
    here.send("written")
    assert here.recv() == expect, "write: bytes differ"
    print(f"write: {N} bytes, checked")

    peer.join(30)
    assert peer.exitcode == 0, f"receiver exited with {peer.exitcode}"
    print("quickstart: OK")


if __name__ == "__main__":
    main()
