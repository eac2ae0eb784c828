/* bench_ops.c - times a backend plugin's main ops against measured machine ceilings.
 *
 * Usage: kiln-bench-ops PLUGIN.so [--threads N] [--reps N] [--quick] [--only
 * gemm|qgemm|fp8|attn|norm|vision|coll] (fp8, coll: only when named)
 *                      [--no-ceilings]
 *
 * Standalone: it dlopens the plugin and calls kiln_backend_query() like any host would, and
 * links nothing but libdl and libm. Every figure is the median of N timed runs after warm-up
 * (the minimum is printed too) and is set against a ceiling measured in the same run (from
 * its fastest run: a ceiling is the best the machine did):
 *   matrix rate  the plugin's own F32 GEMM on a large square problem (GFLOP/s)
 *   bytes        the larger of a single-threaded memcpy and the plugin's parallel F32 copy of
 *                a 512 MiB buffer, counting bytes read + written (GB/s)
 * "roof" is the time the op would take at the ceiling that binds it, max(flops / matrix rate,
 * bytes / bandwidth), divided by the measured time: 100% = at the ceiling. */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kiln/hal.h"
#include "kiln/hal_quant.h"
#include "kiln/hal_util.h"

static const kiln_hal_backend_t *be;
static kiln_hal_device_t *dev;
static kiln_hal_stream_t *stream;
static int reps = 10;
static int quick;
static int no_ceilings;  /* skip the ceilings (e.g. under compute-sanitizer): roofs print 0% */
static const char *only; /* NULL: every group */
static double peak_gflops, peak_gbs;

static void die(const char *what, kiln_hal_error_t *e) {
  fprintf(stderr, "bench_ops: %s: %s\n", what, e ? e->message : "failed");
  exit(1);
}

static void check(kiln_hal_error_t *e, const char *what) {
  if (e) die(what, e);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

typedef struct timing {
  double median, min;
} timing_t;

/* Runs fn twice to warm up, then `reps` times (fewer when one run takes over a second). */
static timing_t time_it(void (*fn)(void *), void *ctx) {
  double t[256];
  fn(ctx);
  double t0 = now_s();
  fn(ctx);
  double once = now_s() - t0;
  int n = reps;
  if (once > 0.25 && n > 5) n = 5;
  if (once > 1.0) n = 3;
  if (n > 256) n = 256;
  for (int i = 0; i < n; i++) {
    double a = now_s();
    fn(ctx);
    check(be->stream_sync(stream), "stream_sync");
    t[i] = now_s() - a;
  }
  qsort(t, (size_t)n, sizeof(double), cmp_double);
  timing_t r = {n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]), t[0]};
  return r;
}

static kiln_hal_buffer_t *alloc_buf(uint64_t bytes) {
  kiln_hal_buffer_t *b = NULL;
  check(be->buffer_alloc(dev, bytes, 0, &b), "buffer_alloc");
  return b;
}

/* Fills a float buffer with values in [-scale, scale) through a host staging copy. */
static void fill_random(kiln_hal_buffer_t *b, int32_t dtype, int64_t n, float scale) {
  size_t es = kiln_hal_dtype_size(dtype);
  int64_t chunk = 1 << 20;
  void *host = malloc((size_t)chunk * es);
  if (!host) die("malloc", NULL);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i < n; i += chunk) {
    int64_t m = n - i < chunk ? n - i : chunk;
    for (int64_t j = 0; j < m; j++) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      float v = scale * ((float)(x >> 40) / 8388608.0f - 1.0f);
      kiln_hal_store_f32(host, dtype, j, v);
    }
    check(be->copy_h2d(stream, b, (uint64_t)i * es, host, (uint64_t)m * es), "copy_h2d");
  }
  free(host);
}

static void print_header(void) {
  printf("%-44s %10s %10s %10s %9s %7s\n", "op", "median ms", "min ms", "rate", "unit", "roof");
}

/* flops and bytes of one call decide the roof. */
static void report(const char *name, timing_t t, double flops, double bytes, int use_flops_rate) {
  double rate = use_flops_rate ? flops / t.median * 1e-9 : bytes / t.median * 1e-9;
  double bound = fmax(flops / (peak_gflops * 1e9), bytes / (peak_gbs * 1e9));
  printf("%-44s %10.3f %10.3f %10.1f %9s %6.0f%%\n", name, t.median * 1e3, t.min * 1e3, rate,
         use_flops_rate ? "GFLOP/s" : "GB/s", 100.0 * bound / t.median);
}

/* ---- ceilings ---------------------------------------------------------------------------- */

typedef struct memcpy_ctx {
  void *dst, *src;
  size_t n;
} memcpy_ctx_t;

static void run_memcpy(void *vctx) {
  memcpy_ctx_t *c = vctx;
  memcpy(c->dst, c->src, c->n);
}

static void run_copy(void *vctx) { check(be->copy(stream, vctx), "copy"); }
static void run_gemm(void *vctx) { check(be->gemm(stream, vctx), "gemm"); }
static void run_attention(void *vctx) { check(be->attention(stream, vctx), "attention"); }
static void run_rmsnorm(void *vctx) { check(be->rmsnorm(stream, vctx), "rmsnorm"); }
static void run_layernorm(void *vctx) { check(be->layernorm(stream, vctx), "layernorm"); }

static void measure_ceilings(void) {
  size_t n = quick ? (size_t)64 << 20 : (size_t)512 << 20;
  memcpy_ctx_t mc = {malloc(n), malloc(n), n};
  if (!mc.dst || !mc.src) die("malloc for memcpy", NULL);
  memset(mc.src, 1, n);
  memset(mc.dst, 2, n);
  timing_t tm = time_it(run_memcpy, &mc);
  double memcpy_gbs = 2.0 * (double)n / tm.min * 1e-9;
  free(mc.dst);
  free(mc.src);

  int64_t elems = (int64_t)(n / 4);
  kiln_hal_buffer_t *a = alloc_buf(n), *b = alloc_buf(n);
  fill_random(a, KILN_HAL_F32, elems, 1.0f);
  kiln_hal_copy_args_t ca = {sizeof(ca), kiln_hal_tensor_make(a, 0, KILN_HAL_F32, 1, &elems),
                             kiln_hal_tensor_make(b, 0, KILN_HAL_F32, 1, &elems)};
  /* A 1-d view is one row; a 2-d one lets the plugin split rows over threads. */
  int64_t shape2[2] = {elems / 4096, 4096};
  ca.src = kiln_hal_tensor_make(a, 0, KILN_HAL_F32, 2, shape2);
  ca.dst = kiln_hal_tensor_make(b, 0, KILN_HAL_F32, 2, shape2);
  timing_t tc = time_it(run_copy, &ca);
  double copy_gbs = 2.0 * (double)n / tc.min * 1e-9;
  be->buffer_free(a);
  be->buffer_free(b);
  peak_gbs = fmax(memcpy_gbs, copy_gbs);

  int64_t S = quick ? 1024 : 2048;
  int64_t sq[2] = {S, S};
  kiln_hal_buffer_t *ga = alloc_buf((uint64_t)(S * S * 4)), *gb = alloc_buf((uint64_t)(S * S * 4));
  kiln_hal_buffer_t *gc = alloc_buf((uint64_t)(S * S * 4));
  fill_random(ga, KILN_HAL_F32, S * S, 1.0f);
  fill_random(gb, KILN_HAL_F32, S * S, 1.0f);
  kiln_hal_gemm_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  g.a = kiln_hal_tensor_make(ga, 0, KILN_HAL_F32, 2, sq);
  g.b = kiln_hal_tensor_make(gb, 0, KILN_HAL_F32, 2, sq);
  g.c = kiln_hal_tensor_make(gc, 0, KILN_HAL_F32, 2, sq);
  g.alpha = 1.0f;
  timing_t tg = time_it(run_gemm, &g);
  peak_gflops = 2.0 * (double)S * (double)S * (double)S / tg.min * 1e-9;
  be->buffer_free(ga);
  be->buffer_free(gb);
  be->buffer_free(gc);

  printf("ceilings: matrix rate %.1f GFLOP/s (f32 gemm %lldx%lldx%lld)\n", peak_gflops,
         (long long)S, (long long)S, (long long)S);
  printf(
      "          bytes %.1f GB/s (memcpy 1 thread %.1f GB/s, plugin copy %.1f GB/s; "
      "read + write of %zu MiB)\n\n",
      peak_gbs, memcpy_gbs, copy_gbs, n >> 20);
}

