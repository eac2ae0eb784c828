/* check_cuda.c - standalone checker for the CUDA plugin: dlopens it, runs every op on random
 * inputs for F32/F16/BF16 against a naive f64 host reference, prints max errors and PASS/FAIL.
 * Usage: kiln-check-cuda [path/to/libkiln-backend-cuda.so [--bench]]; KILN_CHECK_SEED=n repeats
 * a run's random inputs. Exit status 1 when a check fails. --bench prints baseline timings. */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kiln/hal.h"
#include "kiln/hal_util.h"

static const kiln_hal_backend_t *B;
static kiln_hal_device_t *DEV;
static kiln_hal_stream_t *ST;
static int g_fail, g_pass;

#define NDT 3
static const int32_t DTS[NDT] = {KILN_HAL_F32, KILN_HAL_F16, KILN_HAL_BF16};

/* ---- plumbing -------------------------------------------------------------------------- */

static void die_on(kiln_hal_error_t *e, const char *what) {
  if (!e) return;
  printf("FATAL %s: [%s] %s\n", what, kiln_hal_code_name(e->code), e->message);
  exit(2);
}

static void report(const char *name, const char *detail, double err, double tol) {
  bool ok = err <= tol; /* NaN fails */
  printf("%-4s %-34s %-28s maxerr %.3e (tol %.1e)\n", ok ? "PASS" : "FAIL", name, detail, err, tol);
  if (ok)
    g_pass++;
  else
    g_fail++;
}

/* An op that must fail with `code`. */
static void expect_code(const char *name, kiln_hal_error_t *e, int32_t code) {
  bool ok = e && e->code == code;
  printf("%-4s %-34s want %s, got %s%s%s\n", ok ? "PASS" : "FAIL", name, kiln_hal_code_name(code),
         e ? kiln_hal_code_name(e->code) : "OK", e ? ": " : "", e ? e->message : "");
  if (ok)
    g_pass++;
  else
    g_fail++;
  kiln_hal_error_free(e);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_u64(void) {
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double rng_unif(void) { return (double)(rng_u64() >> 11) * (1.0 / 9007199254740992.0); }
static float rnd(float lo, float hi) { return lo + (hi - lo) * (float)rng_unif(); }
static int rndi(int n) { return (int)(rng_u64() % (uint64_t)n); }

static double dtol(int32_t dt, double f32, double f16, double bf16) {
  return dt == KILN_HAL_F32 ? f32 : dt == KILN_HAL_F16 ? f16 : bf16;
}

static kiln_hal_buffer_t *balloc(size_t bytes) {
  kiln_hal_buffer_t *b = NULL;
  die_on(B->buffer_alloc(DEV, bytes, 0, &b), "buffer_alloc");
  return b;
}

static void sync_(void) { die_on(B->stream_sync(ST), "stream_sync"); }

/* Packs n floats (already representable) into dtype storage. */
static void *pack(int32_t dt, const float *x, size_t n) {
  size_t es = kiln_hal_dtype_size(dt);
  void *p = malloc(n * es + 1);
  for (size_t i = 0; i < n; i++) kiln_hal_store_f32(p, dt, (int64_t)i, x[i]);
  return p;
}

/* A device buffer holding x (n floats) in dtype dt. */
static kiln_hal_buffer_t *upload_f(int32_t dt, const float *x, size_t n) {
  size_t bytes = n * kiln_hal_dtype_size(dt);
  kiln_hal_buffer_t *b = balloc(bytes ? bytes : 1);
  void *p = pack(dt, x, n);
  if (bytes) die_on(B->copy_h2d(ST, b, 0, p, bytes), "copy_h2d");
  sync_();
  free(p);
  return b;
}

static kiln_hal_buffer_t *upload_raw(const void *p, size_t bytes) {
  kiln_hal_buffer_t *b = balloc(bytes ? bytes : 1);
  if (bytes) die_on(B->copy_h2d(ST, b, 0, p, bytes), "copy_h2d");
  sync_();
  return b;
}

static void download_f(int32_t dt, kiln_hal_buffer_t *b, float *out, size_t n) {
  size_t es = kiln_hal_dtype_size(dt);
  void *p = malloc(n * es + 1);
  die_on(B->copy_d2h(ST, p, b, 0, n * es), "copy_d2h");
  sync_();
  for (size_t i = 0; i < n; i++) out[i] = kiln_hal_load_f32(p, dt, (int64_t)i);
  free(p);
}

static void download_raw(kiln_hal_buffer_t *b, void *out, size_t bytes) {
  die_on(B->copy_d2h(ST, out, b, 0, bytes), "copy_d2h");
  sync_();
}

/* Fills a buffer with 0xFF bytes (NaN for every float dtype): unwritten outputs then fail. */
static void poison(kiln_hal_buffer_t *b, size_t bytes) {
  die_on(B->fill(ST, b, 0, bytes, 0xFF), "fill");
}

static kiln_hal_tensor_t T2(kiln_hal_buffer_t *b, int32_t dt, int64_t d0, int64_t d1) {
  int64_t s[2] = {d0, d1};
  return kiln_hal_tensor_make(b, 0, dt, 2, s);
}
static kiln_hal_tensor_t T1(kiln_hal_buffer_t *b, int32_t dt, int64_t d0) {
  return kiln_hal_tensor_make(b, 0, dt, 1, &d0);
}
static kiln_hal_tensor_t T3(kiln_hal_buffer_t *b, int32_t dt, int64_t d0, int64_t d1, int64_t d2) {
  int64_t s[3] = {d0, d1, d2};
  return kiln_hal_tensor_make(b, 0, dt, 3, s);
}
static kiln_hal_tensor_t T4(kiln_hal_buffer_t *b, int32_t dt, int64_t d0, int64_t d1, int64_t d2,
                            int64_t d3) {
  int64_t s[4] = {d0, d1, d2, d3};
  return kiln_hal_tensor_make(b, 0, dt, 4, s);
}

/* Random representable values of dtype dt in [lo, hi). */
static float *rand_q(int32_t dt, size_t n, float lo, float hi) {
  float *x = malloc(n * sizeof(float) + 4);
  for (size_t i = 0; i < n; i++) x[i] = kiln_hal_round_to(dt, rnd(lo, hi));
  return x;
}

/* max |out - ref| / max(max |ref|, floor) over n values; NaN when out has a NaN. */
static double rel_err(const float *out, const double *ref, size_t n, double floor_) {
  double mr = floor_, me = 0;
  for (size_t i = 0; i < n; i++) {
    if (fabs(ref[i]) > mr) mr = fabs(ref[i]);
    double e = fabs((double)out[i] - ref[i]);
    if (isnan(out[i]) != isnan(ref[i])) return NAN;
    if (!isnan(e) && e > me) me = e;
  }
  return me / mr;
}

#define FREE_BUFS(...)                                                                          \
  do {                                                                                          \
    kiln_hal_buffer_t *bufs_[] = {__VA_ARGS__};                                                 \
    for (size_t i_ = 0; i_ < sizeof(bufs_) / sizeof(bufs_[0]); i_++) B->buffer_free(bufs_[i_]); \
  } while (0)

/* ---- gemm ------------------------------------------------------------------------------ */

typedef struct gemm_case {
  const char *name;
  int64_t batch, M, N, K; /* batch 0: 2-D */
  bool a_col, b_col, bias, b_bcast, c_f32, tf32;
  float alpha, beta;
} gemm_case_t;

static void check_gemm_case(int32_t dt, const gemm_case_t *gc) {
  int64_t nb = gc->batch ? gc->batch : 1, M = gc->M, N = gc->N, K = gc->K;
  int32_t dc = gc->c_f32 ? KILN_HAL_F32 : dt;
  int64_t nba = nb, nbb = gc->b_bcast ? 1 : nb;
  float *a = rand_q(dt, (size_t)(nba * M * K), -1, 1);
  float *b = rand_q(dt, (size_t)(nbb * K * N), -1, 1);
  float *c0 = rand_q(dc, (size_t)(nb * M * N), -1, 1);
  float *bias = rand_q(dc, (size_t)N + 1, -1, 1);
  /* storage: a row-major [M,K] or column-major (stored [K,M]); same for b */
  float *as = malloc(sizeof(float) * (size_t)(nba * M * K + 1));
  float *bs = malloc(sizeof(float) * (size_t)(nbb * K * N + 1));
  for (int64_t z = 0; z < nba; z++)
    for (int64_t m = 0; m < M; m++)
      for (int64_t k = 0; k < K; k++)
        as[z * M * K + (gc->a_col ? k * M + m : m * K + k)] = a[z * M * K + m * K + k];
  for (int64_t z = 0; z < nbb; z++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t n = 0; n < N; n++)
        bs[z * K * N + (gc->b_col ? n * K + k : k * N + n)] = b[z * K * N + k * N + n];
  kiln_hal_buffer_t *ba = upload_f(dt, as, (size_t)(nba * M * K));
  kiln_hal_buffer_t *bb = upload_f(dt, bs, (size_t)(nbb * K * N));
  kiln_hal_buffer_t *bc = upload_f(dc, c0, (size_t)(nb * M * N));
  kiln_hal_buffer_t *bbias = upload_f(dc, bias, (size_t)N);
  if (gc->beta == 0) poison(bc, (size_t)(nb * M * N) * kiln_hal_dtype_size(dc));
  kiln_hal_gemm_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  int nd = gc->batch ? 3 : 2;
  g.a.buffer = ba;
  g.a.dtype = dt;
  g.a.ndim = nd;
  g.b.buffer = bb;
  g.b.dtype = dt;
  g.b.ndim = gc->b_bcast ? 2 : nd;
  int o = nd - 2;
  if (nd == 3) {
    g.a.shape[0] = nb;
    g.a.stride[0] = M * K;
    if (!gc->b_bcast) {
      g.b.shape[0] = nb;
      g.b.stride[0] = K * N;
    }
  }
  g.a.shape[o] = M;
  g.a.shape[o + 1] = K;
  g.a.stride[o] = gc->a_col ? 1 : K;
  g.a.stride[o + 1] = gc->a_col ? M : 1;
  int ob = gc->b_bcast ? 0 : o;
  g.b.shape[ob] = K;
  g.b.shape[ob + 1] = N;
  g.b.stride[ob] = gc->b_col ? 1 : N;
  g.b.stride[ob + 1] = gc->b_col ? K : 1;
  if (nd == 3) {
    int64_t s[3] = {nb, M, N};
    g.c = kiln_hal_tensor_make(bc, 0, dc, 3, s);
  } else {
    g.c = T2(bc, dc, M, N);
  }
  if (gc->bias) g.bias = T1(bbias, dc, N);
  g.alpha = gc->alpha;
  g.beta = gc->beta;
  g.allow_tf32 = gc->tf32;
  die_on(B->gemm(ST, &g), gc->name);
  float *out = malloc(sizeof(float) * (size_t)(nb * M * N + 1));
  double *ref = malloc(sizeof(double) * (size_t)(nb * M * N + 1));
  download_f(dc, bc, out, (size_t)(nb * M * N));
  for (int64_t z = 0; z < nb; z++)
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) {
        double acc = 0;
        const float *az = a + z * M * K, *bz = b + (gc->b_bcast ? 0 : z) * K * N;
        for (int64_t k = 0; k < K; k++) acc += (double)az[m * K + k] * bz[k * N + n];
        double r = gc->alpha * acc;
        if (gc->beta != 0) r += gc->beta * (double)c0[z * M * N + m * N + n];
        if (gc->bias) r += bias[n];
        ref[z * M * N + m * N + n] = r;
      }
  /* Per element, as tests/test_ops does: |out - ref| <= atol + rtol |ref| + mtol * sum|terms|;
   * reported as the worst ratio to that limit (PASS when <= 1). */
  double rtol = dtol(dc, 1e-5, 2e-3, 1e-2), mtol = gc->tf32 ? 3e-3 : 1e-4, err = 0;
  for (int64_t z = 0; z < nb; z++)
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) {
        const float *az = a + z * M * K, *bz = b + (gc->b_bcast ? 0 : z) * K * N;
        double mag = 0;
        for (int64_t k = 0; k < K; k++) mag += fabs((double)az[m * K + k] * bz[k * N + n]);
        mag = fabs(gc->alpha) * mag +
              (gc->beta != 0 ? fabs(gc->beta * c0[z * M * N + m * N + n]) : 0) +
              (gc->bias ? fabs(bias[n]) : 0);
        size_t i = (size_t)(z * M * N + m * N + n);
        double lim = 1e-5 + rtol * fabs(ref[i]) + mtol * mag;
        double r = fabs((double)out[i] - ref[i]) / lim;
        if (!(r <= err)) err = isnan(r) ? NAN : r;
        if (isnan(err)) break;
      }
  char name[64], detail[64];
  snprintf(name, sizeof(name), "gemm %s", gc->name);
  snprintf(detail, sizeof(detail), "%s->%s %lldx%lldx%lldx%lld", kiln_hal_dtype_name(dt),
           kiln_hal_dtype_name(dc), (long long)nb, (long long)M, (long long)N, (long long)K);
  report(name, detail, err, 1.0);
  FREE_BUFS(ba, bb, bc, bbias);
  free(a), free(b), free(c0), free(bias), free(as), free(bs), free(out), free(ref);
}

