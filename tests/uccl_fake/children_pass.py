"""A parent whose two children pass their checks: judged a pass. Each child
sends its check's result through a pipe, and the parent checks it too."""

import multiprocessing

from uccl import p2p


def child(conn, n):
    conn.send(sum(range(n)))
    assert hasattr(p2p, "Endpoint")


def main():
    got = []
    for n in (10, 100):
        a, b = multiprocessing.Pipe()
        p = multiprocessing.Process(target=child, args=(b, n))
        p.start()
        got.append(a.recv())
        p.join()
    assert got == [45, 4950], got
    print("parent: all tests completed")


if __name__ == "__main__":
    main()
