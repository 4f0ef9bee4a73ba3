"""How long a small host → GPU copy takes, by how it is made, with and
without a second process holding a context on the same GPU:

    python3 benchmarks/h2d_small.py [--gpu 0] [--iters 300] [--json OUT]

The receive side of the socket net lands a small GPU part with an async
copy out of a pinned slot on its own stream and waits on an event; the
inline path lands it with a synchronous copy out of pageable memory. This
times each way (p50 / p90 µs per copy, copy and wait) for 1 KiB … 256 KiB,
first alone on the GPU, then with a second process that holds a context on
it (idle), and then taking turns with a second process that makes the
same copies (as the two sides of a one-GPU pair do: one lands a message,
then the other lands the answer), handing a token over a pipe between
copies.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = [1 << 10, 4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10]


def summary(ts):
    """p50 / p90 of per-copy µs."""
    ts = sorted(ts)
    return {"p50_us": round(statistics.median(ts), 1), "p90_us": round(ts[int(len(ts) * 0.9)], 1)}


def ways_for(torch, dev, size, side, ev):
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    pinned = torch.ones(size, dtype=torch.uint8).pin_memory()
    pageable = torch.ones(size, dtype=torch.uint8)
    return {
        "pinned_async_side_stream_event": lambda: (
            dst.copy_(pinned, non_blocking=True),
            ev.record(side),
            ev.synchronize(),
        ),
        "pinned_sync": lambda: dst.copy_(pinned),
        "pageable_sync": lambda: dst.copy_(pageable),
    }


def turns(gpu, iters, rd, wr, first):
    """Copies taking turns with another process over pipes `rd` / `wr`:
    each way and size, `iters` copies each timed on its own."""
    import torch

    dev = torch.device("cuda", gpu)
    torch.cuda.set_device(dev)
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    out = {}
    for size in SIZES:
        row = {}
        for name, fn in ways_for(torch, dev, size, side, ev).items():
            ts = []
            with torch.cuda.stream(side if "side" in name else torch.cuda.current_stream(dev)):
                for i in range(iters + 20):
                    if not (first and i == 0):
                        os.read(rd, 1)
                    t = time.perf_counter()
                    fn()
                    ts.append((time.perf_counter() - t) * 1e6)
                    os.write(wr, b"x")
            # The first process's last token is read by nobody: drain it.
            if first:
                os.read(rd, 1)
            row[name] = summary(ts[20:])
        out[size] = row
    return out


def measure(gpu, iters):
    import torch

    dev = torch.device("cuda", gpu)
    torch.cuda.set_device(dev)
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    out = {}
    for size in SIZES:
        ways = ways_for(torch, dev, size, side, ev)
        row = {}
        for name, fn in ways.items():
            with torch.cuda.stream(side if "side" in name else torch.cuda.current_stream(dev)):
                for _ in range(20):
                    fn()
                torch.cuda.synchronize(dev)
                ts = []
                for _ in range(iters):
                    t = time.perf_counter()
                    fn()
                    ts.append((time.perf_counter() - t) * 1e6)
            row[name] = summary(ts)
        out[size] = row
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json")
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--turn-fds", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.turn_fds:
        rd, wr = map(int, a.turn_fds.split(","))
        turns(a.gpu, a.iters, rd, wr, first=False)
        return
    if a.hold:
        import torch

        torch.empty(1, device=f"cuda:{a.gpu}")
        print("ready", flush=True)
        sys.stdin.read()
        return
    res = {"alone": measure(a.gpu, a.iters)}
    other = subprocess.Popen(
        [sys.executable, __file__, "--hold", "--gpu", str(a.gpu)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        if other.stdout.readline().strip() == "ready":
            res["beside_idle_context"] = measure(a.gpu, a.iters)
    finally:
        other.stdin.close()
        other.wait(timeout=30)
    a_rd, b_wr = os.pipe()
    b_rd, a_wr = os.pipe()
    other = subprocess.Popen(
        [sys.executable, __file__, "--gpu", str(a.gpu), "--iters", str(a.iters),
         "--turn-fds", f"{b_rd},{b_wr}"],
        pass_fds=(b_rd, b_wr),
    )
    try:
        res["taking_turns"] = turns(a.gpu, a.iters, a_rd, a_wr, first=True)
    finally:
        other.wait(timeout=60)
    print(f"{'case':22} {'size':>7} " + " ".join(f"{w:>32}" for w in res["alone"][SIZES[0]]))
    for case, rows in res.items():
        for size, row in rows.items():
            cells = " ".join(f"{r['p50_us']:>14} / {r['p90_us']:>13}" for r in row.values())
            print(f"{case:22} {size >> 10:>6}K {cells}")
    print("(µs per copy and its wait, p50 / p90)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
