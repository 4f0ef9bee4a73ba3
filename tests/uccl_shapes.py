"""Process bodies for the UCCL-shaped tests (test_uccl_compat.py): each
function is one side of a two-process test written the way UCCL's own
tests and benchmarks use their `p2p` module (the same calls, the same
keyword names), importing ours instead. The two sides talk over a
multiprocessing pipe (`chan`) as UCCL's tests do over pipes or
torch.distributed; each returns what the test process checks (SHA-256 of
bytes, ids, flags).

Tensors are torch CPU tensors where torch is installed, otherwise
`HostTensor`, which has only what UCCL's calls use of a tensor."""

import ctypes
import hashlib
import os
import random
import time

from tcpx_p2p import p2p

try:
    import torch
except ImportError:  # the shim below stands in
    torch = None


class HostTensor:
    """A 1-D host buffer with torch.Tensor's data_ptr()/numel()/element_size()."""

    def __init__(self, n, elem=1):
        self.n, self.es = n, elem
        self.buf = (ctypes.c_char * max(n * elem, 1))()

    def data_ptr(self):
        return ctypes.addressof(self.buf)

    def numel(self):
        return self.n

    def element_size(self):
        return self.es


# The tests' processes use host memory, or GPU 0 when the test process
# sets UCCL_SHAPES_DEVICE=cuda (a GPU machine with torch).
DEVICE = os.environ.get("UCCL_SHAPES_DEVICE", "cpu")


def tensor(nbytes, seed=None):
    """`nbytes` bytes as a tensor, filled from `seed` (or zero)."""
    if DEVICE == "cuda":
        t = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
        if seed is not None:
            t.copy_(torch.frombuffer(bytearray(pattern(nbytes, seed)), dtype=torch.uint8))
        # The fill runs on PyTorch's stream; the engine's copies do not wait
        # for it: a receive that lands before the zeroing runs is zeroed.
        torch.cuda.synchronize()
        return t
    t = torch.zeros(nbytes, dtype=torch.uint8) if torch is not None else HostTensor(nbytes)
    if seed is not None:
        ctypes.memmove(t.data_ptr(), pattern(nbytes, seed), nbytes)
    return t


def zero(t):
    if DEVICE == "cuda":
        t.zero_()
        torch.cuda.synchronize()
    else:
        ctypes.memset(t.data_ptr(), 0, nbytes(t))


def nbytes(t):
    return t.numel() * t.element_size()


def pattern(n, seed):
    return random.Random(seed).randbytes(n)


def digest_of(t, off=0, n=None):
    n = nbytes(t) - off if n is None else n
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        return hashlib.sha256(t[off : off + n].cpu().numpy().tobytes()).hexdigest()
    return hashlib.sha256(ctypes.string_at(t.data_ptr() + off, n)).hexdigest()


def sha(b):
    return hashlib.sha256(b).hexdigest()


def wait_done(ep, ids):
    """UCCL's benchmarks' loop: poll every id until each reports done."""
    deadline = time.time() + 60
    while ids:
        left = []
        for x in ids:
            ok, done = ep.poll_async(x)
            assert ok, ep.last_error()
            if not done:
                left.append(x)
        ids = left
        assert time.time() < deadline, "transfers did not finish"


# ------------------------------------------------- test_engine_write/read


def onesided_initiator(chan, mode, size, seed):
    """test_engine_write.py's `server_proc` (and _read's): connect by the
    peer's metadata, register, take the peer's 64-byte descriptor, write
    into it (or read from it)."""
    ip, port, r_gpu = p2p.Endpoint.parse_metadata(chan.recv())
    ep = p2p.Endpoint(local_gpu_idx=0)
    ok, conn_id = ep.connect(remote_ip_addr=ip, remote_gpu_bdf=r_gpu, remote_port=port)
    assert ok, ep.last_error()
    t = tensor(size, seed if mode == "write" else None)
    ok, mr_id = ep.reg(t.data_ptr(), nbytes(t))
    assert ok
    fifo_meta = chan.recv()
    assert isinstance(fifo_meta, bytes) and len(fifo_meta) == 64
    call = ep.write if mode == "write" else ep.read
    ok = call(conn_id=conn_id, mr_id=mr_id, ptr=t.data_ptr(), size=nbytes(t), meta=fifo_meta)
    assert ok, ep.last_error()
    chan.send("done")
    chan.recv()
    return digest_of(t)


