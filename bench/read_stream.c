/* Read-only memory bandwidth: what a weight-streaming decode step can reach at best.
 *
 *     read_stream BYTES THREADS REPEATS   ->   "<bytes/s of the median repeat>"
 *
 * Every thread sums its contiguous slice of a BYTES buffer of 64-bit ones; a repeat is timed
 * from the threads' start to the last one's end.  Every repeat's sum is checked (a wrong one
 * exits 1), so the compiler cannot drop the reads.  Built and run by bench/throughput.py
 * (read_bandwidth), which needs nothing but a C compiler.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
  const uint64_t* data;
  size_t n;
  uint64_t sum;
} Slice;

static void* sum_slice(void* arg) {
  Slice* s = (Slice*)arg;
  /* Four independent sums: the loop is bound by the loads, not by one add chain. */
  uint64_t a = 0, b = 0, c = 0, d = 0;
  size_t i = 0;
  for (; i + 4 <= s->n; i += 4) {
    a += s->data[i];
    b += s->data[i + 1];
    c += s->data[i + 2];
    d += s->data[i + 3];
  }
  for (; i < s->n; ++i) a += s->data[i];
  s->sum = a + b + c + d;
  return NULL;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void* x, const void* y) {
  double a = *(const double*)x, b = *(const double*)y;
  return (a > b) - (a < b);
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s BYTES THREADS REPEATS\n", argv[0]);
    return 2;
  }
  const size_t n = (size_t)atoll(argv[1]) / sizeof(uint64_t);
  const int threads = atoi(argv[2]), repeats = atoi(argv[3]);
  if (n < (size_t)threads || threads < 1 || threads > 256 || repeats < 1 || repeats > 1000) {
    fprintf(stderr, "read_stream: bad arguments\n");
    return 2;
  }
  uint64_t* data = aligned_alloc(64, (n * sizeof(uint64_t) + 63) / 64 * 64);
  double* times = malloc(sizeof(double) * repeats);
  if (!data || !times) {
    fprintf(stderr, "read_stream: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < n; ++i) data[i] = 1;   /* also faults every page in before timing */
  Slice slices[256];
  pthread_t tids[256];
  for (int r = 0; r < repeats; ++r) {
    const double t0 = now();
    for (int t = 0; t < threads; ++t) {
      const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
      slices[t] = (Slice){data + lo, hi - lo, 0};
      pthread_create(&tids[t], NULL, sum_slice, &slices[t]);
    }
    uint64_t sum = 0;
    for (int t = 0; t < threads; ++t) {
      pthread_join(tids[t], NULL);
      sum += slices[t].sum;
    }
    times[r] = now() - t0;
    if (sum != n) {
      fprintf(stderr, "read_stream: sum %llu, expected %zu\n", (unsigned long long)sum, n);
      return 1;
    }
  }
  qsort(times, repeats, sizeof(double), cmp);
  printf("%.6e\n", n * sizeof(uint64_t) / times[repeats / 2]);
  return 0;
}
