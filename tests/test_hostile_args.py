"""No Python call surfaces a panic, whatever its arguments: every method of
the API is called with hostile values in each argument (negative, huge,
NaN, infinite, of the wrong type, empty or mismatched lists, num_iovs that
disagrees with the lists). Each call must answer (a normal return), or
raise one of our errors (all RuntimeErrors) or a TypeError. A PyO3
PanicException derives from BaseException, and an OverflowError or
ValueError is neither allowed kind: any of them fails the test."""

import ctypes
import math

import pytest
from conftest import connect

from tcpx_p2p import cuda_device_count, p2p

ALLOWED = (p2p.TcpxP2PError, TypeError)

INTS = [-1, -(2**63), 2**64, 2**200, 1.5, math.nan, math.inf, "7", None, b"xyz", [], object()]
LISTS = [[], [-1], [2**64], [1.5], ["a"], [None], "abc", b"abc", None, 5, [2**200, 1]]
BLOBS = [b"", b"x" * 63, b"x" * 65, "x" * 64, [1] * 64, [-1], None, 7, bytearray(3)]
BLOB_LISTS = [[], [b"short"], [None], [b"x" * 64] * 3, "x", None, [[-1] * 64]]
TIMEOUTS = [-1, -0.5, math.nan, -math.inf, 1e19, 1e30, 1e300, float(2**64), 2**64, 2**70, -1e300, "1", b"1", [], object()]


class Tensor:
    """A tensor-like object whose answers are chosen by the test."""

    def __init__(self, ptr, numel, es):
        self.v = (ptr, numel, es)

    def data_ptr(self):
        return self.v[0]

    def numel(self):
        return self.v[1]

    def element_size(self):
        return self.v[2]


def outcome(f, *a, **kw):
    """'ok' or the name of the allowed exception raised; anything else
    propagates and fails the test."""
    try:
        f(*a, **kw)
        return "ok"
    except ALLOWED as e:
        return type(e).__name__


@pytest.fixture
def setup():
    ep = p2p.Endpoint(0)
    buf = (ctypes.c_char * 4096)()
    ptr = ctypes.addressof(buf)
    ok, mr = ep.reg(ptr, 4096)
    assert ok
    ok, meta = ep.advertise(mr, ptr, 64)
    assert ok and len(meta) == 64
    desc = ep.register_memory([Tensor(ptr, 4096, 1)])[0]
    yield ep, buf, ptr, mr, meta, desc
    ep.deregister_memory([desc])


# An unknown connection id makes every data call fail before it could
# block, so the sweep below exercises argument handling alone.
NOCONN = 999_999


