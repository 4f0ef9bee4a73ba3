#!/usr/bin/env python3
"""Where a small message's time goes: reads the `lat:` trace events that
both sides of a bench pair log with TCPX_P2P_LOG=trace (one clock, one
host), orders them in time and prints, for each step from one event to the
next, how often it happened and its median and 90th percentile in µs.

    TCPX_P2P_LOG=trace tcpx-p2p-bench pair --sizes 64K --iters 200 2> trace.log
    python3 benchmarks/lat_breakdown.py trace.log [--json out.json]

Logging costs a few µs per event, so the sum runs above the untraced
figure; the split between the steps is what this is for.
"""

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from datetime import datetime

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LINE = re.compile(r"^(\S+)Z\s+TRACE\s+(?:ThreadId\(\d+\)\s+)?\S+:\s+lat: (.*)$")


def events(lines):
    out = []
    for raw in lines:
        m = LINE.match(ANSI.sub("", raw).strip())
        if not m:
            continue
        ts = datetime.fromisoformat(m.group(1)).timestamp()
        words = m.group(2).split()
        name = " ".join(w for w in words if "=" not in w)
        fields = dict(w.split("=", 1) for w in words if "=" in w)
        if name == "post":
            name = "post send" if fields.get("send") == "true" else "post recv"
        out.append((ts, name))
    out.sort()
    return out


def breakdown(evs):
    steps = defaultdict(list)
    for (t0, a), (t1, b) in zip(evs, evs[1:]):
        steps[(a, b)].append((t1 - t0) * 1e6)
    rows = []
    for (a, b), v in steps.items():
        v.sort()
        rows.append(
            {
                "from": a,
                "to": b,
                "count": len(v),
                "p50_us": round(statistics.median(v), 1),
                "p90_us": round(v[int(0.9 * (len(v) - 1))], 1),
            }
        )
    rows.sort(key=lambda r: -r["count"] * r["p50_us"])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--json")
    a = ap.parse_args()
    with open(a.log, errors="replace") as f:
        evs = events(f)
    if not evs:
        sys.exit(f"{a.log}: no 'lat:' trace events (run with TCPX_P2P_LOG=trace)")
    rows = breakdown(evs)
    print(f"{'from':<22}{'to':<22}{'count':>7}{'p50 us':>9}{'p90 us':>9}")
    for r in rows:
        if r["count"] >= 5:
            print(f"{r['from']:<22}{r['to']:<22}{r['count']:>7}{r['p50_us']:>9.1f}{r['p90_us']:>9.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"events": len(evs), "steps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
