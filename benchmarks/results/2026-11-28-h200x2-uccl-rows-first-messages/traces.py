#!/usr/bin/env python3
"""Reading the TCPX_P2P_LOG=trace logs of this folder (one log per process).

    traces.py quiet    SERVER.log CLIENT.log   longest stretches where neither process logged
    traces.py receives SERVER.log [FROM]       every receive from the FROM-th on that took
                                               over 0.5 ms, and when its first part landed
    traces.py message  LOG K [BEFORE] [send]   every event of the K-th receive (or send) of
                                               LOG, from its post to its end (ms from the
                                               post; BEFORE more lines ahead of it)
    traces.py sends    CLIENT.log N            the first N 1 MiB sends: when each part was
                                               taken, its window copied, landed, written

Times come from each line's own stamp (both processes share the clock);
lines are sorted by it (a process writes its lines slightly out of order).
"""

import datetime
import re
import sys


def stamp(line):
    return datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()


def load(path):
    out = []
    with open(path) as f:
        for line in f:
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            if not line.startswith("20"):
                continue
            th = re.search(r"ThreadId\((\d+)\)", line)
            msg = line.split(": ", 1)[1].strip() if ": " in line else line.strip()
            out.append((stamp(line), th.group(1) if th else "?", msg))
    out.sort(key=lambda e: e[0])
    return out


def posts(ev, send):
    key = "send=%s" % ("true" if send else "false")
    return [i for i, e in enumerate(ev) if "lat: post xfer=" in e[2] and key in e[2]]


def ended(ev, i, xfer):
    pat = re.compile(r"lat: ended xfer=%s\b" % xfer)
    return next((j for j in range(i, len(ev)) if pat.search(ev[j][2])), None)


def quiet(server, client):
    ev = sorted([(t, "S" + th) for t, th, _ in load(server)] + [(t, "C" + th) for t, th, _ in load(client)])
    t0 = ev[0][0]
    gaps = sorted(((ev[i + 1][0] - ev[i][0], ev[i][0] - t0, ev[i][1], ev[i + 1][1]) for i in range(len(ev) - 1)), reverse=True)
    for g, at, a, b in gaps[:25]:
        print(f"gap {g * 1e3:7.3f} ms at {at * 1e3:9.3f} ms  {a}->{b}")


def receives(server, start=44):
    ev = load(server)
    for k, i in enumerate(posts(ev, False)):
        if k < start:
            continue
        x = re.search(r"xfer=(\d+)", ev[i][2]).group(1)
        seq = int(x) - 1
        j = ended(ev, i, x)
        if j is None:
            continue
        first = next((e for e in ev[i + 1 :] if f"seq={seq}" in e[2] and any(w in e[2] for w in ("slot wanted", "payload", "landed"))), None)
        d = (ev[j][0] - ev[i][0]) * 1e3
        if d > 0.5:
            at = f"{(first[0] - ev[i][0]) * 1e3:6.3f} ms by T{first[1]}" if first else "-"
            print(f"{k:3} seq={seq} {d:6.3f} ms, first part landing {at}")


def message(path, k, before=0, send=False):
    ev = load(path)
    i = posts(ev, send)[k]
    x = re.search(r"xfer=(\d+)", ev[i][2]).group(1)
    j = ended(ev, i, x)
    t0 = ev[i][0]
    for t, th, m in ev[max(0, i - before) : (j or i) + 1]:
        print(f"{(t - t0) * 1e3:8.3f} T{th:>2} {m[:200]}")


def sends(client, n):
    ev = load(client)
    isends = [i for i, e in enumerate(ev) if "lat: isend" in e[2] and "bytes=1048576" in e[2]]
    words = ("part taken", "window", "came to a sleeping", "parts out", "job starts", "job queued", "ended")
    for m, i in enumerate(isends[:n]):
        t0 = ev[i][0]
        nxt = ev[isends[m + 1]][0] if m + 1 < len(isends) else t0 + 0.05
        print(f"--- 1 MiB send {m}: {ev[i][2]}")
        for t, th, msg in ev[i + 1 :]:
            if t > nxt:
                break
            if any(w in msg for w in words):
                print(f"   {(t - t0) * 1e6:8.0f} us T{th:>2} {msg}")


if __name__ == "__main__":
    a = sys.argv[1:]
    if not a:
        sys.exit(__doc__)
    cmd, rest = a[0], a[1:]
    if cmd == "quiet":
        quiet(*rest[:2])
    elif cmd == "receives":
        receives(rest[0], int(rest[1]) if len(rest) > 1 else 44)
    elif cmd == "message":
        message(rest[0], int(rest[1]), int(rest[2]) if len(rest) > 2 else 0, len(rest) > 3 and rest[3] == "send")
    elif cmd == "sends":
        sends(rest[0], int(rest[1]))
    else:
        sys.exit(__doc__)