def calls(ptr, mr, meta, desc):
    """(method name, base arguments that are well-formed, kinds per argument)."""
    i, l_, b, bl = "int", "list", "blob", "blobs"
    one = (NOCONN, mr, ptr, 16)
    vec = (NOCONN, [mr], [ptr], [16], 1)
    vecm = (NOCONN, [mr], [ptr], [16], [meta], 1)
    return [
        ("reg", (ptr, 16), (i, i)),
        ("regv", ([ptr], [16]), (l_, l_)),
        ("dereg", (123456,), (i,)),
        ("send", one, (i,) * 4),
        ("recv", one, (i,) * 4),
        ("send_async", one, (i,) * 4),
        ("recv_async", one, (i,) * 4),
        ("sendv", vec, (i, l_, l_, l_, i)),
        ("recvv", vec, (i, l_, l_, l_, i)),
        ("sendv_async", vec, (i, l_, l_, l_, i)),
        ("recvv_async", vec, (i, l_, l_, l_, i)),
        ("advertise", one, (i,) * 4),
        ("advertise", (mr, ptr, 16), (i,) * 3),
        ("advertisev", vec, (i, l_, l_, l_, i)),
        ("advertisev", ([mr], [ptr], [16], 1), (l_, l_, l_, i)),
        ("write", one + (meta,), (i,) * 4 + (b,)),
        ("read", one + (meta,), (i,) * 4 + (b,)),
        ("write_async", one + (meta,), (i,) * 4 + (b,)),
        ("read_async", one + (meta,), (i,) * 4 + (b,)),
        ("writev", vecm, (i, l_, l_, l_, bl, i)),
        ("readv", vecm, (i, l_, l_, l_, bl, i)),
        ("writev_async", vecm, (i, l_, l_, l_, bl, i)),
        ("readv_async", vecm, (i, l_, l_, l_, bl, i)),
        ("poll_async", (424242,), (i,)),
        ("wait", (424242, 0.0), (i, "timeout")),
        ("cancel", (424242, 0.0), (i, "timeout")),
        ("accept", (0.0,), ("timeout",)),
        ("accept_local", (0.0,), ("timeout",)),
        ("send_notif", (NOCONN, b"hi"), (i, b)),
        ("write_async_with_notif", one + (meta, b"n"), (i,) * 4 + (b, b)),
        ("read_async_with_notif", one + (meta, b"n"), (i,) * 4 + (b, b)),
        # same-host calls (an unknown connection: arguments alone)
        ("advertise_ipc", (NOCONN, ptr, 16), (i,) * 3),
        ("advertisev_ipc", (NOCONN, [ptr], [16]), (i, l_, l_)),
        ("write_ipc", (NOCONN, ptr, 16, b"x" * 64), (i,) * 3 + (b,)),
        ("read_ipc", (NOCONN, ptr, 16, b"x" * 64), (i,) * 3 + (b,)),
        ("write_ipc_async", (NOCONN, ptr, 16, b"x" * 64), (i,) * 3 + (b,)),
        ("read_ipc_async", (NOCONN, ptr, 16, b"x" * 64), (i,) * 3 + (b,)),
        ("writev_ipc", (NOCONN, [ptr], [16], [b"x" * 64]), (i, l_, l_, bl)),
        ("readv_ipc", (NOCONN, [ptr], [16], [b"x" * 64]), (i, l_, l_, bl)),
        ("writev_ipc_async", (NOCONN, [ptr], [16], [b"x" * 64]), (i, l_, l_, bl)),
        ("readv_ipc_async", (NOCONN, [ptr], [16], [b"x" * 64]), (i, l_, l_, bl)),
        ("send_ipc", (NOCONN, ptr, 16), (i,) * 3),
        ("recv_ipc", (NOCONN, ptr, 16), (i,) * 3),
        ("send_ipc_async", (NOCONN, ptr, 16), (i,) * 3),
        ("recv_ipc_async", (NOCONN, ptr, 16), (i,) * 3),
        ("remove_remote_endpoint", (NOCONN,), (i,)),
        ("conn_id_of_rank", (3,), (i,)),
        ("add_remote_endpoint", (b"\x7f\x00\x00\x01\x00\x01\x00",), (b,)),
        ("parse_metadata", (b"",), (b,)),
        ("deserialize_descs", (b"",), (b,)),
        ("transfer", (NOCONN, "write", [desc], [desc]), (i, "any", "descs", "descs")),
        ("get_serialized_descs", ([desc],), ("descs",)),
        ("deregister_memory", ([p2p.XferDesc(0, 0, 2**64 - 1)],), ("descs",)),
        ("register_memory", ([Tensor(ptr, 16, 1)],), ("tensors",)),
    ]


def hostile(kind):
    return {
        "int": INTS,
        "list": LISTS,
        "blob": BLOBS,
        "blobs": BLOB_LISTS,
        "timeout": TIMEOUTS,
        "any": INTS + LISTS,
        "descs": [[], [None], [1], "x", None, [p2p.XferDesc()], [p2p.XferDesc(2**64 - 1, 2**64 - 1, 2**64 - 1, [], [1, 2])]],
        "tensors": [
            [],
            None,
            [1],
            [Tensor(-1, 4, 4)],
            [Tensor(1, -4, 4)],
            [Tensor(1, 2**62, 2**10)],
            [Tensor(2**64, 1, 1)],
            [Tensor("p", 1, 1)],
            [Tensor(0, 1, 1)],
            [Tensor(1, 2**40, 1)],
        ],
    }[kind]


