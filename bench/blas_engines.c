// SGEMM rates of one CBLAS library on the GEMM shapes of a training step, built once per library by
// bench/blas_engines.sh (OpenBLAS OpenMP and pthread builds, BLIS). Two kinds of call:
//   library-threaded: one GEMM using all threads (the projections and the lm_head);
//   per-thread tiles: every OpenMP thread calls its own small GEMM at once (the flash-attention tiles and the
//     MoE expert GEMMs), where the library must run single-threaded inside the parallel region.
// Prints one JSON line per shape: {"lib", "shape", "kind", "gflops"} (best of --reps).
#define _GNU_SOURCE
#include <cblas.h>
#include <dlfcn.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef BLAS_NAME
#define BLAS_NAME "unknown"
#endif

typedef struct {
  const char* name;
  int M, N, K;
  int ta, tb;  // transposes (row-major)
  int tiles;   // 1: per-thread tiles inside an OpenMP parallel region
} Shape;

static double run(const Shape* s, int reps) {
  const int lda = s->ta ? s->M : s->K, ldb = s->tb ? s->K : s->N;
  // Tiles are small: repeat them so one measurement lasts a few milliseconds.
  const long inner = s->tiles ? 1 + 400000000L / (2L * s->M * s->N * s->K) : 1;
  const int nt = s->tiles ? omp_get_max_threads() : 1;
  float** a = malloc(sizeof(float*) * nt);
  float** b = malloc(sizeof(float*) * nt);
  float** c = malloc(sizeof(float*) * nt);
  for (int t = 0; t < nt; ++t) {
    a[t] = malloc(sizeof(float) * (size_t)s->M * s->K);
    b[t] = malloc(sizeof(float) * (size_t)s->K * s->N);
    c[t] = malloc(sizeof(float) * (size_t)s->M * s->N);
    for (long i = 0; i < (long)s->M * s->K; ++i) a[t][i] = 0.01f * (float)(i % 7);
    for (long i = 0; i < (long)s->K * s->N; ++i) b[t][i] = 0.02f * (float)(i % 5);
    memset(c[t], 0, sizeof(float) * (size_t)s->M * s->N);
  }
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {
    const double t0 = omp_get_wtime();
    if (s->tiles) {
#pragma omp parallel
      {
        const int t = omp_get_thread_num();
        for (long i = 0; i < inner; ++i)
          cblas_sgemm(CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans, s->tb ? CblasTrans : CblasNoTrans,
                      s->M, s->N, s->K, 1.0f, a[t], lda, b[t], ldb, 1.0f, c[t], s->N);
      }
    } else {
      cblas_sgemm(CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans, s->tb ? CblasTrans : CblasNoTrans, s->M,
                  s->N, s->K, 1.0f, a[0], lda, b[0], ldb, 0.0f, c[0], s->N);
    }
    const double dt = omp_get_wtime() - t0;
    if (r > 0 && dt < best) best = dt;  // the first call warms caches and thread pools
  }
  for (int t = 0; t < nt; ++t) free(a[t]), free(b[t]), free(c[t]);
  free(a), free(b), free(c);
  return 2.0 * s->M * s->N * s->K * (double)inner * nt / best / 1e9;
}

int main(int argc, char** argv) {
  int reps = 3;
  for (int i = 1; i + 1 < argc; i += 2)
    if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
  const Shape shapes[] = {
      {"square2048", 2048, 2048, 2048, 0, 1, 0},   {"gate_up_fwd", 512, 6144, 1024, 0, 1, 0},
      {"lm_head_fwd", 512, 151936, 1024, 0, 1, 0}, {"lm_head_dw", 151936, 1024, 512, 1, 0, 0},
      {"attn_tile_qk", 64, 64, 128, 0, 1, 1},      {"attn_tile_pv", 64, 128, 64, 0, 0, 1},
      {"expert_gate_up", 512, 512, 256, 0, 1, 1},
  };
  Dl_info info;  // the library that really serves cblas_sgemm (the build's rpath picks it)
  const char* path = dladdr((void*)cblas_sgemm, &info) && info.dli_fname ? info.dli_fname : "?";
  fprintf(stderr, "%s: cblas_sgemm from %s\n", BLAS_NAME, path);
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); ++i) {
    const double g = run(&shapes[i], reps);
    printf("{\"lib\":\"%s\",\"threads\":%d,\"shape\":\"%s\",\"kind\":\"%s\",\"gflops\":%.1f}\n", BLAS_NAME,
           omp_get_max_threads(), shapes[i].name, shapes[i].tiles ? "per-thread tiles" : "library-threaded",
           g);
    fflush(stdout);
  }
  return 0;
}