def onesided_target(chan, mode, size, seed, new_advertise=False):
    """The other side: accept, register, advertise(conn_id, mr_id, ptr,
    size) (UCCL main: advertise(mr_id, ptr, size)), hand the blob over, and
    make no further call while the peer moves the bytes."""
    ep = p2p.Endpoint(local_gpu_idx=0)
    chan.send(bytes(ep.get_metadata()))
    ok, r_ip, r_gpu, conn_id = ep.accept()
    assert ok, ep.last_error()
    t = tensor(size, seed if mode == "read" else None)
    ok, mr_id = ep.reg(t.data_ptr(), nbytes(t))
    assert ok
    if new_advertise:
        ok, fifo_blob = ep.advertise(mr_id, t.data_ptr(), nbytes(t))
    else:
        ok, fifo_blob = ep.advertise(conn_id, mr_id, t.data_ptr(), nbytes(t))
    assert ok and isinstance(fifo_blob, bytes) and len(fifo_blob) == 64
    chan.send(bytes(fifo_blob))
    assert chan.recv() == "done"
    chan.send("bye")
    return digest_of(t)


# ------------------------------------------- benchmark_uccl_readwrite.py


def _blocks(ep, sizes, num_iovs, seed, only=None):
    """num_iovs registered buffers per size (UCCL's `_make_buffer` + reg);
    block i of the k-th size filled from seed + 100 k + i. `only`: that
    size alone (registered on the fly)."""
    out = {}
    for k, sz in enumerate(sizes):
        if only is not None and sz != only:
            continue
        per = sz // num_iovs
        ts, mr_id_v, ptr_v, size_v = [], [], [], []
        for i in range(num_iovs):
            t = tensor(per, None if seed is None else seed + 100 * k + i)
            ok, mr_id = ep.reg(t.data_ptr(), per)
            assert ok, ep.last_error()
            ts.append(t)
            mr_id_v.append(mr_id)
            ptr_v.append(t.data_ptr())
            size_v.append(per)
        out[sz] = (ts, mr_id_v, ptr_v, size_v)
    return out


def readwrite_server(chan, sizes, num_iovs, lazy, mode, seed, new_advertise):
    """benchmark_uccl_readwrite.py's server: accept, advertisev every size's
    blocks, send the blobs, keep still. `new_advertise`: UCCL main's
    advertisev without a connection."""
    ep = p2p.Endpoint(local_gpu_idx=0)
    chan.send(bytes(ep.get_metadata()))
    fill = seed if mode == "read" else None
    pre = _blocks(ep, sizes, num_iovs, fill) if lazy else None
    ok, r_ip, r_gpu, conn_id = ep.accept()
    assert ok
    digests = {}
    for sz in sizes:
        ts, mr_id_v, ptr_v, size_v = pre[sz] if lazy else _blocks(ep, sizes, num_iovs, fill, sz)[sz]
        if new_advertise:
            ok, fifo_blob_v = ep.advertisev(mr_id_v=mr_id_v, ptr_v=ptr_v, size_v=size_v, num_iovs=num_iovs)
        else:
            ok, fifo_blob_v = ep.advertisev(conn_id, mr_id_v, ptr_v, size_v, num_iovs)
        assert ok, ep.last_error()
        assert all(len(b) == 64 for b in fifo_blob_v)
        chan.send([bytes(b) for b in fifo_blob_v])
        assert chan.recv() == "barrier"
        digests[sz] = [digest_of(t) for t in ts]
        chan.send("barrier")
    return digests