/* ---- GEMM: x[M, K] @ W^T with W a PyTorch Linear weight [N, K] ------------------------------
 * Decode rows (M <= 8) report GB/s of W (the bytes they must stream; x and c are noise), the
 * rest GFLOP/s. The Qwen2-7B decode shapes (gate_up, down, lm_head) run at M = 1 and 8 only,
 * in bf16: their weights are up to 1 GiB. KILN_CUDA_NO_GEMV=1 gives the CUDA plugin's
 * cuBLASLt numbers for the same rows. */

typedef struct gemm_shape {
  int64_t K, N;
  int64_t max_m; /* rows beyond this are skipped */
  bool half_only;
} gemm_shape_t;

static void bench_gemm(void) {
  static const int64_t Ms[] = {1, 8, 128, 512};
  static const gemm_shape_t shapes[] = {
      {4096, 4096, 512, false}, {4096, 14336, 512, false}, {896, 4864, 512, false},
      {3584, 37888, 8, true},   {18944, 3584, 8, true},    {3584, 152064, 8, true},
  };
  static const int32_t dts[] = {KILN_HAL_F32, KILN_HAL_BF16};
  const int nshapes = (int)(sizeof(shapes) / sizeof(shapes[0]));
  print_header();
  for (int di = 0; di < 2; di++)
    for (int s = 0; s < nshapes; s++) {
      int32_t dt = dts[di];
      if (shapes[s].half_only && dt == KILN_HAL_F32) continue;
      int64_t K = shapes[s].K, N = shapes[s].N;
      size_t es = kiln_hal_dtype_size(dt);
      int64_t maxM = quick ? 128 : 512;
      if (maxM > shapes[s].max_m) maxM = shapes[s].max_m;
      kiln_hal_buffer_t *w = alloc_buf((uint64_t)(N * K) * es);
      kiln_hal_buffer_t *x = alloc_buf((uint64_t)(maxM * K) * es);
      kiln_hal_buffer_t *y = alloc_buf((uint64_t)(maxM * N) * es);
      fill_random(w, dt, N * K, 0.05f);
      fill_random(x, dt, maxM * K, 1.0f);
      for (int mi = 0; mi < 4; mi++) {
        int64_t M = Ms[mi];
        if (M > maxM) continue;
        kiln_hal_gemm_args_t g;
        memset(&g, 0, sizeof(g));
        g.struct_size = sizeof(g);
        int64_t as[2] = {M, K}, bs[2] = {K, N}, cs[2] = {M, N};
        g.a = kiln_hal_tensor_make(x, 0, dt, 2, as);
        g.b = kiln_hal_tensor_make(w, 0, dt, 2, bs);
        g.b.stride[0] = 1; /* [K, N] view of the [N, K] weight */
        g.b.stride[1] = K;
        g.c = kiln_hal_tensor_make(y, 0, dt, 2, cs);
        g.alpha = 1.0f;
        timing_t t = time_it(run_gemm, &g);
        char name[96];
        snprintf(name, sizeof(name), "gemm %-4s M=%-3lld K=%-5lld N=%-6lld",
                 kiln_hal_dtype_name(dt), (long long)M, (long long)K, (long long)N);
        double flops = 2.0 * (double)M * (double)N * (double)K;
        if (M <= 8) {
          report(name, t, flops, (double)(N * K * (int64_t)es), 0);
        } else {
          report(name, t, flops, (double)((N * K + M * K + M * N) * (int64_t)es), 1);
        }
      }
      be->buffer_free(w);
      be->buffer_free(x);
      be->buffer_free(y);
    }
}

/* ---- gemm_quant: the quantized formats against bf16 ----------------------------------------
 * Decode-sized Linear shapes (Llama-3.2-1B-ish and 7B/8B-ish layers, a 152k-row lm_head) in
 * every format the device claims (KILN_HAL_CAP_QUANT): the GGUF block formats with random
 * blocks and finite f16 scales (any byte pattern is a valid block), and the group formats with
 * group_size 128, zeros and no g_idx; x bf16. Each format's row prints the GB/s of its
 * quantized bytes, its roof against the measured copy bandwidth ("bytes" ceiling), and its time
 * against bf16 gemm's on the same shape and M, measured in the same run. So that a GPU's L2
 * (50 MiB on an H200) does not serve the weights, the timed calls rotate over enough copies of
 * the weights to pass 256 MiB, and each timed run is a batch of calls lasting about 2 ms (one
 * synchronisation per batch, not per call). */

#define QB_ROTATE_BYTES ((uint64_t)256 << 20)
#define QB_MAX_COPIES 16

static void fill_blocks(kiln_hal_buffer_t *b, int32_t fmt, int64_t nblocks) {
  const int B = kiln_hal_qfmt_block_bytes(fmt);
  uint8_t *host = malloc((size_t)(nblocks * B));
  if (!host) die("malloc", NULL);
  uint64_t x = 0x2545F4914F6CDD1Dull;
  for (int64_t i = 0; i < nblocks * B; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    host[i] = (uint8_t)(x >> 32);
  }
  const uint16_t d = 0x1c00; /* f16 2^-8 */
  for (int64_t i = 0; i < nblocks; i++) {
    uint8_t *blk = host + i * B;
    int at[2] = {0, -1};
    if (fmt == KILN_HAL_QFMT_Q4_K || fmt == KILN_HAL_QFMT_Q5_K) at[1] = 2;
    if (fmt == KILN_HAL_QFMT_Q6_K) at[0] = 208;
    for (int k = 0; k < 2; k++)
      if (at[k] >= 0) memcpy(blk + at[k], &d, 2);
  }
  check(be->copy_h2d(stream, b, 0, host, (uint64_t)(nblocks * B)), "copy_h2d");
  check(be->stream_sync(stream), "stream_sync");
  free(host);
}

/* FP8_E4M3 with per-channel F32 scales (group_size K), codes random without NaN. */
/* Random bytes (codes, zeros) into b. */
static void fill_bytes(kiln_hal_buffer_t *b, uint64_t n) {
  uint8_t *host = malloc((size_t)n);
  if (!host) die("malloc", NULL);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    host[i] = (uint8_t)(x >> 32);
  }
  check(be->copy_h2d(stream, b, 0, host, n), "copy_h2d");
  check(be->stream_sync(stream), "stream_sync");
  free(host);
}

/* How many copies of `bytes` of weights pass QB_ROTATE_BYTES (at most QB_MAX_COPIES). */
static int rotate_copies(uint64_t bytes) {
  uint64_t n = bytes ? (QB_ROTATE_BYTES + bytes - 1) / bytes : 1;
  return n < 1 ? 1 : n > QB_MAX_COPIES ? QB_MAX_COPIES : (int)n;
}

/* Copies buffer 0's first `bytes` into buffers 1 .. n - 1. */
static void replicate(kiln_hal_buffer_t **bufs, int n, uint64_t bytes) {
  for (int i = 1; i < n; i++)
    check(be->copy_d2d(stream, bufs[i], 0, bufs[0], 0, bytes), "copy_d2d");
  check(be->stream_sync(stream), "stream_sync");
}

/* One call of a rotation: the next of n argument structs, gemm or gemm_quant. */
typedef struct rot_ctx {
  kiln_hal_gemm_args_t *g;
  kiln_hal_gemm_quant_args_t *q;
  int n, i;
  int batch; /* calls per timed run */
} rot_ctx_t;

static void run_rot(void *vctx) {
  rot_ctx_t *c = vctx;
  for (int b = 0; b < c->batch; b++) {
    const int i = c->i;
    c->i = (c->i + 1) % c->n;
    if (c->g)
      check(be->gemm(stream, &c->g[i]), "gemm");
    else
      check(be->gemm_quant(stream, &c->q[i]), "gemm_quant");
  }
}

