// Two threads = two ranks of a W=2 all-gather with N-MiB shards, as plain copies: each copies
// its own shard and a second buffer into its output, 20 times, in one of several orders.
// Usage: nt_copy_orders <shard MiB> <mode> <threads> [refill 0|1 (default 1)] [memfd 0|1]
//   mode 0: glibc memcpy
//        1: non-temporal SSE2, four 4 KiB stripes side by side (glibc's large-copy order)
//        2: the same with AVX-512      3: the same with AVX2
//        4: non-temporal SSE2, one 64-byte line after the other (memcopy::copy)
//        5: the same with AVX-512
//   refill 1: both sources are rewritten (memset) before each copy, as a benchmark that
//   refills its input does; 0: they come from memory, as in a loop without refills.
//   memfd 1: buffers are shared memfd mappings (like the arena's) instead of anonymous ones.
// gcc -O2 -pthread -o nt_copy_orders nt_copy_orders.c
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
static size_t N;
static int mode, refill = 1, memfd;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void sse_striped(char *d, const char *s, size_t n) {
  for (size_t b = 0; b < n; b += 16384)
    for (size_t o = 0; o < 4096; o += 64)
      for (int p = 0; p < 4; p++) {
        const __m128i *sp = (const __m128i *)(s + b + p * 4096 + o);
        __m128i *dp = (__m128i *)(d + b + p * 4096 + o);
        __m128i a = _mm_loadu_si128(sp), b1 = _mm_loadu_si128(sp + 1), c = _mm_loadu_si128(sp + 2), e = _mm_loadu_si128(sp + 3);
        _mm_stream_si128(dp, a); _mm_stream_si128(dp + 1, b1); _mm_stream_si128(dp + 2, c); _mm_stream_si128(dp + 3, e);
      }
  _mm_sfence();
}
__attribute__((target("avx512f"))) static void z_striped(char *d, const char *s, size_t n) {
  for (size_t b = 0; b < n; b += 16384)
    for (size_t o = 0; o < 4096; o += 64)
      for (int p = 0; p < 4; p++) _mm512_stream_si512((__m512i *)(d + b + p * 4096 + o), _mm512_loadu_si512(s + b + p * 4096 + o));
  _mm_sfence();
}
__attribute__((target("avx2"))) static void y_striped(char *d, const char *s, size_t n) {
  for (size_t b = 0; b < n; b += 16384)
    for (size_t o = 0; o < 4096; o += 64)
      for (int p = 0; p < 4; p++) {
        const __m256i *sp = (const __m256i *)(s + b + p * 4096 + o);
        __m256i a = _mm256_loadu_si256(sp), c = _mm256_loadu_si256(sp + 1);
        _mm256_stream_si256((__m256i *)(d + b + p * 4096 + o), a); _mm256_stream_si256((__m256i *)(d + b + p * 4096 + o + 32), c);
      }
  _mm_sfence();
}
static void sse_lines(char *d, const char *s, size_t n) {
  for (size_t o = 0; o < n; o += 64) {
    const __m128i *sp = (const __m128i *)(s + o);
    __m128i *dp = (__m128i *)(d + o);
    __m128i a = _mm_loadu_si128(sp), b1 = _mm_loadu_si128(sp + 1), c = _mm_loadu_si128(sp + 2), e = _mm_loadu_si128(sp + 3);
    _mm_stream_si128(dp, a); _mm_stream_si128(dp + 1, b1); _mm_stream_si128(dp + 2, c); _mm_stream_si128(dp + 3, e);
  }
  _mm_sfence();
}
__attribute__((target("avx512f"))) static void z_lines(char *d, const char *s, size_t n) {
  for (size_t o = 0; o < n; o += 64) _mm512_stream_si512((__m512i *)(d + o), _mm512_loadu_si512(s + o));
  _mm_sfence();
}
static void copy(char *d, const char *s, size_t n) {
  switch (mode) {
  case 0: memcpy(d, s, n); break;
  case 1: sse_striped(d, s, n); break;
  case 2: z_striped(d, s, n); break;
  case 3: y_striped(d, s, n); break;
  case 4: sse_lines(d, s, n); break;
  default: z_lines(d, s, n); break;
  }
}
static char *al(size_t n) {
  if (!memfd) return aligned_alloc(2 << 20, n);
  int fd = memfd_create("nt", 0);
  if (fd < 0 || ftruncate(fd, n)) { perror("memfd"); exit(1); }
  return mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
}
static void *run(void *arg) {
  (void)arg;
  char *src = al(N), *dst = al(2 * N), *other = al(N);
  memset(src, 1, N); memset(dst, 1, 2 * N); memset(other, 1, N);
  double sum = 0;
  int it = 20;
  for (int i = 0; i < it; i++) {
    if (refill) { memset(other, i, N); memset(src, i, N); }
    double t = now();
    copy(dst, src, N);
    copy(dst + N, other, N);
    sum += now() - t;
  }
  printf("mode %d refill %d memfd %d: 2 copies of %zu MiB, avg %.2f ms\n", mode, refill, memfd, N >> 20, sum / it * 1e3);
  return 0;
}
int main(int c, char **v) {
  if (c < 4) { fprintf(stderr, "usage: %s <shard MiB> <mode 0-5> <threads> [refill] [memfd]\n", v[0]); return 2; }
  N = (size_t)atoi(v[1]) << 20; mode = atoi(v[2]);
  int th = atoi(v[3]);
  if (c > 4) refill = atoi(v[4]);
  if (c > 5) memfd = atoi(v[5]);
  if (th < 1 || th > 4) { fprintf(stderr, "threads: 1-4\n"); return 2; }
  pthread_t t[4];
  for (int i = 0; i < th; i++) pthread_create(&t[i], 0, run, 0);
  for (int i = 0; i < th; i++) pthread_join(t[i], 0);
  return 0;
}
