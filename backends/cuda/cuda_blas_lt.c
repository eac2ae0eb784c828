/* cuda_blas_lt.c - the CUDA plugin's GEMM library: cuda_blas_matmul (cuda_internal.h) on
 * cuBLASLt, with a per-stream cache of descriptors and heuristic choices keyed by the call's
 * shape, layout and alignment. cuda_gemm.c maps kiln's row-major gemm onto these calls. */
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>

#include "cuda_internal.h"

/* Workspace each stream hands cuBLASLt (NVIDIA recommends 32 MiB on Hopper). */
#define LT_WORKSPACE_BYTES (32u << 20)
/* Heuristic results cached per stream (plans keyed by shape, layout and alignment). */
#define LT_CACHE_SIZE 64

/* One cached plan: the key fields describe the call, the rest is what cuBLASLt needs. */
typedef struct lt_plan {
  bool used;
  uint64_t stamp; /* LRU clock */
  /* key */
  int32_t dtype_ab, dtype_c, compute;
  int32_t trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
  int32_t align_a, align_b, align_c, epilogue;
  /* value */
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
} lt_plan_t;

struct cuda_blas {
  cublasLtHandle_t lt;
  void *workspace;
  size_t workspace_size;
  lt_plan_t plans[LT_CACHE_SIZE];
  uint64_t clock;
};

/* An error for a failed cuBLASLt call: "<what>: <status name>: <status string>". */
static kiln_hal_error_t *lt_err(cublasStatus_t st, const char *what) {
  int32_t code = st == CUBLAS_STATUS_ALLOC_FAILED ? KILN_HAL_ERR_OUT_OF_MEMORY
                 : st == CUBLAS_STATUS_NOT_SUPPORTED ? KILN_HAL_ERR_UNSUPPORTED
                                                     : KILN_HAL_ERR_DEVICE;
  return kiln_hal_error_new(code, "%s: %s: %s", what, cublasLtGetStatusName(st),
                            cublasLtGetStatusString(st));
}

static cudaDataType_t cuda_dtype(int32_t d) {
  switch (d) {
    case KILN_HAL_F16: return CUDA_R_16F;
    case KILN_HAL_BF16: return CUDA_R_16BF;
    case CUDA_BLAS_FP8_E4M3: return CUDA_R_8F_E4M3;
    default: return CUDA_R_32F;
  }
}

/* Largest power of two (<= 256) dividing the address and every byte stride of an operand. */
static int32_t alignment_of(const void *p, int64_t ld, int64_t batch_stride, size_t es) {
  uint64_t bits = (uint64_t)(uintptr_t)p | (uint64_t)ld * es | (uint64_t)batch_stride * es | 256u;
  return (int32_t)(bits & (~bits + 1));
}

static void plan_destroy(lt_plan_t *p) {
  if (p->desc) cublasLtMatmulDescDestroy(p->desc);
  if (p->la) cublasLtMatrixLayoutDestroy(p->la);
  if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
  if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
  memset(p, 0, sizeof(*p));
}

static bool same_key(const lt_plan_t *a, const lt_plan_t *b) {
  return a->dtype_ab == b->dtype_ab && a->dtype_c == b->dtype_c && a->compute == b->compute &&
         a->trans_a == b->trans_a && a->trans_b == b->trans_b && a->m == b->m && a->n == b->n &&
         a->k == b->k && a->lda == b->lda && a->ldb == b->ldb && a->ldc == b->ldc &&
         a->batch == b->batch && a->stride_a == b->stride_a && a->stride_b == b->stride_b &&
         a->stride_c == b->stride_c && a->align_a == b->align_a && a->align_b == b->align_b &&
         a->align_c == b->align_c && a->epilogue == b->epilogue;
}

#define BLAS(call, what)                       \
  do {                                         \
    cublasStatus_t st_ = (call);               \
    if (st_ != CUBLAS_STATUS_SUCCESS) {        \
      err = lt_err(st_, "gemm: " what); \
      goto fail;                               \
    }                                          \
  } while (0)