/* Times one call of the rotation: picks the batch from a synchronised call, then per-call
 * figures of batched runs. */
static timing_t time_rot(rot_ctx_t *c) {
  c->batch = 1;
  run_rot(c);
  check(be->stream_sync(stream), "stream_sync");
  double t0 = now_s();
  run_rot(c);
  check(be->stream_sync(stream), "stream_sync");
  double once = now_s() - t0;
  int batch = once > 0 ? (int)(2e-3 / once) : 1;
  c->batch = batch < 1 ? 1 : batch > 200 ? 200 : batch;
  timing_t t = time_it(run_rot, c);
  t.median /= c->batch;
  t.min /= c->batch;
  return t;
}

/* n bf16 Linear gemms y[M, N] = x[M, K] @ W^T, W [N, K] in wb[i] (rotated copies). */
static void bf16_linear_args(kiln_hal_gemm_args_t *g, int n, kiln_hal_buffer_t *x,
                             kiln_hal_buffer_t **wb, kiln_hal_buffer_t *y, int64_t M, int64_t K,
                             int64_t N) {
  int64_t as[2] = {M, K}, bs[2] = {K, N}, cs[2] = {M, N};
  for (int i = 0; i < n; i++) {
    memset(&g[i], 0, sizeof(g[i]));
    g[i].struct_size = sizeof(g[i]);
    g[i].a = kiln_hal_tensor_make(x, 0, KILN_HAL_BF16, 2, as);
    g[i].b = kiln_hal_tensor_make(wb[i], 0, KILN_HAL_BF16, 2, bs);
    g[i].b.stride[0] = 1;
    g[i].b.stride[1] = K;
    g[i].c = kiln_hal_tensor_make(y, 0, KILN_HAL_BF16, 2, cs);
    g[i].alpha = 1.0f;
  }
}

/* n FP8_E4M3 gemm_quant calls with g's x and y: codes [N, K] at the start of qb[i], f32 scales
 * [N, ceil(K / gs)] at s_off. */
static void fp8_linear_args(kiln_hal_gemm_quant_args_t *q, int n, const kiln_hal_gemm_args_t *g,
                            kiln_hal_buffer_t **qb, uint64_t s_off, int64_t K, int64_t N,
                            int64_t gs) {
  const int64_t ss[2] = {N, (K + gs - 1) / gs};
  for (int i = 0; i < n; i++) {
    memset(&q[i], 0, sizeof(q[i]));
    q[i].struct_size = sizeof(q[i]);
    q[i].x = g->a;
    q[i].y = g->c;
    q[i].w.buffer = qb[i];
    q[i].w.format = KILN_HAL_QFMT_FP8_E4M3;
    q[i].w.group_size = (int32_t)gs;
    q[i].w.n = N;
    q[i].w.k = K;
    q[i].w.row_stride = K;
    q[i].w.scales = kiln_hal_tensor_make(qb[i], s_off, KILN_HAL_F32, 2, ss);
  }
}

/* FP8_E4M3 against the bf16 gemm g (same x, y): codes, then its f32 scales [N, G] in one
 * buffer, rotated past L2 like the other formats; gs = K (per-channel) or a block size. */
static void bench_fp8(const kiln_hal_gemm_args_t *g, int64_t M, int64_t N, int64_t K, int64_t gs,
                      timing_t tb) {
  const int64_t G = (K + gs - 1) / gs;
  const uint64_t codes = (uint64_t)(N * K), s_off = (codes + 255) / 256 * 256;
  const uint64_t qbytes = s_off + (uint64_t)(N * G) * 4;
  const int nq = rotate_copies(qbytes);
  kiln_hal_buffer_t *qb[QB_MAX_COPIES];
  for (int i = 0; i < nq; i++) qb[i] = alloc_buf(qbytes);
  uint8_t *host = malloc((size_t)codes);
  float *sc = malloc((size_t)(N * G) * sizeof(float));
  if (!host || !sc) die("malloc", NULL);
  uint64_t r = 0x9E3779B97F4A7C15ull;
  for (uint64_t i = 0; i < codes; i++) {
    r ^= r << 13;
    r ^= r >> 7;
    r ^= r << 17;
    host[i] = (uint8_t)(r >> 32);
    if ((host[i] & 0x7F) == 0x7F) host[i] ^= 1; /* no NaN codes */
  }
  for (int64_t i = 0; i < N * G; i++) sc[i] = 1.0f / 4096;
  check(be->copy_h2d(stream, qb[0], 0, host, codes), "copy_h2d");
  check(be->copy_h2d(stream, qb[0], s_off, sc, (uint64_t)(N * G) * 4), "copy_h2d");
  check(be->stream_sync(stream), "stream_sync");
  replicate(qb, nq, qbytes);
  kiln_hal_gemm_quant_args_t q[QB_MAX_COPIES];
  fp8_linear_args(q, nq, g, qb, s_off, K, N, gs);
  rot_ctx_t rq = {NULL, q, nq, 0, 1};
  timing_t tq = time_rot(&rq);
  char name[96];
  if (gs == K)
    snprintf(name, sizeof(name), "  fp8_e4m3 (x%.2f of bf16's time)", tq.median / tb.median);
  else
    snprintf(name, sizeof(name), "  fp8/%-4lld (x%.2f of bf16's time)", (long long)gs,
             tq.median / tb.median);
  report(name, tq, 2.0 * (double)(M * N) * (double)K, (double)qbytes, M > 8);
  for (int i = 0; i < nq; i++) be->buffer_free(qb[i]);
  free(host);
  free(sc);
}

