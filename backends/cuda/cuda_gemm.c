/* cuda_gemm.c - kiln's gemm op for the CUDA and ROCm plugins: checks, the skinny decode kernel,
 * Kiln's own tiled kernel, and the mapping of row-major views onto a column-major GEMM library
 * (cuBLASLt in cuda_blas_lt.c, rocBLAS in backends/rocm/rocm_blas.c).
 *
 * The mapping. kiln computes the row-major C[M, N] = A[M, K] @ B[K, N]. Read column-major,
 * a row-major C is C^T, and C^T = B^T A^T, so the library is asked for D' (N x M) =
 * op(A') op(B') with A' = kiln's b and B' = kiln's a:
 *   b row-major (k, n at k*ld + n): column-major N x K -> op N;  column-major b: K x N -> op T
 *   a row-major (m, k at m*ld + k): column-major K x M -> op N;  column-major a: M x K -> op T
 * The bias [N] is then a per-row bias of D'.
 *
 * Which path a call takes:
 *   1. K == 0: beta * c + bias, one elementwise kernel.
 *   2. Kiln's own kernel (cuda_gemm_kernel.cu) when the plugin has no library (ROCm without
 *      rocBLAS) or KILN_GPU_GEMM=kernel asks for it (tests of that kernel on NVIDIA). It takes
 *      every layout and rounds once by itself.
 *   3. The skinny kernel (cuda_gemv.cu) for decode-sized products (gemv_fits).
 *   4. The library; a half-precision c with a bias or beta != 0 goes through f32 staging. */
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

/* KILN_GPU_GEMM, read once: "kernel" sends every gemm to Kiln's own kernel, "library" (the
 * default) to the GEMM library where the plugin has one. */
static bool own_kernel_forced(void) {
  static atomic_int state; /* 0 = not read yet, 1 = library, 2 = kernel */
  int v = atomic_load_explicit(&state, memory_order_relaxed);
  if (v == 0) {
    const char *m = getenv("KILN_GPU_GEMM");
    v = (m && strcmp(m, "kernel") == 0) ? 2 : 1;
    atomic_store_explicit(&state, v, memory_order_relaxed);
  }
  return v == 2;
}

/* The whole call on Kiln's own kernel: any strides, bias and beta, rounded once. */
static kiln_hal_error_t *gemm_own_kernel(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *a,
                                         const kiln_hal_gemm_dims_t *dims) {
  const kiln_hal_tensor_t *ta = &a->a, *tb = &a->b, *tc = &a->c;
  const int ia = ta->ndim - 2, ib = tb->ndim - 2, ic = tc->ndim - 2;
  cuda_gemm_kernel_params_t p;
  memset(&p, 0, sizeof(p));
  p.a = cuda_view(ta).ptr;
  p.b = cuda_view(tb).ptr;
  p.c = cuda_view(tc).ptr;
  p.bias = cuda_view(&a->bias).ptr;
  p.dtype_ab = ta->dtype;
  p.dtype_c = tc->dtype;
  p.M = dims->M;
  p.N = dims->N;
  p.K = dims->K;
  p.batch = dims->batch;
  p.a_rs = ta->stride[ia];
  p.a_cs = ta->stride[ia + 1];
  p.a_bs = dims->batch_stride_a;
  p.b_rs = tb->stride[ib];
  p.b_cs = tb->stride[ib + 1];
  p.b_bs = dims->batch_stride_b;
  p.c_rs = tc->stride[ic];
  p.c_bs = dims->batch_stride_c;
  p.alpha = a->alpha;
  p.beta = a->beta;
  cudaError_t e = cuda_launch_gemm_kernel(s->stream, s->device->warp_size, &p);
  return e == cudaSuccess ? NULL : cuda_err_rt(e, "gemm: kernel launch");
}

/* The library call for kiln's row-major product of one batch member (or a strided batch). */
static cuda_blas_call_t blas_call(const kiln_hal_gemm_args_t *a, const operand_t *oa,
                                  const operand_t *ob, int64_t M, int64_t N, int64_t K) {
  cuda_blas_call_t c;
  memset(&c, 0, sizeof(c));
  c.dtype_ab = a->a.dtype;
  c.dtype_c = a->c.dtype;
  c.tf32 = a->allow_tf32;
  c.trans_a = !ob->row_major;
  c.trans_b = !oa->row_major;
  c.m = N;
  c.n = M;
  c.k = K;
  c.lda = ob->ld;
  c.ldb = oa->ld;
  c.batch = 1;
  c.alpha = a->alpha;
  return c;
}

