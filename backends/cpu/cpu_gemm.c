/* cpu_gemm.c - gemm: own kernels for decode-sized M, single-threaded sgemm tiles above.
 *
 * Paths, per batch:
 *   M <= 8         the pool runs cpu_vec_gemm_{colb,rowb} over column chunks, reading B (the
 *                  weights, in any float dtype) directly: decode is bound by reading B once.
 *                  (OpenBLAS 0.3.21's sgemm reaches ~20% of memory bandwidth at M = 1.)
 *   M > 8          C is cut into tiles run on the pool, each one single-threaded cblas_sgemm.
 *                  F32 views go to sgemm as they are (packed only when BLAS cannot describe
 *                  them); F16/BF16 A is widened once, and each tile widens its own B panels
 *                  into per-thread scratch right before using them (still in cache).
 * OpenBLAS is set to one thread: its own pool would otherwise spin (sched_yield) for ~0.1 s
 * after every call and fight our pool for the same cores.
 * The F32 accumulator is combined with alpha, beta*c and bias and rounded to c's dtype once. */
#include <cblas.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

/* Rows of A up to which GEMM uses the direct kernels. */
#define GEMM_SMALL_M 8
/* Column chunk per task of the direct kernels: 64 weight rows of K=4096 bf16 = 512 KiB. */
#define GEMM_SMALL_NC 64
/* Columns of B widened to F32 per sgemm call in a tile of the large-M half path
 * (K = 4096: 2 MiB of panel per thread). */
#define GEMM_PANEL_N 128

static char g_blas_name[160];

void cpu_gemm_init(int threads) {
  (void)threads;
  openblas_set_num_threads(1);
}

const char *cpu_gemm_blas_name(void) {
  if (!g_blas_name[0]) {
    const char *cfg = openblas_get_config();
    snprintf(g_blas_name, sizeof(g_blas_name), "%s", cfg ? cfg : "OpenBLAS");
  }
  return g_blas_name;
}

/* A 2-D float matrix: element (i, j) at p + (i*rs + j*cs) elements. */
typedef struct mat {
  char *p;
  int32_t dtype;
  int64_t rs, cs;
} mat_t;

static mat_t mat_of(const kiln_hal_tensor_t *t, int64_t batch, int64_t batch_stride) {
  mat_t m;
  size_t es = kiln_hal_dtype_size(t->dtype);
  m.p = (char *)cpu_tensor_ptr(t) + batch * batch_stride * (int64_t)es;
  m.dtype = t->dtype;
  m.rs = t->stride[t->ndim - 2];
  m.cs = t->stride[t->ndim - 1];
  return m;
}

static inline char *mat_at(const mat_t *m, int64_t i, int64_t j) {
  return m->p + (i * m->rs + j * m->cs) * (int64_t)kiln_hal_dtype_size(m->dtype);
}

/* ---- packing: any strided float matrix -> dense row-major F32 -------------------------- */

typedef struct pack_ctx {
  const mat_t *src;
  int64_t cols, rows_per_task, rows;
  float *dst;
  int64_t ldd;
} pack_ctx_t;

static void pack_task(void *vctx, int64_t task, int thread) {
  (void)thread;
  const pack_ctx_t *c = vctx;
  int64_t r0 = task * c->rows_per_task, r1 = r0 + c->rows_per_task;
  if (r1 > c->rows) r1 = c->rows;
  for (int64_t r = r0; r < r1; r++) {
    float *d = c->dst + r * c->ldd;
    int64_t step = c->src->cs;
    const char *s = mat_at(c->src, r, 0);
    if (step == 1 || c->cols == 1) {
      cpu_vec_to_f32(c->src->dtype, s, d, c->cols);
    } else {
      for (int64_t j = 0; j < c->cols; j++) d[j] = kiln_hal_load_f32(s, c->src->dtype, j * step);
    }
  }
}

/* dst[r, j] = src(r, j) for r < rows, j < cols, in parallel. */
static void pack_f32(const mat_t *src, int64_t rows, int64_t cols, float *dst,
                     int64_t ldd) {
  pack_ctx_t c = {src, cols, 1, rows, dst, ldd};
  int64_t total = rows * cols;
  int64_t tasks = total < (1 << 16) ? 1 : 4 * (int64_t)cpu_num_threads();
  if (tasks > rows) tasks = rows;
  c.rows_per_task = (rows + tasks - 1) / tasks;
  cpu_pool_run(cpu_g_pool, (rows + c.rows_per_task - 1) / c.rows_per_task, pack_task, &c);
}