static void bench_qgemm(void) {
  static const int64_t Ms[] = {1, 8, 128};
  /* {K, N}: 1B-ish (2048 x 8192 up, 8192 x 2048 down), 7B-ish (4096 x 4096 attention,
   * 4096 x 14336 gate/up, 14336 x 4096 down), a Qwen-sized lm_head (3584 x 151936). */
  /* Then Qwen2.5-7B's (3584 x 4608 qkv, 3584 x 37888 gate+up, 3584 x 18944, 18944 x 3584
   * down), for FP8 checkpoints only (the third number: 1 = FP8 alone). */
  static const int64_t shapes[][3] = {{2048, 8192, 0},  {8192, 2048, 0},   {4096, 4096, 0},
                                      {4096, 14336, 0}, {14336, 4096, 0},  {3584, 151936, 0},
                                      {3584, 4608, 1},  {3584, 37888, 1},  {3584, 18944, 1},
                                      {18944, 3584, 1}};
  static const int32_t fmts[] = {KILN_HAL_QFMT_Q4_0, KILN_HAL_QFMT_Q8_0,   KILN_HAL_QFMT_Q4_K,
                                 KILN_HAL_QFMT_Q5_K, KILN_HAL_QFMT_Q6_K,   KILN_HAL_QFMT_INT4_G,
                                 KILN_HAL_QFMT_INT8_G};
  const int32_t gs = 128;
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  check(be->device_info(0, &info), "device_info");
  if (!be->gemm_quant) {
    printf("gemm_quant: not in this plugin's table\n\n");
    return;
  }
  printf("gemm_quant: GB/s of the quantized weight bytes; roof against the copy bandwidth (%.1f "
         "GB/s read + written)\n",
         peak_gbs);
  print_header();
  for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
    const int64_t K = shapes[s][0], N = shapes[s][1], maxM = quick ? 8 : 128;
    if (quick && (N > 100000 || K > 8192 || N > 8192)) continue;
    if (shapes[s][2] && !(info.caps & KILN_HAL_CAP_QUANT(KILN_HAL_QFMT_FP8_E4M3))) continue;
    const uint64_t wbytes = (uint64_t)(N * K) * 2;
    const int nw = rotate_copies(wbytes);
    kiln_hal_buffer_t *wb[QB_MAX_COPIES];
    for (int i = 0; i < nw; i++) wb[i] = alloc_buf(wbytes);
    kiln_hal_buffer_t *x = alloc_buf((uint64_t)(maxM * K) * 2);
    kiln_hal_buffer_t *y = alloc_buf((uint64_t)(maxM * N) * 2);
    fill_random(wb[0], KILN_HAL_BF16, N * K, 0.05f);
    replicate(wb, nw, wbytes);
    fill_random(x, KILN_HAL_BF16, maxM * K, 1.0f);
    for (size_t mi = 0; mi < sizeof(Ms) / sizeof(Ms[0]); mi++) {
      const int64_t M = Ms[mi];
      if (M > maxM || (M > 8 && N > 100000)) continue;
      kiln_hal_gemm_args_t g[QB_MAX_COPIES];
      bf16_linear_args(g, nw, x, wb, y, M, K, N);
      rot_ctx_t rg = {g, NULL, nw, 0, 1};
      timing_t tb = time_rot(&rg);
      char name[96];
      snprintf(name, sizeof(name), "gemm bf16 M=%-3lld K=%-5lld N=%-6lld", (long long)M,
               (long long)K, (long long)N);
      report(name, tb, 2.0 * (double)(M * N) * (double)K, (double)wbytes, M > 8);
      for (size_t f = 0; f < sizeof(fmts) / sizeof(fmts[0]) && !shapes[s][2]; f++) {
        const int32_t fmt = fmts[f];
        const bool group = kiln_hal_qfmt_is_group(fmt);
        if (!(info.caps & KILN_HAL_CAP_QUANT(fmt))) continue;
        if (!group && K % kiln_hal_qfmt_block_elems(fmt)) continue;
        const int64_t row = group ? kiln_hal_qgroup_row_bytes(fmt, K)
                                  : K / kiln_hal_qfmt_block_elems(fmt) *
                                        kiln_hal_qfmt_block_bytes(fmt);
        const int64_t G = (K + gs - 1) / gs;
        /* the group formats' scales (f16) and zeros (u8) follow the codes in the buffer */
        const uint64_t codes = (uint64_t)(row * N), sz_off = (codes + 255) / 256 * 256;
        const uint64_t z_off = sz_off + (uint64_t)(N * G) * 2;
        const uint64_t qbytes = group ? z_off + (uint64_t)(N * G) : codes;
        const int nq = rotate_copies(qbytes);
        kiln_hal_buffer_t *qb[QB_MAX_COPIES];
        for (int i = 0; i < nq; i++) qb[i] = alloc_buf(qbytes);
        if (group) {
          fill_bytes(qb[0], qbytes);
          /* scales: f16 2^-8 everywhere (finite products) */
          uint16_t *h = malloc((size_t)(N * G) * 2);
          if (!h) die("malloc", NULL);
          for (int64_t i = 0; i < N * G; i++) h[i] = 0x1c00;
          check(be->copy_h2d(stream, qb[0], sz_off, h, (uint64_t)(N * G) * 2), "copy_h2d");
          check(be->stream_sync(stream), "stream_sync");
          free(h);
        } else {
          fill_blocks(qb[0], fmt, N * (K / kiln_hal_qfmt_block_elems(fmt)));
        }
        replicate(qb, nq, qbytes);
        kiln_hal_gemm_quant_args_t q[QB_MAX_COPIES];
        for (int i = 0; i < nq; i++) {
          memset(&q[i], 0, sizeof(q[i]));
          q[i].struct_size = sizeof(q[i]);
          q[i].x = g[0].a;
          q[i].y = g[0].c;
          q[i].w.buffer = qb[i];
          q[i].w.format = fmt;
          q[i].w.n = N;
          q[i].w.k = K;
          q[i].w.row_stride = row;
          if (group) {
            int64_t ss[2] = {N, G};
            q[i].w.group_size = gs;
            q[i].w.scales = kiln_hal_tensor_make(qb[i], sz_off, KILN_HAL_F16, 2, ss);
            q[i].w.zeros = kiln_hal_tensor_make(qb[i], z_off, KILN_HAL_U8, 2, ss);
          }
        }
        rot_ctx_t rq = {NULL, q, nq, 0, 1};
        timing_t tq = time_rot(&rq);
        snprintf(name, sizeof(name), "  %-6s (x%.2f of bf16's time)", kiln_hal_qfmt_name(fmt),
                 tq.median / tb.median);
        report(name, tq, 2.0 * (double)(M * N) * (double)K, (double)qbytes, M > 8);
        for (int i = 0; i < nq; i++) be->buffer_free(qb[i]);
      }
      if (info.caps & KILN_HAL_CAP_QUANT(KILN_HAL_QFMT_FP8_E4M3)) {
        bench_fp8(&g[0], M, N, K, K, tb);  /* per-channel scales */
        bench_fp8(&g[0], M, N, K, 128, tb); /* block FP8's 128 */
      }
    }
    for (int i = 0; i < nw; i++) be->buffer_free(wb[i]);
    be->buffer_free(x);
    be->buffer_free(y);
  }
  printf("\n");
}

/* ---- fp8: the FP8 GEMV on whole models' decode shapes ----------------------------------------
 * `--only fp8`: every Linear of Qwen2-7B and Llama-3-8B at M = 1, 2, 4, 8 and 16 (q/k/v fused,
 * o_proj, gate/up fused, down_proj; the lm_head at M = 1), per-channel FP8 (f32 scales) against
 * bf16 gemm on the same shape and x in the same run, weights rotated past L2, weight-only (W8A16)
 * and, where the device has KILN_HAL_CAP_FP8_XQUANT, with x quantized per token (W8A8: the GEMV
 * below KILN_CUDA_FP8_LT_MIN_M, cuBLASLt's FP8 GEMM from it up); each M's layer sum shows
 * where the threshold belongs. Then the weights' share of one batch-1 decode step: layers x (the four GEMVs) + the lm_head (kept bf16, as checkpoints
 * list it in `ignore`), with the bytes streamed, so that bytes / time is the GEMVs' effective
 * bandwidth against the card's copy rate (quote one measured outside: this program's copy
 * ceiling is not the device's on CUDA). Fills repeat a 1 MiB random block: fast (a 7B's
 * weights in well under a second) and the values do not change the timing. */

#define FP8B_CHUNK ((uint64_t)1 << 20)

static void fill_repeat(kiln_hal_buffer_t *b, uint64_t n, int fp8) {
  uint8_t *host = malloc(FP8B_CHUNK);
  if (!host) die("malloc", NULL);
  uint64_t r = fp8 ? 0x9E3779B97F4A7C15ull : 0x2545F4914F6CDD1Dull;
  for (uint64_t i = 0; i < FP8B_CHUNK; i++) {
    r ^= r << 13;
    r ^= r >> 7;
    r ^= r << 17;
    host[i] = (uint8_t)(r >> 32);
    if (fp8 && (host[i] & 0x7F) == 0x7F) host[i] ^= 1; /* no NaN codes */
    /* bf16: keep the exponent small and finite (bytes at odd offsets are the high ones) */
    if (!fp8 && (i & 1)) host[i] = (uint8_t)((host[i] & 0x80) | 0x3C | (host[i] & 0x01));
  }
  for (uint64_t off = 0; off < n; off += FP8B_CHUNK) {
    const uint64_t m = n - off < FP8B_CHUNK ? n - off : FP8B_CHUNK;
    check(be->copy_h2d(stream, b, off, host, m), "copy_h2d");
  }
  check(be->stream_sync(stream), "stream_sync");
  free(host);
}

static bool fp8b_xquant; /* the device takes x_quant = FP8_TOKEN: time W8A8 too */

typedef struct fp8b_shape {
  const char *name;
  int64_t K, N;
} fp8b_shape_t;

