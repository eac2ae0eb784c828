/* rocm_blas.c - the ROCm plugin's GEMM library: cuda_blas_matmul (backends/cuda/cuda_internal.h)
 * on rocBLAS, loaded at run time with dlopen. Debian 12 ships no rocBLAS, and a ROCm install may
 * lack it, so the plugin never links it: without it, cuda_blas_create leaves the stream's
 * library state NULL and cuda_gemm.c sends every product to Kiln's own kernel
 * (backends/cuda/cuda_gemm_kernel.cu).
 *
 * Only the few entry points below are declared, by hand, from rocBLAS's public C API (the
 * values are those of rocblas-types.h, stable since ROCm 3). The library must come from the
 * same ROCm major as the HIP runtime the plugin links (librocblas.so.0 with HIP 5,
 * librocblas.so.4 with HIP 6, librocblas.so.5 with HIP 7): a rocBLAS of another major would
 * pull a second HIP runtime into the process. KILN_ROCBLAS=<path> names another file, and
 * KILN_ROCBLAS=none turns the library off (tests of the fallback). rocBLAS has no bias
 * epilogue, so cuda_gemm.c adds the bias with its own kernel. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hip/hip_version.h>

#include "cuda_internal.h"

/* ---- the declared subset of rocBLAS ------------------------------------------------------ */

typedef struct rocblas_handle_s *rocblas_handle;
typedef int32_t rocblas_status; /* rocblas_status_success = 0 */
enum { ROCBLAS_STATUS_SUCCESS = 0 };
enum { ROCBLAS_OP_NONE = 111, ROCBLAS_OP_TRANSPOSE = 112 };
enum { ROCBLAS_F16 = 150, ROCBLAS_F32 = 151, ROCBLAS_BF16 = 168 };
enum { ROCBLAS_ALGO_STANDARD = 0, ROCBLAS_FLAGS_NONE = 0 };

typedef rocblas_status (*rocblas_create_handle_fn)(rocblas_handle *);
typedef rocblas_status (*rocblas_destroy_handle_fn)(rocblas_handle);
typedef rocblas_status (*rocblas_set_stream_fn)(rocblas_handle, hipStream_t);
typedef rocblas_status (*rocblas_set_workspace_fn)(rocblas_handle, void *, size_t);
typedef const char *(*rocblas_status_to_string_fn)(rocblas_status);
typedef rocblas_status (*rocblas_gemm_ex_fn)(rocblas_handle, int32_t trans_a, int32_t trans_b,
                                             int32_t m, int32_t n, int32_t k, const void *alpha,
                                             const void *a, int32_t a_type, int32_t lda,
                                             const void *b, int32_t b_type, int32_t ldb,
                                             const void *beta, const void *c, int32_t c_type,
                                             int32_t ldc, void *d, int32_t d_type, int32_t ldd,
                                             int32_t compute_type, int32_t algo,
                                             int32_t solution_index, uint32_t flags);
typedef rocblas_status (*rocblas_gemm_strided_batched_ex_fn)(
    rocblas_handle, int32_t trans_a, int32_t trans_b, int32_t m, int32_t n, int32_t k,
    const void *alpha, const void *a, int32_t a_type, int32_t lda, int64_t stride_a,
    const void *b, int32_t b_type, int32_t ldb, int64_t stride_b, const void *beta, const void *c,
    int32_t c_type, int32_t ldc, int64_t stride_c, void *d, int32_t d_type, int32_t ldd,
    int64_t stride_d, int32_t batch_count, int32_t compute_type, int32_t algo,
    int32_t solution_index, uint32_t flags);

/* The library, loaded once per process (never unloaded: kernels it registered with the HIP
 * runtime must stay mapped). */
static struct {
  pthread_once_t once;
  bool loaded;
  char path[256];
  char why[512]; /* why it is not loaded */
  rocblas_create_handle_fn create_handle;
  rocblas_destroy_handle_fn destroy_handle;
  rocblas_set_stream_fn set_stream;
  rocblas_set_workspace_fn set_workspace; /* may be NULL (older rocBLAS) */
  rocblas_status_to_string_fn status_to_string;
  rocblas_gemm_ex_fn gemm_ex;
  rocblas_gemm_strided_batched_ex_fn gemm_strided_batched_ex;
} g_rb = {.once = PTHREAD_ONCE_INIT};

