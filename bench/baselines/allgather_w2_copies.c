// Two threads = two ranks of a W=2 all-gather with N-byte shards, as plain copies: each
// refills its input (untimed), then copies its own shard and the other shard into its
// output. Usage: allgather_w2_copies <shard MiB> <madvise hugepage 0|1> <threads>
// (GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000 for non-temporal stores).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <time.h>
static size_t N; static int huge;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void* al(size_t n){void*p=aligned_alloc(2<<20,n); if(huge) madvise(p,n,MADV_HUGEPAGE); memset(p,1,n); return p;}
void* run(void*a){ char*src=al(N),*dst=al(2*N),*fill=al(N); double best=1e9,sum=0; int it=20;
 for(int i=0;i<it;i++){ memset(fill,i,N); memset(src,i,N); double t=now(); memcpy(dst,src,N); memcpy(dst+N,fill,N); t=now()-t; sum+=t; if(t<best)best=t;}
 printf("huge=%d N=%zuMiB: 2 copies of N: best %.2f ms avg %.2f ms -> %.1f GB/s copy\n",huge,N>>20,best*1e3,sum/it*1e3,2*N/(sum/it)/1e9); return 0;}
int main(int c,char**v){N=(size_t)atoi(v[1])<<20; huge=atoi(v[2]); int th=atoi(v[3]); pthread_t t[4]; for(int i=0;i<th;i++)pthread_create(&t[i],0,run,0); for(int i=0;i<th;i++)pthread_join(t[i],0);}
