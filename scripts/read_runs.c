// How fast one core reads a 256 MiB pool as runs of B bytes (the whole runs that fit), in order or
// shuffled (as a paged KV pool's blocks), with a prefetcht1 of every line D bytes ahead of the reads
// (0: none, the hardware prefetchers alone). docs/benchmarks.md, "Paged overhead, round 8".
// Build and run (x86-64 with AVX-512F):
//   gcc -O2 -march=native -o /tmp/read_runs scripts/read_runs.c && /tmp/read_runs B D SHUFFLE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s RUN_BYTES PREFETCH_DISTANCE_BYTES SHUFFLE(0|1)\n", argv[0]);
    return 2;
  }
  const size_t pool = 256ul << 20, huge = 2ul << 20;
  const long run = atol(argv[1]), distance = atol(argv[2]);
  const int shuffle = atoi(argv[3]);
  if (run < 64 || run % 64 || (size_t)run > pool) {
    fprintf(stderr, "RUN_BYTES: %ld must be a multiple of 64, at most 256 MiB\n", run);
    return 2;
  }
  char* raw = mmap(0, pool + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char* p = (char*)(((size_t)raw + huge - 1) & ~(huge - 1));  // 2 MiB-aligned, as the KV pools
  madvise(p, pool, MADV_HUGEPAGE);
  memset(p, 1, pool);
  const long n = pool / run, lines = run / 64;
  long* order = malloc(n * sizeof(long));
  for (long i = 0; i < n; i++) order[i] = i;
  srand(1);
  if (shuffle)
    for (long i = n - 1; i > 0; i--) {
      const long j = rand() % (i + 1), t = order[i];
      order[i] = order[j];
      order[j] = t;
    }
  double best = 1e9;
  __m512 acc = _mm512_setzero_ps();
  for (int rep = 0; rep < 5; rep++) {
    const double t0 = now();
    for (long i = 0; i < n; i++) {
      const char* b = p + order[i] * run;
      for (long l = 0; l < lines; l++) {
        const long ahead = l * 64 + distance, bi = i + ahead / run;
        if (distance && bi < n) _mm_prefetch(p + order[bi] * run + ahead % run, _MM_HINT_T1);
        acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float*)(b + l * 64)));
      }
    }
    const double t = now() - t0;
    if (t < best) best = t;
  }
  float sink[16];
  _mm512_storeu_ps(sink, acc);
  printf("runs of %ld bytes, %s, prefetch %ld bytes ahead: %.1f GB/s%s\n", run, shuffle ? "shuffled" : "in order",
         distance, (double)(n * run) / best / 1e9, sink[0] == 12345.0f ? " " : "");
  return 0;
}