static void check_gemm(void) {
  const gemm_case_t cases[] = {
      {"small rowmaj", 0, 7, 13, 29, false, false, false, false, false, false, 1, 0},
      {"linear [N,K] weight+bias", 0, 33, 200, 96, false, true, true, false, false, false, 1, 0},
      {"decode M=1 weight", 0, 1, 1024, 512, false, true, false, false, false, false, 1, 0},
      {"colmaj a, alpha/beta", 0, 40, 24, 64, true, false, false, false, false, false, 0.7f, 0.5f},
      {"batched 3", 3, 17, 31, 45, false, false, true, false, false, false, 1, 0},
      {"batched bcast b", 4, 9, 40, 32, false, true, false, true, false, false, 1, 1},
      {"c f32", 0, 16, 48, 80, false, true, true, false, true, false, 1, 0},
      {"K=0 beta+bias", 0, 5, 6, 0, false, false, true, false, false, false, 1, 0.5f},
      {"K=0 beta=0", 0, 5, 6, 0, false, false, false, false, false, false, 1, 0},
      {"big", 0, 256, 512, 1024, false, true, true, false, false, false, 1, 0},
      {"odd 31x146x55 bias", 0, 31, 146, 55, false, true, true, false, false, false, 1, 0},
      {"colmaj a+b 93x134x121", 1, 93, 134, 121, true, true, false, false, false, false, 1, 0},
      {"beta=1 8x16x32", 0, 8, 16, 32, false, true, false, false, false, false, 1, 1},
      {"K=4096 split-K bait", 0, 16, 64, 4096, false, true, false, false, false, false, 1, 0},
  };
  for (int d = 0; d < NDT; d++)
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
      check_gemm_case(DTS[d], &cases[i]);
  gemm_case_t tf = {"tf32", 0, 64, 64, 256, false, true, false, false, false, true, 1, 0};
  check_gemm_case(KILN_HAL_F32, &tf);
}

/* ---- embedding ------------------------------------------------------------------------- */

static void check_embedding(int32_t dt) {
  int64_t V = 50, H = 96, T = 9;
  float *tab = rand_q(dt, (size_t)(V * H), -2, 2);
  int32_t ids[9] = {0, 49, 3, -1, 50, 7, 7, 12, 1000};
  kiln_hal_buffer_t *bt = upload_f(dt, tab, (size_t)(V * H));
  kiln_hal_buffer_t *bi = upload_raw(ids, sizeof(ids));
  kiln_hal_buffer_t *bo = balloc((size_t)(T * H) * kiln_hal_dtype_size(dt));
  poison(bo, (size_t)(T * H) * kiln_hal_dtype_size(dt));
  kiln_hal_embedding_args_t a = {sizeof(a), T2(bt, dt, V, H), T1(bi, KILN_HAL_I32, T),
                                 T2(bo, dt, T, H)};
  die_on(B->embedding(ST, &a), "embedding");
  float out[9 * 96];
  double ref[9 * 96];
  download_f(dt, bo, out, (size_t)(T * H));
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++)
      ref[t * H + h] = (ids[t] >= 0 && ids[t] < V) ? tab[ids[t] * H + h] : 0.0;
  report("embedding", kiln_hal_dtype_name(dt), rel_err(out, ref, (size_t)(T * H), 1), 0);
  FREE_BUFS(bt, bi, bo);
  free(tab);
}