/* The growable staging for a product of elems f32 values (capped at CUDA_GEMM_STAGE_MAX_BYTES):
 * grows it when no graph is being captured on the device (a capture must not see a host sync
 * or an allocation, and must not hold an address that a later growth frees), waiting for the
 * stream's earlier work before freeing the smaller buffer. NULL: use the fixed buffer's chunks
 * (a capture, or the allocation failed). *out_elems gets the buffer's size in elements. */
static float *stage_big(kiln_hal_stream_t *s, size_t elems, int64_t *out_elems) {
  static atomic_int mode; /* 0 = not read yet, 1 = grow, 2 = KILN_CUDA_GEMM_STAGE=fixed (A/B) */
  int md = atomic_load_explicit(&mode, memory_order_relaxed);
  if (md == 0) {
    const char *v = getenv("KILN_CUDA_GEMM_STAGE");
    md = v && !strcmp(v, "fixed") ? 2 : 1;
    atomic_store_explicit(&mode, md, memory_order_relaxed);
  }
  if (md == 2) return NULL;
  size_t want = elems * sizeof(float);
  if (want > CUDA_GEMM_STAGE_MAX_BYTES) want = CUDA_GEMM_STAGE_MAX_BYTES;
  if (s->capturing || atomic_load(&s->device->capturing) > 0) return NULL;
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s->stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return NULL;
  }
  if (s->stage_big_bytes < want) {
    if (s->stage_big) {
      if (cudaStreamSynchronize(s->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
      }
      (void)cudaFree(s->stage_big);
      s->stage_big = NULL;
      s->stage_big_bytes = 0;
    }
    if (cudaMalloc((void **)&s->stage_big, want) != cudaSuccess) {
      (void)cudaGetLastError();
      s->stage_big = NULL;
      return NULL;
    }
    s->stage_big_bytes = want;
  }
  *out_elems = (int64_t)(s->stage_big_bytes / sizeof(float));
  return s->stage_big;
}

/* A half-precision c with a bias or beta != 0. cuBLASLt rounds alpha * (a @ b) to the output
 * type before it adds beta * c and the bias (seen on an H200: f16/bf16 results on a grid set by
 * the product's magnitude, not the result's), which hal.h forbids ("rounded once, at the end").
 * So the product goes to the stream's f32 staging buffer, a chunk of rows at a time, and
 * gemm_finish adds beta * c + bias and rounds once. */
