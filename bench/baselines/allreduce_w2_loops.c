// Build: gcc -O3 -march=native -pthread allreduce_w2_loops.c -o ar && ./ar 64   (64 MiB)
// Two threads = two ranks of a W=2 all-reduce of N floats each, as plain loops in one
// address space (the least work the op needs): each refills its buffer (untimed), then
// (timed) adds the peer's half into its own half, waits for the peer, copies the peer's
// reduced half into its other half.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
static size_t N; static float* buf[2]; static pthread_barrier_t bar;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
void* run(void*a){ int r=(int)(long)a, p=1-r; size_t h=N/2; float*me=buf[r];
 double sum=0; int it=20;
 for(int i=0;i<it+3;i++){ for(size_t k=0;k<N;k++) me[k]=(float)((k*13+r*7)%17);
  pthread_barrier_wait(&bar); double t=now();
  float*mine=me+r*h; float*theirs=buf[p]+r*h; for(size_t k=0;k<h;k++) mine[k]+=theirs[k];
  pthread_barrier_wait(&bar);
  memcpy(me+p*h, buf[p]+p*h, h*4);
  pthread_barrier_wait(&bar); t=now()-t; if(i>=3) sum+=t; }
 if(r==0) printf("W=2 all-reduce of %zu MiB as plain loops: %.2f ms -> busbw %.2f GB/s\n",N*4>>20,sum/it*1e3,N*4/(sum/it)/1e9); return 0;}
int main(int c,char**v){N=(size_t)atoi(v[1])<<18; for(int i=0;i<2;i++){buf[i]=aligned_alloc(4096,N*4); memset(buf[i],0,N*4);} pthread_barrier_init(&bar,0,2); pthread_t t[2]; for(long i=0;i<2;i++)pthread_create(&t[i],0,run,(void*)i); for(int i=0;i<2;i++)pthread_join(t[i],0);}
