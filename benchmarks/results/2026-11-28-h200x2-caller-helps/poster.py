"""For each round of progress over 500 us on a traced server log whose time
went to posting: the posting thread's own events in that round, with the
events of other threads it waited beside left out."""
import sys
sys.path.insert(0, "../2026-11-28-h200x2-uccl-rows-first-messages")
import traces
ev = traces.load(sys.argv[1])
n = 0
for i, (t, th, m) in enumerate(ev):
    if "long round" not in m or "post_us=" not in m:
        continue
    post = int(m.split("post_us=")[1].split()[0])
    if post < 500:
        continue
    us = int(m.split(" us=")[1].split()[0])
    n += 1
    if n > 6:
        break
    print(f"--- round of {us} us, posting {post} us, on T{th}")
    for t2, th2, m2 in ev[max(0, i - 400): i + 1]:
        d = (t2 - t) * 1e3
        if d >= -us / 1e3 - 0.01 and th2 == th:
            print(f"   {d:8.3f} {m2[:110]}")
