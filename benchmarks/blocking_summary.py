"""Summarises runs of the benchmark's blocking mode (`--inflight N`) kept
in one folder: per op and size, the median over the runs of each figure
and the range of the p50s, as a Markdown table.

    python3 benchmarks/blocking_summary.py FOLDER [INFLIGHT]
"""

import glob
import json
import os
import statistics
import sys


def size_name(n):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def main(folder, inflight=1):
    docs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(folder, "*.json")))]
    docs = [d for d in docs if d["args"].get("inflight") == inflight]
    if not docs:
        sys.exit(f"no --inflight {inflight} runs in {folder}")
    rows = {}
    for d in docs:
        for r in d["rows"]:
            rows.setdefault((r["op"], r.get("batch", 1), r["size"]), []).append(r)
    loads = [f"{d['loadavg']['start'][0]:.1f}–{d['loadavg']['end'][0]:.1f}" for d in docs if "loadavg" in d]
    print(f"{len(docs)} runs, --inflight {inflight}, memory {docs[0]['args']['memory']}, net {docs[0]['net']}, {docs[0]['streams']} streams, on {docs[0].get('cpus')} CPUs")
    if loads:
        print(f"load average (1 min) at each run's start–end: {', '.join(loads)}")
    print()
    ratio_name = "p50 ÷ floor" if inflight == 1 else "µs per transfer ÷ floor"
    print(f"| op | size | µs per transfer | p50 µs (range over runs) | p99 µs | floor p50 µs (range) | {ratio_name} (range) |")
    print("|---|---|---|---|---|---|---|")
    m = statistics.median
    for (op, batch, size), rs in rows.items():
        per = m(r["us_per_transfer"] for r in rs)
        p50 = [r["lat_p50_us"] for r in rs]
        p99 = m(r["lat_p99_us"] for r in rs)
        fl = [r["floor_p50_us"] for r in rs if "floor_p50_us" in r]
        # One in flight: p50 ÷ floor; several: µs per transfer ÷ floor (a
        # transfer's own time then includes its wait behind the others).
        if inflight == 1:
            ra = [r["lat_p50_us"] / r["floor_p50_us"] for r in rs if r.get("floor_p50_us")]
        else:
            ra = [r["us_per_transfer"] / r["floor_p50_us"] for r in rs if r.get("floor_p50_us")]
        what = f"`{op}`" + (f" × {batch}" if batch > 1 else "")
        floor = f"{m(fl):,.1f} ({min(fl):,.1f}–{max(fl):,.1f})" if fl else "–"
        ratio = f"{m(ra):.2f} ({min(ra):.2f}–{max(ra):.2f})" if ra else "–"
        print(f"| {what} | {size_name(size)} | {per:,.1f} | {m(p50):,.1f} ({min(p50):,.1f}–{max(p50):,.1f}) | {p99:,.1f} | {floor} | {ratio} |")
    print()
    print("(medians over the runs; floor: raw TCP moving the same bytes one way and back, measured in the same run)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