/* Builds descriptors for key `k` and asks the heuristic for an algorithm. On success *out is a
 * complete plan; *found is false when cuBLASLt has no algorithm for it (not an error). */
static kiln_hal_error_t *plan_build(cuda_blas_t *s, const lt_plan_t *k, const cuda_blas_call_t *c,
                                    lt_plan_t *out, bool *found) {
  kiln_hal_error_t *err = NULL;
  cublasLtMatmulPreference_t pref = NULL;
  *out = *k;
  out->desc = NULL;
  out->la = out->lb = out->lc = NULL;
  *found = false;
  cudaDataType_t tab = cuda_dtype(k->dtype_ab), tc = cuda_dtype(k->dtype_c);
  BLAS(cublasLtMatmulDescCreate(&out->desc, (cublasComputeType_t)k->compute, CUDA_R_32F),
       "cublasLtMatmulDescCreate");
  cublasOperation_t ta = k->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = k->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  BLAS(cublasLtMatmulDescSetAttribute(out->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
       "set TRANSA");
  BLAS(cublasLtMatmulDescSetAttribute(out->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
       "set TRANSB");
  if (k->dtype_ab == CUDA_BLAS_FP8_E4M3) { /* per-row (A') and per-column (B') f32 scales */
    int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    BLAS(cublasLtMatmulDescSetAttribute(out->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode,
                                        sizeof(mode)),
         "set A_SCALE_MODE");
    BLAS(cublasLtMatmulDescSetAttribute(out->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode,
                                        sizeof(mode)),
         "set B_SCALE_MODE");
    /* cuBLASLt checks the scale pointers of a non-scalar mode at the heuristic query; the
     * call's own are set again before every matmul */
    BLAS(cublasLtMatmulDescSetAttribute(out->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                        &c->scale_a, sizeof(c->scale_a)),
         "set A_SCALE_POINTER");
    BLAS(cublasLtMatmulDescSetAttribute(out->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                        &c->scale_b, sizeof(c->scale_b)),
         "set B_SCALE_POINTER");
  }
  if (k->epilogue) {
    cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    BLAS(cublasLtMatmulDescSetAttribute(out->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)),
         "set EPILOGUE");
    BLAS(cublasLtMatmulDescSetAttribute(out->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &tc,
                                        sizeof(tc)),
         "set BIAS_DATA_TYPE");
  }
  /* A' = kiln's b: stored N x K (op N) or K x N (op T); B' = kiln's a: K x M or M x K. */
  uint64_t ra = k->trans_a ? (uint64_t)k->k : (uint64_t)k->m;
  uint64_t ca = k->trans_a ? (uint64_t)k->m : (uint64_t)k->k;
  uint64_t rb = k->trans_b ? (uint64_t)k->n : (uint64_t)k->k;
  uint64_t cb = k->trans_b ? (uint64_t)k->k : (uint64_t)k->n;
  BLAS(cublasLtMatrixLayoutCreate(&out->la, tab, ra, ca, k->lda), "layout A");
  BLAS(cublasLtMatrixLayoutCreate(&out->lb, tab, rb, cb, k->ldb), "layout B");
  BLAS(cublasLtMatrixLayoutCreate(&out->lc, tc, (uint64_t)k->m, (uint64_t)k->n, k->ldc),
       "layout C");
  if (k->batch > 1) {
    int32_t bc = (int32_t)k->batch;
    cublasLtMatrixLayout_t ls[3] = {out->la, out->lb, out->lc};
    int64_t strides[3] = {k->stride_a, k->stride_b, k->stride_c};
    for (int i = 0; i < 3; i++) {
      BLAS(cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc,
                                            sizeof(bc)),
           "set BATCH_COUNT");
      BLAS(cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                            &strides[i], sizeof(strides[i])),
           "set STRIDED_BATCH_OFFSET");
    }
  }
  BLAS(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  size_t ws = s->workspace_size;
  BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                            sizeof(ws)),
       "set MAX_WORKSPACE_BYTES");
  /* Split-K partial sums must be reduced in f32: reducing them in the output type (bf16, f16)
   * rounds each partial and breaks hal.h's "rounded once, at the end" (seen on an H200: bf16
   * results off by ~10 ulps, and exact zeros where partials cancelled). */
  uint32_t red = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &red,
                                            sizeof(red)),
       "set REDUCTION_SCHEME_MASK");
  uint32_t al[3] = {(uint32_t)k->align_a, (uint32_t)k->align_b, (uint32_t)k->align_c};
  BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                            &al[0], sizeof(al[0])),
       "set MIN_ALIGNMENT_A");
  BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                            &al[1], sizeof(al[1])),
       "set MIN_ALIGNMENT_B");
  BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                            &al[2], sizeof(al[2])),
       "set MIN_ALIGNMENT_C");
  BLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                            &al[2], sizeof(al[2])),
       "set MIN_ALIGNMENT_D");
  cublasLtMatmulHeuristicResult_t res;
  int n = 0;
  memset(&res, 0, sizeof(res));
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(s->lt, out->desc, out->la, out->lb, out->lc,
                                                     out->lc, pref, 1, &res, &n);
  cublasLtMatmulPreferenceDestroy(pref);
  pref = NULL;
  /* FP8 with outer-vector scales: INVALID_VALUE is how some cuBLASLt versions say that they
   * have no kernel for the layout; the caller then takes its own kernels */
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && n == 0) ||
      (st == CUBLAS_STATUS_INVALID_VALUE && k->dtype_ab == CUDA_BLAS_FP8_E4M3)) {
    plan_destroy(out);
    return NULL;
  }
  if (st != CUBLAS_STATUS_SUCCESS) {
    err = lt_err(st, "gemm: cublasLtMatmulAlgoGetHeuristic");
    goto fail;
  }
  out->algo = res.algo;
  out->used = true;
  *found = true;
  return NULL;