/* Times bf16 and FP8 (per-channel) at M on one shape; returns both, prints a line. */
static void fp8b_one(const fp8b_shape_t *sh, int64_t M, double *t_bf16, double *t_fp8,
                     double *t_w8a8, double *fp8_bytes) {
  const int64_t K = sh->K, N = sh->N;
  const uint64_t wbytes = (uint64_t)(N * K) * 2;
  const uint64_t codes = (uint64_t)(N * K), s_off = (codes + 255) / 256 * 256;
  const uint64_t qbytes = s_off + (uint64_t)N * 4;
  const int nw = rotate_copies(wbytes), nq = rotate_copies(qbytes);
  kiln_hal_buffer_t *wb[QB_MAX_COPIES], *qb[QB_MAX_COPIES];
  for (int i = 0; i < nw; i++) wb[i] = alloc_buf(wbytes);
  for (int i = 0; i < nq; i++) qb[i] = alloc_buf(qbytes);
  fill_repeat(wb[0], wbytes, 0);
  replicate(wb, nw, wbytes);
  fill_repeat(qb[0], codes, 1);
  float *sc = malloc((size_t)N * sizeof(float));
  if (!sc) die("malloc", NULL);
  for (int64_t i = 0; i < N; i++) sc[i] = 1.0f / 4096;
  check(be->copy_h2d(stream, qb[0], s_off, sc, (uint64_t)N * 4), "copy_h2d");
  check(be->stream_sync(stream), "stream_sync");
  free(sc);
  replicate(qb, nq, qbytes);
  kiln_hal_buffer_t *x = alloc_buf((uint64_t)(M * K) * 2), *y = alloc_buf((uint64_t)(M * N) * 2);
  fill_random(x, KILN_HAL_BF16, M * K, 1.0f);
  kiln_hal_gemm_args_t g[QB_MAX_COPIES];
  bf16_linear_args(g, nw, x, wb, y, M, K, N);
  kiln_hal_gemm_quant_args_t q[QB_MAX_COPIES];
  fp8_linear_args(q, nq, &g[0], qb, s_off, K, N, K);
  rot_ctx_t rg = {g, NULL, nw, 0, 1}, rq = {NULL, q, nq, 0, 1};
  const timing_t tb = time_rot(&rg), tq = time_rot(&rq);
  /* W8A8: the same weights with x quantized per token on the device (x_quant, ABI 1.6) */
  timing_t tx = {0};
  if (fp8b_xquant) {
    kiln_hal_gemm_quant_args_t qx[QB_MAX_COPIES];
    memcpy(qx, q, sizeof(q[0]) * (size_t)nq);
    for (int i = 0; i < nq; i++) qx[i].x_quant = KILN_HAL_XQUANT_FP8_TOKEN;
    rot_ctx_t rx = {NULL, qx, nq, 0, 1};
    tx = time_rot(&rx);
  }
  printf("%-10s M=%-2lld K=%-5lld N=%-6lld  bf16 %8.2f us %7.0f GB/s   fp8 %8.2f us %7.0f GB/s"
         "  (x%.2f of bf16's time)",
         sh->name, (long long)M, (long long)K, (long long)N, tb.median * 1e6,
         (double)wbytes / tb.median * 1e-9, tq.median * 1e6, (double)qbytes / tq.median * 1e-9,
         tq.median / tb.median);
  if (fp8b_xquant)
    printf("   w8a8 %8.2f us %7.0f GB/s (x%.2f)", tx.median * 1e6,
           (double)qbytes / tx.median * 1e-9, tx.median / tb.median);
  printf("\n");
  *t_bf16 = tb.median;
  *t_fp8 = tq.median;
  *t_w8a8 = tx.median;
  *fp8_bytes = (double)qbytes;
  for (int i = 0; i < nw; i++) be->buffer_free(wb[i]);
  for (int i = 0; i < nq; i++) be->buffer_free(qb[i]);
  be->buffer_free(x);
  be->buffer_free(y);
}

static void bench_fp8_decode(void) {
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  check(be->device_info(0, &info), "device_info");
  if (!be->gemm_quant || !(info.caps & KILN_HAL_CAP_QUANT(KILN_HAL_QFMT_FP8_E4M3))) {
    printf("fp8: the plugin has no FP8 gemm_quant\n\n");
    return;
  }
  static const struct {
    const char *model;
    int layers;
    fp8b_shape_t lin[4], head;
  } models[] = {
      {"qwen2-7b", 28,
       {{"qkv", 3584, 4608}, {"o_proj", 3584, 3584}, {"gate_up", 3584, 37888},
        {"down", 18944, 3584}},
       {"lm_head", 3584, 152064}},
      {"llama-3-8b", 32,
       {{"qkv", 4096, 6144}, {"o_proj", 4096, 4096}, {"gate_up", 4096, 28672},
        {"down", 14336, 4096}},
       {"lm_head", 4096, 128256}},
  };
  fp8b_xquant = (info.caps & KILN_HAL_CAP_FP8_XQUANT) != 0;
  const char *ks = getenv("KILN_CUDA_FP8_GEMV"), *lt = getenv("KILN_CUDA_FP8_LT_MIN_M");
  printf("fp8 GEMV (per-channel e4m3, f32 scales; x, y bf16)%s%s%s%s\n",
         ks ? ", KILN_CUDA_FP8_GEMV=" : "", ks ? ks : "", lt ? ", KILN_CUDA_FP8_LT_MIN_M=" : "",
         lt ? lt : "");
  static const int64_t ms[] = {1, 2, 4, 8, 16};
  for (size_t mi = 0; mi < sizeof(models) / sizeof(models[0]); mi++) {
    double lay_b = 0, lay_q = 0, lay_bytes = 0, head_b = 0, head_q = 0, head_bytes = 0, tb, tq,
           tx, by, head_x;
    double step_b[5] = {0}, step_q[5] = {0}, step_x[5] = {0}; /* the layers' GEMMs at each M */
    for (int mj = 0; mj < 5; mj++)
      for (int l = 0; l < 4; l++) {
        fp8b_one(&models[mi].lin[l], ms[mj], &tb, &tq, &tx, &by);
        if (ms[mj] == 1) lay_b += tb, lay_q += tq, lay_bytes += by;
        step_b[mj] += tb, step_q[mj] += tq, step_x[mj] += tx;
      }
    fp8b_one(&models[mi].head, 1, &head_b, &head_q, &head_x, &head_bytes);
    for (int mj = 0; mj < 5 && fp8b_xquant; mj++)
      printf("%s layers' GEMMs at M = %lld (x %d layers): bf16 %.3f ms, fp8 W8A16 %.3f ms "
             "(x%.2f), W8A8 %.3f ms (x%.2f)\n",
             models[mi].model, (long long)ms[mj], models[mi].layers,
             models[mi].layers * step_b[mj] * 1e3, models[mi].layers * step_q[mj] * 1e3,
             step_q[mj] / step_b[mj], models[mi].layers * step_x[mj] * 1e3,
             step_x[mj] / step_b[mj]);
    const int L = models[mi].layers;
    const double bf16_bytes = 2.0 * (double)models[mi].head.K * (double)models[mi].head.N;
    const double t_fp8 = L * lay_q + head_b, bytes_fp8 = L * lay_bytes + bf16_bytes;
    printf("%s decode step, GEMVs only (%d layers + bf16 lm_head): bf16 %.3f ms, FP8 %.3f ms "
           "(%.2f GB streamed: %.0f GB/s); with an FP8 lm_head %.3f ms (%.0f GB/s)\n\n",
           models[mi].model, L, (L * lay_b + head_b) * 1e3, t_fp8 * 1e3, bytes_fp8 * 1e-9,
           bytes_fp8 / t_fp8 * 1e-9, (L * lay_q + head_q) * 1e3,
           (L * lay_bytes + head_bytes) / (L * lay_q + head_q) * 1e-9);
  }
}

/* ---- attention: the serving shapes ------------------------------------------------------------
 * Decode (one query row per sequence) is judged by the KV bytes it must read, against the byte
 * ceiling; prefill (causal, the whole prompt at once) by its flops, against the plugin's own
 * bf16 GEMM rate measured here. Each case also runs with the caches viewed 2 bytes off 16-byte
 * alignment: the same op, which the CUDA plugin then serves with its CUDA-core fallback kernel
 * (the version-0 kernel), so one run shows the tensor-core/split-KV kernels against it. */

