#!/usr/bin/env python3
"""The longest Rust functions under the given directories (default: crates/*/src),
by the lines from `fn` to its closing brace (found by brace depth, skipping
strings, chars and comments). Usage: python3 benchmarks/fn_lengths.py [-n 10] [DIR...]"""
import argparse
import pathlib
import re

FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+\"C\"\s+)?fn\s+(\w+)")


def strip(line, state):
    """The line with strings, chars and comments blanked; `state` carries an
    open block comment across lines."""
    out, i, n = [], 0, len(line)
    while i < n:
        if state["block"]:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out)
            state["block"], i = False, j + 2
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state["block"], i = True, i + 2
            continue
        if c == '"':
            i += 1
            while i < n and line[i] != '"':
                i += 2 if line[i] == "\\" else 1
            i += 1
            continue
        if c == "'" and re.match(r"'(\\.|[^\\'])'", line[i:]):
            i += len(re.match(r"'(\\.|[^\\'])'", line[i:]).group(0))
            continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(path):
    lines = path.read_text().splitlines()
    state, found, stack, depth = {"block": False}, [], [], 0
    for no, raw in enumerate(lines, 1):
        m = FN.match(raw)
        code = strip(raw, state)
        if m and not state["block"]:
            stack.append((m.group(7), no, depth))
        for ch in code:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if stack and depth == stack[-1][2]:
                    name, start, _ = stack.pop()
                    found.append((no - start + 1, f"{path}:{start}", name))
        # A declaration without a body (trait method, extern): drop it.
        if stack and code.rstrip().endswith(";") and depth == stack[-1][2]:
            stack.pop()
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("dirs", nargs="*", default=["crates"])
    a = ap.parse_args()
    allf = []
    for d in a.dirs:
        for p in sorted(pathlib.Path(d).rglob("*.rs")):
            if "/src/" in str(p):
                allf += functions(p)
    for n, where, name in sorted(allf, reverse=True)[: a.n]:
        print(f"{n:5d}  {name:32s} {where}")


if __name__ == "__main__":
    main()
