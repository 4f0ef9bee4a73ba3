#!/usr/bin/env python3
"""The timeline of one-sided transfers made of several requests (a vLLM
list of 131,072 blocks goes as 16 requests of 8,192), from
`TCPX_P2P_LOG=trace` logs of both sides in one file (NIXL's two agents,
`nixl_bench.py`, or `crates/p2p-engine/tests/rma_figures.rs`).

Each request's messages are matched by its transfer id (`xfer=` on the
`lat: ctl` lines and on `lat: ended`); in a log without ids, by order (the
control messages of one connection arrive in the order they leave). A
transfer is a run of requests whose posts are less than `--gap` ms apart.
Per request, from the transfer's first post (ms): posted (initiator), read
by the target, cleared (write: `WriteCts`) or accepted (read: `ReadAck`)
by it, and done (the request's transfer ended at the initiator, or, in a
log without ids, `WriteDone` / `ReadAck` in) -- where the requests' checks
end and where the data's time goes.

With `--streams`, each transfer is followed by its receive streams' work
(the `lat: rx header` / `lat: rx done` lines, by thread): parts read,
first and last part header, messages completed there and the median time
between parts -- a stream that ends far after the others (and completes
every message, its part being each one's last) is what the transfer waits
for.

With `--posting`, where the posting call's time went, per transfer of
several requests (the `lat: rma posted` line, and `lat: request posted`
per request): checking every piece, making the parts (the peer's items,
our buffers resolved), and the requests (per request: its runs, its ops, its keys, releasing its list of runs,
the state machine with the request's frame written).

usage: rma_timeline.py LOG [--op write|read] [--gap 5] [--bytes N] [--streams] [--posting]
"""
import argparse, datetime, gzip, re, statistics, sys

# What each request's steps are called, per operation: (message, direction).
# (name, message, direction[, message marking the end in a log without ids]).
STEPS = {
    "write": [("posted", "WriteReq", "out"), ("target in", "WriteReq", "in"),
              ("cleared", "WriteCts", "out"), ("done", "", "ended", "WriteDone")],
    "read": [("posted", "ReadReq", "out"), ("target in", "ReadReq", "in"),
             ("accepted", "ReadAck", "out"), ("done", "", "ended", "ReadAck")],
}