def readwrite_client(chan, sizes, num_iovs, lazy, mode, seed, async_api):
    """benchmark_uccl_readwrite.py's client: connect, then per size write
    (or read) all blocks, sync or async (polling), a warm-up and `iters`
    rounds, with UCCL's keyword names."""
    ep = p2p.Endpoint(local_gpu_idx=0)
    remote_metadata = chan.recv()
    fill = seed if mode == "write" else None
    pre = _blocks(ep, sizes, num_iovs, fill) if lazy else None
    ip, port, r_gpu = p2p.Endpoint.parse_metadata(remote_metadata)
    ok, conn_id = ep.connect(ip, r_gpu, remote_port=port)
    assert ok
    digests = {}
    for sz in sizes:
        ts, mr_id_v, ptr_v, size_v = pre[sz] if lazy else _blocks(ep, sizes, num_iovs, fill, sz)[sz]
        fifo_blob_v = chan.recv()
        for _ in range(3):  # warm-up and two timed rounds in UCCL's loop
            if async_api:
                if num_iovs == 1:
                    call = ep.write_async if mode == "write" else ep.read_async
                    ok, transfer_id = call(conn_id, mr_id_v[0], ptr_v[0], size_v[0], fifo_blob_v[0])
                else:
                    call = ep.writev_async if mode == "write" else ep.readv_async
                    ok, transfer_id = call(
                        conn_id=conn_id,
                        mr_id_v=mr_id_v,
                        ptr_v=ptr_v,
                        size_v=size_v,
                        meta_blob_v=fifo_blob_v,
                        num_iovs=num_iovs,
                    )
                assert ok, ep.last_error()
                wait_done(ep, [transfer_id])
            else:
                call = ep.writev if mode == "write" else ep.readv
                assert call(conn_id, mr_id_v, ptr_v, size_v, fifo_blob_v, num_iovs), ep.last_error()
        digests[sz] = [digest_of(t) for t in ts]
        chan.send("barrier")
        assert chan.recv() == "barrier"
    return digests


# ------------------------------------------------------ benchmark_uccl.py


def sendrecv_server(chan, sizes, kvblocks, async_api):
    """benchmark_uccl.py's server (receiver): accept, then per size recv
    (kvblocks == 1) or recvv, sync or async with poll_async."""
    ep = p2p.Endpoint(local_gpu_idx=0)
    chan.send(bytes(ep.get_metadata()))
    ok, r_ip, r_gpu, conn_id = ep.accept()
    assert ok
    out = {}
    for sz in sizes:
        per = sz // kvblocks
        ts = [tensor(per) for _ in range(kvblocks)]
        mr_id_v = []
        for t in ts:
            ok, mr_id = ep.reg(t.data_ptr(), per)
            mr_id_v.append(mr_id)
        data_ptr_v = [t.data_ptr() for t in ts]
        size_v = [per] * kvblocks
        if kvblocks == 1:
            if async_api:
                ok, transfer_id = ep.recv_async(conn_id, mr_id_v[0], data_ptr_v[0], size_v[0])
                assert ok, ep.last_error()
                wait_done(ep, [transfer_id])
            else:
                assert ep.recv(conn_id=conn_id, mr_id=mr_id_v[0], ptr=data_ptr_v[0], size=size_v[0])
        elif async_api:
            ok, transfer_id = ep.recvv_async(conn_id, mr_id_v, data_ptr_v, size_v, kvblocks)
            assert ok, ep.last_error()
            wait_done(ep, [transfer_id])
        else:
            assert ep.recvv(
                conn_id=conn_id, mr_id_v=mr_id_v, data_ptr_v=data_ptr_v, size_v=size_v, num_iovs=kvblocks
            ), ep.last_error()
        out[sz] = [digest_of(t) for t in ts]
        for m in mr_id_v:
            assert ep.dereg(m)
    chan.send("done")  # the sender keeps its endpoint until everything landed
    return out


def sendrecv_client(chan, sizes, kvblocks, async_api, seed):
    """benchmark_uccl.py's client (sender)."""
    ep = p2p.Endpoint(local_gpu_idx=0)
    ip, port, r_gpu = p2p.Endpoint.parse_metadata(chan.recv())
    ok, conn_id = ep.connect(ip, r_gpu, remote_port=port)
    assert ok
    out = {}
    for k, sz in enumerate(sizes):
        per = sz // kvblocks
        ts = [tensor(per, seed + 100 * k + i) for i in range(kvblocks)]
        ok, mr_id_v = ep.regv(ptrs=[t.data_ptr() for t in ts], sizes=[per] * kvblocks)
        assert ok
        data_ptr_v = [t.data_ptr() for t in ts]
        size_v = [per] * kvblocks
        if kvblocks == 1:
            if async_api:
                ok, transfer_id = ep.send_async(conn_id=conn_id, mr_id=mr_id_v[0], ptr=data_ptr_v[0], size=per)
                assert ok
                wait_done(ep, [transfer_id])
            else:
                assert ep.send(conn_id, mr_id_v[0], data_ptr_v[0], size_v[0]), ep.last_error()
        elif async_api:
            ok, transfer_id = ep.sendv_async(
                conn_id=conn_id, mr_id_v=mr_id_v, data_ptr_v=data_ptr_v, size_v=size_v, num_iovs=kvblocks
            )
            assert ok
            wait_done(ep, [transfer_id])
        else:
            assert ep.sendv(conn_id, mr_id_v, data_ptr_v, size_v, kvblocks), ep.last_error()
        out[sz] = [digest_of(t) for t in ts]
    assert chan.recv() == "done"
    return out


