"""UCCL's users, unchanged: tests in the shape of UCCL P2P's own tests and
benchmarks (two processes, the same calls with UCCL's keyword names, host
memory), bytes checked by SHA-256. The process bodies are in uccl_shapes.py;
what each side of UCCL's test or benchmark does is named there."""

import math
import multiprocessing as mp
import os
import queue

import pytest
import uccl_shapes as shapes
from uccl_shapes import HostTensor, pattern, sha

from tcpx_p2p import p2p

KIB = 1 << 10


@pytest.fixture
def shapes_device(device, monkeypatch):
    """Host memory; GPU memory too on a GPU machine (conftest's `device`):
    the spawned processes read UCCL_SHAPES_DEVICE."""
    monkeypatch.setenv("UCCL_SHAPES_DEVICE", device)
    return device


def run_pair(a, a_args, b, b_args, timeout=120):
    """Runs `a` and `b` in two spawned processes joined by a pipe; returns
    their results (a's, b's). Fails with the traceback of a side that
    raised, and kills both if they outlive `timeout`."""
    ctx = mp.get_context("spawn")
    ca, cb = ctx.Pipe()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=shapes.run, args=(0, a, ca, out, a_args), daemon=True),
        ctx.Process(target=shapes.run, args=(1, b, cb, out, b_args), daemon=True),
    ]
    for p in procs:
        p.start()
    res = {}
    try:
        for _ in procs:
            tag, status, val = out.get(timeout=timeout)
            assert status == "ok", f"{(a, b)[tag].__name__} failed:\n{val}"
            res[tag] = val
    except queue.Empty:
        pytest.fail(f"{a.__name__}/{b.__name__} did not finish in {timeout} s")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
    return res[0], res[1]


# ------------------------------------------------- test_engine_write/read


@pytest.mark.parametrize("mode", ["write", "read"])
@pytest.mark.parametrize("new_advertise", [False, True])
def test_engine_write_read(mode, new_advertise, shapes_device):
    """test_engine_write.py / test_engine_read.py: connect with
    remote_ip_addr/remote_gpu_bdf/remote_port, advertise(conn_id, ...) as in
    0.1.1 or advertise(mr_id, ...) as in UCCL main, write/read with the
    64-byte blob."""
    size = 4 * KIB + 3
    init, target = run_pair(
        shapes.onesided_initiator, (mode, size, 5), shapes.onesided_target, (mode, size, 5, new_advertise)
    )
    assert init == target == sha(pattern(size, 5))


# ------------------------------------------- benchmark_uccl_readwrite.py

SIZES = [256, 64 * KIB, 1 << 20]


@pytest.mark.parametrize(
    "mode,num_iovs,async_api,lazy,new_advertise",
    [
        ("write", 1, False, False, False),
        ("read", 1, False, False, False),
        ("write", 4, False, False, False),
        ("read", 4, True, False, False),
        ("write", 1, True, False, False),
        ("write", 4, True, True, False),
        ("read", 4, False, True, True),
        ("write", 1, False, False, True),
    ],
)
def test_benchmark_readwrite_modes(mode, num_iovs, async_api, lazy, new_advertise, shapes_device):
    """benchmark_uccl_readwrite.py's modes (write, read, several iovs,
    --async-api, --lazy) at small sizes, and UCCL main's advertisev without
    a connection; every block's bytes checked on both sides."""
    seed = 40
    server, client = run_pair(
        shapes.readwrite_server,
        (SIZES, num_iovs, lazy, mode, seed, new_advertise),
        shapes.readwrite_client,
        (SIZES, num_iovs, lazy, mode, seed, async_api),
    )
    for k, sz in enumerate(SIZES):
        per = sz // num_iovs
        want = [sha(pattern(per, seed + 100 * k + i)) for i in range(num_iovs)]
        assert server[sz] == want, f"server blocks, size {sz}"
        assert client[sz] == want, f"client blocks, size {sz}"


# ------------------------------------------------------ benchmark_uccl.py


