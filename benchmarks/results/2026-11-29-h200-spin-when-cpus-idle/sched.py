"""Summarises schedwrap.py's JSON lines: per size, each timed call
(the first call of a size is the warm-up) with the calling thread's CPU
time and run-queue wait; and per thread the size's deltas (CPU ms,
run-queue wait ms, nonvoluntary switches), biggest waits first."""
import json, sys
from collections import defaultdict

SIZES = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "262144,1048576").split(",")]
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
snaps = [r for r in rows if "snap" in r]
calls = defaultdict(list)
for r in rows:
    if "snap" not in r:
        calls[r["size"]].append(r)
for size in SIZES:
    cs = calls.get(size, [])[1:]
    if not cs:
        continue
    tot = sum(c["us"] for c in cs)
    print(f"size {size}: {len(cs)} calls, {tot:.0f} us in all ({size*len(cs)/tot/1e3:.2f} GB/s of call time)")
    print("   " + " ".join(f"{c['us']:.0f}/{c['run_us']:.0f}/{c['rq_us']:.0f}" for c in cs) + "   (us wall/on-cpu/run-queue)")
    i = next((k for k, s in enumerate(snaps) if s["snap"] == size), None)
    if i is None or i + 1 >= len(snaps):
        continue
    a, b = snaps[i], snaps[i + 1]
    dt = b["t"] - a["t"]
    cpu = [y - x for x, y in zip(a["cpu"], b["cpu"])]
    print(f"   span {dt*1e3:.1f} ms; machine jiffies user {cpu[0]} sys {cpu[2]} idle {cpu[3]} steal {cpu[7]}")
    d = []
    for t, v in b["threads"].items():
        o = a["threads"].get(t, [v[0], 0, 0, 0, 0, 0])
        d.append((v[0], t, (v[1]-o[1])/1e6, (v[2]-o[2])/1e6, v[5]-o[5], v[4]-o[4]))
    d.sort(key=lambda x: -x[3])
    for name, t, run, wait, nv, vo in d[:8]:
        if run > 0.01 or wait > 0.01:
            print(f"   {name:16s} {t:>8s} cpu {run:7.2f} ms  rq-wait {wait:6.2f} ms  nonvol {nv:4d} vol {vo:5d}")
