"""Per-receive timings from a TCPX_P2P_LOG=trace log of UCCL's
benchmark_uccl.py server: for each transfer, its time from post to end
("dur", µs) and the caller's time until its next post ("gap", µs), grouped
by the benchmark's default sizes (one warm-up and 10 timed receives each).

    python durations.py after_server.log.gz
"""

import datetime
import gzip
import re
import sys

SIZES = "256B 1K 4K 16K 64K 256K 1M 10M 16M 100M".split()


def us(line):
    t = datetime.datetime.strptime(line[:26], "%Y-%m-%dT%H:%M:%S.%f")
    return t.timestamp() * 1e6


def main(path):
    post, end = {}, {}
    with gzip.open(path, "rt") as f:
        for line in f:
            m = re.search(r"lat: (post|ended) xfer=(\d+)", line)
            if m:
                (post if m.group(1) == "post" else end)[int(m.group(2))] = us(line)
    for i, x in enumerate(sorted(post)):
        size = SIZES[i // 11] if i // 11 < len(SIZES) else "?"
        nxt = post.get(x + 1)
        dur = end.get(x, post[x]) - post[x]
        gap = nxt - end[x] if nxt and x in end else 0
        print(f"{size:>5} xfer {x:4d} dur {dur:8.0f} gap {gap:8.0f}")


if __name__ == "__main__":
    main(sys.argv[1])