def late_receiver(chan, n):
    """test_gpu_index_mapping.py's `_subprocess_ipc_server`: accept, and
    only then allocate, register and receive, after the sender has sent
    and gone. Says "posting" just before it posts its receive."""
    ep = p2p.Endpoint(0)
    chan.send(bytes(ep.get_metadata()))
    ok, r_ip, r_gpu, conn_id = ep.accept()
    assert ok
    assert chan.recv() == "sent"
    time.sleep(0.5)  # the sender's process ends meanwhile
    t = tensor(n)
    ok, mr_id = ep.reg(t.data_ptr(), n)
    assert ok
    chan.send("posting")
    assert ep.recv(conn_id, mr_id, t.data_ptr(), size=n), ep.last_error()
    return digest_of(t)


def sender_exits(chan, n, seed):
    """test_gpu_index_mapping.py's `_subprocess_ipc_client`: connect by the
    peer's metadata with UCCL's keywords, send once and exit at once (no
    close, no goodbye). The send returns once its bytes are out of the
    tensor; the endpoint's end (its drop, as the process exits) waits for
    the receiver's acknowledgement. Returns whether the receiver had begun
    posting its receive when the endpoint's end was over, and the digest
    of what was sent."""
    ip, port, remote_bdf = p2p.Endpoint.parse_metadata(chan.recv())
    ep = p2p.Endpoint(0)
    ok, conn_id = ep.connect(remote_ip_addr=ip, remote_gpu_bdf=remote_bdf, remote_port=port)
    assert ok
    t = tensor(n, seed)
    ok, mr_id = ep.reg(t.data_ptr(), n)
    assert ok
    sent = digest_of(t)
    ok = ep.send(conn_id, mr_id, t.data_ptr(), n)
    assert ok, ep.last_error()
    chan.send("sent")
    del ep  # what the process's exit does
    return chan.poll(0) and chan.recv() == "posting", sent


def clamp_receiver(chan, reg_n, cap, buf_n, guard_seed):
    """test_engine_send.py's `server_process`: accept, register `reg_n`
    bytes and post `recv(..., size=cap)` into them, with cap > reg_n; once
    per message the sender sends. The registration is the start of a
    `buf_n`-byte buffer whose every byte holds a guard pattern, so a byte
    written past the registration would show. Per receive: (ok, the
    reason if not, digest of the registered bytes, digest of the rest)."""
    ep = p2p.Endpoint(local_gpu_idx=0)
    chan.send(bytes(ep.get_metadata()))
    ok, _, _, conn_id = ep.accept()
    assert ok
    t = tensor(buf_n, guard_seed)
    ok, mr_id = ep.reg(t.data_ptr(), reg_n)
    assert ok
    got = []
    for _ in range(chan.recv()):
        ok = ep.recv(conn_id, mr_id, t.data_ptr(), size=cap)
        got.append((ok, "" if ok else ep.last_error(), digest_of(t, 0, reg_n), digest_of(t, reg_n)))
    chan.send("done")
    return got


def clamp_sender(chan, sizes, seed):
    """test_engine_send.py's `client_process`: connect and send one message
    of each size (message i filled from seed + i)."""
    ip, port, r_gpu = p2p.Endpoint.parse_metadata(chan.recv())
    ep = p2p.Endpoint(local_gpu_idx=0)
    ok, conn_id = ep.connect(remote_ip_addr=ip, remote_gpu_bdf=r_gpu, remote_port=port)
    assert ok, ep.last_error()
    chan.send(len(sizes))
    for i, n in enumerate(sizes):
        t = tensor(n, seed + i)
        ok, mr_id = ep.reg(t.data_ptr(), n)
        assert ok
        # The send of a message too large for the receive may complete
        # (its bytes left this buffer) or fail (the connection failed
        # first): the receiver's side is what is checked.
        ep.send(conn_id, mr_id, t.data_ptr(), n)
    assert chan.recv() == "done"
    return True


