"""A parent that exits 0 while its child dies with an AssertionError (as
UCCL's test_engine_send.py did against a receive it refused)."""

import multiprocessing

from uccl import p2p  # noqa: F401  (the runner replaces the import)


def server():
    got = sum(range(10))
    assert got == 46, f"the child's check failed: {got}"


def main():
    p = multiprocessing.Process(target=server)
    p.start()
    p.join()
    print("parent: all tests completed")


if __name__ == "__main__":
    main()
