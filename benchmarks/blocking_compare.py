"""Before and after, from two folders of blocking-mode runs (`--inflight
1`, several runs each, alternated on one machine): per op and size the
median over the runs of the p50, of the floor measured in the same runs,
and of their ratio, with the range of the ratios, as a Markdown table.

    python3 benchmarks/blocking_compare.py BEFORE_DIR AFTER_DIR
"""

import glob
import json
import os
import statistics
import sys

from blocking_summary import size_name


def load(folder):
    rows = {}
    loads = []
    for f in sorted(glob.glob(os.path.join(folder, "*.json"))):
        d = json.load(open(f))
        la = d.get("loadavg") or {}
        loads.append(round((la.get("start") or [0])[0], 1))
        for r in d["rows"]:
            if r.get("inflight") == 1:
                rows.setdefault((r["op"], r["size"]), []).append(r)
    return rows, loads


def med(rs, key):
    v = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(v) if v else None


def main(before, after):
    b, bl = load(before)
    a, al = load(after)
    print(f"runs: before {len(bl)} (1-min load {bl}), after {len(al)} (1-min load {al})\n")
    print("| op | size | before p50 µs | after p50 µs | floor p50 µs | before ÷ floor | after ÷ floor (range over runs) |")
    print("|---|---|---|---|---|---|---|")
    order = {"write": 0, "read": 1, "send": 2}
    for key in sorted(set(b) | set(a), key=lambda k: (order.get(k[0], 9), k[1])):
        rb, ra = b.get(key, []), a.get(key, [])
        fl = med(rb + ra, "floor_p50_us")
        ratios = [r["p50_vs_floor"] for r in ra if r.get("p50_vs_floor") is not None]
        rng = f" ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else ""

        def f(x, d=1):
            return "–" if x is None else f"{x:.{d}f}"

        print(
            f"| {key[0]} | {size_name(key[1])} | {f(med(rb, 'lat_p50_us'))} | {f(med(ra, 'lat_p50_us'))} | {f(fl)} "
            f"| {f(med(rb, 'p50_vs_floor'), 2)} | {f(med(ra, 'p50_vs_floor'), 2)}{rng} |"
        )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2])
