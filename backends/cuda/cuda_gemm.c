/* cuda_gemm.c - kiln's gemm op on cuBLASLt: row-major views mapped onto cuBLASLt's column-major
 * matmul, with a per-stream cache of descriptors and heuristic choices keyed by the call's
 * shape, layout and alignment.
 *
 * The mapping. kiln computes the row-major C[M, N] = A[M, K] @ B[K, N]. Read column-major,
 * a row-major C is C^T, and C^T = B^T A^T, so cuBLASLt is asked for D' (N x M) = op(A') op(B')
 * with A' = kiln's b and B' = kiln's a:
 *   b row-major (k, n at k*ld + n): column-major N x K -> op N;  column-major b: K x N -> op T
 *   a row-major (m, k at m*ld + k): column-major K x M -> op N;  column-major a: M x K -> op T
 * The bias [N] is then a per-row bias of D', which is what CUBLASLT_EPILOGUE_BIAS adds. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

typedef struct operand {
  bool row_major; /* of kiln's view */
  int64_t ld;     /* elements */
  int64_t batch_stride;
} operand_t;

/* Decides whether a [R, C] view with strides (sr, sc) is row- or column-major. */
static bool pick_layout(int64_t R, int64_t C, int64_t sr, int64_t sc, operand_t *o) {
  if ((sc == 1 || C <= 1) && (R <= 1 || sr >= C)) {
    o->row_major = true;
    o->ld = R <= 1 ? (C > 1 ? C : 1) : sr;
    if (o->ld < 1) o->ld = 1;
    return true;
  }
  if ((sr == 1 || R <= 1) && (C <= 1 || sc >= R)) {
    o->row_major = false;
    o->ld = C <= 1 ? (R > 1 ? R : 1) : sc;
    if (o->ld < 1) o->ld = 1;
    return true;
  }
  return false;
}