typedef struct attn_case {
  const char *label;
  int64_t NH, NKV;
  int64_t S, ctx, qlen; /* every sequence: ctx keys, qlen queries (the last ones) */
  int32_t dtype;
  int64_t D; /* head dim; 0 = 128 */
  bool full; /* non-causal (a vision tower's blocks) */
} attn_case_t;

/* One timed attention call; misalign views the caches one element past their (aligned) start. */
static timing_t attention_time(const attn_case_t *c, int misalign) {
  const int64_t NH = c->NH, NKV = c->NKV, D = c->D ? c->D : 128, BS = 16;
  const int32_t dt = c->dtype;
  const size_t es = kiln_hal_dtype_size(dt);
  const int64_t MB = (c->ctx + BS - 1) / BS, NB = c->S * MB, T = c->S * c->qlen;
  int64_t cache_shape[4] = {NB, NKV, BS, D}, qshape[3] = {T, NH, D};
  const int64_t cache_elems = NB * NKV * BS * D, off = misalign ? 1 : 0;
  kiln_hal_buffer_t *kc = alloc_buf((uint64_t)(cache_elems + 8) * es);
  kiln_hal_buffer_t *vc = alloc_buf((uint64_t)(cache_elems + 8) * es);
  kiln_hal_buffer_t *q = alloc_buf((uint64_t)(T * NH * D) * es);
  kiln_hal_buffer_t *o = alloc_buf((uint64_t)(T * NH * D) * es);
  kiln_hal_buffer_t *meta = alloc_buf((uint64_t)(c->S * MB + 2 * c->S + 1) * 4);
  fill_random(kc, dt, cache_elems + 8, 1.0f);
  fill_random(vc, dt, cache_elems + 8, 1.0f);
  fill_random(q, dt, T * NH * D, 1.0f);
  int32_t *host = malloc((size_t)(c->S * MB + 2 * c->S + 1) * 4);
  if (!host) die("malloc", NULL);
  /* Sequence s owns blocks s, s + S, s + 2S...: interleaved like a real pool. */
  for (int64_t s = 0; s < c->S; s++)
    for (int64_t b = 0; b < MB; b++) host[s * MB + b] = (int32_t)(b * c->S + s);
  int32_t *lens = host + c->S * MB, *qsl = lens + c->S;
  for (int64_t s = 0; s < c->S; s++) lens[s] = (int32_t)c->ctx;
  for (int64_t s = 0; s <= c->S; s++) qsl[s] = (int32_t)(s * c->qlen);
  check(be->copy_h2d(stream, meta, 0, host, (uint64_t)(c->S * MB + 2 * c->S + 1) * 4), "h2d");
  free(host);
  kiln_hal_attention_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.q = kiln_hal_tensor_make(q, 0, dt, 3, qshape);
  a.out = kiln_hal_tensor_make(o, 0, dt, 3, qshape);
  a.k_cache = kiln_hal_tensor_make(kc, (uint64_t)off * es, dt, 4, cache_shape);
  a.v_cache = kiln_hal_tensor_make(vc, (uint64_t)off * es, dt, 4, cache_shape);
  int64_t bts[2] = {c->S, MB}, ls[1] = {c->S}, qs[1] = {c->S + 1};
  a.block_table = kiln_hal_tensor_make(meta, 0, KILN_HAL_I32, 2, bts);
  a.seq_lens = kiln_hal_tensor_make(meta, (uint64_t)(c->S * MB) * 4, KILN_HAL_I32, 1, ls);
  a.query_start_loc =
      kiln_hal_tensor_make(meta, (uint64_t)(c->S * MB + c->S) * 4, KILN_HAL_I32, 1, qs);
  a.num_seqs = (int32_t)c->S;
  a.max_query_len = (int32_t)c->qlen;
  a.max_seq_len = (int32_t)c->ctx;
  a.scale = 1.0f / sqrtf((float)D);
  a.causal = !c->full;
  timing_t t = time_it(run_attention, &a);
  be->buffer_free(kc);
  be->buffer_free(vc);
  be->buffer_free(q);
  be->buffer_free(o);
  be->buffer_free(meta);
  return t;
}

/* The plugin's bf16 GEMM rate on a large square problem (GFLOP/s, from the fastest run). */
static double measure_bf16_gemm(void) {
  const int64_t S = quick ? 2048 : 4096;
  int64_t sq[2] = {S, S};
  const uint64_t bytes = (uint64_t)(S * S * 2);
  kiln_hal_buffer_t *ga = alloc_buf(bytes), *gb = alloc_buf(bytes), *gc = alloc_buf(bytes);
  fill_random(ga, KILN_HAL_BF16, S * S, 1.0f);
  fill_random(gb, KILN_HAL_BF16, S * S, 1.0f);
  kiln_hal_gemm_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  g.a = kiln_hal_tensor_make(ga, 0, KILN_HAL_BF16, 2, sq);
  g.b = kiln_hal_tensor_make(gb, 0, KILN_HAL_BF16, 2, sq);
  g.c = kiln_hal_tensor_make(gc, 0, KILN_HAL_BF16, 2, sq);
  g.alpha = 1.0f;
  timing_t tg = time_it(run_gemm, &g);
  be->buffer_free(ga);
  be->buffer_free(gb);
  be->buffer_free(gc);
  double r = 2.0 * (double)S * (double)S * (double)S / tg.min * 1e-9;
  printf("attention ceilings: bf16 matrix rate %.1f GFLOP/s (bf16 gemm %lld^3), bytes %.1f GB/s\n",
         r, (long long)S, peak_gbs);
  return r;
}

static void attention_rows(const attn_case_t *cases, size_t ncases, double mm);

static void bench_attention(void) {
  /* Qwen2-7B (28 query heads, 4 KV heads, head dim 128), and the 32/8 shape of the earlier
   * baselines (Llama-3-8B). */
  const attn_case_t cases[] = {
      {"decode", 28, 4, 1, 512, 1, KILN_HAL_BF16, 0, false},
      {"prefill", 28, 4, 1, 512, 512, KILN_HAL_BF16, 0, false},
      {"decode", 28, 4, 1, 32768, 1, KILN_HAL_BF16, 0, false},
      {"decode", 28, 4, 64, 1024, 1, KILN_HAL_BF16, 0, false},
      {"decode", 28, 4, 256, 768, 1, KILN_HAL_BF16, 0, false},
      {"prefill", 28, 4, 1, 2048, 2048, KILN_HAL_BF16, 0, false},
      {"prefill", 28, 4, 1, 2048, 2048, KILN_HAL_F16, 0, false},
      {"decode", 32, 8, 64, 2048, 1, KILN_HAL_BF16, 0, false},
      {"prefill", 32, 8, 1, 2048, 2048, KILN_HAL_BF16, 0, false},
  };
  printf("\n");
  const double mm = no_ceilings ? 0.0 : measure_bf16_gemm();
  attention_rows(cases, sizeof(cases) / sizeof(cases[0]), mm);
}

