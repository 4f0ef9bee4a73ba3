"""A parent that exits 0 while a grandchild exits 3 without a traceback."""

import multiprocessing
import os

from uccl import p2p  # noqa: F401  (the runner replaces the import)


def grandchild():
    os._exit(3)


def child():
    p = multiprocessing.Process(target=grandchild)
    p.start()
    p.join()


def main():
    p = multiprocessing.Process(target=child)
    p.start()
    p.join()
    print("parent: all tests completed")


if __name__ == "__main__":
    main()
