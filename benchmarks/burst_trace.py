#!/usr/bin/env python3
"""Where a burst of small messages waits, from `TCPX_P2P_LOG=trace` logs of
`tcpx-p2p-bench pair --memory host --sizes 4K` (both sides in one log).

Per log: when the sender posted (`isend`) and wrote (`tx wrote`, `sent
inline`) the last message of the burst, when the receiver read its header
and completed it (`rx header`, `rx done`), all from the burst's first post;
post -> write and write -> header read delays; each stream's first write and
first header read; receives whose header waited > 0.3 ms for its receive to
be entered into the stream's book (header read -> done).

usage: burst_trace.py LOG... [--first 2] [--count 2000] [--streams 8]
"""
import argparse, datetime, re, statistics

def ts(s):
    return datetime.datetime.strptime(s[:26], "%Y-%m-%dT%H:%M:%S.%f").timestamp()

def events(path):
    opener = open
    if path.endswith(".gz"):
        import gzip
        opener = lambda p: gzip.open(p, "rt")
    ev = {"isend": {}, "wrote": {}, "hdr": {}, "done": {}}
    for line in opener(path):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        m = re.match(r"(\S+) TRACE \S+ lat: (.*)", line)
        if not m:
            continue
        t, e = ts(m.group(1)), m.group(2)
        for key, pat in (("isend", r"isend seq=(\d+)"), ("hdr", r"rx header seq=(\d+)"),
                         ("done", r"rx done seq=(\d+)"), ("wrote", r"sent inline seq=(\d+)")):
            x = re.match(pat, e)
            if x:
                ev[key].setdefault(int(x.group(1)), t)
        x = re.match(r"tx wrote seq=(\d+) n=(\d+)", e)
        if x:
            ev["batch"] = ev.get("batch", 0) + 1
            ev.setdefault("batched", []).append((int(x.group(1)), int(x.group(2)), t))
    return ev

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--first", type=int, default=2, help="sequence number of the burst's first message")
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=8)
    a = ap.parse_args()
    for path in a.logs:
        ev = events(path)
        n = a.streams
        # A batch is `k` queued messages of one stream from `s0` on: the
        # stream's next messages that were not written inline.
        inline = set(ev["wrote"])
        for s0, k, t in ev.get("batched", []):
            s = s0
            while k > 0:
                if s not in inline:
                    ev["wrote"].setdefault(s, t)
                    k -= 1
                s += n
        # Logs of builds before the `tx wrote` event: no write times.
        keys = ("isend", "wrote", "hdr", "done") if "batched" in ev else ("isend", "hdr", "done")
        seqs = [s for s in range(a.first, a.first + a.count) if all(s in ev[k] for k in keys)]
        if not seqs:
            print(f"{path}: no complete burst in the log (trace level?)")
            continue
        t0 = ev["isend"][seqs[0]]
        ms = lambda t: (t - t0) * 1e3
        last = {k: max(ms(ev[k][s]) for s in seqs) for k in keys}
        waits = [(s, (ev["done"][s] - ev["hdr"][s]) * 1e3) for s in seqs]
        long = [(s, round(w, 2)) for s, w in waits if w > 0.3]
        q = lambda v, p: v[min(len(v) - 1, int(p * len(v)))]
        if "wrote" not in keys:
            print(f"{path}: {len(seqs)} messages (no write events); last post {last['isend']:.1f} ms, "
                  f"header read {last['hdr']:.1f}, done {last['done']:.1f}")
            print("  per stream, first header read (ms): " + " ".join(
                f"{k}:{min(ms(ev['hdr'][s]) for s in seqs if s % n == k):.1f}" for k in range(n)
                if any(s % n == k for s in seqs)))
            print(f"  headers that waited > 0.3 ms for their receive: {len(long)} {long[:10]}")
            continue
        post_write = sorted((ev["wrote"][s] - ev["isend"][s]) * 1e3 for s in seqs)
        write_hdr = sorted((ev["hdr"][s] - ev["wrote"][s]) * 1e3 for s in seqs)
        print(f"{path}: {len(seqs)} messages; last post {last['isend']:.1f} ms, write (p99) {q(sorted(ms(ev['wrote'][s]) for s in seqs), .99):.1f}, "
              f"header read {last['hdr']:.1f}, done {last['done']:.1f}")
        print(f"  post -> write ms p50 {statistics.median(post_write):.2f} max {post_write[-1]:.2f}; "
              f"write -> header read p50 {statistics.median(write_hdr):.2f} p90 {q(write_hdr, .9):.2f} max {write_hdr[-1]:.2f}")
        print("  per stream, first write / first header read (ms): " + " ".join(
            f"{k}:{min(ms(ev['wrote'][s]) for s in seqs if s % n == k):.1f}/{min(ms(ev['hdr'][s]) for s in seqs if s % n == k):.1f}"
            for k in range(n) if any(s % n == k for s in seqs)))
        print(f"  headers that waited > 0.3 ms for their receive: {len(long)} {long[:10]}")

if __name__ == "__main__":
    main()