fail:
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  plan_destroy(out);
  return err;
}

/* Finds or builds the plan for key k; NULL in *out_plan when cuBLASLt has none. */
static kiln_hal_error_t *plan_get(cuda_blas_t *s, const lt_plan_t *k, const cuda_blas_call_t *c,
                                  lt_plan_t **out_plan) {
  *out_plan = NULL;
  lt_plan_t *victim = &s->plans[0];
  for (int i = 0; i < LT_CACHE_SIZE; i++) {
    lt_plan_t *p = &s->plans[i];
    if (p->used && same_key(p, k)) {
      p->stamp = ++s->clock;
      *out_plan = p;
      return NULL;
    }
    if (!p->used) {
      if (victim->used) victim = p;
    } else if (victim->used && p->stamp < victim->stamp) {
      victim = p;
    }
  }
  lt_plan_t fresh;
  bool found = false;
  kiln_hal_error_t *err = plan_build(s, k, c, &fresh, &found);
  if (err || !found) return err;
  if (victim->used) plan_destroy(victim);
  *victim = fresh;
  victim->stamp = ++s->clock;
  *out_plan = victim;
  return NULL;
}

const char *cuda_blas_describe(void) {
#define LT_STR2(x) #x
#define LT_STR(x) LT_STR2(x)
  return "cuBLASLt " LT_STR(CUBLAS_VER_MAJOR) "." LT_STR(CUBLAS_VER_MINOR);
}

kiln_hal_error_t *cuda_blas_create(kiln_hal_stream_t *s, cuda_blas_t **out) {
  (void)s;
  *out = NULL;
  cuda_blas_t *b = calloc(1, sizeof(*b));
  if (!b) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "stream_create: out of host memory");
  cublasStatus_t bs = cublasLtCreate(&b->lt);
  if (bs != CUBLAS_STATUS_SUCCESS) {
    free(b);
    return lt_err(bs, "stream_create: cublasLtCreate");
  }
  b->workspace_size = LT_WORKSPACE_BYTES;
  cudaError_t e = cudaMalloc(&b->workspace, b->workspace_size);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    cublasLtDestroy(b->lt);
    free(b);
    return cuda_err_rt(e, "stream_create: cudaMalloc(cuBLASLt workspace)");
  }
  *out = b;
  return NULL;
}

