"""The pages that describe the code name only what exists, so they cannot
rot unnoticed: every path docs/ARCHITECTURE.md names is a file or folder of
the repository (a path without a crate is under crates/p2p-engine/src/),
every test it cites is defined where it says, every `Type::name` it cites
is defined on that type, and benchmarks/README.md lists every script in
benchmarks/ and names none that is gone (but in its table of old names)."""

import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "crates" / "p2p-engine" / "src"
ARCH = ROOT / "docs" / "ARCHITECTURE.md"
BENCH = ROOT / "benchmarks"

EXT = r"(?:rs|py|pyi|sh|md|c|h|hpp|cpp|toml|txt)"
# A path: words joined by '/', ending in a file with a known extension or in
# a folder's '/'; `./run` is the one extensionless file the pages name.
PATH = re.compile(rf"^(?:\./run|[\w.-]+(?:/[\w.-]+)*\.{EXT}|[\w.-]+(?:/[\w.-]+)*/)$")
TEST_REF = re.compile(rf"^([\w./-]+\.(?:py|rs))::(\w+)(…)?$")
SYMBOL = re.compile(r"^(?:[a-z_]\w*::)*(\w+)::(\w+)")
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)


def resolve(path):
    """The file or folder `path` names: from the root, else in the engine."""
    path = path.rstrip("/") or path
    for base in (ROOT, ENGINE):
        if (base / path).exists():
            return base / path
    return None


def split_fences(text):
    """(prose, [fenced blocks])."""
    blocks = FENCE.findall(text)
    return FENCE.sub("", text), blocks


def backticked(prose):
    return re.findall(r"`([^`\n]+)`", prose)


def arch_paths():
    """Every path the page names: in backticks, as a page link in prose, or
    as a token of its layer diagram."""
    prose, blocks = split_fences(ARCH.read_text())
    found = {t for t in backticked(prose) if PATH.match(t)}
    for word in re.findall(r"(?<![\w/.])((?:docs|benchmarks|tests|crates|fuzz|include)/[\w./-]*[\w/])", prose):
        found.add(word)
    diagram = blocks[0]
    for token in diagram.split():
        token = token.strip("(),:;")
        if "/" in token.strip("/") or re.search(rf"\.{EXT}$", token):
            if PATH.match(token):
                found.add(token)
    return sorted(found)


@pytest.mark.parametrize("path", arch_paths())
def test_architecture_names_only_paths_that_exist(path):
    assert resolve(path), f"docs/ARCHITECTURE.md names {path}, which is neither at the root nor under crates/p2p-engine/src/"


def file_map():
    """(entry, its folder or file, the names on its lines) of the page's file
    map: a line at the left margin names a path from the root, an indented
    one a path in crates/p2p-engine/src/, and the files and folders its
    description (and continuation lines) names lie inside it."""
    _, blocks = split_fences(ARCH.read_text())
    block = next(b for b in blocks if b.startswith("crates/p2p-engine/src/"))
    entries = []
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if indent <= 2 and (PATH.match(first) or first == "run"):
            base = ROOT if indent == 0 else ENGINE
            entries.append([first, base / first.rstrip("/"), line[len(first) + indent :]])
        elif entries:
            entries[-1][2] += " " + line
    return entries


@pytest.mark.parametrize("entry,where,desc", file_map(), ids=lambda v: str(v)[:40])
def test_file_map_entries_and_their_files_exist(entry, where, desc):
    assert where.exists(), f"the file map names {entry}, which does not exist"
    if not where.is_dir():
        return
    names = re.findall(rf"(?<![\w/.`])([\w-]+(?:/[\w-]+)*(?:\.{EXT}|/))(?=[\s,;:)]|$)", desc)
    for name in names:
        last = name.rstrip("/").split("/")[-1]
        hits = [p for p in where.rglob(last) if str(p).endswith(name.rstrip("/"))]
        assert hits, f"the file map says {entry} holds {name}, which is not under {where.relative_to(ROOT)}"


@lru_cache(maxsize=None)
def rust_sources():
    return {p: p.read_text() for p in (ROOT / "crates").rglob("*.rs")}


@lru_cache(maxsize=None)
def crate_roots():
    """{library name (`tcpx_p2p_wire`): its src/lib.rs} of the workspace's crates."""
    out = {}
    for toml in (ROOT / "crates").glob("*/Cargo.toml"):
        m = re.search(r'(?ms)^\[lib\][^\[]*?^name\s*=\s*"(\w+)"', toml.read_text())
        if m and (toml.parent / "src" / "lib.rs").exists():
            out[m.group(1)] = toml.parent / "src" / "lib.rs"
    return out


