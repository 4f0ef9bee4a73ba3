# Round trip of one byte over loopback TCP to a peer blocked in recv(), after
# the peer has been idle for a while: how long a blocked thread takes to wake.
import os, socket, sys, time, statistics
def peer(port):
    s = socket.create_connection(("127.0.0.1", port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = s.recv(1)
        if not b: return
        s.sendall(b)
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(1); port = l.getsockname()[1]
if os.fork() == 0:
    peer(port); os._exit(0)
c, _ = l.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for idle in (0.0, 0.001, 0.01, 0.05, 0.2):
    v = []
    for i in range(25 if idle < 0.1 else 12):
        time.sleep(idle)
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1); v.append((time.perf_counter() - t) * 1e6)
    v.sort()
    print(f"idle {idle*1e3:6.1f} ms: round trip us p50 {statistics.median(v):8.1f}  max {v[-1]:8.1f}  all>1ms {sum(x>1000 for x in v)}/{len(v)}")
c.close()