/* ---- rmsnorm --------------------------------------------------------------------------- */

static void check_rmsnorm(int32_t dt, bool with_res, float woff, bool inplace) {
  int64_t T = 5, H = 1000;
  size_t n = (size_t)(T * H), es = kiln_hal_dtype_size(dt);
  float *x = rand_q(dt, n, -2, 2), *r = rand_q(dt, n, -2, 2), *w = rand_q(dt, (size_t)H, 0, 2);
  float eps = 1e-5f;
  kiln_hal_buffer_t *bx = upload_f(dt, x, n), *br = upload_f(dt, r, n),
                    *bw = upload_f(dt, w, (size_t)H);
  kiln_hal_buffer_t *bo = inplace ? bx : balloc(n * es);
  if (!inplace) poison(bo, n * es);
  kiln_hal_rmsnorm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = T2(bx, dt, T, H);
  if (with_res) a.residual = T2(br, dt, T, H);
  a.weight = T1(bw, dt, H);
  a.out = T2(bo, dt, T, H);
  a.eps = eps;
  a.weight_offset = woff;
  die_on(B->rmsnorm(ST, &a), "rmsnorm");
  float *out = malloc(n * 4), *rout = malloc(n * 4);
  double *ref = malloc(n * 8), *rref = malloc(n * 8);
  download_f(dt, bo, out, n);
  download_f(dt, br, rout, n);
  for (int64_t t = 0; t < T; t++) {
    double ss = 0;
    for (int64_t h = 0; h < H; h++) {
      double s = x[t * H + h];
      if (with_res) s = kiln_hal_round_to(dt, (float)(s + r[t * H + h]));
      rref[t * H + h] = with_res ? s : r[t * H + h];
      ss += s * s;
    }
    double inv = 1.0 / sqrt(ss / (double)H + eps);
    for (int64_t h = 0; h < H; h++) {
      double s = with_res ? rref[t * H + h] : x[t * H + h];
      double nv = kiln_hal_round_to(dt, (float)(s * inv));
      ref[t * H + h] = nv * ((double)w[h] + woff);
    }
  }
  char detail[64];
  snprintf(detail, sizeof(detail), "%s res=%d off=%g%s", kiln_hal_dtype_name(dt), with_res, woff,
           inplace ? " inplace" : "");
  report("rmsnorm out", detail, rel_err(out, ref, n, 1), dtol(dt, 2e-6, 1e-3, 8e-3));
  if (with_res) report("rmsnorm residual", detail, rel_err(rout, rref, n, 1), 1e-6);
  if (!inplace) B->buffer_free(bo);
  FREE_BUFS(bx, br, bw);
  free(x), free(r), free(w), free(out), free(rout), free(ref), free(rref);
}

/* ---- rope ------------------------------------------------------------------------------ */

static void check_rope(int32_t dt, int style, int64_t R) {
  int64_t T = 6, NH = 4, NKV = 2, D = 64, P = 32;
  /* q and k are slices of one fused [T, (NH + 2 NKV) D] row, as a QKV projection gives. */
  int64_t W = (NH + 2 * NKV) * D;
  size_t n = (size_t)(T * W);
  float *x = rand_q(dt, n, -1, 1);
  float *cs = malloc(sizeof(float) * (size_t)(P * R));
  for (int64_t p = 0; p < P; p++)
    for (int64_t i = 0; i < R / 2; i++) {
      double f = p * pow(10000.0, -2.0 * (double)i / (double)R);
      cs[p * R + i] = (float)cos(f);
      cs[p * R + R / 2 + i] = (float)sin(f);
    }
  int32_t pos[6] = {0, 5, 31, 7, 32, -3};
  kiln_hal_buffer_t *bx = upload_f(dt, x, n), *bp = upload_raw(pos, sizeof(pos));
  kiln_hal_buffer_t *bcs = upload_raw(cs, sizeof(float) * (size_t)(P * R));
  kiln_hal_rope_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.q = T3(bx, dt, T, NH, D);
  a.q.stride[0] = W;
  a.k = T3(bx, dt, T, NKV, D);
  a.k.stride[0] = W;
  a.k.offset = (uint64_t)(NH * D) * kiln_hal_dtype_size(dt);
  a.positions = T1(bp, KILN_HAL_I32, T);
  a.cos_sin = T2(bcs, KILN_HAL_F32, P, R);
  a.style = style;
  die_on(B->rope(ST, &a), "rope");
  float *out = malloc(n * 4);
  double *ref = malloc(n * 8);
  download_f(dt, bx, out, n);
  for (size_t i = 0; i < n; i++) ref[i] = x[i];
  for (int64_t t = 0; t < T; t++) {
    if (pos[t] < 0 || pos[t] >= P) continue;
    for (int64_t h = 0; h < NH + NKV; h++) {
      float *row = x + t * W + h * D;
      double *rr = ref + t * W + h * D;
      for (int64_t i = 0; i < R / 2; i++) {
        int64_t i0 = style == KILN_HAL_ROPE_NEOX ? i : 2 * i;
        int64_t i1 = style == KILN_HAL_ROPE_NEOX ? i + R / 2 : 2 * i + 1;
        double c = cs[pos[t] * R + i], s = cs[pos[t] * R + R / 2 + i];
        rr[i0] = row[i0] * c - row[i1] * s;
        rr[i1] = row[i1] * c + row[i0] * s;
      }
    }
  }
  char detail[64];
  snprintf(detail, sizeof(detail), "%s %s R=%lld", kiln_hal_dtype_name(dt),
           style ? "interleaved" : "neox", (long long)R);
  report("rope (fused qkv view)", detail, rel_err(out, ref, n, 1), dtol(dt, 1e-6, 1e-3, 8e-3));
  FREE_BUFS(bx, bp, bcs);
  free(x), free(cs), free(out), free(ref);
}

/* ---- silu_mul, add --------------------------------------------------------------------- */

static double act_ref(double v, int act) {
  if (act == KILN_HAL_ACT_GELU_TANH)
    return 0.5 * v * (1 + tanh(sqrt(2.0 / 3.14159265358979323846) * (v + 0.044715 * v * v * v)));
  if (act == KILN_HAL_ACT_GELU) return 0.5 * v * (1 + erf(v / sqrt(2.0)));
  return v / (1 + exp(-v));
}

static void check_silu_mul(int32_t dt, int act) {
  int64_t T = 5, I = 300;
  size_t n = (size_t)(T * 2 * I), no = (size_t)(T * I);
  float *x = rand_q(dt, n, -4, 4);
  kiln_hal_buffer_t *bx = upload_f(dt, x, n), *bo = balloc(no * kiln_hal_dtype_size(dt));
  poison(bo, no * kiln_hal_dtype_size(dt));
  kiln_hal_silu_mul_args_t a = {sizeof(a), T2(bx, dt, T, 2 * I), T2(bo, dt, T, I), act};
  die_on(B->silu_mul(ST, &a), "silu_mul");
  float *out = malloc(no * 4);
  double *ref = malloc(no * 8);
  download_f(dt, bo, out, no);
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < I; i++)
      ref[t * I + i] = act_ref(x[t * 2 * I + i], act) * x[t * 2 * I + I + i];
  char detail[32];
  snprintf(detail, sizeof(detail), "%s act=%d", kiln_hal_dtype_name(dt), act);
  report("silu_mul", detail, rel_err(out, ref, no, 1), dtol(dt, 1e-6, 1e-3, 8e-3));
  FREE_BUFS(bx, bo);
  free(x), free(out), free(ref);
}