/* ---- epilogue: c = alpha*acc + beta*c + bias, rounded to c's dtype once ------------------ */

typedef struct epi {
  const mat_t *c;
  const char *bias; /* NULL or [N] in c's dtype, contiguous */
  float alpha, beta;
} epi_t;

/* Rows [m0, m1), columns [n0, n1) of c from acc (acc(m, n) at acc[(m - m0)*ldacc + n - n0];
 * a NULL acc reads as zeros). */
static void epilogue(const epi_t *e, const float *acc, int64_t ldacc, int64_t m0, int64_t m1,
                     int64_t n0, int64_t n1) {
  float out[256], old[256], bias[256];
  int32_t dt = e->c->dtype;
  for (int64_t n = n0; n < n1; n += 256) {
    int64_t w = n1 - n < 256 ? n1 - n : 256;
    if (e->bias) cpu_vec_to_f32(dt, e->bias + n * (int64_t)kiln_hal_dtype_size(dt), bias, w);
    for (int64_t m = m0; m < m1; m++) {
      char *cp = mat_at(e->c, m, n);
      if (acc) {
        const float *a = acc + (m - m0) * ldacc + (n - n0);
        for (int64_t j = 0; j < w; j++) out[j] = e->alpha * a[j];
      } else {
        memset(out, 0, (size_t)w * sizeof(float));
      }
      if (e->beta != 0.0f) {
        cpu_vec_to_f32(dt, cp, old, w);
        for (int64_t j = 0; j < w; j++) out[j] += e->beta * old[j];
      }
      if (e->bias)
        for (int64_t j = 0; j < w; j++) out[j] += bias[j];
      cpu_vec_from_f32(dt, out, cp, w);
    }
  }
}

/* ---- small-M half path ----------------------------------------------------------------- */

typedef struct small_ctx {
  const float *a; /* [M, K] dense F32 */
  const mat_t *b;
  int64_t M, K, N;
  bool colb;
  float *acc; /* [M, N] */
  const epi_t *epi;
} small_ctx_t;

static void small_task(void *vctx, int64_t task, int thread) {
  (void)thread;
  const small_ctx_t *c = vctx;
  int64_t n0 = task * GEMM_SMALL_NC, n1 = n0 + GEMM_SMALL_NC;
  if (n1 > c->N) n1 = c->N;
  if (c->colb)
    cpu_vec_gemm_colb(c->b->dtype, c->M, c->K, c->a, c->b->p, c->b->cs, n0, n1, c->acc, c->N);
  else
    cpu_vec_gemm_rowb(c->b->dtype, c->M, c->K, c->a, c->b->p, c->b->rs, n0, n1, c->acc, c->N);
  epilogue(c->epi, c->acc + n0, c->N, 0, c->M, n0, n1);
}

/* ---- bias-only / epilogue in parallel over rows ---------------------------------------- */

typedef struct epi_ctx {
  const epi_t *epi;
  const float *acc; /* NULL: zeros (K == 0, or a bias added to c in place) */
  int64_t ldacc, M, N, n0, rows_per_task;
} epi_ctx_t;

static void epi_task(void *vctx, int64_t task, int thread) {
  (void)thread;
  const epi_ctx_t *c = vctx;
  int64_t m0 = task * c->rows_per_task, m1 = m0 + c->rows_per_task;
  if (m1 > c->M) m1 = c->M;
  epilogue(c->epi, c->acc, c->ldacc, m0, m1, c->n0, c->n0 + c->N);
}

static void epilogue_parallel(const epi_t *e, const float *acc, int64_t ldacc, int64_t M,
                              int64_t n0, int64_t N) {
  epi_ctx_t c = {e, acc, ldacc, M, N, n0, 1};
  int64_t tasks = M * N < (1 << 15) ? 1 : 4 * (int64_t)cpu_num_threads();
  if (tasks > M) tasks = M;
  c.rows_per_task = (M + tasks - 1) / tasks;
  cpu_pool_run(cpu_g_pool, (M + c.rows_per_task - 1) / c.rows_per_task, epi_task, &c);
}

/* ---- BLAS description of a view -------------------------------------------------------- */