def test_every_call_with_hostile_arguments(setup):
    ep, _buf, ptr, mr, meta, desc = setup
    seen = {}
    for name, base, kinds in calls(ptr, mr, meta, desc):
        f = getattr(ep, name)
        for pos, kind in enumerate(kinds):
            for v in hostile(kind):
                args = list(base)
                args[pos] = v
                r = outcome(f, *args)
                seen[r] = seen.get(r, 0) + 1
    # Lists that disagree with each other or with num_iovs.
    for name in ["sendv", "recvv", "sendv_async", "recvv_async"]:
        for lists, n in [(([mr], [ptr, ptr], [16]), 1), (([mr], [ptr], [16]), 2), (([], [], []), 1), (([mr], [ptr], [16]), 0)]:
            with pytest.raises(p2p.InvalidArgumentError, match="num_iovs"):
                getattr(ep, name)(NOCONN, *lists, n)
    for name in ["writev", "readv", "writev_async", "readv_async"]:
        with pytest.raises(p2p.InvalidArgumentError, match="meta_blob_v"):
            getattr(ep, name)(NOCONN, [mr], [ptr], [16], [meta, meta], 1)
    with pytest.raises(p2p.InvalidArgumentError, match="ptr_v"):
        ep.advertisev([mr, mr], [ptr], [16, 16], 2)
    with pytest.raises(p2p.InvalidArgumentError, match="regv"):
        ep.regv([ptr], [16, 16])
    assert sum(seen.values()) > 1000 and set(seen) <= {"ok", "TypeError", "InvalidArgumentError"} | {
        e.__name__ for e in (p2p.ConnectError, p2p.ConnectionLostError, p2p.RefusedError)
    }, seen
    # The endpoint still works after all that.
    ok, blob = ep.advertise(mr, ptr, 32)
    assert ok and len(blob) == 64


def test_constructors_and_connect_with_hostile_arguments():
    seen = []
    for v in INTS:
        seen.append(outcome(p2p.Endpoint, v))
        seen.append(outcome(p2p.Endpoint, 0, v))
        seen.append(outcome(p2p.XferDesc, v))
        seen.append(outcome(p2p.XferDesc, 0, 0, 0, [v]))
        d = p2p.XferDesc()
        for field in ["addr", "size", "mr_id", "lkeys", "rkeys"]:
            seen.append(outcome(setattr, d, field, v))
    ep = p2p.Endpoint(0)
    for v in INTS + LISTS:
        seen.append(outcome(ep.connect, v, 0, 1))
        seen.append(outcome(ep.connect, "127.0.0.1", v, 1))
        seen.append(outcome(ep.connect, "127.0.0.1", 0, v))
    assert "ok" in seen and "InvalidArgumentError" in seen and "TypeError" in seen


HOSTILE_TIMEOUTS = [-1, -0.001, math.nan, -math.inf, 1e19, 1e30, 1e300, 2.0**64, 2**64, 2**70]


@pytest.mark.parametrize("bad", HOSTILE_TIMEOUTS)
def test_timeouts_are_checked(bad):
    """Defect: accept(timeout=-1), NaN, inf, 1e300 panicked, and so did
    accept_local (9 of 12 hostile values raised PanicException). Negative,
    NaN and finite values past 1e9 s are refused naming the argument, by
    every call that takes a timeout; None and +inf mean no limit."""
    ep = p2p.Endpoint(0)
    for call in (ep.accept, ep.accept_local):
        with pytest.raises(p2p.InvalidArgumentError, match="timeout"):
            call(timeout=bad)
        with pytest.raises(p2p.InvalidArgumentError, match="timeout"):
            call(bad)
    with pytest.raises(p2p.InvalidArgumentError, match="timeout"):
        ep.wait(1, bad)
    with pytest.raises(p2p.InvalidArgumentError, match="timeout"):
        ep.cancel(1, bad)
    # The error is catchable as an ordinary exception (a PanicException is not).
    try:
        ep.accept_local(bad)
    except Exception as e:  # noqa: BLE001 - the point of the test
        assert isinstance(e, p2p.TcpxP2PError)
    # And the endpoint still answers.
    assert ep.accept_local(0.0) == (False, "", -1)


def test_infinite_timeout_waits_without_limit(local, peers):
    ep, bufs = local
    peer = peers()
    ip, port, _ = ep.parse_metadata(ep.get_metadata())
    peer.pipe.send(("ep", ("connect", (ip, 0, port))))
    ok, _ip, _gpu, conn = ep.accept(timeout=math.inf)
    assert ok and peer._reply()[0]
    n = 4096
    b, ptr = bufs.alloc(n)
    ok, mr = ep.reg(ptr, n)
    ok, rx = ep.recv_async(conn, mr, ptr, n)
    sb, sptr = peer.call("alloc", n, 6)
    ok, smr = peer.ep("reg", sptr, n)
    assert peer.ep("send", peer.ep("conn_ids")[0], smr, sptr, n)
    assert ep.wait(rx, math.inf)
    assert bufs.data(b) == peer.call("data", sb)


