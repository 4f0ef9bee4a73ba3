#!/usr/bin/env python3
"""The kernel's TCP recovery and drop counters, to set beside a run's
figures (Linux, from /proc; no tools needed):

    python3 benchmarks/tcp_counters.py before.json       # a snapshot
    ... the run ...
    python3 benchmarks/tcp_counters.py after.json
    python3 benchmarks/tcp_counters.py before.json after.json   # what changed

Kept: the Tcp / TcpExt counters of retransmits, timeouts, drops, losses,
prunes and collapses, and the per-CPU backlog's dropped / squeezed counts
(/proc/net/softnet_stat).
"""
import json
import sys

WORDS = ("Retrans", "Timeout", "Drop", "Loss", "Prune", "Collapse")


def snapshot():
    out = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = open(path).read().split("\n")
        # Pairs of lines: "Prefix: names..." then "Prefix: values...".
        for head, vals in zip(lines[0::2], lines[1::2]):
            if not head:
                continue
            prefix = head.split(":")[0]
            if prefix not in ("Tcp", "TcpExt"):
                continue
            for k, v in zip(head.split()[1:], vals.split()[1:]):
                if any(w in k for w in WORDS):
                    out[prefix + k] = int(v)
    dropped = squeezed = 0
    for line in open("/proc/net/softnet_stat"):
        p = line.split()
        dropped += int(p[1], 16)
        squeezed += int(p[2], 16)
    out["softnet_dropped"], out["softnet_squeezed"] = dropped, squeezed
    return out


def main(argv):
    if len(argv) == 1:
        with open(argv[0], "w") as f:
            json.dump(snapshot(), f)
    elif len(argv) == 2:
        a, b = (json.load(open(p)) for p in argv)
        changed = [f"{k}+{b[k] - a.get(k, 0)}" for k in b if b[k] != a.get(k, 0)]
        print(" ".join(changed) or "no change")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