static kiln_hal_error_t *gemm_staged(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *a,
                                     const operand_t *oa, const operand_t *ob, const operand_t *oc,
                                     int64_t M, int64_t N, int64_t K, int64_t batch, int64_t sa,
                                     int64_t sb, int64_t sc) {
  const kiln_hal_tensor_t *ta = &a->a, *tb = &a->b, *tc = &a->c;
  float *stage = s->stage;
  int64_t stage_elems = CUDA_GEMM_STAGE_BYTES / sizeof(float);
  if (M > stage_elems / N) stage = stage_big(s, (size_t)M * (size_t)N, &stage_elems);
  if (!stage) {
    stage = s->stage;
    stage_elems = CUDA_GEMM_STAGE_BYTES / sizeof(float);
  }
  if (N > stage_elems)
    return cuda_err_unsupported(
        "gemm: N = %lld is too wide for the f32 staging of a %s output with bias/beta",
        (long long)N, kiln_hal_dtype_name(tc->dtype));
  const int64_t chunk = M < stage_elems / N ? M : stage_elems / N;
  size_t es_ab = kiln_hal_dtype_size(ta->dtype), es_c = kiln_hal_dtype_size(tc->dtype);
  const char *pa = cuda_view(ta).ptr, *pb = cuda_view(tb).ptr;
  char *pc = cuda_view(tc).ptr;
  const void *bias = cuda_view(&a->bias).ptr;
  /* a's rows r0.. start at r0 * ld (row-major) or r0 (column-major) elements */
  const int64_t a_row_step = oa->row_major ? oa->ld : 1;
  kiln_hal_error_t *err;
  for (int64_t z = 0; z < batch; z++) {
    for (int64_t r0 = 0; r0 < M; r0 += chunk) {
      const int64_t rows = M - r0 < chunk ? M - r0 : chunk;
      cuda_blas_call_t c = blas_call(a, oa, ob, rows, N, K);
      c.dtype_c = KILN_HAL_F32;
      c.a = pb + (size_t)(z * sb) * es_ab;
      c.b = pa + (size_t)(z * sa + r0 * a_row_step) * es_ab;
      c.d = stage;
      c.ldd = N;
      c.beta = 0.0f;
      bool bias_done = false;
      if ((err = cuda_blas_matmul(s, &c, &bias_done))) return err;
      cuda_view_t cv;
      memset(&cv, 0, sizeof(cv));
      cv.ptr = pc + (size_t)(z * sc + r0 * oc->ld) * es_c;
      cv.dtype = tc->dtype;
      cv.ndim = 2;
      cv.shape[0] = rows;
      cv.shape[1] = N;
      cv.stride[0] = oc->ld;
      cv.stride[1] = 1;
      cudaError_t e = cuda_launch_gemm_finish(s->stream, cv, stage, bias, a->beta);
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
 * product (batch 1) of f16/bf16 (or f32 without allow_tf32) with M <= 8, a's rows and b's columns
 * (the rows of a [N, K] weight) contiguous along K, K % 8 == 0, and a, b and their row strides
 * 16-byte aligned. */
static bool gemv_fits(const kiln_hal_gemm_args_t *a, int64_t M, int64_t N, int64_t K, int64_t batch,
                      const operand_t *oc, cuda_gemv_params_t *p) {
  const kiln_hal_tensor_t *ta = &a->a, *tb = &a->b, *tc = &a->c;
  const int ia = ta->ndim - 2, ib = tb->ndim - 2;
  if (batch != 1 || M < 1 || M > CUDA_GEMV_MAX_M || N < 1 || K < 8 || K % 8 != 0) return false;
  if (ta->dtype != KILN_HAL_F16 && ta->dtype != KILN_HAL_BF16 && ta->dtype != KILN_HAL_F32)
    return false;
  if (tc->dtype != ta->dtype && tc->dtype != KILN_HAL_F32) return false;
  if (ta->dtype == KILN_HAL_F32 && a->allow_tf32) return false;     /* cuBLASLt's TF32 is faster */
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
  if (M == 0 || N == 0 || batch == 0) return NULL;
  if (K > 0 && (!s->blas || own_kernel_forced())) return gemm_own_kernel(s, a, &dims);
  /* A library needs a leading dimension covering a row or column: overlapping rows (a stride
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

  if (tc->dtype != KILN_HAL_F32 && (a->beta != 0.0f || has_bias))
    return gemm_staged(s, a, &oa, &ob, &oc, M, N, K, batch, sa, sb, sc);

  /* Broadcast batches (stride 0) run as a loop of single products. */
  const bool loop = batch > 1 && (sa == 0 || sb == 0 || sc == 0);
  size_t es_ab = kiln_hal_dtype_size(ta->dtype), es_c = kiln_hal_dtype_size(tc->dtype);
  const char *pa = cuda_view(ta).ptr, *pb = cuda_view(tb).ptr;
  bool bias_done = !has_bias;
  for (int64_t i = 0; i < (loop ? batch : 1); i++) {
    cuda_blas_call_t c = blas_call(a, &oa, &ob, M, N, K);
    c.a = pb + (size_t)(i * sb) * es_ab;
    c.b = pa + (size_t)(i * sa) * es_ab;
    c.d = (char *)vc.ptr + (size_t)(i * sc) * es_c;
    c.ldd = oc.ld;
    c.batch = loop ? 1 : batch;
    c.stride_a = sb;
    c.stride_b = sa;
    c.stride_d = sc;
    c.beta = a->beta;
    c.bias = vbias.ptr; /* only with an f32 c: see gemm_staged */
    if ((err = cuda_blas_matmul(s, &c, &bias_done))) return err;
  }
  /* Only a bias the library could not fuse needs the extra pass: cuda_blas_matmul reports
   * bias_done = false for a call without one too, and an unconditional fix-up here read and
   * wrote the whole output of every bias-free library gemm once more (since 75d6328; the
   * suspect of issue 24's prefill and throughput regression on the H200). */
  if (has_bias && !bias_done) {
    cudaError_t e = cuda_launch_scale_bias(s->stream, c3, vbias.ptr, 1.0f);
    if (e != cudaSuccess) return cuda_err_rt(e, "gemm: bias kernel launch");
  }
  return NULL;
}