static void check_add(int32_t dt) {
  int64_t T = 7, H = 333, LD = 400;
  size_t n = (size_t)(T * LD);
  float *x = rand_q(dt, n, -2, 2), *y = rand_q(dt, n, -2, 2);
  kiln_hal_buffer_t *ba = upload_f(dt, x, n), *bb = upload_f(dt, y, n);
  kiln_hal_add_args_t a = {sizeof(a), T2(ba, dt, T, H), T2(bb, dt, T, H), T2(ba, dt, T, H)};
  a.a.stride[0] = a.b.stride[0] = a.out.stride[0] = LD;
  die_on(B->add(ST, &a), "add");
  float *out = malloc(n * 4);
  double *ref = malloc(n * 8);
  download_f(dt, ba, out, n);
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < LD; h++)
      ref[t * LD + h] = h < H ? (double)x[t * LD + h] + y[t * LD + h] : x[t * LD + h];
  report("add (strided rows, out=a)", kiln_hal_dtype_name(dt), rel_err(out, ref, n, 1),
         dtol(dt, 1e-7, 1e-3, 8e-3));
  FREE_BUFS(ba, bb);
  free(x), free(y), free(out), free(ref);
}

/* ---- copy ------------------------------------------------------------------------------ */

static void check_copy(int32_t ds, int32_t dd) {
  /* src: a [4, 5, 6] tensor read through a permuted view (2, 0, 1) -> shape [6, 4, 5] */
  int64_t A = 4, Bn = 5, C = 6;
  size_t n = (size_t)(A * Bn * C);
  float *x = rand_q(ds, n, -3, 3);
  kiln_hal_buffer_t *bs = upload_f(ds, x, n), *bd = balloc(n * kiln_hal_dtype_size(dd));
  poison(bd, n * kiln_hal_dtype_size(dd));
  kiln_hal_copy_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.src = T3(bs, ds, C, A, Bn);
  a.src.stride[0] = 1;
  a.src.stride[1] = Bn * C;
  a.src.stride[2] = C;
  a.dst = T3(bd, dd, C, A, Bn);
  die_on(B->copy(ST, &a), "copy");
  float *out = malloc(n * 4);
  double *ref = malloc(n * 8);
  download_f(dd, bd, out, n);
  for (int64_t c = 0; c < C; c++)
    for (int64_t i = 0; i < A; i++)
      for (int64_t j = 0; j < Bn; j++)
        ref[(c * A + i) * Bn + j] = kiln_hal_round_to(dd, x[(i * Bn + j) * C + c]);
  char detail[32];
  snprintf(detail, sizeof(detail), "%s->%s", kiln_hal_dtype_name(ds), kiln_hal_dtype_name(dd));
  report("copy (permuted 3-D)", detail, rel_err(out, ref, n, 1), 0);
  FREE_BUFS(bs, bd);
  free(x), free(out), free(ref);
}

static void check_copy_int(void) {
  int64_t n = 24;
  int64_t src[24];
  for (int i = 0; i < n; i++) src[i] = (int64_t)rng_u64();
  kiln_hal_buffer_t *bs = upload_raw(src, sizeof(src)), *bd = balloc(sizeof(src));
  kiln_hal_copy_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.src = T2(bs, KILN_HAL_I64, 4, 6);
  a.src.stride[0] = 1;
  a.src.stride[1] = 4; /* transposed read of a [6,4] */
  a.dst = T2(bd, KILN_HAL_I64, 4, 6);
  die_on(B->copy(ST, &a), "copy i64");
  int64_t out[24];
  download_raw(bd, out, sizeof(out));
  double bad = 0;
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 6; j++) bad += out[i * 6 + j] != src[j * 4 + i];
  report("copy i64 transposed", "", bad, 0);
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.src = T1(bs, KILN_HAL_F32, 4);
  a.dst = T1(bd, KILN_HAL_I32, 4);
  expect_code("copy f32->i32 refused", B->copy(ST, &a), KILN_HAL_ERR_INVALID_ARGUMENT);
  FREE_BUFS(bs, bd);
}

/* ---- kv_write -------------------------------------------------------------------------- */

static void check_kv_write(int32_t dt) {
  int64_t T = 10, NKV = 2, D = 64, NB = 6, BS = 4, W = 3 * NKV * D;
  size_t nc = (size_t)(NB * NKV * BS * D), es = kiln_hal_dtype_size(dt);
  float *kv = rand_q(dt, (size_t)(T * W), -1, 1);
  float *c0 = rand_q(dt, nc, -1, 1);
  int32_t slots[10] = {0, 5, 23, -1, 24, 9, 13, 100, 2, 17};
  kiln_hal_buffer_t *bkv = upload_f(dt, kv, (size_t)(T * W)),
                    *bs = upload_raw(slots, sizeof(slots));
  kiln_hal_buffer_t *bk = upload_f(dt, c0, nc), *bv = upload_f(dt, c0, nc);
  kiln_hal_kv_write_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.k = T3(bkv, dt, T, NKV, D);
  a.k.stride[0] = W;
  a.k.offset = (uint64_t)(NKV * D) * es;
  a.v = T3(bkv, dt, T, NKV, D);
  a.v.stride[0] = W;
  a.v.offset = (uint64_t)(2 * NKV * D) * es;
  a.k_cache = T4(bk, dt, NB, NKV, BS, D);
  a.v_cache = T4(bv, dt, NB, NKV, BS, D);
  a.slot_mapping = T1(bs, KILN_HAL_I32, T);
  die_on(B->kv_write(ST, &a), "kv_write");
  float *ok = malloc(nc * 4), *ov = malloc(nc * 4);
  double *rk = malloc(nc * 8), *rv = malloc(nc * 8);
  download_f(dt, bk, ok, nc);
  download_f(dt, bv, ov, nc);
  for (size_t i = 0; i < nc; i++) rk[i] = rv[i] = c0[i];
  for (int64_t t = 0; t < T; t++) {
    int32_t s = slots[t];
    if (s < 0 || s >= NB * BS) continue;
    for (int64_t h = 0; h < NKV; h++)
      for (int64_t d = 0; d < D; d++) {
        int64_t dst = (((s / BS) * NKV + h) * BS + s % BS) * D + d;
        rk[dst] = kv[t * W + NKV * D + h * D + d];
        rv[dst] = kv[t * W + 2 * NKV * D + h * D + d];
      }
  }
  double e = fmax(rel_err(ok, rk, nc, 1), rel_err(ov, rv, nc, 1));
  report("kv_write (skip <0 / out of pool)", kiln_hal_dtype_name(dt), e, 0);
  FREE_BUFS(bkv, bs, bk, bv);
  free(kv), free(c0), free(ok), free(ov), free(rk), free(rv);
}

/* ---- attention ------------------------------------------------------------------------- */

typedef struct att_case {
  const char *name;
  int S;
  int q_len[6], seq_len[6];
  int NH, NKV, D, BS;
  bool causal;
  int window;
  float softcap;
  float scale_mul; /* scale = scale_mul / sqrt(D) */
} att_case_t;