def cited_tests():
    prose, _ = split_fences(ARCH.read_text())
    return [m for m in (TEST_REF.match(t) for t in backticked(prose)) if m]


@pytest.mark.parametrize("m", cited_tests(), ids=lambda m: m.group(0))
def test_cited_tests_exist(m):
    path, name, prefix = m.groups()
    f = resolve(path)
    assert f and f.is_file(), f"docs/ARCHITECTURE.md cites {path}, which does not exist"
    kw = "def" if path.endswith(".py") else "fn"
    pat = rf"\b{kw} {name}" + ("" if prefix else r"\b")
    assert re.search(pat, f.read_text()), f"{path} defines no {name}{prefix or ''}"


def symbols():
    prose, _ = split_fences(ARCH.read_text())
    out = set()
    for t in backticked(prose):
        if TEST_REF.match(t):
            continue
        m = SYMBOL.match(t)
        if m:
            out.add(m.group(0))
    return sorted(out)


def defines(text, name):
    kinds = r"(?:fn|struct|enum|trait|const|static|type|mod)"
    return re.search(rf"\b{kinds}\s+{name}\b", text) or re.search(rf"^\s*{name}\b\s*(?:[,({{]|$)", text, re.M)


@pytest.mark.parametrize("sym", symbols())
def test_cited_symbols_exist(sym):
    owner, name = sym.split("::")[-2:]
    if owner in crate_roots():
        # crate::item: the item is defined in (or re-exported by) the crate's root.
        files = [crate_roots()[owner].read_text()]
    elif owner[0].islower():
        # module::item: the item is defined in that module's file.
        files = [t for p, t in rust_sources().items() if p.stem == owner or (p.name == "mod.rs" and p.parent.name == owner)]
    else:
        # Type::item: defined in a file that defines or implements the type.
        files = [
            t
            for t in rust_sources().values()
            if re.search(rf"\b(?:struct|enum|trait)\s+{owner}\b|\bimpl(?:<[^>]*>)?\s+(?:\w+(?:<[^>]*>)?\s+for\s+)?{owner}\b", t)
        ]
    assert files, f"docs/ARCHITECTURE.md cites {sym}: no Rust file defines {owner}"
    assert any(defines(t, name) for t in files), f"docs/ARCHITECTURE.md cites {sym}: {owner} has no {name}"


def bench_readme():
    text = (BENCH / "README.md").read_text()
    current, _, old = text.partition("## Old names")
    return current, old


def test_benchmarks_readme_lists_every_script():
    current, _ = bench_readme()
    scripts = sorted(p.name for p in BENCH.iterdir() if p.is_file() and p.name != "README.md")
    missing = [s for s in scripts if s not in current]
    assert not missing, f"benchmarks/README.md does not say what these are for: {missing}"


def test_benchmarks_readme_names_only_scripts_that_exist():
    current, old = bench_readme()
    named = set(re.findall(r"(?<![\w/.-])([\w/.-]*\w\.(?:sh|py|c))\b", current))
    gone = sorted(n for n in named if not (BENCH / n).exists() and resolve(n) is None)
    assert not gone, f"benchmarks/README.md names scripts that are gone (move them to its old names): {gone}"
    # The old names are gone: a script still here must not be listed as replaced.
    for line in re.findall(r"`(\w+\.sh)[^`]*` →", old):
        assert not (BENCH / line).exists(), f"{line} is listed as an old name but still exists"


def round_steps():
    """The steps benchmarks/gpu_round.sh carries out (its case branches)."""
    text = (BENCH / "gpu_round.sh").read_text()
    body = text.split("step() {", 1)[1]
    steps = set()
    for pats in re.findall(r"^\s{4}([\w|]+)\)", body, re.M):
        steps.update(pats.split("|"))
    return text, sorted(steps)


def test_gpu_round_documents_every_step():
    text, steps = round_steps()
    assert {"suites", "nets", "nixl", "uccl"} <= set(steps), steps
    header = "\n".join(l for l in text.splitlines() if l.startswith("#"))
    current, _ = bench_readme()
    for st in steps:
        assert re.search(rf"^#\s+{st}\s", header, re.M), f"gpu_round.sh's header does not describe its step {st}"
        assert f"`{st}`" in current, f"benchmarks/README.md does not name gpu_round.sh's step {st}"
