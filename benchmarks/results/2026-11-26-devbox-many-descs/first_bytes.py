"""From a log of `LOOP_MARK=1 TCPX_P2P_LOG=trace python loop.py ...` (both
processes' stderr): per timed transfer, milliseconds from the call to
agent.transfer (MARK) to the first one-sided request sent (`ctl out
WriteReq/ReadReq`), to the first data message posted (`isend`, on the side
that sends the bytes) and to the last transfer end seen before the next
mark. Prints the medians."""
import re
import statistics
import sys
from datetime import datetime


def ts(s):
    return datetime.strptime(s[:26], "%Y-%m-%dT%H:%M:%S.%f").timestamp() * 1e3


rows, cur = [], None
for line in open(sys.argv[1]):
    if line.startswith("MARK "):
        cur = {"mark": ts(line[5:].strip())}
        rows.append(cur)
        continue
    if cur is None or "lat:" not in line:
        continue
    t = ts(line)
    if re.search(r"lat: ctl out (WriteReq|ReadReq)", line):
        cur.setdefault("req", t)
    elif "lat: isend" in line:
        cur.setdefault("isend", t)
    elif "lat: ended" in line:
        cur["end"] = t
ok = [r for r in rows if {"req", "isend", "end"} <= r.keys()]
med = lambda k: statistics.median(r[k] - r["mark"] for r in ok)
print(f"{len(ok)} transfers: first request {med('req'):.1f} ms, first data {med('isend'):.1f} ms, end {med('end'):.1f} ms (medians, from the call)")
