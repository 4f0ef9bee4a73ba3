#!/usr/bin/env python3
"""The table of README.md from the runs' JSON files (run.sh)."""
import glob
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
rows = {}
for b in ["new", "old"]:
    for f in sorted(glob.glob(os.path.join(here, f"local_bench_cpu_{b}_run*.json"))):
        for row in json.load(open(f))["rows"]:
            rows.setdefault(row["size"], {}).setdefault(b, []).append(row)


def span(v, fmt="{:.1f}"):
    v = sorted(v)
    return f"{fmt.format(v[0])}-{fmt.format(v[-1])} (median {fmt.format(v[len(v) // 2])})"


print("| size | way | old p50 µs | new p50 µs | old read_ipc ÷ engine | new read_ipc ÷ engine |")
print("|---|---|---|---|---|---|")
for s in sorted(rows):
    v = rows[s]
    for way, ipc in [("tcp_read", "read_ipc"), ("tcp_write", "write_ipc")]:
        o = [x[way]["p50_us"] for x in v["old"]]
        n = [x[way]["p50_us"] for x in v["new"]]
        ro = [x[ipc]["p50_us"] / x[way]["p50_us"] for x in v["old"]]
        rn = [x[ipc]["p50_us"] / x[way]["p50_us"] for x in v["new"]]
        name = "read" if way == "tcp_read" else "write"
        print(f"| {s // 1024} KiB | {name} | {span(o)} | {span(n)} | {span(ro, '{:.2f}')} | {span(rn, '{:.2f}')} |")
