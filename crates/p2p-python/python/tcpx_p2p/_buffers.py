"""Buffers for the demo and the benchmark: host memory (ctypes) or GPU
memory (torch), filled with a seeded pattern and hashed with SHA-256."""

import ctypes
import hashlib
import random


def parse_size(s):
    """'4K' → 4096, '256M', '1G', '100' (powers of 1024)."""
    s = str(s).strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def fmt_size(n):
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def pattern(n, seed):
    """`n` deterministic bytes: one random MiB, repeated."""
    blk = random.Random(seed).randbytes(min(n, 1 << 20)) if n else b""
    return (blk * (n // max(len(blk), 1) + 1))[:n]


class Buffer:
    """`n` bytes in host memory, or on GPU `gpu` (needs PyTorch)."""

    def __init__(self, n, gpu=None):
        self.n, self.gpu = n, gpu
        if gpu is None:
            self.obj = (ctypes.c_char * max(n, 1))()
            self.ptr = ctypes.addressof(self.obj)
        else:
            import torch

            self.obj = torch.zeros(max(n, 1), dtype=torch.uint8, device=f"cuda:{gpu}")
            self.ptr = self.obj.data_ptr()

    def fill(self, seed):
        data = pattern(self.n, seed)
        if self.gpu is None:
            ctypes.memmove(self.ptr, data, self.n)
        else:
            import torch

            self.obj[: self.n].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            torch.cuda.synchronize(self.gpu)

    def clear(self):
        if self.gpu is None:
            ctypes.memset(self.ptr, 0, self.n)
        else:
            import torch

            self.obj.zero_()
            torch.cuda.synchronize(self.gpu)

    def bytes(self, off=0, n=None):
        n = self.n - off if n is None else n
        if self.gpu is None:
            return ctypes.string_at(self.ptr + off, n)
        import torch

        torch.cuda.synchronize(self.gpu)
        return self.obj[off : off + n].cpu().numpy().tobytes()

    def digest(self, off=0, n=None):
        return hashlib.sha256(self.bytes(off, n)).hexdigest()

    def digest_blocks(self, offsets, bs):
        """SHA-256 of the `bs`-byte blocks at `offsets`, in that order."""
        data = memoryview(self.bytes())
        h = hashlib.sha256()
        for off in offsets:
            h.update(data[off : off + bs])
        return h.hexdigest()


def block_offsets(nblk, bs, layout, seed):
    """Where `nblk` KV blocks of `bs` bytes sit in a pool of exactly that
    size: back to back ("contiguous", one tensor of consecutive blocks), or
    a seeded permutation of the pool's slots ("scattered", as a paged KV
    cache's block table hands them out)."""
    order = list(range(nblk))
    if layout == "scattered":
        random.Random(seed).shuffle(order)
    return [i * bs for i in order]