static void check_attention_case(int32_t dt, const att_case_t *ac) {
  int S = ac->S, NH = ac->NH, NKV = ac->NKV, D = ac->D, BS = ac->BS;
  int qsl[7];
  qsl[0] = 0;
  int max_q = 0, max_l = 0, MB = 1, NBtot = 0;
  for (int s = 0; s < S; s++) {
    qsl[s + 1] = qsl[s] + ac->q_len[s];
    if (ac->q_len[s] > max_q) max_q = ac->q_len[s];
    if (ac->seq_len[s] > max_l) max_l = ac->seq_len[s];
    int nb = (ac->seq_len[s] + BS - 1) / BS;
    if (nb > MB) MB = nb;
    NBtot += nb;
  }
  int T = qsl[S], Tpad = T + 3; /* 3 rows past qsl[S] must stay untouched */
  int NB = NBtot + 5;
  size_t es = kiln_hal_dtype_size(dt);
  size_t nq = (size_t)Tpad * NH * D, nc = (size_t)NB * NKV * BS * D;
  float *q = rand_q(dt, nq, -1, 1), *kc = rand_q(dt, nc, -1, 1), *vc = rand_q(dt, nc, -1, 1);
  /* block table: a random permutation of the pool */
  int *perm = malloc(sizeof(int) * (size_t)NB);
  for (int i = 0; i < NB; i++) perm[i] = i;
  for (int i = NB - 1; i > 0; i--) {
    int j = rndi(i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  int32_t *bt = calloc((size_t)S * MB, sizeof(int32_t));
  int used = 0;
  for (int s = 0; s < S; s++)
    for (int b = 0; b < MB; b++)
      bt[s * MB + b] = b < (ac->seq_len[s] + BS - 1) / BS ? perm[used++] : -1;
  int32_t sl[6];
  for (int s = 0; s < S; s++) sl[s] = ac->seq_len[s];
  kiln_hal_buffer_t *bq = upload_f(dt, q, nq), *bk = upload_f(dt, kc, nc),
                    *bv = upload_f(dt, vc, nc);
  kiln_hal_buffer_t *bo = balloc(nq * es);
  poison(bo, nq * es);
  kiln_hal_buffer_t *bbt = upload_raw(bt, sizeof(int32_t) * (size_t)S * MB);
  kiln_hal_buffer_t *bsl = upload_raw(sl, sizeof(int32_t) * (size_t)S);
  kiln_hal_buffer_t *bqsl = upload_raw(qsl, sizeof(int32_t) * (size_t)(S + 1));
  float scale = ac->scale_mul / sqrtf((float)D);
  kiln_hal_attention_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.q = T3(bq, dt, T, NH, D);
  a.out = T3(bo, dt, T, NH, D);
  a.k_cache = T4(bk, dt, NB, NKV, BS, D);
  a.v_cache = T4(bv, dt, NB, NKV, BS, D);
  a.block_table = T2(bbt, KILN_HAL_I32, S, MB);
  a.seq_lens = T1(bsl, KILN_HAL_I32, S);
  a.query_start_loc = T1(bqsl, KILN_HAL_I32, S + 1);
  a.num_seqs = S;
  a.max_query_len = max_q;
  a.max_seq_len = max_l;
  a.scale = scale;
  a.causal = ac->causal;
  a.sliding_window = ac->window;
  a.softcap = ac->softcap;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  die_on(B->attention(ST, &a), ac->name);
  sync_();
  clock_gettime(CLOCK_MONOTONIC, &t1);
  float *out = malloc(nq * 4);
  double *ref = malloc(nq * 8);
  download_f(dt, bo, out, nq);
  double *sc = malloc(sizeof(double) * (size_t)(max_l + 1));
  for (int s = 0; s < S; s++) {
    int ql = ac->q_len[s], L = ac->seq_len[s];
    for (int i = 0; i < ql; i++) {
      int pos = L - ql + i, t = qsl[s] + i;
      for (int h = 0; h < NH; h++) {
        int kvh = h / (NH / NKV);
        const float *qr = q + ((size_t)t * NH + h) * D;
        double mx = -INFINITY;
        for (int j = 0; j < L; j++) {
          bool vis = (!ac->causal || j <= pos) && (ac->window <= 0 || j > pos - ac->window);
          if (!vis) {
            sc[j] = -INFINITY;
            continue;
          }
          int blk = bt[s * MB + j / BS];
          const float *kr = kc + (((size_t)blk * NKV + kvh) * BS + j % BS) * D;
          double dot = 0;
          for (int d = 0; d < D; d++) dot += (double)qr[d] * kr[d];
          dot *= scale;
          if (ac->softcap > 0) dot = ac->softcap * tanh(dot / ac->softcap);
          sc[j] = dot;
          if (dot > mx) mx = dot;
        }
        double *rr = ref + ((size_t)t * NH + h) * D;
        for (int d = 0; d < D; d++) rr[d] = 0;
        if (mx == -INFINITY) continue;
        double z = 0;
        for (int j = 0; j < L; j++) {
          if (sc[j] == -INFINITY) continue;
          double p = exp(sc[j] - mx);
          z += p;
          int blk = bt[s * MB + j / BS];
          const float *vr = vc + (((size_t)blk * NKV + kvh) * BS + j % BS) * D;
          for (int d = 0; d < D; d++) rr[d] += p * vr[d];
        }
        for (int d = 0; d < D; d++) rr[d] /= z;
      }
    }
  }
  /* rows past qsl[S]: still the poison */
  int untouched = 1;
  for (size_t i = (size_t)T * NH * D; i < nq; i++)
    if (!isnan(out[i])) untouched = 0;
  double err = rel_err(out, ref, (size_t)T * NH * D, 0.05);
  if (!untouched) err = NAN;
  char detail[96];
  snprintf(detail, sizeof(detail), "%s D=%d BS=%d %d/%d %.2fms", kiln_hal_dtype_name(dt), D, BS, NH,
           NKV, (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) * 1e-6);
  char name[64];
  snprintf(name, sizeof(name), "attention %s", ac->name);
  report(name, detail, err, dtol(dt, 2e-5, 2e-3, 1.6e-2));
  FREE_BUFS(bq, bk, bv, bo, bbt, bsl, bqsl);
  free(q), free(kc), free(vc), free(perm), free(bt), free(out), free(ref), free(sc);
}

static void check_attention(int32_t dt) {
  const att_case_t cases[] = {
      {"decode", 3, {1, 1, 1}, {1, 37, 200}, 8, 2, 128, 16, true, 0, 0, 1},
      {"prefill", 2, {17, 64}, {17, 64}, 8, 8, 128, 16, true, 0, 0, 1},
      {"mixed chunk+decode", 4, {1, 5, 33, 1}, {50, 40, 33, 9}, 8, 2, 128, 16, true, 0, 0, 1},
      {"D=64 BS=7 MQA", 2, {3, 1}, {20, 61}, 4, 1, 64, 7, true, 0, 0, 1},
      {"D=80 BS=1", 2, {4, 1}, {9, 13}, 6, 3, 80, 1, true, 0, 0, 1},
      {"D=96 BS=32", 2, {40, 1}, {70, 100}, 4, 2, 96, 32, true, 0, 0, 1},
      {"D=256", 2, {9, 1}, {30, 77}, 4, 2, 256, 16, true, 0, 0, 1},
      {"sliding window 8", 2, {20, 1}, {30, 50}, 4, 2, 128, 16, true, 8, 0, 1},
      {"softcap 5 (big scale)", 2, {6, 1}, {6, 40}, 4, 2, 128, 16, true, 0, 5.0f, 20},
      {"non-causal", 2, {7, 3}, {7, 20}, 4, 2, 64, 16, false, 0, 0, 1},
      {"empty rows", 4, {0, 2, 1, 3}, {0, 1, 5, 3}, 4, 2, 128, 16, true, 0, 0, 1},
      {"long decode 20000", 2, {1, 1}, {20000, 4097}, 8, 1, 128, 16, true, 0, 0, 1},
      {"long prefill chunk", 1, {256}, {3000}, 4, 2, 128, 16, true, 0, 0, 1},
  };
  bool quick = getenv("KILN_CHECK_QUICK") != NULL; /* under compute-sanitizer: skip long ones */
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    if (!quick || strncmp(cases[i].name, "long", 4) != 0) check_attention_case(dt, &cases[i]);
}

/* ---- sampling ops ---------------------------------------------------------------------- */

static float *rand_logits(int S, int V, bool ties) {
  float *x = malloc(sizeof(float) * (size_t)S * V);
  for (int i = 0; i < S * V; i++) {
    float v = rnd(-6, 6);
    x[i] = ties ? roundf(v * 2) / 2 : v;
  }
  return x;
}

static int cmp_rank_x;
static const float *g_rank_x;
static int rank_cmp(const void *pa, const void *pb) {
  int a = *(const int *)pa, b = *(const int *)pb;
  float xa = g_rank_x[a], xb = g_rank_x[b];
  if (xa != xb) return xa > xb ? -1 : 1;
  return a < b ? -1 : a > b;
}

static int *ranking(const float *x, int V) {
  int *o = malloc(sizeof(int) * (size_t)V);
  for (int i = 0; i < V; i++) o[i] = i;
  g_rank_x = x;
  (void)cmp_rank_x;
  qsort(o, (size_t)V, sizeof(int), rank_cmp);
  return o;
}

static double ref_logprob(const float *x, int V, int id) {
  double m = -INFINITY, z = 0;
  for (int v = 0; v < V; v++)
    if (x[v] > m) m = x[v];
  for (int v = 0; v < V; v++) z += exp(x[v] - m);
  return x[id] - m - log(z);
}

static void check_argmax_topk(void) {
  int S = 4, V = 1000, k = 10;
  float *x = rand_logits(S, V, true);
  x[1 * V + 10] = x[1 * V + 20] = 50; /* tie at the max: the lower index wins */
  kiln_hal_buffer_t *bl = upload_raw(x, sizeof(float) * (size_t)S * V);
  kiln_hal_buffer_t *bid = balloc(sizeof(int32_t) * S), *blp = balloc(sizeof(float) * S);
  kiln_hal_argmax_args_t a = {sizeof(a), T2(bl, KILN_HAL_F32, S, V), T1(bid, KILN_HAL_I32, S),
                              T1(blp, KILN_HAL_F32, S)};
  die_on(B->argmax(ST, &a), "argmax");
  int32_t ids[4];
  float lp[4];
  download_raw(bid, ids, sizeof(ids));
  download_raw(blp, lp, sizeof(lp));
  double bad = 0, lerr = 0;
  for (int s = 0; s < S; s++) {
    int *o = ranking(x + s * V, V);
    bad += ids[s] != o[0];
    lerr = fmax(lerr, fabs(lp[s] - ref_logprob(x + s * V, V, o[0])));
    free(o);
  }
  report("argmax ids (ties)", "", bad, 0);
  report("argmax logprob", "", lerr, 1e-5);

  kiln_hal_buffer_t *bv = balloc(sizeof(float) * S * k), *bi = balloc(sizeof(int32_t) * S * k);
  kiln_hal_buffer_t *blse = balloc(sizeof(float) * S);
  kiln_hal_topk_args_t t = {sizeof(t), T2(bl, KILN_HAL_F32, S, V), T2(bv, KILN_HAL_F32, S, k),
                            T2(bi, KILN_HAL_I32, S, k), T1(blse, KILN_HAL_F32, S)};
  die_on(B->topk(ST, &t), "topk");
  float vals[40], lse[4];
  int32_t tids[40];
  download_raw(bv, vals, sizeof(vals));
  download_raw(bi, tids, sizeof(tids));
  download_raw(blse, lse, sizeof(lse));
  bad = 0;
  lerr = 0;
  for (int s = 0; s < S; s++) {
    int *o = ranking(x + s * V, V);
    for (int r = 0; r < k; r++)
      bad += tids[s * k + r] != o[r] || vals[s * k + r] != x[s * V + o[r]];
    double lp0 = ref_logprob(x + s * V, V, o[0]);
    lerr = fmax(lerr, fabs((vals[s * k] - lse[s]) - lp0));
    free(o);
  }
  report("topk ids+values (ties)", "k=10 V=1000", bad, 0);
  report("topk lse", "", lerr, 1e-5);
  FREE_BUFS(bl, bid, blp, bv, bi, blse);
  free(x);
}

static void check_penalize(void) {
  int S = 3, V = 1000;
  float *x = rand_logits(S, V, false);
  int32_t prompt[] = {1, 2, 2, 999, 1000, -5, 5, 7, 7, 7};
  int32_t poff[] = {0, 4, 7, 10};
  int32_t outp[] = {2, 3, 3, 3, 500, 7, 42, 42, -1, 1000, 9};
  int32_t ooff[] = {0, 5, 8, 11};
  float rep[] = {1.3f, 1.0f, 0.8f}, freq[] = {0.5f, 0.25f, 0}, pres[] = {0.2f, 0, 1.5f};
  int32_t bid[] = {2, 2, 17, 999, 5, 5, 5};
  float bval[] = {1.5f, -0.5f, 3.0f, -100.0f, 0.25f, 0.5f, 1.0f};
  int32_t boff[] = {0, 3, 4, 7};
  kiln_hal_buffer_t *bl = upload_raw(x, sizeof(float) * (size_t)S * V);
  kiln_hal_buffer_t *b1 = upload_raw(prompt, sizeof(prompt)), *b2 = upload_raw(poff, sizeof(poff));
  kiln_hal_buffer_t *b3 = upload_raw(outp, sizeof(outp)), *b4 = upload_raw(ooff, sizeof(ooff));
  kiln_hal_buffer_t *b5 = upload_raw(rep, sizeof(rep)), *b6 = upload_raw(freq, sizeof(freq));
  kiln_hal_buffer_t *b7 = upload_raw(pres, sizeof(pres)), *b8 = upload_raw(bid, sizeof(bid));
  kiln_hal_buffer_t *b9 = upload_raw(bval, sizeof(bval)), *b10 = upload_raw(boff, sizeof(boff));
  kiln_hal_penalize_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = T2(bl, KILN_HAL_F32, S, V);
  a.prompt_ids = T1(b1, KILN_HAL_I32, 10);
  a.prompt_offsets = T1(b2, KILN_HAL_I32, S + 1);
  a.output_ids = T1(b3, KILN_HAL_I32, 11);
  a.output_offsets = T1(b4, KILN_HAL_I32, S + 1);
  a.repetition = T1(b5, KILN_HAL_F32, S);
  a.frequency = T1(b6, KILN_HAL_F32, S);
  a.presence = T1(b7, KILN_HAL_F32, S);
  a.bias_ids = T1(b8, KILN_HAL_I32, 7);
  a.bias_values = T1(b9, KILN_HAL_F32, 7);
  a.bias_offsets = T1(b10, KILN_HAL_I32, S + 1);
  die_on(B->penalize(ST, &a), "penalize");
  float *out = malloc(sizeof(float) * (size_t)S * V);
  double *ref = malloc(sizeof(double) * (size_t)S * V);
  download_raw(bl, out, sizeof(float) * (size_t)S * V);
  for (int s = 0; s < S; s++)
    for (int v = 0; v < V; v++) {
      double l = x[s * V + v];
      int inp = 0, cnt = 0;
      for (int j = poff[s]; j < poff[s + 1]; j++) inp |= prompt[j] == v;
      for (int j = ooff[s]; j < ooff[s + 1]; j++) cnt += outp[j] == v;
      if (inp || cnt) l = l > 0 ? l / rep[s] : l * rep[s];
      l -= freq[s] * cnt + pres[s] * (cnt > 0);
      for (int j = boff[s]; j < boff[s + 1]; j++)
        if (bid[j] == v) l += bval[j];
      ref[s * V + v] = l;
    }
  report("penalize (all groups)", "", rel_err(out, ref, (size_t)S * V, 1), 1e-6);
  FREE_BUFS(bl, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10);
  free(x), free(out), free(ref);
}

static int ref_sample(const float *x, int V, float t, int K, float tp, float mp, float u) {
  int *o = ranking(x, V);
  int am = o[0];
  if (t <= 0) {
    free(o);
    return am;
  }
  double m = x[am], z = 0;
  double *p = malloc(sizeof(double) * (size_t)V);
  for (int v = 0; v < V; v++) z += (p[v] = exp(((double)x[v] - m) / t));
  for (int v = 0; v < V; v++) p[v] /= z;
  double pmax = p[am];
  char *keep = calloc((size_t)V, 1);
  double before = 0;
  for (int r = 0; r < V; r++) {
    int v = o[r];
    bool k = (K <= 0 || r < K) && (tp >= 1 || before < tp) && (mp <= 0 || p[v] >= mp * pmax);
    keep[v] = k || v == am;
    before += p[v];
  }
  double W = 0, cum = 0;
  for (int v = 0; v < V; v++)
    if (keep[v]) W += p[v];
  int res = am;
  for (int v = 0; v < V; v++) {
    if (!keep[v]) continue;
    cum += p[v];
    if (cum > u * W) {
      res = v;
      break;
    }
  }
  free(o), free(p), free(keep);
  return res;
}

static void check_sample(bool ties) {
  int S = 96, V = 2000;
  float *x = rand_logits(S, V, ties);
  float temp[96], tp[96], mp[96], un[96];
  int32_t tk[96];
  for (int s = 0; s < S; s++) {
    int mode = s % 8;
    temp[s] = mode == 0 ? 0.0f : rnd(0.3f, 1.5f);
    tk[s] = (mode == 1 || mode == 5) ? 1 + rndi(60) : mode == 6 ? V + 5 : 0;
    tp[s] = (mode == 2 || mode == 5) ? rnd(0.2f, 0.95f) : mode == 7 ? 0.0f : 1.0f;
    mp[s] = (mode == 3 || mode == 5) ? rnd(0.01f, 0.3f) : 0.0f;
    un[s] = (float)rng_unif();
    if (un[s] >= 1.0f) un[s] = 0.5f;
  }
  kiln_hal_buffer_t *bl = upload_raw(x, sizeof(float) * (size_t)S * V);
  kiln_hal_buffer_t *bt = upload_raw(temp, sizeof(temp)), *bk = upload_raw(tk, sizeof(tk));
  kiln_hal_buffer_t *bp = upload_raw(tp, sizeof(tp)), *bm = upload_raw(mp, sizeof(mp));
  kiln_hal_buffer_t *bu = upload_raw(un, sizeof(un));
  kiln_hal_buffer_t *bo = balloc(sizeof(int32_t) * S), *blp = balloc(sizeof(float) * S);
  kiln_hal_sample_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = T2(bl, KILN_HAL_F32, S, V);
  a.temperature = T1(bt, KILN_HAL_F32, S);
  a.top_k = T1(bk, KILN_HAL_I32, S);
  a.top_p = T1(bp, KILN_HAL_F32, S);
  a.min_p = T1(bm, KILN_HAL_F32, S);
  a.uniform = T1(bu, KILN_HAL_F32, S);
  a.out_ids = T1(bo, KILN_HAL_I32, S);
  a.out_logprob = T1(blp, KILN_HAL_F32, S);
  die_on(B->sample(ST, &a), "sample");
  int32_t ids[96];
  float lp[96];
  download_raw(bo, ids, sizeof(ids));
  download_raw(blp, lp, sizeof(lp));
  double bad = 0, lerr = 0;
  for (int s = 0; s < S; s++) {
    int r = ref_sample(x + s * V, V, temp[s], tk[s], tp[s], mp[s], un[s]);
    if (ids[s] != r) {
      bad++;
      printf("     row %d mode %d: got %d want %d (t=%g k=%d p=%g minp=%g u=%g)\n", s, s % 8,
             ids[s], r, temp[s], tk[s], tp[s], mp[s], un[s]);
    }
    if (ids[s] >= 0 && ids[s] < V)
      lerr = fmax(lerr, fabs(lp[s] - ref_logprob(x + s * V, V, ids[s])));
  }
  report("sample ids (exact rule)", ties ? "V=2000 tied logits" : "V=2000", bad, 0);
  report("sample logprob", "", lerr, 1e-5);
  /* determinism: same inputs, same ids */
  die_on(B->sample(ST, &a), "sample");
  int32_t ids2[96];
  download_raw(bo, ids2, sizeof(ids2));
  report("sample deterministic", "", memcmp(ids, ids2, sizeof(ids)) ? 1 : 0, 0);
  FREE_BUFS(bl, bt, bk, bp, bm, bu, bo, blp);
  free(x);
}

/* ---- graphs and validation ------------------------------------------------------------- */

static void check_graph(void) {
  int32_t dt = KILN_HAL_BF16;
  int64_t T = 4, H = 512;
  size_t n = (size_t)(T * H);
  float *x = rand_q(dt, n, -1, 1), *y = rand_q(dt, n, -1, 1);
  kiln_hal_buffer_t *bx = upload_f(dt, x, n), *by = upload_f(dt, y, n), *bo = balloc(n * 2);
  kiln_hal_add_args_t a = {sizeof(a), T2(bx, dt, T, H), T2(by, dt, T, H), T2(bo, dt, T, H)};
  die_on(B->graph_begin(ST), "graph_begin");
  die_on(B->add(ST, &a), "add in capture");
  char host[16];
  expect_code("copy_h2d during capture", B->copy_h2d(ST, bx, 0, host, 16),
              KILN_HAL_ERR_INVALID_ARGUMENT);
  expect_code("copy_d2h during capture", B->copy_d2h(ST, host, bx, 0, 16),
              KILN_HAL_ERR_INVALID_ARGUMENT);
  expect_code("stream_sync during capture", B->stream_sync(ST), KILN_HAL_ERR_INVALID_ARGUMENT);
  kiln_hal_buffer_t *tmp = NULL;
  expect_code("buffer_alloc during capture", B->buffer_alloc(DEV, 64, 0, &tmp),
              KILN_HAL_ERR_INVALID_ARGUMENT);
  kiln_hal_graph_t *g = NULL;
  die_on(B->graph_end(ST, &g), "graph_end");
  /* new contents at the same addresses, then replay twice */
  float *x2 = rand_q(dt, n, -1, 1);
  void *p = pack(dt, x2, n);
  die_on(B->copy_h2d(ST, bx, 0, p, n * 2), "h2d");
  die_on(B->graph_replay(g, ST), "graph_replay");
  die_on(B->graph_replay(g, ST), "graph_replay");
  float *out = malloc(n * 4);
  double *ref = malloc(n * 8);
  download_f(dt, bo, out, n);
  for (size_t i = 0; i < n; i++) ref[i] = (double)x2[i] + y[i];
  report("graph capture+replay (add)", "bf16", rel_err(out, ref, n, 1), 8e-3);
  B->graph_destroy(g);
  FREE_BUFS(bx, by, bo);
  free(x), free(y), free(x2), free(p), free(out), free(ref);
}

static void check_validation(void) {
  kiln_hal_buffer_t *b = balloc(1024);
  kiln_hal_add_args_t a = {sizeof(a), T2(b, KILN_HAL_F32, 4, 65), T2(b, KILN_HAL_F32, 4, 65),
                           T2(b, KILN_HAL_F32, 4, 65)};
  expect_code("add: view past buffer end", B->add(ST, &a), KILN_HAL_ERR_INVALID_ARGUMENT);
  a.a = a.b = a.out = T2(b, KILN_HAL_F32, 4, 8);
  a.b.dtype = KILN_HAL_F16;
  expect_code("add: dtype mismatch", B->add(ST, &a), KILN_HAL_ERR_INVALID_ARGUMENT);
  a.b = a.a;
  a.out.stride[1] = 2;
  a.out.stride[0] = 16;
  expect_code("add: non-contiguous last dim", B->add(ST, &a), KILN_HAL_ERR_INVALID_ARGUMENT);
  kiln_hal_gemm_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  g.a = T2(b, KILN_HAL_F32, 4, 8);
  g.b = T2(b, KILN_HAL_F32, 7, 4);
  g.c = T2(b, KILN_HAL_F32, 4, 4);
  g.alpha = 1;
  expect_code("gemm: K mismatch", B->gemm(ST, &g), KILN_HAL_ERR_INVALID_ARGUMENT);
  char host[8];
  expect_code("copy_d2h: out of range", B->copy_d2h(ST, host, b, 1020, 8),
              KILN_HAL_ERR_INVALID_ARGUMENT);
  expect_code("fill: out of range", B->fill(ST, b, 1000, 100, 0), KILN_HAL_ERR_INVALID_ARGUMENT);
  kiln_hal_buffer_t *pin = NULL;
  die_on(B->buffer_alloc(DEV, 4096, KILN_HAL_BUFFER_HOST_PINNED, &pin), "pinned alloc");
  report("pinned buffer has a host pointer", "", B->buffer_host_ptr(pin) ? 0 : 1, 0);
  report("device buffer has no host pointer", "", B->buffer_host_ptr(b) ? 1 : 0, 0);
  B->buffer_free(pin);
  B->buffer_free(b);
}

/* ---- benchmarks (--bench): baseline timings for the tuning work, no reference ------------- */

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

/* Median of `reps` timed runs of fn(arg), each synchronised, after 3 warm-ups. */
static double time_op(void (*fn)(void *), void *arg, int reps) {
  double t[64];
  if (reps > 64) reps = 64;
  for (int i = 0; i < 3; i++) fn(arg);
  sync_();
  for (int i = 0; i < reps; i++) {
    double t0 = now_ms();
    fn(arg);
    sync_();
    t[i] = now_ms() - t0;
  }
  for (int i = 1; i < reps; i++)
    for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
      double x = t[j];
      t[j] = t[j - 1];
      t[j - 1] = x;
    }
  return t[reps / 2];
}

static void run_gemm(void *a) { die_on(B->gemm(ST, (kiln_hal_gemm_args_t *)a), "bench gemm"); }
static void run_att(void *a) {
  die_on(B->attention(ST, (kiln_hal_attention_args_t *)a), "bench attention");
}

static void bench_gemm(int64_t M, int64_t N, int64_t K) {
  int32_t dt = KILN_HAL_BF16;
  float *x = rand_q(dt, (size_t)(M > N ? M : N) * K, -1, 1);
  kiln_hal_buffer_t *ba = upload_f(dt, x, (size_t)(M * K)), *bb = upload_f(dt, x, (size_t)(N * K));
  kiln_hal_buffer_t *bc = balloc((size_t)(M * N) * 2);
  kiln_hal_gemm_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  g.a = T2(ba, dt, M, K);
  g.b = T2(bb, dt, K, N);
  g.b.stride[0] = 1;
  g.b.stride[1] = K; /* a [N, K] weight */
  g.c = T2(bc, dt, M, N);
  g.alpha = 1;
  double ms = time_op(run_gemm, &g, 20);
  double bytes = 2.0 * (M * K + N * K + M * N);
  printf("BENCH gemm bf16 %5lldx%5lldx%5lld  %8.3f ms  %7.1f TFLOP/s  %7.1f GB/s\n", (long long)M,
         (long long)N, (long long)K, ms, 2.0 * M * N * K / ms * 1e-9, bytes / ms * 1e-6);
  FREE_BUFS(ba, bb, bc);
  free(x);
}

/* S sequences of context L each with q_len new tokens; NH/NKV heads, D = 128, BS = 16. */
static void bench_attention(int S, int q_len, int L, int NH, int NKV) {
  int32_t dt = KILN_HAL_BF16;
  int D = 128, BS = 16, MB = (L + BS - 1) / BS, NB = S * MB, T = S * q_len;
  size_t nq = (size_t)T * NH * D, nc = (size_t)NB * NKV * BS * D;
  float *q = rand_q(dt, nq, -1, 1), *c = rand_q(dt, nc, -1, 1);
  int32_t *bt = malloc(sizeof(int32_t) * (size_t)NB), *sl = malloc(sizeof(int32_t) * (size_t)S);
  int32_t *qsl = malloc(sizeof(int32_t) * (size_t)(S + 1));
  for (int i = 0; i < NB; i++) bt[i] = (i * 7919) % NB;
  for (int s = 0; s < S; s++) sl[s] = L;
  for (int s = 0; s <= S; s++) qsl[s] = s * q_len;
  kiln_hal_buffer_t *bq = upload_f(dt, q, nq), *bk = upload_f(dt, c, nc), *bv = upload_f(dt, c, nc);
  kiln_hal_buffer_t *bo = balloc(nq * 2), *bbt = upload_raw(bt, sizeof(int32_t) * (size_t)NB);
  kiln_hal_buffer_t *bsl = upload_raw(sl, sizeof(int32_t) * (size_t)S);
  kiln_hal_buffer_t *bqsl = upload_raw(qsl, sizeof(int32_t) * (size_t)(S + 1));
  kiln_hal_attention_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.q = T3(bq, dt, T, NH, D);
  a.out = T3(bo, dt, T, NH, D);
  a.k_cache = T4(bk, dt, NB, NKV, BS, D);
  a.v_cache = T4(bv, dt, NB, NKV, BS, D);
  a.block_table = T2(bbt, KILN_HAL_I32, S, MB);
  a.seq_lens = T1(bsl, KILN_HAL_I32, S);
  a.query_start_loc = T1(bqsl, KILN_HAL_I32, S + 1);
  a.num_seqs = S;
  a.max_query_len = q_len;
  a.max_seq_len = L;
  a.scale = 1.0f / sqrtf((float)D);
  a.causal = true;
  double ms = time_op(run_att, &a, 10);
  /* keys visited per (row, head): causal prefix */
  double pairs = 0;
  for (int i = 0; i < q_len; i++) pairs += L - q_len + i + 1;
  double flops = 4.0 * D * pairs * S * NH;
  double kv_bytes = 2.0 * S * L * NKV * D * 2;
  printf(
      "BENCH attention bf16 S=%d q=%d L=%d NH=%d NKV=%d  %8.3f ms  %7.2f TFLOP/s  KV %7.1f GB/s\n",
      S, q_len, L, NH, NKV, ms, flops / ms * 1e-9, kv_bytes / ms * 1e-6);
  FREE_BUFS(bq, bk, bv, bo, bbt, bsl, bqsl);
  free(q), free(c), free(bt), free(sl), free(qsl);
}

static void run_bench(void) {
  bench_gemm(4096, 4096, 4096);
  bench_gemm(64, 4096, 4096);
  bench_gemm(1, 14336, 4096);
  bench_attention(64, 1, 2048, 32, 8);
  bench_attention(1, 1, 32768, 32, 8);
  bench_attention(256, 1, 1024, 32, 8);
  bench_attention(1, 2048, 2048, 32, 8);
  bench_attention(4, 512, 4096, 32, 8);
}

int main(int argc, char **argv) {
  bool bench = argc > 2 && strcmp(argv[2], "--bench") == 0;
  const char *path = argc > 1 ? argv[1] : "lib/kiln/libkiln-backend-cuda.so";
  const char *seed = getenv("KILN_CHECK_SEED");
  rng_state = seed ? strtoull(seed, NULL, 0) : (uint64_t)time(NULL);
  printf("seed %llu (KILN_CHECK_SEED to repeat)\n", (unsigned long long)rng_state);
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    printf("dlopen %s: %s\n", path, dlerror());
    return 2;
  }
  kiln_hal_query_fn q;
  void *sym = dlsym(h, KILN_HAL_ENTRY_SYMBOL);
  memcpy(&q, &sym, sizeof(q));
  B = q(KILN_HAL_ABI_MAJOR, KILN_HAL_ABI_MINOR);
  printf("plugin %s ABI %u.%u: %s\n", B->name, B->abi_major, B->abi_minor, B->build_info);
  int32_t score = 0;
  kiln_hal_error_t *pe = B->probe(&score);
  printf("probe score %d%s%s\n", score, pe ? ": " : "", pe ? pe->message : "");
  if (score <= 0) return 3;
  die_on(B->init(NULL), "init");
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  die_on(B->device_info(0, &info), "device_info");
  printf("device 0: %s %s mem %.1f/%.1f GiB warp %d SMs %d pci %06x caps 0x%llx\n", info.name,
         info.arch, info.free_memory / 1073741824.0, info.total_memory / 1073741824.0,
         info.warp_size, info.compute_units, info.pci_bus_id, (unsigned long long)info.caps);
  die_on(B->device_open(0, &DEV), "device_open");
  die_on(B->stream_create(DEV, &ST), "stream_create");

  if (bench) {
    run_bench();
    B->stream_destroy(ST);
    B->device_close(DEV);
    return 0;
  }
  check_gemm();
  for (int d = 0; d < NDT; d++) {
    int32_t dt = DTS[d];
    check_embedding(dt);
    check_rmsnorm(dt, false, 0, false);
    check_rmsnorm(dt, true, 0, false);
    check_rmsnorm(dt, true, 1, true);
    check_rope(dt, KILN_HAL_ROPE_NEOX, 64);
    check_rope(dt, KILN_HAL_ROPE_INTERLEAVED, 64);
    check_rope(dt, KILN_HAL_ROPE_NEOX, 32);
    for (int act = 0; act < 3; act++) check_silu_mul(dt, act);
    check_add(dt);
    for (int d2 = 0; d2 < NDT; d2++) check_copy(dt, DTS[d2]);
    check_kv_write(dt);
    check_attention(dt);
  }
  check_copy_int();
  check_argmax_topk();
  check_penalize();
  check_sample(false);
  check_sample(true);
  check_graph();
  check_validation();

  B->stream_destroy(ST);
  B->device_close(DEV);
  B->shutdown();
  printf("\n%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
