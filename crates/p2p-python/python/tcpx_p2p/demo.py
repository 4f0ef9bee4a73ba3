"""The demo: two endpoints in two processes move data and check it.

    python -m tcpx_p2p.demo [--size 256M] [--iters 8] [--memory auto|host|gpu]

On a machine with GPUs the sender uses GPU 0 and the receiver the last GPU;
otherwise both use host memory. Prints bytes moved, time, GB/s and whether
the SHA-256 of what arrived matches what was sent.
"""

import argparse
import multiprocessing as mp
import os
import sys
import time

from ._buffers import Buffer, parse_size


def _receiver(q, size, iters, gpu, env):
    os.environ.update(env)
    from tcpx_p2p import p2p

    ep = p2p.Endpoint(gpu if gpu is not None else 0)
    buf = Buffer(size, gpu)
    ok, mr = ep.reg(buf.ptr, size)
    q.put(ep.get_metadata())
    ok, _ip, _g, conn = ep.accept()
    for _ in range(iters):
        if not ep.recv(conn, mr, buf.ptr, size):
            q.put(("error", ep.last_error()))
            return
    q.put(("received", None))
    q.put(("digest", buf.digest()))
    # Stay until the sender has read our answer.
    q.get()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256M", help="message size (e.g. 1M, 256M)")
    ap.add_argument("--iters", type=int, default=8, help="messages to send")
    ap.add_argument("--memory", choices=["auto", "host", "gpu"], default="auto")
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    os.environ.setdefault("TCPX_P2P_IFNAME", "lo")

    from tcpx_p2p import cuda_device_count, p2p

    ngpu = cuda_device_count()
    use_gpu = a.memory == "gpu" or (a.memory == "auto" and ngpu > 0)
    if use_gpu:
        try:
            import torch  # noqa: F401
        except ImportError:
            if a.memory == "gpu":
                sys.exit("--memory gpu needs PyTorch to allocate GPU buffers")
            use_gpu = False
    if use_gpu and ngpu == 0:
        sys.exit("--memory gpu: no GPU found")
    sgpu, rgpu = (0, ngpu - 1) if use_gpu else (None, None)
    where = f"GPU {sgpu} -> GPU {rgpu}" if use_gpu else "host memory -> host memory"

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    env = {k: v for k, v in os.environ.items() if k.startswith("TCPX_P2P_")}
    peer = ctx.Process(target=_receiver, args=(q, size, a.iters, rgpu, env), daemon=True)
    peer.start()
    md = q.get(timeout=120)

    ep = p2p.Endpoint(sgpu if sgpu is not None else 0)
    buf = Buffer(size, sgpu)
    buf.fill(seed=1234)
    want = buf.digest()
    ok, mr = ep.reg(buf.ptr, size)
    ok, conn = ep.add_remote_endpoint(md)
    if not ok:
        sys.exit(f"connect failed: {ep.last_error()}")
    print(f"tcpx-p2p demo: {where}, net={ep.net_name()}, {a.iters} x {size} bytes")
    t0 = time.perf_counter()
    for i in range(a.iters):
        if not ep.send(conn, mr, buf.ptr, size):
            sys.exit(f"send {i} failed: {ep.last_error()}")
    kind, got = q.get(timeout=600)
    dt = time.perf_counter() - t0
    if kind == "received":
        kind, got = q.get(timeout=600)
    q.put("bye")
    peer.join(30)
    if kind == "error":
        sys.exit(f"receiver failed: {got}")
    total = size * a.iters
    verdict = "OK (SHA-256 match)" if got == want else "MISMATCH"
    print(f"moved {total} bytes in {dt:.3f} s: {total / dt / 1e9:.2f} GB/s ({total * 8 / dt / 1e9:.1f} Gbps)")
    print(f"checksum: {verdict}")
    return 0 if got == want else 1


if __name__ == "__main__":
    sys.exit(main())