/* Sets *trans and *ld when BLAS can read the rows x cols view m as is. */
static bool blas_view(const mat_t *m, int64_t rows, int64_t cols, CBLAS_TRANSPOSE *trans,
                      int64_t *ld) {
  if ((m->cs == 1 || cols == 1) && (rows == 1 || m->rs >= cols)) {
    *trans = CblasNoTrans;
    *ld = rows == 1 ? cols : m->rs;
    return *ld >= 1;
  }
  if ((m->rs == 1 || rows == 1) && (cols == 1 || m->cs >= rows)) {
    *trans = CblasTrans;
    *ld = cols == 1 ? rows : m->cs;
    return *ld >= 1;
  }
  return false;
}

/* ---- one batch ------------------------------------------------------------------------- */

typedef struct gemm_plan {
  int64_t M, N, K;
  float alpha, beta;
  const char *bias;
} gemm_plan_t;

static kiln_hal_error_t *oom(const char *what, size_t bytes) {
  return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "gemm: cannot allocate %zu bytes for %s",
                            bytes, what);
}

/* A tiling of C: tiles of mc x nc, numbered n-major. */
typedef struct tile_ctx {
  const gemm_plan_t *p;
  const mat_t *c;
  /* F32 operands as sgemm sees them (a may be widened/packed, b may be packed) */
  const float *ap;
  int64_t lda;
  CBLAS_TRANSPOSE ta;
  const float *bp;
  int64_t ldb;
  CBLAS_TRANSPOSE tb;
  const mat_t *bh; /* half B, widened per panel (NULL: bp is F32) */
  bool colb;
  int64_t mc, nc, ntm;
  float *tmp; /* per thread: tmp_floats */
  int64_t tmp_floats;
} tile_ctx_t;

/* Element (i, j) of an F32 operand as sgemm sees it. */
static const float *f32_at(const float *p, CBLAS_TRANSPOSE t, int64_t ld, int64_t i, int64_t j) {
  return t == CblasNoTrans ? p + i * ld + j : p + j * ld + i;
}

static void tile_task(void *vctx, int64_t task, int thread) {
  const tile_ctx_t *t = vctx;
  const gemm_plan_t *p = t->p;
  int64_t m0 = (task % t->ntm) * t->mc, n0 = (task / t->ntm) * t->nc;
  int64_t mt = p->M - m0 < t->mc ? p->M - m0 : t->mc, nt = p->N - n0 < t->nc ? p->N - n0 : t->nc;
  bool direct = t->c->dtype == KILN_HAL_F32;
  int64_t ldc = p->M == 1 ? p->N : t->c->rs;
  const float *ap = f32_at(t->ap, t->ta, t->lda, m0, 0);
  if (!t->bh) {
    const float *bp = f32_at(t->bp, t->tb, t->ldb, 0, n0);
    cblas_sgemm(CblasRowMajor, t->ta, t->tb, (int)mt, (int)nt, (int)p->K, p->alpha, ap,
                (int)t->lda, bp, (int)t->ldb, p->beta, (float *)mat_at(t->c, m0, n0), (int)ldc);
    if (p->bias) {
      epi_t eb = {t->c, p->bias, 1.0f, 1.0f};
      epilogue(&eb, NULL, 0, m0, m0 + mt, n0, n0 + nt);
    }
    return;
  }
  float *bf = t->tmp + (int64_t)thread * t->tmp_floats, *cf = bf + p->K * GEMM_PANEL_N;
  epi_t e = {t->c, p->bias, p->alpha, p->beta};
  for (int64_t j0 = n0; j0 < n0 + nt; j0 += GEMM_PANEL_N) {
    int64_t w = n0 + nt - j0 < GEMM_PANEL_N ? n0 + nt - j0 : GEMM_PANEL_N;
    if (t->colb)
      for (int64_t r = 0; r < w; r++)
        cpu_vec_to_f32(t->bh->dtype, mat_at(t->bh, 0, j0 + r), bf + r * p->K, p->K);
    else
      for (int64_t k = 0; k < p->K; k++)
        cpu_vec_to_f32(t->bh->dtype, mat_at(t->bh, k, j0), bf + k * w, w);
    CBLAS_TRANSPOSE tb = t->colb ? CblasTrans : CblasNoTrans;
    int ldb = (int)(t->colb ? p->K : w);
    if (direct) {
      cblas_sgemm(CblasRowMajor, t->ta, tb, (int)mt, (int)w, (int)p->K, p->alpha, ap, (int)t->lda,
                  bf, ldb, p->beta, (float *)mat_at(t->c, m0, j0), (int)ldc);
      if (p->bias) {
        epi_t eb = {t->c, p->bias, 1.0f, 1.0f};
        epilogue(&eb, NULL, 0, m0, m0 + mt, j0, j0 + w);
      }
    } else {
      cblas_sgemm(CblasRowMajor, t->ta, tb, (int)mt, (int)w, (int)p->K, 1.0f, ap, (int)t->lda, bf,
                  ldb, 0.0f, cf, (int)w);
      epilogue(&e, cf, w, m0, m0 + mt, j0, j0 + w);
    }
  }
}

