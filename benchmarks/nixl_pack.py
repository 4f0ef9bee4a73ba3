#!/usr/bin/env python3
"""Packs NIXL's PyPI wheel (`nixl-cu13`, `nixl-cu12`) small enough to carry
to a GPU machine without a package index (`NIXL_WHEEL=` of
`benchmarks/gpu_round.sh`, steps `nixl` and `vllm`).

The wheel is about 60 MB packed and 220 MB installed; a device call
carries at most 64 MiB with our own wheel. What the benchmarks load is the
Python package, NIXL's core libraries, the UCX backend plugin (the
reference beside ours) with UCX's transports, and the telemetry
exporters; the rest (the `nixl_ep` extension, the storage and fabric
plugins, the libraries only they need) stays behind. Libraries are kept by
the dynamic linker's view: every ELF file kept pulls in the `DT_NEEDED`
libraries the wheel bundles, and the script fails if one is missing.

    python3 benchmarks/nixl_pack.py nixl_cu13-1.5.1-cp312-...whl .device/nixl.tgz

The tarball holds the installed layout (`nixl_cu13/` beside its library
folders); `gpu_round.sh` puts it on PYTHONPATH.
"""

import argparse
import io
import os
import struct
import sys
import tarfile
import zipfile

# Backend plugins kept (by file name); the others need libraries of
# their own (cloud storage, fabrics) the benchmarks never load.
PLUGINS = ("libplugin_UCX.so", "libtelemetry_exporter_", "libtrace_backend_")
# Loaded at run time by UCX itself (dlopen), so never named as needed.
UCX_DIR = "/ucx/"
UCX_SKIP = ("perftest",)


def needed(data):
    """The DT_NEEDED names of an ELF64 little-endian shared object."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        off = shoff + i * shentsize
        _name, typ, _flags, _addr, offset, size, link = struct.unpack_from("<IIQQQQI", data, off)
        sections.append((typ, offset, size, link))
    names = []
    for typ, offset, size, link in sections:
        if typ != 6:  # SHT_DYNAMIC
            continue
        _t, stroff, _s, _l = sections[link]
        for at in range(offset, offset + size, 16):
            tag, val = struct.unpack_from("<qQ", data, at)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", stroff + val)
                names.append(data[stroff + val : end].decode())
    return names


def is_elf(name):
    base = os.path.basename(name)
    return base.endswith(".so") or ".so." in base


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel")
    ap.add_argument("out", help="the .tgz to write")
    a = ap.parse_args()
    z = zipfile.ZipFile(a.wheel)
    files = {i.filename: i for i in z.infolist() if not i.is_dir()}
    pkg = next(n.split("/")[0] for n in files if n.endswith("/_api.py") and n.count("/") == 1)
    # The bundled libraries by file name (what DT_NEEDED names).
    libs = {os.path.basename(n): n for n in files if is_elf(n)}

    keep = set()
    for n in files:
        top = n.split("/")[0]
        if top == pkg:
            keep.add(n)
        elif top == f".{pkg}.mesonpy.libs":
            if "/plugins/" in n and not os.path.basename(n).startswith(PLUGINS):
                continue
            keep.add(n)
        elif top == f"{pkg}.libs" and UCX_DIR in n and not any(s in n for s in UCX_SKIP):
            keep.add(n)
    todo = [n for n in keep if is_elf(n)]
    deps = {}  # each kept library's DT_NEEDED names, read once
    missing = set()
    while todo:
        n = todo.pop()
        deps[n] = needed(z.read(n))
        for lib in deps[n]:
            path = libs.get(lib)
            if path is None:
                missing.add(lib)  # a system library (libc, libcuda, ...)
            elif path not in keep:
                keep.add(path)
                todo.append(path)

    total = 0
    with tarfile.open(a.out, "w:gz") as t:
        for n in sorted(keep):
            data = z.read(n)
            total += len(data)
            info = tarfile.TarInfo(n)
            info.size = len(data)
            info.mode = 0o755 if is_elf(n) else 0o644
            t.addfile(info, io.BytesIO(data))
    # Every library the kept files need that the wheel bundles is kept
    # (checked again from the archive), so the loader finds it there.
    with tarfile.open(a.out) as t:
        names = {os.path.basename(m.name) for m in t.getmembers()}
    lost = sorted({lib for d in deps.values() for lib in d if lib in libs and lib not in names})
    if lost:
        sys.exit(f"needed libraries left out: {lost}")
    print(
        f"{a.out}: {len(keep)} of {len(files)} files, {total / 1e6:.1f} MB unpacked, "
        f"{os.path.getsize(a.out) / 1e6:.1f} MB packed; system libraries they need: {sorted(missing)}"
    )


if __name__ == "__main__":
    main()
