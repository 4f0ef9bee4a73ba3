"""Raw TCP's answer to the same question as `--gap`: N bytes one way over
loopback and 8 back, each exchange after GAP ms of idle time (both sides
blocked in recv meanwhile, as a plain TCP program would be), p50 / p99 in
microseconds. Two processes.

    python3 cold_tcp.py GAP_MS SIZE [COUNT]
"""

import multiprocessing as mp
import socket
import statistics
import sys
import time


def serve(port_q, size, count):
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port_q.put(ls.getsockname()[1])
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(count):
        got = 0
        while got < size:
            b = c.recv(size - got)
            if not b:
                return
            got += len(b)
        c.sendall(b"x" * 8)


def main():
    gap, size = float(sys.argv[1]) / 1e3, int(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    q = mp.Queue()
    p = mp.Process(target=serve, args=(q, size, count))
    p.start()
    s = socket.create_connection(("127.0.0.1", q.get()))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data, lats = b"y" * size, []
    for _ in range(count):
        time.sleep(gap)
        t = time.perf_counter()
        s.sendall(data)
        got = 0
        while got < 8:
            got += len(s.recv(8 - got))
        lats.append((time.perf_counter() - t) * 1e6)
    p.join()
    lats = sorted(lats[5:])
    print(f"gap {gap * 1e3:g} ms, {size} B one way + 8 back: p50 {statistics.median(lats):.1f} us, p99 {lats[int(len(lats) * 0.99) - 1]:.1f} us")


if __name__ == "__main__":
    main()