/* Cuts C into about 2 tiles per thread: columns first (each tile then reads a disjoint slice
 * of B, the big operand), rows too when there are few columns. */
static void plan_tiles(tile_ctx_t *t, int64_t M, int64_t N) {
  int64_t threads = cpu_num_threads();
  int64_t nc = (N + 2 * threads - 1) / (2 * threads);
  nc = (nc + 63) / 64 * 64;
  if (nc < 64) nc = 64;
  int64_t ntn = (N + nc - 1) / nc, ntm = 1;
  if (ntn < 2 * threads) {
    ntm = (2 * threads + ntn - 1) / ntn;
    if (ntm > M / 32) ntm = M / 32 > 1 ? M / 32 : 1;
  }
  t->nc = nc;
  t->mc = (M + ntm - 1) / ntm;
  t->ntm = (M + t->mc - 1) / t->mc;
}

static kiln_hal_error_t *gemm_large(kiln_hal_stream_t *s, const gemm_plan_t *p, const mat_t *a,
                                    const mat_t *b, const mat_t *c) {
  int64_t M = p->M, N = p->N, K = p->K;
  tile_ctx_t t;
  memset(&t, 0, sizeof(t));
  t.p = p;
  t.c = c;
  plan_tiles(&t, M, N);
  bool half = a->dtype != KILN_HAL_F32;
  bool a_ok = !half && blas_view(a, M, K, &t.ta, &t.lda);
  bool b_ok = !half && blas_view(b, K, N, &t.tb, &t.ldb);
  int threads = cpu_num_threads();
  size_t abytes = a_ok ? 0 : ((size_t)(M * K) * sizeof(float) + 63) & ~(size_t)63;
  size_t bbytes = half || b_ok ? 0 : ((size_t)(K * N) * sizeof(float) + 63) & ~(size_t)63;
  if (half) {
    t.tmp_floats = K * GEMM_PANEL_N + (c->dtype == KILN_HAL_F32 ? 0 : t.mc * GEMM_PANEL_N);
    t.tmp_floats = (t.tmp_floats + 15) & ~(int64_t)15;
  }
  size_t tbytes = (size_t)(t.tmp_floats * threads) * sizeof(float);
  char *scratch = cpu_scratch(s, abytes + bbytes + tbytes + 64);
  if (!scratch) return oom("F32 copies and panels", abytes + bbytes + tbytes);
  t.ap = (const float *)a->p;
  t.bp = (const float *)b->p;
  if (!a_ok) {
    pack_f32(a, M, K, (float *)scratch, K);
    t.ap = (const float *)scratch;
    t.ta = CblasNoTrans;
    t.lda = K;
  }
  if (half) {
    t.bh = b;
    t.colb = b->rs == 1 && K > 1;
  } else if (!b_ok) {
    pack_f32(b, K, N, (float *)(scratch + abytes), N);
    t.bp = (const float *)(scratch + abytes);
    t.tb = CblasNoTrans;
    t.ldb = N;
  }
  t.tmp = (float *)(scratch + abytes + bbytes);
  cpu_pool_run(cpu_g_pool, t.ntm * ((N + t.nc - 1) / t.nc), tile_task, &t);
  return NULL;
}