def test_negative_sizes_and_ids_name_the_argument(setup):
    ep, _buf, ptr, mr, meta, desc = setup
    with pytest.raises(p2p.InvalidArgumentError, match="size"):
        ep.reg(ptr, -5)
    with pytest.raises(p2p.InvalidArgumentError, match="ptr"):
        ep.reg(-ptr, 5)
    with pytest.raises(p2p.InvalidArgumentError, match="conn_id"):
        ep.send(-1, mr, ptr, 5)
    with pytest.raises(p2p.InvalidArgumentError, match="mr_id"):
        ep.write(1, -mr, ptr, 5, meta)
    with pytest.raises(p2p.InvalidArgumentError, match=r"size_v\[1\]"):
        ep.sendv(1, [mr, mr], [ptr, ptr], [4, -4], 2)
    with pytest.raises(p2p.InvalidArgumentError, match="num_iovs"):
        ep.sendv(1, [mr], [ptr], [4], -1)
    with pytest.raises(p2p.InvalidArgumentError, match=r"tensor_list\[0\].numel"):
        ep.register_memory([Tensor(ptr, -1, 4)])
    with pytest.raises(TypeError, match="size"):
        ep.reg(ptr, "5")


def test_gpu_index_checked():
    """Endpoint(-5) is refused; Endpoint(7) is refused where CUDA shows
    fewer GPUs, and where there is no CUDA at all (only 0 or None then)."""
    with pytest.raises(p2p.InvalidArgumentError, match="local_gpu_idx"):
        p2p.Endpoint(-5)
    with pytest.raises(p2p.InvalidArgumentError, match="local_gpu_idx"):
        p2p.Endpoint(local_gpu_idx=2**40)
    n = cuda_device_count()
    if n <= 7:
        with pytest.raises(p2p.InvalidArgumentError, match="local_gpu_idx"):
            p2p.Endpoint(7)


def test_keyword_forms_of_advertise(local, peers):
    """advertise/advertisev by keyword in both of UCCL's forms; a
    descriptor made without a connection works on a connection made after
    it; wrong combinations are TypeErrors."""
    ep, bufs = local
    n = 8192
    b, ptr = bufs.alloc(n)
    ok, mr = ep.reg(ptr, n)
    ok, any_conn = ep.advertise(mr_id=mr, ptr=ptr, size=n)
    assert ok
    ok, blobs = ep.advertisev(mr_id_v=[mr], ptr_v=[ptr], size_v=[n], num_iovs=1)
    assert ok and len(blobs) == 1
    with pytest.raises(TypeError):
        ep.advertise(mr, ptr)
    with pytest.raises(TypeError):
        ep.advertise(mr, ptr, n, mr_id=mr)
    with pytest.raises(TypeError):
        ep.advertise(conn_id=1, ptr=ptr, size=n)
    peer = peers()
    cid, pcid = connect(ep, peer)
    ok, per_conn = ep.advertise(conn_id=cid, mr_id=mr, ptr=ptr, size=n)
    assert ok
    sb, sptr = peer.call("alloc", n, 12)
    ok, smr = peer.ep("reg", sptr, n)
    assert peer.ep("write", pcid, smr, sptr, n // 2, any_conn), peer.ep("last_error")
    assert bufs.data(b, 0, n // 2) == peer.call("data", sb, 0, n // 2)
    assert peer.ep("write", pcid, smr, sptr + n // 2, n // 2, per_conn)
    assert bufs.data(b, 0, n // 2) == peer.call("data", sb, n // 2, n // 2)


def test_module_functions_with_hostile_arguments():
    """The module's own functions (the benchmark's raw-TCP reference among
    them) take the same checks."""
    import socket

    from tcpx_p2p import _native

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()
    seen = []
    base = ("127.0.0.1", closed, 1, 16, 1)
    for pos in range(len(base)):
        for v in INTS + ["", "::::", 0]:
            args = list(base)
            args[pos] = v
            seen.append(outcome(_native.rawtcp_run, *args))
    for v in INTS:
        if isinstance(v, int) and 0 <= v < 65536:
            continue  # a real port: it would start a server
        seen.append(outcome(_native.rawtcp_serve, "127.0.0.1", v))
    assert set(seen) <= {"TypeError", "InvalidArgumentError", "TcpxP2PError", "ConnectError"}, seen
    with pytest.raises(p2p.InvalidArgumentError, match="streams"):
        _native.rawtcp_run("127.0.0.1", closed, 0, 16, 1)