static void attention_rows(const attn_case_t *cases, size_t ncases, double mm) {
  print_header();
  for (size_t ci = 0; ci < ncases; ci++) {
    const attn_case_t *c = &cases[ci];
    if (quick && (c->S * c->ctx > 65536 || c->qlen > 512)) continue;
    const int64_t D = c->D ? c->D : 128;
    const size_t es = kiln_hal_dtype_size(c->dtype);
    /* Keys each query row sees (causal), K and V bytes read once per KV head and sequence. */
    double pairs = 0;
    for (int64_t i = 0; i < c->qlen; i++)
      pairs += c->full ? (double)c->ctx : (double)(c->ctx - c->qlen + i + 1);
    pairs *= (double)c->S;
    const double flops = 4.0 * pairs * (double)c->NH * (double)D;
    const double kv_bytes = 2.0 * (double)c->S * (double)c->ctx * (double)(c->NKV * D) * (double)es;
    const int prefill = c->qlen > 1;
    for (int misalign = 0; misalign < 2; misalign++) {
      timing_t t = attention_time(c, misalign);
      char name[96];
      snprintf(name, sizeof(name), "attn %-4s %-7s %lld/%lld S=%lld ctx=%lld q=%lld%s%s",
               kiln_hal_dtype_name(c->dtype), c->label, (long long)c->NH, (long long)c->NKV,
               (long long)c->S, (long long)c->ctx, (long long)c->qlen,
               c->D && c->D != 128 ? (D == 80 ? " d80" : " d?") : "", misalign ? " unal" : "");
      /* Decode is judged by KV bytes (GB/s) against the byte ceiling, prefill by flops
       * (GFLOP/s) against the bf16 matrix rate. */
      const double rate = prefill ? flops / t.median * 1e-9 : kv_bytes / t.median * 1e-9;
      const double ceil = prefill ? mm * 1e9 : peak_gbs * 1e9;
      const double bound = ceil > 0 ? (prefill ? flops : kv_bytes) / ceil : 0.0;
      printf("%-44s %10.3f %10.3f %10.1f %9s %6.0f%%\n", name, t.median * 1e3, t.min * 1e3, rate,
             prefill ? "GFLOP/s" : "GB/s", 100.0 * bound / t.median);
    }
  }
  printf(
      "(unal: the same call with the caches 2 bytes off 16-byte alignment; on cuda that takes "
      "the CUDA-core fallback kernel)\n");
}

/* ---- the Qwen2-VL-7B vision tower's ops (a 1280 x 720 image: 4,784 patches) ------------------
 * Its GEMMs carry a bias (qkv, proj, fc1, fc2: K or N = 1280), so they are timed with and
 * without one; its attention is non-causal over all 4,784 patches, 16 heads of dim 80. */
static void bench_vision(void) {
  const int64_t M = quick ? 1024 : 4784;
  static const int64_t kn[][2] = {{1280, 3840}, {1280, 1280}, {1280, 5120}, {5120, 1280}};
  const int32_t dt = KILN_HAL_BF16;
  const size_t es = 2;
  printf("\n");
  print_header();
  for (size_t s = 0; s < sizeof(kn) / sizeof(kn[0]); s++) {
    const int64_t K = kn[s][0], N = kn[s][1];
    kiln_hal_buffer_t *w = alloc_buf((uint64_t)(N * K) * es),
                      *x = alloc_buf((uint64_t)(M * K) * es);
    kiln_hal_buffer_t *y = alloc_buf((uint64_t)(M * N) * es), *b = alloc_buf((uint64_t)N * es);
    fill_random(w, dt, N * K, 0.05f);
    fill_random(x, dt, M * K, 1.0f);
    fill_random(b, dt, N, 1.0f);
    for (int with_bias = 0; with_bias < 2; with_bias++) {
      kiln_hal_gemm_args_t g;
      memset(&g, 0, sizeof(g));
      g.struct_size = sizeof(g);
      int64_t as[2] = {M, K}, bs[2] = {K, N}, cs[2] = {M, N}, vs[1] = {N};
      g.a = kiln_hal_tensor_make(x, 0, dt, 2, as);
      g.b = kiln_hal_tensor_make(w, 0, dt, 2, bs);
      g.b.stride[0] = 1;
      g.b.stride[1] = K;
      g.c = kiln_hal_tensor_make(y, 0, dt, 2, cs);
      if (with_bias) g.bias = kiln_hal_tensor_make(b, 0, dt, 1, vs);
      g.alpha = 1.0f;
      timing_t t = time_it(run_gemm, &g);
      char name[96];
      snprintf(name, sizeof(name), "gemm bf16 M=%lld K=%-4lld N=%-4lld%s", (long long)M,
               (long long)K, (long long)N, with_bias ? " +bias" : "");
      report(name, t, 2.0 * (double)M * (double)N * (double)K,
             (double)((N * K + M * K + M * N) * (int64_t)es), 1);
    }
    be->buffer_free(w);
    be->buffer_free(x);
    be->buffer_free(y);
    be->buffer_free(b);
  }
  const attn_case_t cases[] = {
      {"vision", 16, 16, 1, M, M, KILN_HAL_BF16, 80, true},
      {"vision", 16, 16, 1, M, M, KILN_HAL_F32, 80, true},
  };
  const double mm = no_ceilings ? 0.0 : measure_bf16_gemm();
  attention_rows(cases, sizeof(cases) / sizeof(cases[0]), mm);
}

/* ---- rmsnorm with the fused residual add ------------------------------------------------------
 */

static void bench_rmsnorm(void) {
  static const int32_t dts[] = {KILN_HAL_BF16, KILN_HAL_F32};
  static const int64_t Ts[] = {16, 512};
  const int64_t H = 4096;
  printf("\n");
  print_header();
  for (int di = 0; di < 2; di++)
    for (int ti = 0; ti < 2; ti++) {
      int32_t dt = dts[di];
      int64_t T = Ts[ti], shape[2] = {T, H}, ws[1] = {H};
      size_t es = kiln_hal_dtype_size(dt);
      kiln_hal_buffer_t *x = alloc_buf((uint64_t)(T * H) * es),
                        *r = alloc_buf((uint64_t)(T * H) * es);
      kiln_hal_buffer_t *w = alloc_buf((uint64_t)H * es), *o = alloc_buf((uint64_t)(T * H) * es);
      fill_random(x, dt, T * H, 1.0f);
      fill_random(r, dt, T * H, 1.0f);
      fill_random(w, dt, H, 1.0f);
      kiln_hal_rmsnorm_args_t a;
      memset(&a, 0, sizeof(a));
      a.struct_size = sizeof(a);
      a.x = kiln_hal_tensor_make(x, 0, dt, 2, shape);
      a.residual = kiln_hal_tensor_make(r, 0, dt, 2, shape);
      a.weight = kiln_hal_tensor_make(w, 0, dt, 1, ws);
      a.out = kiln_hal_tensor_make(o, 0, dt, 2, shape);
      a.eps = 1e-5f;
      timing_t t = time_it(run_rmsnorm, &a);
      char name[96];
      snprintf(name, sizeof(name), "rmsnorm+residual %-4s T=%-4lld H=%lld", kiln_hal_dtype_name(dt),
               (long long)T, (long long)H);
      /* x, residual read; residual, out written. */
      report(name, t, 0.0, 4.0 * (double)(T * H) * (double)es, 0);
      be->buffer_free(x);
      be->buffer_free(r);
      be->buffer_free(w);
      be->buffer_free(o);
    }
}

/* ---- layernorm with residual and bias (ABI 1.2; Qwen2-VL's vision blocks: H = 1280) ---------- */

static void bench_layernorm(void) {
  if (!KILN_HAL_HAS(be, layernorm) || !be->layernorm) {
    printf("\n(layernorm: not in this plugin's table, ABI %u.%u)\n", be->abi_major, be->abi_minor);
    return;
  }
  static const int32_t dts[] = {KILN_HAL_BF16, KILN_HAL_F32};
  static const int64_t Ts[] = {16, 4096};
  const int64_t H = 1280;
  printf("\n");
  print_header();
  for (int di = 0; di < 2; di++)
    for (int ti = 0; ti < 2; ti++) {
      int32_t dt = dts[di];
      int64_t T = Ts[ti], shape[2] = {T, H}, ws[1] = {H};
      size_t es = kiln_hal_dtype_size(dt);
      kiln_hal_buffer_t *x = alloc_buf((uint64_t)(T * H) * es),
                        *r = alloc_buf((uint64_t)(T * H) * es);
      kiln_hal_buffer_t *w = alloc_buf((uint64_t)H * es), *b = alloc_buf((uint64_t)H * es);
      kiln_hal_buffer_t *o = alloc_buf((uint64_t)(T * H) * es);
      fill_random(x, dt, T * H, 1.0f);
      fill_random(r, dt, T * H, 1.0f);
      fill_random(w, dt, H, 1.0f);
      fill_random(b, dt, H, 1.0f);
      kiln_hal_layernorm_args_t a;
      memset(&a, 0, sizeof(a));
      a.struct_size = sizeof(a);
      a.x = kiln_hal_tensor_make(x, 0, dt, 2, shape);
      a.residual = kiln_hal_tensor_make(r, 0, dt, 2, shape);
      a.weight = kiln_hal_tensor_make(w, 0, dt, 1, ws);
      a.bias = kiln_hal_tensor_make(b, 0, dt, 1, ws);
      a.out = kiln_hal_tensor_make(o, 0, dt, 2, shape);
      a.eps = 1e-6f;
      timing_t t = time_it(run_layernorm, &a);
      char name[96];
      snprintf(name, sizeof(name), "layernorm+res+bias %-4s T=%-4lld H=%lld",
               kiln_hal_dtype_name(dt), (long long)T, (long long)H);
      /* x, residual read; residual, out written. */
      report(name, t, 0.0, 4.0 * (double)(T * H) * (double)es, 0);
      be->buffer_free(x);
      be->buffer_free(r);
      be->buffer_free(w);
      be->buffer_free(b);
      be->buffer_free(o);
    }
}