void cuda_blas_destroy(cuda_blas_t *b) {
  if (!b) return;
  for (int i = 0; i < LT_CACHE_SIZE; i++)
    if (b->plans[i].used) plan_destroy(&b->plans[i]);
  cublasLtDestroy(b->lt);
  (void)cudaFree(b->workspace);
  free(b);
}

kiln_hal_error_t *cuda_blas_matmul(kiln_hal_stream_t *s, const cuda_blas_call_t *c,
                                   bool *bias_done) {
  cuda_blas_t *b = s->blas;
  kiln_hal_error_t *err;
  const bool fp8 = c->dtype_ab == CUDA_BLAS_FP8_E4M3;
  const size_t es_ab = fp8 ? 1 : kiln_hal_dtype_size(c->dtype_ab),
               es_c = kiln_hal_dtype_size(c->dtype_c);
  lt_plan_t key;
  memset(&key, 0, sizeof(key));
  key.dtype_ab = c->dtype_ab;
  key.dtype_c = c->dtype_c;
  key.compute = (c->dtype_ab == KILN_HAL_F32 && c->tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                          : CUBLAS_COMPUTE_32F;
  key.trans_a = c->trans_a;
  key.trans_b = c->trans_b;
  key.m = c->m;
  key.n = c->n;
  key.k = c->k;
  key.lda = c->lda;
  key.ldb = c->ldb;
  key.ldc = c->ldd;
  key.batch = c->batch;
  key.stride_a = c->batch > 1 ? c->stride_a : 0;
  key.stride_b = c->batch > 1 ? c->stride_b : 0;
  key.stride_c = c->batch > 1 ? c->stride_d : 0;
  key.align_a = alignment_of(c->a, c->lda, key.stride_a, es_ab);
  key.align_b = alignment_of(c->b, c->ldb, key.stride_b, es_ab);
  key.align_c = alignment_of(c->d, c->ldd, key.stride_c, es_c);
  key.epilogue = c->bias ? 1 : 0;
  lt_plan_t *plan = NULL;
  if ((err = plan_get(b, &key, c, &plan))) return err;
  *bias_done = c->bias != NULL;
  if (!plan && c->bias && !c->bias_required) { /* no algorithm with the bias epilogue: the
                                                    caller adds the bias */
    key.epilogue = 0;
    if ((err = plan_get(b, &key, c, &plan))) return err;
    *bias_done = false;
  }
  if (!plan)
    return cuda_err_unsupported("gemm: cuBLASLt has no algorithm for %s x %s -> %s, m=%lld n=%lld k=%lld",
                                fp8 ? "e4m3" : kiln_hal_dtype_name(c->dtype_ab),
                                fp8 ? "e4m3" : kiln_hal_dtype_name(c->dtype_ab),
                                kiln_hal_dtype_name(c->dtype_c), (long long)c->m, (long long)c->n,
                                (long long)c->k);
  if (plan->epilogue) {
    cublasStatus_t st = cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &c->bias, sizeof(c->bias));
    if (st != CUBLAS_STATUS_SUCCESS) return lt_err(st, "gemm: set BIAS_POINTER");
  }
  if (fp8) {
    cublasStatus_t st = cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &c->scale_a, sizeof(c->scale_a));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                          &c->scale_b, sizeof(c->scale_b));
    if (st != CUBLAS_STATUS_SUCCESS) return lt_err(st, "gemm: set A/B_SCALE_POINTER");
  }
  float alpha = c->alpha, beta = c->beta;
  cublasStatus_t st = cublasLtMatmul(b->lt, plan->desc, &alpha, c->a, plan->la, c->b, plan->lb,
                                     &beta, c->d, plan->lc, c->d, plan->lc, &plan->algo,
                                     b->workspace, b->workspace_size, s->stream);
  return st == CUBLAS_STATUS_SUCCESS ? NULL : lt_err(st, "gemm: cublasLtMatmul");
}
