"""A stand-in for the rx rule manager (rxdm) that Google's GPUDirect-TCPX
plugin asks, on accept, to steer each data socket's flow to a NIC queue.
On a machine without A3 NICs there is nothing to steer: this listener
answers every request "Ok." as rxdm does once a rule is installed, and logs
what it was asked. It serves the two unix sockets the plugin connects to,
``PREFIX/rx_rule_manager`` and ``PREFIX/rx_rule_uninstall``
(``NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX``).

Framing (read from the plugin's unix-socket client): each message is a
2-byte big-endian length, then that many bytes of a serialized
``UnixSocketProto``; the answer is ``UnixSocketProto{raw_bytes: "Ok."}``,
i.e. field 1 (bytes) = "Ok.": ``0a 03 4f 6b 2e``.

    python3 rx_rule_manager_standin.py PREFIX [LOG]     (runs until killed)
"""

import os
import socket
import struct
import sys
import threading
import time

OK = b"\x0a\x03Ok."


def serve_one(conn, name, log):
    with conn:
        while True:
            head = conn.recv(2, socket.MSG_WAITALL)
            if len(head) < 2:
                return
            (n,) = struct.unpack(">H", head)
            body = conn.recv(n, socket.MSG_WAITALL) if n else b""
            if len(body) < n:
                return
            log.write(f"{time.time():.6f} {name} request {n} bytes: {body.hex()}\n")
            log.flush()
            conn.sendall(struct.pack(">H", len(OK)) + OK)


def listen(path, log):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(256)
    name = os.path.basename(path)
    while True:
        conn, _ = s.accept()
        threading.Thread(target=serve_one, args=(conn, name, log), daemon=True).start()


def main():
    prefix = sys.argv[1]
    log = open(sys.argv[2], "a") if len(sys.argv) > 2 else sys.stdout
    os.makedirs(prefix, exist_ok=True)
    for name in ("rx_rule_manager", "rx_rule_uninstall"):
        threading.Thread(target=listen, args=(os.path.join(prefix, name), log), daemon=True).start()
    log.write(f"rx rule manager stand-in listening under {prefix}\n")
    log.flush()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