/* The soname of the rocBLAS built against this plugin's HIP major. */
#if HIP_VERSION_MAJOR == 5
#define ROCBLAS_SONAME "librocblas.so.0"
#elif HIP_VERSION_MAJOR == 6
#define ROCBLAS_SONAME "librocblas.so.4"
#else
#define ROCBLAS_SONAME "librocblas.so.5"
#endif

/* Workspace each stream hands rocBLAS, so that it never allocates during a graph capture. */
#define ROCM_BLAS_WORKSPACE_BYTES (32u << 20)

static void *rb_sym(void *h, const char *name, bool required) {
  void *p = dlsym(h, name);
  if (!p && required && !g_rb.why[0])
    snprintf(g_rb.why, sizeof(g_rb.why), "%s has no symbol %s", g_rb.path, name);
  return p;
}

static void rb_load(void) {
  const char *want = getenv("KILN_ROCBLAS");
  if (want && strcmp(want, "none") == 0) {
    snprintf(g_rb.why, sizeof(g_rb.why), "turned off by KILN_ROCBLAS=none");
    return;
  }
  snprintf(g_rb.path, sizeof(g_rb.path), "%s", want && *want ? want : ROCBLAS_SONAME);
  dlerror();
  void *h = dlopen(g_rb.path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    snprintf(g_rb.why, sizeof(g_rb.why), "%s", e ? e : "dlopen failed");
    return;
  }
  g_rb.create_handle = (rocblas_create_handle_fn)rb_sym(h, "rocblas_create_handle", true);
  g_rb.destroy_handle = (rocblas_destroy_handle_fn)rb_sym(h, "rocblas_destroy_handle", true);
  g_rb.set_stream = (rocblas_set_stream_fn)rb_sym(h, "rocblas_set_stream", true);
  g_rb.set_workspace = (rocblas_set_workspace_fn)rb_sym(h, "rocblas_set_workspace", false);
  g_rb.status_to_string = (rocblas_status_to_string_fn)rb_sym(h, "rocblas_status_to_string", false);
  g_rb.gemm_ex = (rocblas_gemm_ex_fn)rb_sym(h, "rocblas_gemm_ex", true);
  g_rb.gemm_strided_batched_ex = (rocblas_gemm_strided_batched_ex_fn)rb_sym(
      h, "rocblas_gemm_strided_batched_ex", true);
  g_rb.loaded = !g_rb.why[0];
}

static kiln_hal_error_t *rb_err(rocblas_status st, const char *what) {
  const char *name = g_rb.status_to_string ? g_rb.status_to_string(st) : NULL;
  int32_t code = st == 5 /* rocblas_status_memory_error */ ? KILN_HAL_ERR_OUT_OF_MEMORY
                 : st == 2 /* rocblas_status_not_implemented */ ? KILN_HAL_ERR_UNSUPPORTED
                                                                : KILN_HAL_ERR_DEVICE;
  return kiln_hal_error_new(code, "%s: rocBLAS status %d%s%s", what, (int)st, name ? ": " : "",
                            name ? name : "");
}

struct cuda_blas {
  rocblas_handle handle;
  void *workspace;
};

const char *cuda_blas_describe(void) {
  static char text[600];
  pthread_once(&g_rb.once, rb_load);
  if (g_rb.loaded)
    snprintf(text, sizeof(text), "rocBLAS (%s)", g_rb.path);
  else
    snprintf(text, sizeof(text), "no rocBLAS (%s): Kiln's own GEMM kernel", g_rb.why);
  return text;
}