def dual_side(chan, first, sizes, seed):
    """benchmark_uccl.py --dual: each side accepts one connection and makes
    one; per size each receives on one and sends on the other at once."""
    ep = p2p.Endpoint(local_gpu_idx=0)
    chan.send(bytes(ep.get_metadata()))
    ip, port, r_gpu = p2p.Endpoint.parse_metadata(chan.recv())
    if first:
        ok, r_ip, r_gpu2, conn_id = ep.accept()
        assert ok
        ok, conn_id2 = ep.connect(ip, r_gpu, remote_port=port)
        assert ok
    else:
        ok, conn_id = ep.connect(ip, r_gpu, remote_port=port)
        assert ok
        ok, r_ip, r_gpu2, conn_id2 = ep.accept()
        assert ok
    recv_conn, send_conn = (conn_id, conn_id2) if first else (conn_id2, conn_id)
    out = {}
    for k, size in enumerate(sizes):
        rx, tx = tensor(size), tensor(size, seed + k + (0 if first else 1000))
        ok, mr_id = ep.reg(rx.data_ptr(), size)
        ok, mr_id2 = ep.reg(tx.data_ptr(), size)
        ok, t1 = ep.recv_async(recv_conn, mr_id, rx.data_ptr(), size)
        assert ok
        ok, t2 = ep.send_async(send_conn, mr_id2, tx.data_ptr(), size)
        assert ok
        wait_done(ep, [t1, t2])
        out[size] = (digest_of(rx), digest_of(tx))
    chan.send("done")
    assert chan.recv() == "done"
    return out


# --------------------------------------- test_remove_remote_endpoint.py


def remove_side(chan, rank, seed):
    """test_remove_remote_endpoint.py's two-process tests on one pair of
    endpoints that add each other: add then remove, remove twice,
    remove then re-add (a new id), and a transfer on a removed id raising
    RuntimeError("Invalid conn_id"); before removing, a transfer() each
    way through register_memory descriptors, bytes checked."""

    def barrier():
        chan.send("b")
        assert chan.recv() == "b"

    ep = p2p.Endpoint(0)
    ep.start_passive_accept()
    chan.send(bytes(ep.get_metadata()))
    remote_meta = chan.recv()

    assert ep.remove_remote_endpoint(999999) is False  # invalid conn_id
    ok, conn_id = ep.add_remote_endpoint(metadata_bytes=remote_meta)
    assert ok, ep.last_error()
    barrier()
    assert ep.remove_remote_endpoint(conn_id) is True
    assert ep.remove_remote_endpoint(conn_id) is False  # double remove
    barrier()
    ok, conn_id2 = ep.add_remote_endpoint(remote_meta)
    assert ok and conn_id2 != conn_id

    n = 64 << 10
    # src: ours; wdst: the peer writes its src here; rdst: we read the peer's src here.
    src, wdst, rdst = tensor(n, seed + rank), tensor(n), tensor(n)
    local_descs = ep.register_memory(tensor_list=[src, wdst, rdst])
    chan.send(ep.get_serialized_descs(desc_list=local_descs))
    remote_descs = ep.deserialize_descs(serialized_bytes=chan.recv())
    barrier()
    ok, w = ep.transfer(conn_id2, "write", local_desc_list=[local_descs[0]], remote_desc_list=[remote_descs[1]])
    assert ok, ep.last_error()
    ok, r = ep.transfer(
        conn_id=conn_id2, op_name="read", local_desc_list=[local_descs[2]], remote_desc_list=[remote_descs[0]]
    )
    assert ok, ep.last_error()
    wait_done(ep, [w, r])
    barrier()
    got = (digest_of(wdst), digest_of(rdst))

    assert ep.remove_remote_endpoint(conn_id2) is True
    barrier()
    try:
        ep.transfer(conn_id2, "write", local_descs, remote_descs)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    ep.deregister_memory(desc_list=local_descs)
    barrier()
    return {"got": got, "raised": raised}


# ---------------------------------------------------- benchmark_ray_p2p.py


