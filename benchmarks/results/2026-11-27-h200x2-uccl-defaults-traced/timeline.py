#!/usr/bin/env python3
"""Per-message timeline of UCCL's benchmark_uccl.py (send / recv rows) from
both ranks' TCPX_P2P_LOG=trace logs: for each message in order, when the
client posted its send and saw it end, and when the server posted its
receive and saw it end (ms from the client's first post).

    python3 timeline.py r3_run2_client.log.gz r3_run2_server.log.gz
"""

import datetime
import gzip
import re
import sys

SIZES = ["256B", "1K", "4K", "16K", "64K", "256K", "1M", "10M", "16M", "100M"]
ITERS = 11  # one warm-up and ten timed, per size


def stamp(line):
    t = line.split()[0].replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(t).timestamp()


def events(path, send):
    posts, ends, order = {}, {}, []
    post = re.compile(r"lat: post xfer=(\d+) send=%s" % ("true" if send else "false"))
    end = re.compile(r"lat: ended xfer=(\d+)")
    with gzip.open(path, "rt") as f:
        for line in f:
            m = post.search(line)
            if m:
                x = int(m.group(1))
                posts[x] = stamp(line)
                order.append(x)
            m = end.search(line)
            if m and int(m.group(1)) not in ends:
                ends[int(m.group(1))] = stamp(line)
    return posts, ends, order


def main():
    cp, ce, co = events(sys.argv[1], True)
    sp, se, so = events(sys.argv[2], False)
    t0 = cp[co[0]]
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    for i in range(min(len(co), len(so))):
        a, b = co[i], so[i]
        size = SIZES[i // ITERS] if i // ITERS < len(SIZES) else "?"
        print(
            f"{size:5} {i:3}  client post {ms(cp[a]):8.3f} end {ms(ce.get(a, t0)):8.3f}"
            f"  | server post {ms(sp[b]):8.3f} end {ms(se.get(b, t0)):8.3f}"
        )


if __name__ == "__main__":
    main()