kiln_hal_error_t *cuda_blas_create(kiln_hal_stream_t *s, cuda_blas_t **out) {
  *out = NULL;
  pthread_once(&g_rb.once, rb_load);
  if (!g_rb.loaded) return NULL; /* cuda_gemm.c uses Kiln's own kernel */
  cuda_blas_t *b = calloc(1, sizeof(*b));
  if (!b) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "stream_create: out of host memory");
  kiln_hal_error_t *err = NULL;
  rocblas_status st = g_rb.create_handle(&b->handle);
  if (st != ROCBLAS_STATUS_SUCCESS) {
    b->handle = NULL;
    err = rb_err(st, "stream_create: rocblas_create_handle");
    goto fail;
  }
  if ((st = g_rb.set_stream(b->handle, s->stream)) != ROCBLAS_STATUS_SUCCESS) {
    err = rb_err(st, "stream_create: rocblas_set_stream");
    goto fail;
  }
  if (g_rb.set_workspace) {
    hipError_t e = hipMalloc(&b->workspace, ROCM_BLAS_WORKSPACE_BYTES);
    if (e != hipSuccess) {
      (void)hipGetLastError();
      b->workspace = NULL;
      err = cuda_err_rt(e, "stream_create: hipMalloc(rocBLAS workspace)");
      goto fail;
    }
    st = g_rb.set_workspace(b->handle, b->workspace, ROCM_BLAS_WORKSPACE_BYTES);
    if (st != ROCBLAS_STATUS_SUCCESS) {
      err = rb_err(st, "stream_create: rocblas_set_workspace");
      goto fail;
    }
  }
  *out = b;
  return NULL;
fail:
  cuda_blas_destroy(b);
  return err;
}

void cuda_blas_destroy(cuda_blas_t *b) {
  if (!b) return;
  if (b->handle) (void)g_rb.destroy_handle(b->handle);
  if (b->workspace) (void)hipFree(b->workspace);
  free(b);
}

static int32_t rb_dtype(int32_t d) {
  switch (d) {
    case KILN_HAL_F16: return ROCBLAS_F16;
    case KILN_HAL_BF16: return ROCBLAS_BF16;
    default: return ROCBLAS_F32;
  }
}

kiln_hal_error_t *cuda_blas_matmul(kiln_hal_stream_t *s, const cuda_blas_call_t *c,
                                   bool *bias_done) {
  *bias_done = false; /* no epilogue in rocBLAS: cuda_gemm.c adds the bias */
  if (c->dtype_ab == CUDA_BLAS_FP8_E4M3)
    return cuda_err_unsupported("gemm: FP8 products are not implemented on rocBLAS here");
  if (c->lda > INT32_MAX || c->ldb > INT32_MAX || c->ldd > INT32_MAX || c->batch > INT32_MAX)
    return cuda_err_unsupported("gemm: leading dimensions or batch beyond rocBLAS's int32");
  const int32_t ta = c->trans_a ? ROCBLAS_OP_TRANSPOSE : ROCBLAS_OP_NONE;
  const int32_t tb = c->trans_b ? ROCBLAS_OP_TRANSPOSE : ROCBLAS_OP_NONE;
  const int32_t tab = rb_dtype(c->dtype_ab), tc = rb_dtype(c->dtype_c);
  const float alpha = c->alpha, beta = c->beta;
  rocblas_status st;
  if (c->batch == 1)
    st = g_rb.gemm_ex(s->blas->handle, ta, tb, (int32_t)c->m, (int32_t)c->n, (int32_t)c->k, &alpha,
                      c->a, tab, (int32_t)c->lda, c->b, tab, (int32_t)c->ldb, &beta, c->d, tc,
                      (int32_t)c->ldd, c->d, tc, (int32_t)c->ldd, ROCBLAS_F32,
                      ROCBLAS_ALGO_STANDARD, 0, ROCBLAS_FLAGS_NONE);
  else
    st = g_rb.gemm_strided_batched_ex(
        s->blas->handle, ta, tb, (int32_t)c->m, (int32_t)c->n, (int32_t)c->k, &alpha, c->a, tab,
        (int32_t)c->lda, c->stride_a, c->b, tab, (int32_t)c->ldb, c->stride_b, &beta, c->d, tc,
        (int32_t)c->ldd, c->stride_d, c->d, tc, (int32_t)c->ldd, c->stride_d, (int32_t)c->batch,
        ROCBLAS_F32, ROCBLAS_ALGO_STANDARD, 0, ROCBLAS_FLAGS_NONE);
  return st == ROCBLAS_STATUS_SUCCESS ? NULL : rb_err(st, "gemm: rocblas_gemm_ex");
}