static cudaDataType_t cuda_dtype(int32_t d) {
  switch (d) {
    case KILN_HAL_F16: return CUDA_R_16F;
    case KILN_HAL_BF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

/* Largest power of two (<= 256) dividing the address and every byte stride of an operand. */
static int32_t alignment_of(const void *p, int64_t ld, int64_t batch_stride, size_t es) {
  uint64_t bits = (uint64_t)(uintptr_t)p | (uint64_t)ld * es | (uint64_t)batch_stride * es | 256u;
  return (int32_t)(bits & (~bits + 1));
}

void cuda_gemm_plans_release(kiln_hal_stream_t *s) {
  for (int i = 0; i < CUDA_GEMM_CACHE_SIZE; i++) {
    cuda_gemm_plan_t *p = &s->plans[i];
    if (!p->used) continue;
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    memset(p, 0, sizeof(*p));
  }
}

static void plan_destroy(cuda_gemm_plan_t *p) {
  if (p->desc) cublasLtMatmulDescDestroy(p->desc);
  if (p->la) cublasLtMatrixLayoutDestroy(p->la);
  if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
  if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
  memset(p, 0, sizeof(*p));
}

static bool same_key(const cuda_gemm_plan_t *a, const cuda_gemm_plan_t *b) {
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
      err = cuda_err_blas(st_, "gemm: " what); \
      goto fail;                               \
    }                                          \
  } while (0)

/* Builds descriptors for key `k` and asks the heuristic for an algorithm. On success *out is a
 * complete plan; *found is false when cuBLASLt has no algorithm for it (not an error). */
static kiln_hal_error_t *plan_build(kiln_hal_stream_t *s, const cuda_gemm_plan_t *k,
                                    cuda_gemm_plan_t *out, bool *found) {
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
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && n == 0)) {
    plan_destroy(out);
    return NULL;
  }
  if (st != CUBLAS_STATUS_SUCCESS) {
    err = cuda_err_blas(st, "gemm: cublasLtMatmulAlgoGetHeuristic");
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
static kiln_hal_error_t *plan_get(kiln_hal_stream_t *s, const cuda_gemm_plan_t *k,
                                  cuda_gemm_plan_t **out_plan) {
  *out_plan = NULL;
  cuda_gemm_plan_t *victim = &s->plans[0];
  for (int i = 0; i < CUDA_GEMM_CACHE_SIZE; i++) {
    cuda_gemm_plan_t *p = &s->plans[i];
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
  cuda_gemm_plan_t fresh;
  bool found = false;
  kiln_hal_error_t *err = plan_build(s, k, &fresh, &found);
  if (err || !found) return err;
  if (victim->used) plan_destroy(victim);
  *victim = fresh;
  victim->stamp = ++s->clock;
  *out_plan = victim;
  return NULL;
}

static kiln_hal_error_t *no_algorithm(int32_t dab, int32_t dc, int64_t M, int64_t N, int64_t K) {
  return cuda_err_unsupported(
      "gemm: cuBLASLt has no algorithm for %s x %s -> %s, M=%lld N=%lld "
      "K=%lld",
      kiln_hal_dtype_name(dab), kiln_hal_dtype_name(dab), kiln_hal_dtype_name(dc), (long long)M,
      (long long)N, (long long)K);
}

/* A half-precision c with a bias or beta != 0. cuBLASLt rounds alpha * (a @ b) to the output
 * type before it adds beta * c and the bias (seen on an H200: f16/bf16 results on a grid set by
 * the product's magnitude, not the result's), which hal.h forbids ("rounded once, at the end").
 * So the product goes to the stream's f32 staging buffer, a chunk of rows at a time, and
 * gemm_finish adds beta * c + bias and rounds once. */
static kiln_hal_error_t *gemm_staged(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *a,
                                     const operand_t *oa, const operand_t *ob, const operand_t *oc,
                                     int64_t M, int64_t N, int64_t K, int64_t batch, int64_t sa,
                                     int64_t sb, int64_t sc, int32_t compute) {
  const kiln_hal_tensor_t *ta = &a->a, *tb = &a->b, *tc = &a->c;
  const int64_t stage_elems = CUDA_GEMM_STAGE_BYTES / sizeof(float);
  if (N > stage_elems)
    return cuda_err_unsupported(
        "gemm: N = %lld is too wide for the f32 staging of a %s output "
        "with bias/beta",
        (long long)N, kiln_hal_dtype_name(tc->dtype));
  const int64_t chunk = M < stage_elems / N ? M : stage_elems / N;
  size_t es_ab = kiln_hal_dtype_size(ta->dtype), es_c = kiln_hal_dtype_size(tc->dtype);
  const char *pa = cuda_view(ta).ptr, *pb = cuda_view(tb).ptr;
  char *pc = cuda_view(tc).ptr;
  const void *bias = cuda_view(&a->bias).ptr;
  /* a's rows r0.. start at r0 * ld (row-major) or r0 (column-major) elements */
  const int64_t a_row_step = oa->row_major ? oa->ld : 1;
  float alpha = a->alpha, zero = 0.0f;
  kiln_hal_error_t *err;
  for (int64_t z = 0; z < batch; z++) {
    for (int64_t r0 = 0; r0 < M; r0 += chunk) {
      const int64_t rows = M - r0 < chunk ? M - r0 : chunk;
      const char *pai = pa + (size_t)(z * sa + r0 * a_row_step) * es_ab;
      const char *pbi = pb + (size_t)(z * sb) * es_ab;
      char *pci = pc + (size_t)(z * sc + r0 * oc->ld) * es_c;
      cuda_gemm_plan_t key;
      memset(&key, 0, sizeof(key));
      key.dtype_ab = ta->dtype;
      key.dtype_c = KILN_HAL_F32;
      key.compute = compute;
      key.trans_a = ob->row_major ? 0 : 1;
      key.trans_b = oa->row_major ? 0 : 1;
      key.m = N;
      key.n = rows;
      key.k = K;
      key.lda = ob->ld;
      key.ldb = oa->ld;
      key.ldc = N;
      key.batch = 1;
      key.align_a = alignment_of(pbi, ob->ld, 0, es_ab);
      key.align_b = alignment_of(pai, oa->ld, 0, es_ab);
      key.align_c = alignment_of(s->stage, N, 0, sizeof(float));
      cuda_gemm_plan_t *plan = NULL;
      if ((err = plan_get(s, &key, &plan))) return err;
      if (!plan) return no_algorithm(ta->dtype, KILN_HAL_F32, rows, N, K);
      cublasStatus_t st = cublasLtMatmul(s->lt, plan->desc, &alpha, pbi, plan->la, pai, plan->lb,
                                         &zero, s->stage, plan->lc, s->stage, plan->lc, &plan->algo,
                                         s->workspace, s->workspace_size, s->stream);
      if (st != CUBLAS_STATUS_SUCCESS) return cuda_err_blas(st, "gemm: cublasLtMatmul");
      cuda_view_t cv;
      memset(&cv, 0, sizeof(cv));
      cv.ptr = pci;
      cv.dtype = tc->dtype;
      cv.ndim = 2;
      cv.shape[0] = rows;
      cv.shape[1] = N;
      cv.stride[0] = oc->ld;
      cv.stride[1] = 1;
      cudaError_t e = cuda_launch_gemm_finish(s->stream, cv, s->stage, bias, a->beta);
      if (e != cudaSuccess) return cuda_err_rt(e, "gemm: finish kernel launch");
    }
  }
  return NULL;
}

/* Which calls the skinny kernel takes, read once from the environment:
 *   1 (default) only where it measured faster than cuBLASLt on an H200 (2026-11-29): M <= 2 and
 *     K <= 8192. At M = 1 it streams W at 3.5 TB/s for K=3584 N=37888 (cuBLASLt 3.1) and 4.3
 *     TB/s for the lm_head (3.9), but only 2.2 TB/s for K=18944 N=3584, where its 448 blocks
 *     are too few (cuBLASLt 2.8); at M = 8 cuBLASLt is faster on every large shape.
 *   2 every call that fits (KILN_CUDA_GEMV=all: for tests of the kernel at M up to 8);
 *   3 never (KILN_CUDA_NO_GEMV=1: A/B benchmarks). */
static int gemv_mode(void) {
  static atomic_int state; /* 0 = not read yet */
  int v = atomic_load_explicit(&state, memory_order_relaxed);
  if (v == 0) {
    const char *off = getenv("KILN_CUDA_NO_GEMV"), *all = getenv("KILN_CUDA_GEMV");
    v = (off && off[0] && strcmp(off, "0") != 0) ? 3 : (all && !strcmp(all, "all")) ? 2 : 1;
    atomic_store_explicit(&state, v, memory_order_relaxed);
  }
  return v;
}

/* Fills *p and returns true when the skinny kernel (cuda_gemv.cu) can take the call: one
 * product (batch 1) of f16/bf16 with M <= 8, a's rows and b's columns (the rows of a [N, K]
 * weight) contiguous along K, K % 8 == 0, and a, b and their row strides 16-byte aligned. */
static bool gemv_fits(const kiln_hal_gemm_args_t *a, int64_t M, int64_t N, int64_t K, int64_t batch,
                      const operand_t *oc, cuda_gemv_params_t *p) {
  const kiln_hal_tensor_t *ta = &a->a, *tb = &a->b, *tc = &a->c;
  const int ia = ta->ndim - 2, ib = tb->ndim - 2;
  if (batch != 1 || M < 1 || M > CUDA_GEMV_MAX_M || N < 1 || K < 8 || K % 8 != 0) return false;
  if (ta->dtype != KILN_HAL_F16 && ta->dtype != KILN_HAL_BF16) return false;
  if (tc->dtype != ta->dtype && tc->dtype != KILN_HAL_F32) return false;
  if (ta->stride[ia + 1] != 1 || tb->stride[ib] != 1) return false; /* unit stride along K */
  const int64_t ldx = M > 1 ? ta->stride[ia] : K, ldw = N > 1 ? tb->stride[ib + 1] : K;
  const void *px = cuda_view(ta).ptr, *pw = cuda_view(tb).ptr;
  if (ldx % 8 != 0 || ldw % 8 != 0 || ((uintptr_t)px | (uintptr_t)pw) % 16 != 0) return false;
  const int mode = gemv_mode();
  if (mode == 3 || (mode == 1 && (M > 2 || K > 8192))) return false;
  memset(p, 0, sizeof(*p));
  p->x = px;
  p->w = pw;
  p->bias = cuda_view(&a->bias).ptr;
  p->c = cuda_view(tc).ptr;
  p->ldx = ldx;
  p->ldw = ldw;
  p->ldc = oc->ld;
  p->dtype_ab = ta->dtype;
  p->dtype_c = tc->dtype;
  p->M = (int32_t)M;
  p->N = (int32_t)N;
  p->K = (int32_t)K;
  p->alpha = a->alpha;
  p->beta = a->beta;
  return true;
}

kiln_hal_error_t *cuda_gemm(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *a) {
  kiln_hal_device_t *d = s->device;
  kiln_hal_error_t *err;
  kiln_hal_check_env_t env = cuda_check_env(d);
  kiln_hal_gemm_dims_t dims;
  if ((err = kiln_hal_check_gemm(&env, a, &dims))) return err;
  const kiln_hal_tensor_t *ta = &a->a, *tb = &a->b, *tc = &a->c;
  int ia = ta->ndim - 2, ib = tb->ndim - 2, ic = tc->ndim - 2;
  int64_t M = dims.M, N = dims.N, K = dims.K, batch = dims.batch;
  int64_t sa = dims.batch_stride_a, sb = dims.batch_stride_b, sc = dims.batch_stride_c;
  /* cuBLASLt needs a leading dimension covering a row or column: overlapping rows (a stride
   * below the row length), which hal.h allows for a and b, are refused here. */
  operand_t oa, ob, oc;
  if (!pick_layout(M, K, ta->stride[ia], ta->stride[ia + 1], &oa))
    return cuda_err_arg("gemm: a (strides %lld, %lld) is neither row- nor column-major",
                        (long long)ta->stride[ia], (long long)ta->stride[ia + 1]);
  if (!pick_layout(K, N, tb->stride[ib], tb->stride[ib + 1], &ob))
    return cuda_err_arg("gemm: b (strides %lld, %lld) is neither row- nor column-major",
                        (long long)tb->stride[ib], (long long)tb->stride[ib + 1]);
  if (!pick_layout(M, N, tc->stride[ic], tc->stride[ic + 1], &oc) || !oc.row_major)
    return cuda_err_arg("gemm: c must be row-major (strides %lld, %lld)", (long long)tc->stride[ic],
                        (long long)tc->stride[ic + 1]);
  bool has_bias = a->bias.buffer != NULL;
  if (M == 0 || N == 0 || batch == 0) return NULL;

  cuda_view_t vc = cuda_view(tc);
  cuda_view_t vbias = cuda_view(&a->bias);
  /* c as a 3-D view [batch, M, N] for the elementwise fix-ups. */
  cuda_view_t c3 = vc;
  c3.ndim = 3;
  c3.shape[0] = batch;
  c3.shape[1] = M;
  c3.shape[2] = N;
  c3.stride[0] = sc;
  c3.stride[1] = oc.ld;
  c3.stride[2] = 1;
  if (K == 0) {
    cudaError_t e = cuda_launch_scale_bias(s->stream, c3, vbias.ptr, a->beta);
    return e == cudaSuccess ? NULL : cuda_err_rt(e, "gemm: scale/bias kernel launch");
  }
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || batch > INT32_MAX)
    return cuda_err_unsupported("gemm: dimensions beyond int32");

  /* Decode-sized products stream the weight in one kernel, bias and beta included. */
  cuda_gemv_params_t gp;
  if (gemv_fits(a, M, N, K, batch, &oc, &gp)) {
    cudaError_t e = cuda_launch_gemv(s->stream, d->warp_size, &gp);
    return e == cudaSuccess ? NULL : cuda_err_rt(e, "gemm: gemv kernel launch");
  }

  size_t es_ab = kiln_hal_dtype_size(ta->dtype), es_c = kiln_hal_dtype_size(tc->dtype);
  const void *pa = cuda_view(ta).ptr, *pb = cuda_view(tb).ptr;
  const int32_t compute = (ta->dtype == KILN_HAL_F32 && a->allow_tf32)
                              ? CUBLAS_COMPUTE_32F_FAST_TF32
                              : CUBLAS_COMPUTE_32F;
  if (tc->dtype != KILN_HAL_F32 && (a->beta != 0.0f || has_bias))
    return gemm_staged(s, a, &oa, &ob, &oc, M, N, K, batch, sa, sb, sc, compute);

  /* Broadcast batches (stride 0) run as a loop of single products. */
  bool loop = batch > 1 && (sa == 0 || sb == 0 || sc == 0);
  cuda_gemm_plan_t key;
  memset(&key, 0, sizeof(key));
  key.dtype_ab = ta->dtype;
  key.dtype_c = tc->dtype;
  key.compute = compute;
  key.trans_a = ob.row_major ? 0 : 1;
  key.trans_b = oa.row_major ? 0 : 1;
  key.m = N;
  key.n = M;
  key.k = K;
  key.lda = ob.ld;
  key.ldb = oa.ld;
  key.ldc = oc.ld;
  key.batch = loop ? 1 : batch;
  key.stride_a = loop ? 0 : sb;
  key.stride_b = loop ? 0 : sa;
  key.stride_c = loop ? 0 : sc;
  key.align_a = alignment_of(pb, ob.ld, sb, es_ab);
  key.align_b = alignment_of(pa, oa.ld, sa, es_ab);
  key.align_c = alignment_of(vc.ptr, oc.ld, sc, es_c);
  key.epilogue = has_bias ? 1 : 0; /* only with an f32 c: see gemm_staged */

  cuda_gemm_plan_t *plan = NULL;
  if ((err = plan_get(s, &key, &plan))) return err;
  bool bias_kernel = false;
  if (!plan && has_bias) { /* no algorithm with the bias epilogue: add the bias separately */
    key.epilogue = 0;
    if ((err = plan_get(s, &key, &plan))) return err;
    bias_kernel = true;
  }
  if (!plan) return no_algorithm(ta->dtype, tc->dtype, M, N, K);
  if (plan->epilogue) {
    cublasStatus_t st = cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vbias.ptr, sizeof(vbias.ptr));
    if (st != CUBLAS_STATUS_SUCCESS) return cuda_err_blas(st, "gemm: set BIAS_POINTER");
  }
  float alpha = a->alpha, beta = a->beta;
  int64_t iters = loop ? batch : 1;
  for (int64_t i = 0; i < iters; i++) {
    const char *pbi = (const char *)pb + (size_t)(i * sb) * es_ab;
    const char *pai = (const char *)pa + (size_t)(i * sa) * es_ab;
    char *pci = (char *)vc.ptr + (size_t)(i * sc) * es_c;
    cublasStatus_t st = cublasLtMatmul(s->lt, plan->desc, &alpha, pbi, plan->la, pai, plan->lb,
                                       &beta, pci, plan->lc, pci, plan->lc, &plan->algo,
                                       s->workspace, s->workspace_size, s->stream);
    if (st != CUBLAS_STATUS_SUCCESS) return cuda_err_blas(st, "gemm: cublasLtMatmul");
  }
  if (bias_kernel) {
    cudaError_t e = cuda_launch_scale_bias(s->stream, c3, vbias.ptr, 1.0f);
    if (e != cudaSuccess) return cuda_err_rt(e, "gemm: bias kernel launch");
  }
  return NULL;
}