static kiln_hal_error_t *gemm_small(kiln_hal_stream_t *s, const gemm_plan_t *p, const mat_t *a,
                                    const mat_t *b, const mat_t *c) {
  int64_t M = p->M, N = p->N, K = p->K;
  epi_t e = {c, p->bias, p->alpha, p->beta};
  size_t abytes = ((size_t)(M * K) * sizeof(float) + 63) & ~(size_t)63;
  size_t accbytes = (size_t)(M * N) * sizeof(float);
  char *scratch = cpu_scratch(s, abytes + accbytes);
  if (!scratch) return oom("F32 copies of a and c", abytes + accbytes);
  pack_f32(a, M, K, (float *)scratch, K);
  small_ctx_t sc = {(const float *)scratch, b, M, K, N, b->rs == 1 && K > 1,
                    (float *)(scratch + abytes), &e};
  cpu_pool_run(cpu_g_pool, (N + GEMM_SMALL_NC - 1) / GEMM_SMALL_NC, small_task, &sc);
  return NULL;
}

/* ---- the entry point (hal_check.h validates) ---------------------------------------------- */

kiln_hal_error_t *cpu_gemm(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *g, bool dry_run) {
  kiln_hal_gemm_dims_t dims;
  kiln_hal_error_t *e = kiln_hal_check_gemm(&cpu_check_env, g, &dims);
  if (e) return e;
  const kiln_hal_tensor_t *a = &g->a, *b = &g->b, *c = &g->c;
  int64_t M = dims.M, N = dims.N, K = dims.K, batch = dims.batch;
  int64_t abs = dims.batch_stride_a, bbs = dims.batch_stride_b, cbs = dims.batch_stride_c;
  int64_t crs = c->stride[c->ndim - 2];
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX || crs > INT_MAX ||
      a->stride[a->ndim - 2] > INT_MAX || a->stride[a->ndim - 1] > INT_MAX ||
      b->stride[b->ndim - 2] > INT_MAX || b->stride[b->ndim - 1] > INT_MAX)
    return kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED,
                              "gemm: dimensions or strides above 2^31 are not supported");
  if (dry_run || M == 0 || N == 0 || batch == 0) return NULL;

  /* b shared by every batch and a, c evenly strided: one tall GEMM instead of `batch` ones
   * (decode-style batched calls then read B once). */
  mat_t am = mat_of(a, 0, 0), bm = mat_of(b, 0, 0), cm = mat_of(c, 0, 0);
  if (batch > 1 && bbs == 0 && abs != 0 && (am.cs == 1 || K == 1) &&
      (M == 1 || abs == M * am.rs) && (M == 1 || cbs == M * cm.rs)) {
    am.rs = M == 1 ? abs : am.rs;
    cm.rs = M == 1 ? cbs : cm.rs;
    M *= batch;
    batch = 1;
    if (M > INT_MAX || cm.rs > INT_MAX)
      return kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED, "gemm: batch * M above 2^31");
  }
  const char *bias = kiln_hal_tensor_present(&g->bias) ? cpu_tensor_ptr(&g->bias) : NULL;
  gemm_plan_t p = {M, N, K, g->alpha, g->beta, bias};
  /* The kernels read B with K or N contiguous; a [1, N] view with a column stride is the one
   * valid layout that has neither, and is copied (rarely used, so a plain malloc). */
  e = NULL;
  bool b_odd = K > 0 && !(bm.rs == 1 && K > 1) && !(bm.cs == 1 || N == 1);
  float *bcopy = NULL;
  size_t aes = kiln_hal_dtype_size(a->dtype), ces = kiln_hal_dtype_size(c->dtype);
  if (b_odd && !(bcopy = malloc((size_t)(K * N) * sizeof(float))))
    return oom("a dense copy of b", (size_t)(K * N) * sizeof(float));
  for (int64_t i = 0; i < batch && !e; i++) {
    mat_t ai = am, bi = bm, ci = cm;
    ai.p += i * abs * (int64_t)aes;
    bi.p += i * bbs * (int64_t)aes;
    ci.p += i * cbs * (int64_t)ces;
    if (K == 0) {
      epi_t ep = {&ci, bias, 0.0f, g->beta};
      epilogue_parallel(&ep, NULL, 0, M, 0, N);
      continue;
    }
    if (b_odd) {
      pack_f32(&bi, K, N, bcopy, N);
      bi = (mat_t){(char *)bcopy, KILN_HAL_F32, N, 1};
    }
    e = M <= GEMM_SMALL_M ? gemm_small(s, &p, &ai, &bi, &ci) : gemm_large(s, &p, &ai, &bi, &ci);
  }
  free(bcopy);
  return e;
}