def ray_server(chan, sizes, num_iovs, iters, per_iter, mode, seed):
    """benchmark_ray_p2p.py's server: register the blocks as tensors, send
    the serialized descriptors, keep still while the client moves bytes;
    `per_iter` ("normal mode"): register and deregister every iteration."""
    ep = p2p.Endpoint(0)
    chan.send(bytes(ep.get_metadata()))
    out = {}
    for k, sz in enumerate(sizes):
        per = sz // num_iovs
        fill = (lambda i: seed + 100 * k + i) if mode == "read" else (lambda i: None)
        buf_v = [tensor(per, fill(i)) for i in range(num_iovs)]
        rounds = iters + 1 if per_iter else 1
        for _ in range(rounds):
            remote_descs = ep.register_memory(buf_v)
            chan.send(ep.get_serialized_descs(remote_descs))
            assert chan.recv() == "barrier"
            ep.deregister_memory(remote_descs)
        out[sz] = [digest_of(t) for t in buf_v]
        chan.send("barrier")
    return out


def ray_client(chan, sizes, num_iovs, iters, per_iter, mode, seed):
    """benchmark_ray_p2p.py's client: register, add_remote_endpoint,
    deserialize, transfer(conn_id, mode, local, remote), poll until done,
    deregister, remove_remote_endpoint."""
    ep = p2p.Endpoint(0)
    remote_metadata = chan.recv()
    out = {}
    for k, sz in enumerate(sizes):
        per = sz // num_iovs
        fill = (lambda i: seed + 100 * k + i) if mode == "write" else (lambda i: None)
        buf_v = [tensor(per, fill(i)) for i in range(num_iovs)]
        rounds = iters + 1 if per_iter else 1
        for _ in range(rounds):
            local_descs = ep.register_memory(buf_v)
            success, conn_id = ep.add_remote_endpoint(remote_metadata)
            assert success, ep.last_error()
            remote_descs = ep.deserialize_descs(chan.recv())
            for _ in range(1 if per_iter else iters + 1):
                success, transfer_id = ep.transfer(conn_id, mode, local_descs, remote_descs)
                assert success, ep.last_error()
                wait_done(ep, [transfer_id])
            ep.deregister_memory(local_descs)
            assert ep.remove_remote_endpoint(conn_id)
            chan.send("barrier")
        out[sz] = [digest_of(t) for t in buf_v]
        assert chan.recv() == "barrier"
    return out


# -------------------------------------------- test_register_memory_cache


def cache_owner(chan, n, seed):
    """Registers one tensor twice and hands the first descriptor out;
    releases the handles one at a time while the peer reads."""
    ep = p2p.Endpoint(0)
    chan.send(bytes(ep.get_metadata()))
    ok, _ip, _gpu, _conn = ep.accept()
    assert ok
    t = tensor(n, seed)
    d1 = ep.register_memory([t])[0]
    d2 = ep.register_memory([t])[0]
    assert d1.mr_id != d2.mr_id and d1.rkeys == d2.rkeys
    chan.send(ep.get_serialized_descs([d1]))
    assert chan.recv() == "read"
    ep.deregister_memory([d1])
    chan.send("released one")
    assert chan.recv() == "read"
    ep.deregister_memory([d2])
    chan.send("released all")
    assert chan.recv() == "done"
    return None


def cache_reader(chan, n):
    """Reads the owner's tensor through the first descriptor's keys after
    each release; reports the bytes, and whether the last read worked."""
    ep = p2p.Endpoint(0)
    ip, port, gpu = p2p.Endpoint.parse_metadata(chan.recv())
    ok, conn = ep.connect(ip, gpu, port)
    assert ok
    remote = ep.deserialize_descs(chan.recv())
    dst = tensor(n)
    local = ep.register_memory([dst])

    def read():
        zero(dst)
        ok, x = ep.transfer(conn, "read", local, remote)
        assert ok, ep.last_error()
        while True:
            ok, done = ep.poll_async(x)
            if not ok or done:
                return ok
            time.sleep(0.001)

    got = {}
    assert read()
    got["before"] = digest_of(dst)
    chan.send("read")
    assert chan.recv() == "released one"
    assert read(), ep.last_error()
    got["after_one"] = digest_of(dst)
    chan.send("read")
    assert chan.recv() == "released all"
    got["after_all"] = read()
    got["reason"] = ep.last_error()
    chan.send("done")
    return got


def run(tag, fn, chan, out, args):
    """Target of each spawned process: runs `fn`, reports (tag, "ok",
    result) or (tag, "err", traceback) on `out`."""
    import traceback

    try:
        out.put((tag, "ok", fn(chan, *args)))
    except BaseException:  # noqa: BLE001 - reported to the test process
        out.put((tag, "err", traceback.format_exc()))
