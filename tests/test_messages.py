"""What a user reads: errors that name the argument once and in our words,
exceptions under the tcpx_p2p module, a peer's clean exit reported as
such on every call, the server's refusal log worded for a reader, and no
colour codes in logs that go to a file."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import connect

import tcpx_p2p
from tcpx_p2p import p2p


@pytest.fixture
def ep():
    return p2p.Endpoint(0)


def test_type_errors_name_the_argument_once(ep):
    with pytest.raises(TypeError) as e:
        ep.reg("abc", 10)
    assert str(e.value) == "argument 'ptr': expected an int, got str"
    with pytest.raises(TypeError) as e:
        ep.send(1, 1, 1, [1])
    assert str(e.value) == "argument 'size': expected an int, got list"
    with pytest.raises(TypeError) as e:
        ep.regv([1, "x"], [1, 1])
    assert str(e.value) == "argument 'ptrs': ptrs[1]: expected an int, got str"


def test_notification_of_the_wrong_type_says_what_to_pass(ep):
    with pytest.raises(TypeError) as e:
        ep.send_notif(1, "hello")
    msg = str(e.value)
    assert msg.startswith("argument 'msg': expected bytes"), msg
    assert "encode" in msg and "extract" not in msg
    with pytest.raises(TypeError, match="argument 'notif': expected bytes"):
        ep.write_async_with_notif(1, 1, 1, 1, b"\0" * 64, "done")


def test_exceptions_are_named_after_the_package(ep):
    with pytest.raises(tcpx_p2p.InvalidArgumentError) as e:
        ep.reg(1, -5)
    assert type(e.value).__module__ == "tcpx_p2p"
    assert type(e.value).__qualname__ == "InvalidArgumentError"
    for cls in (tcpx_p2p.TcpxP2PError, tcpx_p2p.ConnectionLostError, tcpx_p2p.ProtocolError):
        assert cls.__module__ == "tcpx_p2p", cls
    # What a traceback's last line shows.
    import traceback

    line = traceback.format_exception_only(type(e.value), e.value)[-1]
    assert line.startswith("tcpx_p2p.InvalidArgumentError: "), line


@pytest.mark.parametrize("device", ["cpu"])
@pytest.mark.parametrize("how", ["close", "exit"])
def test_peer_exit_reads_the_same_on_every_call(local, peers, how):
    """The peer goes away (closes its endpoint, or its process exits) while
    receives are posted: the receives and every later call on the connection
    say the peer closed it, none that it broke the protocol."""
    ep, bufs = local
    peer = peers()
    conn, _ = connect(ep, peer)
    n = 1 << 20
    _, ptr = bufs.alloc(n)
    ok, mr = ep.reg(ptr, n)
    assert ok
    rxs = []
    for _ in range(8):
        ok, rx = ep.recv_async(conn, mr, ptr, n)
        assert ok
        rxs.append(rx)
    rx = rxs[0]
    if how == "close":
        peer.close()
    else:
        peer.pipe.send(("exit", (0,)))
        peer.proc.join(30)
    deadline = time.monotonic() + 30
    while True:
        ok, done = ep.poll_async(rx)
        if not ok:
            break
        assert not done, "a receive completed with no sender"
        assert time.monotonic() < deadline, "the receive did not fail after the peer left"
        time.sleep(0.01)
    # The socket net sees the peer's close; an ncclNet plugin reports its
    # own "remote error" for the same event, and the connection keeps it.
    gone = ("closed", "remote error")
    recv_reason = ep.last_error()
    assert any(w in recv_reason for w in gone), recv_reason
    assert not ep.send(conn, mr, ptr, n)
    send_reason = ep.last_error()
    assert any(w in send_reason for w in gone), send_reason
    assert "protocol" not in send_reason and "out of step" not in send_reason, send_reason


SERVER = textwrap.dedent(
    """
    import sys, time
    from tcpx_p2p import p2p
    ep = p2p.Endpoint(0)
    ip, port, _ = ep.parse_metadata(ep.get_metadata())
    print(port, flush=True)
    sys.stdin.readline()   # the client has tried
    time.sleep(0.5)        # the handshake thread logs its refusal
    """
)


def test_refusal_log_is_worded_for_a_reader_and_has_no_colour_codes():
    env = dict(os.environ, TCPX_P2P_AUTH_TOKEN="right-token", TCPX_P2P_LOG="warn", TCPX_P2P_IFNAME="lo")
    srv = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(srv.stdout.readline())
        client_env = dict(os.environ, TCPX_P2P_AUTH_TOKEN="wrong-token", TCPX_P2P_IFNAME="lo")
        code = f"from tcpx_p2p import p2p\nprint(p2p.Endpoint(0).connect('127.0.0.1', 0, {port}))"
        cl = subprocess.run([sys.executable, "-c", code], env=client_env, capture_output=True, text=True, timeout=60)
        assert "(False," in cl.stdout, cl.stdout + cl.stderr
        srv.stdin.write("\n")
        srv.stdin.flush()
        _, err = srv.communicate(timeout=60)
    finally:
        srv.kill()
    assert srv.returncode == 0, err
    assert "refused a connection from 127.0.0.1:" in err, err
    assert "cannot connect to" not in err, err
    assert "\x1b[" not in err, repr(err)