/* ---- collectives at world size 1 (ABI 1.5; issue 22: the NCCL path on one GPU) ------------
 * `--only coll` (not in the default set). A communicator of one rank, then bf16 all-reduces in
 * place on [T, 3584] (Qwen2-7B's hidden rows) in bursts of 56, a Qwen2-7B step's count under
 * tensor parallelism (o_proj and down_proj of 28 layers), eagerly and replayed from a graph
 * when the device has graphs. At world size 1 nothing crosses a link: what is left is what a
 * TP step pays per collective for being one (the launch, NCCL's own kernel or copy), which a
 * TP = 1 step without collectives does not pay. */

typedef struct coll_ctx {
  kiln_hal_coll_args_t a;
  int n;
  kiln_hal_graph_t *graph;
} coll_ctx_t;

static void run_allreduce(void *p) {
  coll_ctx_t *c = p;
  for (int i = 0; i < c->n; i++) check(be->all_reduce(stream, &c->a), "all_reduce");
}

static void run_coll_graph(void *p) {
  coll_ctx_t *c = p;
  check(be->graph_replay(c->graph, stream), "graph_replay");
}

static void bench_collectives(void) {
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  check(be->device_info(0, &info), "device_info");
  if (!(info.caps & KILN_HAL_CAP_COLLECTIVES) || !KILN_HAL_HAS(be, all_reduce) || !be->all_reduce) {
    printf("\n(collectives: device 0 of %s has none)\n", be->name);
    return;
  }
  kiln_hal_comm_args_t ca;
  memset(&ca, 0, sizeof(ca));
  ca.struct_size = sizeof(ca);
  ca.world_size = 1;
  ca.rank = 0;
  check(be->comm_get_unique_id(&ca.id), "comm_get_unique_id");
  kiln_hal_comm_t *comm = NULL;
  double t0 = now_s();
  check(be->comm_create(dev, &ca, &comm), "comm_create");
  printf("\ncollectives: a communicator of 1 rank in %.1f ms; bursts of 56 bf16 all-reduces in "
         "place (a Qwen2-7B step under TP)\n",
         (now_s() - t0) * 1e3);
  printf("%-44s %10s %10s %12s %10s\n", "op", "median ms", "min ms", "us per call", "GB/s");
  static const int64_t Ts[] = {1, 8, 64, 256, 512};
  const int64_t H = 3584;
  for (size_t ti = 0; ti < sizeof(Ts) / sizeof(Ts[0]); ti++) {
    int64_t T = Ts[ti], shape[2] = {T, H};
    kiln_hal_buffer_t *x = alloc_buf((uint64_t)(T * H) * 2);
    fill_random(x, KILN_HAL_BF16, T * H, 1.0f);
    coll_ctx_t c;
    memset(&c, 0, sizeof(c));
    c.a.struct_size = sizeof(c.a);
    c.a.comm = comm;
    c.a.src = kiln_hal_tensor_make(x, 0, KILN_HAL_BF16, 2, shape);
    c.a.dst = c.a.src;
    c.n = 56;
    for (int g = 0; g < 2; g++) {
      if (g == 1) {
        if (!(info.caps & KILN_HAL_CAP_GRAPHS)) break;
        check(be->graph_begin(stream), "graph_begin");
        run_allreduce(&c);
        check(be->graph_end(stream, &c.graph), "graph_end");
      }
      timing_t t = time_it(g ? run_coll_graph : run_allreduce, &c);
      char name[96];
      snprintf(name, sizeof(name), "56 x all_reduce bf16 T=%-4lld H=%lld %s", (long long)T,
               (long long)H, g ? "graph" : "eager");
      printf("%-44s %10.3f %10.3f %12.2f %10.1f\n", name, t.median * 1e3, t.min * 1e3,
             t.median * 1e6 / c.n, 2.0 * (double)(T * H) * 2.0 * c.n / t.median * 1e-9);
      if (c.graph) be->graph_destroy(c.graph);
      c.graph = NULL;
    }
    be->buffer_free(x);
  }
  be->comm_destroy(comm);
}

int main(int argc, char **argv) {
  const char *path = NULL;
  int threads = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--threads") && i + 1 < argc)
      threads = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--quick"))
      quick = 1;
    else if (!strcmp(argv[i], "--no-ceilings"))
      no_ceilings = 1;
    else if (!strcmp(argv[i], "--only") && i + 1 < argc)
      only = argv[++i];
    else if (argv[i][0] != '-' && !path)
      path = argv[i];
    else {
      fprintf(stderr,
              "usage: %s PLUGIN.so [--threads N] [--reps N] [--quick] [--only "
              "gemm|qgemm|fp8|attn|norm|vision|coll]\n",
              argv[0]);
      return 2;
    }
  }
  if (!path) {
    fprintf(stderr,
            "usage: %s PLUGIN.so [--threads N] [--reps N] [--quick] [--only "
            "gemm|qgemm|fp8|attn|norm|vision|coll]\n",
            argv[0]);
    return 2;
  }
  if (reps < 1) reps = 1;
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "bench_ops: %s\n", dlerror());
    return 1;
  }
  kiln_hal_query_fn query;
  *(void **)&query = dlsym(h, KILN_HAL_ENTRY_SYMBOL);
  if (!query) {
    fprintf(stderr, "bench_ops: %s exports no %s\n", path, KILN_HAL_ENTRY_SYMBOL);
    return 1;
  }
  be = query(KILN_HAL_ABI_MAJOR, KILN_HAL_ABI_MINOR);
  if (!be || be->abi_major != KILN_HAL_ABI_MAJOR) {
    fprintf(stderr, "bench_ops: %s: no table for ABI %d.x\n", path, KILN_HAL_ABI_MAJOR);
    return 1;
  }
  kiln_hal_host_t host;
  memset(&host, 0, sizeof(host));
  host.struct_size = sizeof(host);
  host.num_threads = threads;
  check(be->init(&host), "init");
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  check(be->device_info(0, &info), "device_info");
  check(be->device_open(0, &dev), "device_open");
  check(be->stream_create(dev, &stream), "stream_create");
  printf(
      "plugin: %s (%s)\ndevice: %s, %s\nreps: %d (median and min; fewer for runs over 0.25 s)\n\n",
      be->name, be->build_info, info.name, info.arch, reps);

  if (!no_ceilings) measure_ceilings();
  if (!only || !strcmp(only, "gemm")) bench_gemm();
  if (!only || !strcmp(only, "qgemm")) bench_qgemm();
  if (only && !strcmp(only, "fp8")) bench_fp8_decode(); /* not in the default set: see above */
  if (!only || !strcmp(only, "attn")) bench_attention();
  if (!only || !strcmp(only, "norm")) bench_rmsnorm();
  if (!only || !strcmp(only, "norm")) bench_layernorm();
  if (!only || !strcmp(only, "vision")) bench_vision();
  if (only && !strcmp(only, "coll")) bench_collectives(); /* not in the default set either */

  be->stream_destroy(stream);
  be->device_close(dev);
  be->shutdown();
  return 0;
}
