"""Security checks through the Python API (the hostile-peer tests proper
are Rust integration tests: crates/p2p-engine/tests/hostile.rs; see
docs/SECURITY.md)."""

import ctypes
import mmap

import pytest

from tcpx_p2p import p2p


def _gpus():
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


@pytest.mark.parametrize("bad", [-5, 7])
def test_endpoint_on_a_gpu_that_does_not_exist_says_which(bad):
    if bad >= 0 and _gpus() > bad:
        pytest.skip(f"this machine has GPU {bad}")
    with pytest.raises(Exception) as e:
        p2p.Endpoint(bad)
    msg = str(e.value)
    assert f"GPU index {bad}" in msg or f"local_gpu_idx: {bad}" in msg, msg


def test_reg_of_unmapped_memory_names_the_range():
    ep = p2p.Endpoint(0)
    # Map two pages, unmap the second: the range runs into a hole.
    m = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    assert libc.munmap(base + mmap.PAGESIZE, mmap.PAGESIZE) == 0
    ok, mr = ep.reg(base, 2 * mmap.PAGESIZE)
    assert not ok and mr == -1
    err = ep.last_error()
    assert "not all mapped" in err and hex(base) in err, err
    # The mapped page alone registers.
    ok, mr = ep.reg(base, mmap.PAGESIZE)
    assert ok, ep.last_error()
    assert ep.dereg(mr)
