// Spins on the monotonic clock for argv[1] seconds and counts the gaps
// between successive reads longer than 100 us / 1 ms / 3 ms: a thread
// that was not run for that long (the machine's own stalls).
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
  double secs = argc > 1 ? atof(argv[1]) : 3, t0 = now(), last = t0, worst = 0, worst_at = 0;
  long g100 = 0, g1 = 0, g3 = 0;
  for (;;) {
    double t = now(), g = t - last;
    if (g > 100e-6) g100++;
    if (g > 1e-3) { g1++; fprintf(stderr, "gap %.3f ms at %.3f s\n", g * 1e3, last - t0); }
    if (g > 3e-3) g3++;
    if (g > worst) { worst = g; worst_at = last - t0; }
    last = t;
    if (t - t0 > secs) break;
  }
  printf("%s: %.1f s: gaps >100us %ld, >1ms %ld, >3ms %ld, worst %.3f ms at %.3f s\n", argc > 2 ? argv[2] : "stall", secs, g100, g1, g3, worst * 1e3, worst_at);
  return 0;
}
