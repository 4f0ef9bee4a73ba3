#!/usr/bin/env python3
"""Where the socket net's I/O threads spent their time, per comm.

Reads the logs of a run made with TCPX_P2P_LOG=debug (each I/O thread logs
its account when its comm closes: bytes moved, and the share of its life
spent in socket calls, waiting for staged GPU copies, queueing copies with
the driver, waiting for work, and the rest) and prints, per comm and
direction, the bytes and the mean shares of its streams, and the shares of
the busy time only (the life minus waiting for work).

    TCPX_P2P_LOG=debug tcpx-p2p-bench pair --memory gpu --sizes 16M 2> run.log
    python3 benchmarks/time_split.py run.log [--json out.json]
"""
import argparse
import collections
import json
import re

LINE = re.compile(
    r"(?P<dir>tx|rx) stream (?P<idx>\d+) (?:to|at) (?P<addr>\S+)(?: from \S+)?: (?P<gb>[\d.]+) GB in "
    r"(?P<secs>[\d.]+) s \([\d.]+ GB/s\):(?P<shares>( [a-z]+ [\d.]+%)+)"
)
KINDS = ["socket", "copies", "driver", "waiting", "other"]


def parse(paths):
    comms = collections.defaultdict(list)
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                m = LINE.search(line)
                if not m:
                    continue
                shares = {k: float(v) for k, v in re.findall(r" ([a-z]+) ([\d.]+)%", m["shares"])}
                # A comm's streams share the receiver's listening address:
                # the sender's "to", the receiver's "at".
                key = (path, m["addr"], m["dir"])
                comms[key].append({"gb": float(m["gb"]), "secs": float(m["secs"]), **shares})
    return comms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--json")
    a = ap.parse_args()
    out = []
    print(f"{'comm':<34} {'streams':>7} {'GB':>8}  " + " ".join(f"{k:>8}" for k in KINDS) + "   busy: " + " ".join(f"{k:>7}" for k in KINDS[:3]))
    for (path, peer, d), rows in sorted(parse(a.logs).items()):
        n = len(rows)
        mean = {k: sum(r.get(k, 0.0) for r in rows) / n for k in KINDS}
        busy = max(100.0 - mean["waiting"], 1e-9)
        busy_share = {k: 100.0 * mean[k] / busy for k in ("socket", "copies", "driver", "other")}
        name = f"{d} {peer}"
        print(f"{name:<34} {n:>7} {sum(r['gb'] for r in rows):>8.2f}  " + " ".join(f"{mean[k]:>7.1f}%" for k in KINDS) + "         " + " ".join(f"{busy_share[k]:>6.1f}%" for k in KINDS[:3]))
        out.append({"log": path, "dir": d, "peer": peer, "streams": n, "GB": sum(r["gb"] for r in rows), "share": mean, "busy_share": busy_share})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