@pytest.mark.parametrize("kvblocks,async_api", [(1, False), (1, True), (8, False), (8, True)])
def test_benchmark_sendrecv_modes(kvblocks, async_api, shapes_device):
    """benchmark_uccl.py's default mode: send/recv (or sendv/recvv of
    --num-kvblocks blocks), sync or --async-api."""
    sizes = [256, 32 * KIB, 1 << 20]
    server, client = run_pair(
        shapes.sendrecv_server, (sizes, kvblocks, async_api), shapes.sendrecv_client, (sizes, kvblocks, async_api, 70)
    )
    for k, sz in enumerate(sizes):
        want = [sha(pattern(sz // kvblocks, 70 + 100 * k + i)) for i in range(kvblocks)]
        assert client[sz] == want and server[sz] == want, f"size {sz}"


def test_benchmark_dual_mode(shapes_device):
    """benchmark_uccl.py --dual: both directions at once over two connections."""
    sizes = [4 * KIB, 1 << 20]
    a, b = run_pair(shapes.dual_side, (True, sizes, 9), shapes.dual_side, (False, sizes, 9))
    for k, sz in enumerate(sizes):
        a_rx, a_tx = a[sz]
        b_rx, b_tx = b[sz]
        assert a_tx == sha(pattern(sz, 9 + k)) and b_tx == sha(pattern(sz, 9 + k + 1000))
        assert a_rx == b_tx and b_rx == a_tx, f"size {sz}"


# ---------------------------------------------------- benchmark_ray_p2p.py


@pytest.mark.parametrize("mode,per_iter", [("write", False), ("read", False), ("write", True), ("read", True)])
def test_benchmark_ray_modes(mode, per_iter, shapes_device):
    """benchmark_ray_p2p.py: register_memory descriptors sent serialized,
    transfer() of num_iovs blocks; raw mode (registered once) and normal
    mode (registered, connected and released every iteration)."""
    sizes, num_iovs, seed = [4 * KIB, 256 * KIB], 4, 60
    args = (sizes, num_iovs, 2, per_iter, mode, seed)
    server, client = run_pair(shapes.ray_server, args, shapes.ray_client, args)
    for k, sz in enumerate(sizes):
        want = [sha(pattern(sz // num_iovs, seed + 100 * k + i)) for i in range(num_iovs)]
        assert server[sz] == client[sz] == want, f"size {sz}"


# --------------------------------------- test_remove_remote_endpoint.py


def test_remove_remote_endpoint(shapes_device):
    """All five of test_remove_remote_endpoint.py's cases between two
    processes, with a transfer() each way (bytes checked) before the
    removal and RuntimeError("Invalid conn_id") after it."""
    r0, r1 = run_pair(shapes.remove_side, (0, 20), shapes.remove_side, (1, 20))
    n = 64 * KIB
    # Each side's wdst holds what the peer wrote; its rdst what it read: the peer's src.
    assert r0["got"] == (sha(pattern(n, 21)), sha(pattern(n, 21)))
    assert r1["got"] == (sha(pattern(n, 20)), sha(pattern(n, 20)))
    for r in (r0, r1):
        assert r["raised"] is not None and "Invalid conn_id" in r["raised"]


# ------------------------------------------------ test_engine_send.py


def test_receive_larger_than_its_registration(shapes_device):
    """test_engine_send.py / test_engine_metadata.py: the server registers
    4 KiB and posts recv(..., size=8192) into them; the client sends 4 KiB.
    The receive's capacity is clamped to its registration: a 4 KiB message
    lands, and a 6 KiB one fails the receive with a clear reason, with no
    byte written past the registration (the buffer around it holds a guard
    pattern that must come back unchanged)."""
    reg, cap, buf = 4 * KIB, 8 * KIB, 16 * KIB
    got, _ = run_pair(shapes.clamp_receiver, (reg, cap, buf, 77), shapes.clamp_sender, ([4 * KIB, 6 * KIB], 40))
    guard_rest = sha(pattern(buf, 77)[reg:])
    (ok1, err1, body1, rest1), (ok2, err2, _, rest2) = got
    assert ok1, err1
    assert body1 == sha(pattern(4 * KIB, 40)) and rest1 == guard_rest
    assert not ok2, "a 6 KiB message was accepted into a 4 KiB registration"
    assert "receive of at most 4096 bytes" in err2, err2
    if os.environ.get("TCPX_P2P_NET", "socket") == "socket":
        # The socket net names the message's size too (a plugin gives only
        # a code; the stand-in logs the sizes).
        assert "6144" in err2, err2
    assert rest2 == guard_rest, "bytes written past the registration"


# ------------------------------------------- test_gpu_index_mapping.py


@pytest.mark.parametrize("n", [4 * KIB, 1 << 20])
def test_sender_exits_right_after_send(n, shapes_device):
    """test_gpu_index_mapping.py's exchange: the receiver registers and
    posts its receive only after the sender has sent and exited. A send
    completes once its bytes are out of the sender's buffer; the end of the
    sender's endpoint (as its process exits) waits until the receiver has
    acknowledged the message, so the exit loses nothing."""
    got, (waited, want) = run_pair(shapes.late_receiver, (n,), shapes.sender_exits, (n, 31))
    assert got == want == sha(pattern(n, 31))
    assert waited, "the sender's endpoint ended before the receiver posted its receive"


# ------------------------------------------------ single-process semantics


def test_register_memory_cache():
    """test_register_memory_cache.py: the same tensor twice → distinct
    mr_id, identical lkeys/rkeys; releasing one keeps the keys for the
    other; a sub-range gets keys of its own (a stricter rule than UCCL's:
    a token bounds exactly its range)."""
    ep = p2p.Endpoint(0)
    t = HostTensor(4096, 4)
    d1 = ep.register_memory([t])[0]
    d2 = ep.register_memory([t])[0]
    assert d1.addr == d2.addr == t.data_ptr() and d1.size == d2.size == 4096 * 4
    assert d1.mr_id != d2.mr_id
    assert d1.lkeys == d2.lkeys and d1.rkeys == d2.rkeys and d1.rkeys
    ep.deregister_memory([d1])
    d3 = ep.register_memory([t])[0]
    assert d3.lkeys == d2.lkeys and d3.rkeys == d2.rkeys
    # Local calls take each handle.
    ok, blob = ep.advertise(d3.mr_id, d3.addr, 16)
    assert ok and len(blob) == 64
    ep.deregister_memory([d2, d3])
    d4 = ep.register_memory([t])[0]
    assert d4.rkeys != d1.rkeys, "all handles released: new keys"
    # A second, overlapping tensor: its own keys.
    sub = HostTensor(1024, 4)
    sub.data_ptr = lambda: t.data_ptr() + 1024  # a view into t
    ds = ep.register_memory([sub])[0]
    assert ds.rkeys != d4.rkeys
    ep.deregister_memory([d4, ds])


def test_register_memory_cache_keys_serve_peers(shapes_device):
    """The shared keys work on the wire while any handle of the range lives,
    and stop working once the last one is released."""
    _, got = run_pair(shapes.cache_owner, (8 * KIB, 3), shapes.cache_reader, (8 * KIB,))
    assert got["before"] == got["after_one"] == sha(pattern(8 * KIB, 3))
    assert got["after_all"] is False


def test_uccl_surface():
    """What UCCL code touches beyond the calls: XferDesc() empty,
    RuntimeError as the base of our errors, transfer() on an unknown
    conn_id raising "Invalid conn_id", keywords of the static calls."""
    assert p2p.kBFloat16 == p2p.FloatType.kBFloat16 and p2p.kUndefined == p2p.FloatType.kUndefined
    d = p2p.XferDesc()
    assert (d.addr, d.size, d.mr_id, d.lkeys, d.rkeys) == (0, 0, 0, [], [])
    d.addr, d.size, d.mr_id, d.lkeys, d.rkeys = 1, 2, 3, [4], [5, 6]
    assert (d.addr, d.size, d.mr_id, d.lkeys, d.rkeys) == (1, 2, 3, [4], [5, 6])
    for e in (p2p.TcpxP2PError, p2p.InvalidArgumentError, p2p.ConnectError, p2p.ConnectionLostError,
              p2p.RefusedError, p2p.CudaError, p2p.ConfigError):
        assert issubclass(e, RuntimeError)
    ep = p2p.Endpoint(local_gpu_idx=0)
    md = ep.get_metadata()
    assert p2p.Endpoint.parse_metadata(metadata=md)[1] > 0
    with pytest.raises(RuntimeError, match="Invalid conn_id"):
        ep.transfer(424242, "write", [], [])
    with pytest.raises(RuntimeError, match="Invalid conn_id"):
        ep.transfer(conn_id=424242, op_name="read", local_desc_list=[], remote_desc_list=[])
    assert ep.deserialize_descs(serialized_bytes=ep.get_serialized_descs(desc_list=[])) == []
    assert ep.deserialize_descs(b"") == []
    with pytest.raises(RuntimeError, match="no access token"):
        ep.get_serialized_descs([p2p.XferDesc()])
    assert ep.conn_id_of_rank(rank=0) == -1
    assert ep.remove_remote_endpoint(conn_id=7) is False
    ok, x = ep.poll_async(transfer_id=99)
    assert ok is False
    ok, _ip, _gpu, _conn = ep.accept(timeout=0)
    assert ok is False and "in time" in ep.last_error()
    assert ep.wait(99, math.inf) is False  # no such transfer: answered at once