# Colour codes a terminal log may carry.
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def ts(s):
    return datetime.datetime.strptime(s[:26], "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def control_events(lines):
    """(time, what, xfer) of every `lat: ctl` and `lat: ended` trace line,
    in file order; `what` is ("in"|"out", kind) or ("ended", ""), xfer 0
    where the line has none."""
    out = []
    for line in lines:
        line = ANSI.sub("", line)
        m = re.match(r"(\S+) TRACE .*lat: (?:ctl (in|out) (\w+)|(ended))(.*)", line)
        if m:
            x = re.search(r"xfer=(\d+)", m.group(5))
            what = ("ended", "") if m.group(4) else (m.group(2), m.group(3))
            out.append((ts(m.group(1)), what, int(x.group(1)) if x else 0))
    return out


def wholes(lines):
    """Each part's transfer: part xfer id -> the whole's id, from the
    `lat: part of` trace lines (a list posted in several requests)."""
    out = {}
    for line in lines:
        m = re.search(r"lat: part of xfer=(\d+) whole=(\d+)", ANSI.sub("", line))
        if m:
            out[int(m.group(1))] = int(m.group(2))
    return out


def _rows_by_id(events, steps, ids=None):
    """Per request (by its posted line's xfer id), each step's first time
    at or after the step before it; with `ids` (a list), each row's xfer
    id is appended to it."""
    by = {}
    for t, what, x in events:
        if x:
            by.setdefault((what, x), []).append(t)
    rows = []
    for t0, what, x in events:
        if what != (steps[0][2], steps[0][1]) or not x:
            continue
        row, t = [t0], t0
        for st in steps[1:]:
            kind, d = st[1], st[2]
            key = ("ended", "") if d == "ended" else (d, kind)
            later = [u for u in by.get((key, x), []) if u >= t]
            if not later:
                break
            t = later[0]
            row.append(t)
        if len(row) == len(steps):
            rows.append(row)
            if ids is not None:
                ids.append(x)
    return rows


def _rows_by_order(events, steps):
    """Per request, the k-th line of each step (logs without ids)."""
    seen = {}
    for t, what, _ in events:
        seen.setdefault(what, []).append(t)
    cols = [seen.get((d, kind), []) for _, kind, d in steps[:3]]
    cols.append(seen.get(("in", steps[3][3]), []))
    n = min(len(c) for c in cols)
    return [[c[k] for c in cols] for k in range(n)]


def transfers_at(events, op, gap_ms, whole=None):
    """Per transfer, per request, each step's time (seconds, as logged).
    Requests are grouped by the transfer they are parts of where `whole`
    (see `wholes`) names it, else a gap of more than `gap_ms` between two
    posts starts a new transfer (logs without part lines)."""
    steps = STEPS[op]
    with_ids = any(x for _, what, x in events if what[0] != "ended")
    if with_ids and whole:
        ids = []
        rows = _rows_by_id(events, steps, ids)
        groups = {}
        for r, x in sorted(zip(rows, ids)):
            groups.setdefault(whole.get(x, ("own", x)), []).append(r)
        return sorted(groups.values())
    rows = sorted(_rows_by_id(events, steps) if with_ids else _rows_by_order(events, steps))
    if not rows:
        return []
    transfers, cur = [], [rows[0]]
    for r in rows[1:]:
        if (r[0] - cur[-1][0]) * 1e3 > gap_ms:
            transfers.append(cur)
            cur = []
        cur.append(r)
    transfers.append(cur)
    return transfers


def timelines(events, op, gap_ms, whole=None):
    """Per transfer, per request, each step's time from the transfer's first post."""
    return [[[(x - tr[0][0]) * 1e3 for x in r] for r in tr] for tr in transfers_at(events, op, gap_ms, whole)]


def data_events(lines):
    """(time, thread, "header"|"done", seq) of every `lat: rx header` and
    `lat: rx done` trace line, in file order."""
    out = []
    for line in lines:
        line = ANSI.sub("", line)
        m = re.match(r"(\S+) TRACE (ThreadId\(\d+\)) .*lat: rx (header|done) seq=(\d+)", line)
        if m:
            out.append((ts(m.group(1)), m.group(2), m.group(3), int(m.group(4))))
    return out


def streams(data, start, end):
    """Per receive thread with parts between `start` and `end` (seconds):
    (last header, thread, parts, first header, messages completed, median
    seconds between parts), the last to finish last."""
    per = {}
    for t, th, what, _ in data:
        if start <= t <= end:
            per.setdefault(th, []).append((t, what))
    rows = []
    for th, ev in per.items():
        heads = [t for t, w in ev if w == "header"]
        if not heads:
            continue
        done = sum(1 for _, w in ev if w == "done")
        gaps = [b - a for a, b in zip(heads, heads[1:])]
        rows.append((heads[-1], th, len(heads), heads[0], done, statistics.median(gaps) if gaps else 0.0))
    return sorted(rows)


def stream_report(rows, start, out=sys.stdout):
    print("  receive threads: parts, first -> last part header (ms), messages completed there, ms between parts", file=out)
    for last, th, n, first, done, gap in rows:
        print(
            f"  {th:>16} {n:>6} {(first - start) * 1e3:>9.2f} -> {(last - start) * 1e3:>8.2f} {done:>8} {gap * 1e3:>9.3f}",
            file=out,
        )
    if len(rows) > 1:
        lasts = [r[0] for r in rows]
        print(
            f"  the last thread's last part: {(lasts[-1] - statistics.median(lasts)) * 1e3:.2f} ms after the median thread's",
            file=out,
        )


def report(trs, op, nbytes, out=sys.stdout, label=None):
    names = [s[0] for s in STEPS[op]]
    for i, tr in enumerate(trs):
        end = max(r[-1] for r in tr)
        print(f"transfer {i if label is None else label}: {len(tr)} requests, ends at {end:.2f} ms", file=out)
        print("  req " + "".join(f"{n:>11}" for n in names) + f"   {'done - ' + names[2]:>14}", file=out)
        for k, r in enumerate(tr):
            print(f"  {k:>3} " + "".join(f"{x:>11.2f}" for x in r) + f"   {r[-1] - r[2]:>14.2f}", file=out)
        first_clear, last_clear = min(r[2] for r in tr), max(r[2] for r in tr)
        line = f"  requests checked by {last_clear:.2f} ms; data phase {first_clear:.2f} -> {end:.2f} ms"
        if nbytes:
            line += f" ({nbytes / ((end - first_clear) / 1e3) / 1e9:.2f} GB/s)"
        print(line, file=out)


def posting_events(lines):
    """The posting steps the initiator traced: (kind, fields) in order,
    kind `rma` (one per transfer) or `request` (one per request)."""
    out = []
    for raw in lines:
        m = re.search(r"lat: (rma|request) posted (.*)$", ANSI.sub("", raw))
        if m:
            out.append((m.group(1), {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}))
    return out


def posting_report(events, min_pieces=2, out=sys.stdout):
    """Each transfer of at least `min_pieces` pieces: its posting steps in
    ms, its requests' steps summed. Returns the rows printed."""
    rows, reqs = [], []
    for kind, f in events:
        if kind == "request":
            reqs.append(f)
            continue
        mine, reqs = reqs, []
        if f.get("pieces", 0) < min_pieces:
            continue
        row = {k: f.get(k, 0) / 1e3 for k in ("checks_us", "parts_us", "requests_us")}
        for k in ("runs_us", "ops_us", "keys_us", "release_us", "state_us"):
            row[k] = sum(r.get(k, 0) for r in mine) / 1e3
        row["pieces"], row["requests"] = f["pieces"], len(mine)
        rows.append(row)
        print(
            f"posting {row['pieces']} pieces as {row['requests']} requests: checks {row['checks_us']:.2f} ms, "
            f"parts made {row['parts_us']:.2f}, requests {row['requests_us']:.2f} (runs {row['runs_us']:.2f}, "
            f"ops {row['ops_us']:.2f}, keys {row['keys_us']:.2f}, release {row['release_us']:.2f}, "
            f"state machine {row['state_us']:.2f}; "
            "the rest waits or locks)",
            file=out,
        )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--op", choices=sorted(STEPS), default="write")
    ap.add_argument("--gap", type=float, default=5.0, help="ms between posts that starts a new transfer (logs without `lat: part of` lines)")
    ap.add_argument("--bytes", type=int, default=0, help="bytes a transfer moves (prints the data phase's GB/s)")
    ap.add_argument("--streams", action="store_true", help="each transfer's receive streams, by thread")
    ap.add_argument("--posting", action="store_true", help="where each posting call's time went")
    a = ap.parse_args(argv)
    opener = (lambda p: gzip.open(p, "rt")) if a.log.endswith(".gz") else open
    with opener(a.log) as f:
        lines = f.readlines()
    if a.posting:
        return 0 if posting_report(posting_events(lines)) else 1
    at = transfers_at(control_events(lines), a.op, a.gap, wholes(lines))
    if not at:
        print(f"no {a.op} requests traced in {a.log} (TCPX_P2P_LOG=trace on both sides?)")
        return 1
    data = data_events(lines) if a.streams else []
    for i, tr in enumerate(at):
        rel = [[(x - tr[0][0]) * 1e3 for x in r] for r in tr]
        report([rel], a.op, a.bytes, label=i)
        if a.streams:
            stream_report(streams(data, tr[0][0], max(r[-1] for r in tr)), tr[0][0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
