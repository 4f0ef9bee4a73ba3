// Loopback TCP from host memory, written (send) or lent (vmsplice + splice,
// the receiver crediting what it has read so that a lent slot of the ring is
// reused only once read): the measurement behind the socket net's lending
// of GPU staging (crates/p2p-engine/src/net/splice.rs).
//
//   gcc -O2 -pthread -o splice_vs_send benchmarks/splice_vs_send.c
//   ./splice_vs_send MODE STREAMS MIB_PER_STREAM [SLOT_KIB [DEPTH]]
//   MODE 0: send(), 1: vmsplice + splice; prints GB/s (10^9 B/s) over all streams.
//
// Results: benchmarks/results/2026-11-22-h200x2-splice/prototype.txt
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static int lend;            /* 1: vmsplice + splice, 0: send() */
static size_t slot = 1 << 20;
static int depth = 4;
static size_t total;        /* bytes per stream */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char *what) {
  perror(what);
  exit(1);
}

static void *sender(void *arg) {
  int fd = (int)(intptr_t)arg;
  char *ring = aligned_alloc(4096, slot * depth);
  memset(ring, 1, slot * depth);
  int pp[2];
  if (lend) {
    if (pipe(pp)) die("pipe");
    if (fcntl(pp[1], F_SETPIPE_SZ, (int)slot) < 0) die("F_SETPIPE_SZ");
  }
  uint64_t sent = 0, credited = 0;
  for (size_t k = 0; k < total / slot; k++) {
    char *s = ring + (k % depth) * slot;
    if (lend) {
      /* The slot about to be reused must have been read by the receiver. */
      while (sent - credited >= (uint64_t)depth * slot) {
        if (read(fd, &credited, 8) != 8) die("reading a credit");
      }
      for (size_t off = 0; off < slot;) {
        struct iovec iv = {s + off, slot - off};
        ssize_t n = vmsplice(pp[1], &iv, 1, 0);
        if (n < 0) die("vmsplice");
        for (ssize_t left = n; left > 0;) {
          ssize_t m = splice(pp[0], NULL, fd, NULL, left, SPLICE_F_MORE);
          if (m < 0) die("splice");
          left -= m;
        }
        off += n;
      }
    } else {
      for (size_t off = 0; off < slot;) {
        ssize_t n = send(fd, s + off, slot - off, 0);
        if (n < 0) die("send");
        off += n;
      }
    }
    sent += slot;
  }
  return NULL;
}

static void *receiver(void *arg) {
  int fd = (int)(intptr_t)arg;
  char *buf = aligned_alloc(4096, slot);
  for (uint64_t got = 0; got < total;) {
    for (size_t off = 0; off < slot;) {
      ssize_t n = recv(fd, buf + off, slot - off, 0);
      if (n <= 0) die("recv");
      off += n;
    }
    got += slot;
    if (lend && write(fd, &got, 8) != 8) die("writing a credit");
  }
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s MODE STREAMS MIB_PER_STREAM [SLOT_KIB [DEPTH]]\n", argv[0]);
    return 2;
  }
  lend = atoi(argv[1]);
  int n = atoi(argv[2]);
  total = (size_t)atol(argv[3]) << 20;
  if (argc > 4) slot = (size_t)atol(argv[4]) << 10;
  if (argc > 5) depth = atoi(argv[5]);
  if (n < 1 || n > 64 || slot == 0 || depth < 1 || total < slot) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  if (bind(ls, (void *)&sa, sizeof sa) || listen(ls, 64) || getsockname(ls, (void *)&sa, &len)) die("listen");
  int cs[64], ss[64];
  for (int i = 0; i < n; i++) {
    cs[i] = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(cs[i], (void *)&sa, sizeof sa)) die("connect");
    ss[i] = accept(ls, NULL, NULL);
  }
  pthread_t t[128];
  double t0 = now();
  for (int i = 0; i < n; i++) {
    pthread_create(&t[i], NULL, sender, (void *)(intptr_t)cs[i]);
    pthread_create(&t[64 + i], NULL, receiver, (void *)(intptr_t)ss[i]);
  }
  for (int i = 0; i < n; i++) {
    pthread_join(t[i], NULL);
    pthread_join(t[64 + i], NULL);
  }
  double dt = now() - t0;
  printf("%s streams=%d slot=%zuK depth=%d: %.2f GB/s\n", lend ? "splice" : "send  ", n, slot >> 10, depth,
         (double)total * n / dt / 1e9);
  return 0;
}
