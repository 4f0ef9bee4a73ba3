// Host memory between two processes of one host: cross-memory attach
// (process_vm_readv, one kernel copy) beside a shared-memory hand-off (the
// writer copies into a shared mapping, the reader copies out: two copies, not
// pipelined; timed in one process, so on one core) and one plain memcpy.
// The measurement behind the same-host path choice (docs/SAME_HOST.md).
//   cc -O2 -o local_mech benchmarks/local_mech.c && ./local_mech $((16<<20)) 20
#define _GNU_SOURCE
#include <sys/uio.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t n = (size_t)atol(argv[1]); int iters=atoi(argv[2]);
  char *src = malloc(n); memset(src, 7, n);
  int p[2]; pipe(p);
  char *shm = mmap(0,n,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  pid_t parent = getpid();
  pid_t c = fork();
  if (c==0){ // child = target: pulls from parent
    char *dst = malloc(n); memset(dst,0,n);
    struct iovec l={dst,n}, r={src,n};
    double t0=now();
    for(int i=0;i<iters;i++){ ssize_t k=process_vm_readv(parent,&l,1,&r,1,0); if(k!=(ssize_t)n){perror("cma");return 1;} }
    double t1=now();
    printf("cma  %zu: %.2f GB/s\n", n, (double)n*iters/(t1-t0)/1e9);
    // shm: writer copies into shm (simulate in child for both copies), target copies out
    t0=now();
    for(int i=0;i<iters;i++){ memcpy(shm,src,n); memcpy(dst,shm,n);} 
    t1=now();
    printf("shm2 %zu: %.2f GB/s (two memcpys, one thread)\n", n, (double)n*iters/(t1-t0)/1e9);
    t0=now();
    for(int i=0;i<iters;i++){ memcpy(dst,shm,n);} 
    t1=now();
    printf("memcpy1 %zu: %.2f GB/s\n", n, (double)n*iters/(t1-t0)/1e9);
    return dst[5]!=7;
  }
  int st; waitpid(c,&st,0); return WEXITSTATUS(st);
}
