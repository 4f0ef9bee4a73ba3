#!/usr/bin/env python3
"""The engine's module import graph (`crate::a::b` and `super::x` paths in
crates/p2p-engine/src), its cycles between sibling modules, and any
ground-floor module (error, memory, topo, config) that imports from `net`
or above (the byte formats and the GPU helpers are crates of their own,
below the engine, and cannot import it at all). Exits non-zero on either. Usage:
python3 benchmarks/import_graph.py [--edges]"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "crates/p2p-engine/src"
GROUND = {"error", "memory", "topo", "config"}
UPPER = {"net", "conn", "endpoint", "progress", "transfer", "rma"}


def module_of(path):
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


def strip_tests(text):
    # Test modules may reach anywhere; the graph is of the code.
    i = text.find("#[cfg(test)]\nmod tests")
    return text if i < 0 else text[:i]


def edges():
    out = {}
    for p in SRC.rglob("*.rs"):
        me = module_of(p)
        if me and me[-1] == "tests":
            continue
        text = re.sub(r"//.*", "", strip_tests(p.read_text()))
        deps = set()
        for m in re.finditer(r"\bcrate::(\w+)(?:::(\w+))?", text):
            deps.add(tuple(x for x in m.groups() if x))
        for m in re.finditer(r"\b((?:super::)+)(\w+)", text):
            up = m.group(1).count("super::")
            base = me[: len(me) - up] if up <= len(me) else ()
            deps.add(base + (m.group(2),))
        out[me] = deps
    return out


# The crates below the engine: both the engine and the stand-in use them.
BELOW = {"tcpx-p2p-wire", "tcpx-p2p-gpu", "ncclnet-abi", "tcpx-p2p-timing"}
ENGINE = "tcpx-p2p"
STAND_IN = "nccl-net-emu"
HARNESSES = "tcpx-p2p-fuzzing"


def crate_deps():
    """{crate: set of workspace crates among its normal dependencies}."""
    manifests = {}
    for p in sorted(ROOT.glob("crates/**/Cargo.toml")):
        text = p.read_text()
        name = re.search(r'(?m)^\[package\][^\[]*?^name\s*=\s*"([^"]+)"', text)
        if name:
            manifests[name.group(1)] = text
    out = {}
    for name, text in manifests.items():
        deps = set()
        section = None
        for line in text.splitlines():
            h = re.match(r"\s*\[([^\]]+)\]", line)
            if h:
                section = h.group(1).strip()
                continue
            d = re.match(r"\s*([A-Za-z0-9_-]+)\s*(?:\.workspace\s*)?=", line)
            if section == "dependencies" and d and d.group(1) in manifests:
                deps.add(d.group(1))
        out[name] = deps
    return out


def crates_main():
    g = crate_deps()
    bad = []
    for c, deps in sorted(g.items()):
        print(f"{c} -> {', '.join(sorted(deps)) or '-'}")
        if c in BELOW and deps - BELOW:
            bad.append(f"{c} (below the engine) depends on {', '.join(sorted(deps - BELOW))}")
        if c == STAND_IN and deps - BELOW:
            bad.append(f"the stand-in depends on {', '.join(sorted(deps - BELOW))}")
        if c == ENGINE and deps - BELOW:
            bad.append(f"the engine depends on {', '.join(sorted(deps - BELOW))}")
        if HARNESSES in deps:
            bad.append(f"{c} depends on the fuzz harnesses (a development crate)")
    for b in bad:
        print(b)
    print(f"{len(g)} crates, {len(bad)} problems")
    sys.exit(1 if bad else 0)


def main():
    if "--crates" in sys.argv:
        crates_main()
    g = edges()
    mods = set(g)
    bad = []
    # Ground floor: no edge into net or the engine above it.
    for m, deps in g.items():
        if m and m[0] in GROUND:
            for d in deps:
                if d and d[0] in UPPER:
                    bad.append(f"ground floor {'::'.join(m)} imports {'::'.join(d)}")
    # Cycles between siblings (a parent and its children are one unit).
    def owner(d, parent):
        for k in range(len(d), 0, -1):
            if d[:k] in mods and d[: len(parent)] == parent and len(d[:k]) > len(parent):
                return d[: len(parent) + 1]
        return None
    parents = {m[:-1] for m in mods if m}
    for parent in parents:
        kids = [m for m in mods if len(m) == len(parent) + 1 and m[:-1] == parent]
        adj = {k: set() for k in kids}
        for m, deps in g.items():
            src = m[: len(parent) + 1]
            if src not in adj:
                continue
            for d in deps:
                o = owner(d, parent)
                if o and o != src and o in adj:
                    adj[src].add(o)
        seen, stack = {}, []

        def visit(k):
            seen[k] = 1
            stack.append(k)
            for n in adj[k]:
                if seen.get(n) == 1:
                    cyc = stack[stack.index(n):] + [n]
                    bad.append("cycle: " + " -> ".join("::".join(c) for c in cyc))
                elif n not in seen:
                    visit(n)
            stack.pop()
            seen[k] = 2

        for k in kids:
            if k not in seen:
                visit(k)
    if "--edges" in sys.argv:
        for m in sorted(g):
            print("::".join(m) or "lib", "->", ", ".join(sorted("::".join(d) for d in g[m])))
    for b in bad:
        print(b)
    print(f"{len(g)} modules, {len(bad)} problems")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
