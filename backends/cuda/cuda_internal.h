/* cuda_internal.h - private types and helpers shared by the CUDA backend's host C files. */
#ifndef KILN_CUDA_INTERNAL_H
#define KILN_CUDA_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kiln/hal.h"
#include "kiln/hal_check.h"
#include "kiln/hal_util.h"

#include "cuda_kernels.h"
#include "portable.h"

/* cudaMalloc aligns to 256 bytes at least, which the ABI asks for. */

/* f32 staging for gemms with a half-precision output and a bias or beta != 0 (cuda_gemm.c):
 * the product is formed in f32 here, row chunk by row chunk, then rounded once. */
#define CUDA_GEMM_STAGE_BYTES (32u << 20)
/* Attention's split-KV scratch (cuda_attention_mma.cuh): partial (max, sum, output) states of
 * the decode rows, f32. Fixed per stream so captured graphs replay against the same address;
 * a launch whose splits would not fit uses fewer (down to none). */
#define CUDA_ATTN_SCRATCH_BYTES (16u << 20)

/* ---- handles ----------------------------------------------------------------------------- */

struct kiln_hal_device {
  int32_t index;
  int32_t warp_size;
  int32_t sm_count;
  int64_t smem_optin;   /* max dynamic shared memory per block after opt-in, bytes */
  int32_t cc;           /* compute capability, major * 10 + minor (89: FP8 matrix units) */
  atomic_int capturing; /* streams of this device inside graph_begin..graph_end */
};

/* A g_idx tensor of this buffer that gemm_quant has found inside its groups (cuda_backend.c). */
typedef struct cuda_gidx_ok {
  uint64_t offset;
  int64_t k, groups;
} cuda_gidx_ok_t;

struct kiln_hal_buffer {
  kiln_hal_device_t *device;
  void *ptr;     /* device address (pinned: host address, also valid on the device) */
  uint64_t size; /* bytes */
  bool pinned;
  /* gemm_quant's checked g_idx views, sorted by offset (a lock in cuda_backend.c guards it) */
  cuda_gidx_ok_t *gidx_ok;
  int64_t gidx_len, gidx_cap;
};

/* The GEMM library's state for one stream: cuBLASLt (cuda_blas_lt.c) in the CUDA plugin,
 * rocBLAS (backends/rocm/rocm_blas.c) in the ROCm one. Opaque to everything else. */
typedef struct cuda_blas cuda_blas_t;

/* A stream owns its GEMM library state and scratch buffers: it is used by one thread at a time
 * (hal.h), so none of these needs a lock. */
struct kiln_hal_stream {
  kiln_hal_device_t *device;
  cudaStream_t stream;
  cuda_blas_t *blas;  /* NULL when the plugin has no GEMM library (rocBLAS absent) */
  float *stage;       /* CUDA_GEMM_STAGE_BYTES of f32 staging, fixed for the stream's life */
  void *attn_scratch; /* CUDA_ATTN_SCRATCH_BYTES for attention's split-KV partials, likewise */
  bool capturing;     /* between graph_begin and graph_end */
};

struct kiln_hal_graph {
  kiln_hal_device_t *device;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
};

/* ---- errors (cuda_backend.c) -------------------------------------------------------------- */

/* INVALID_ARGUMENT with a printf-style message. */
kiln_hal_error_t *cuda_err_arg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* UNSUPPORTED with a printf-style message. */
kiln_hal_error_t *cuda_err_unsupported(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* An error for a failed runtime call: "<what>: <cudaGetErrorName>: <cudaGetErrorString>"; code
 * OUT_OF_MEMORY for allocation failures, else DEVICE. */
kiln_hal_error_t *cuda_err_rt(cudaError_t e, const char *what);

/* Makes the stream's device current on the calling thread. */
kiln_hal_error_t *cuda_stream_enter(kiln_hal_stream_t *s);

/* ---- validation (cuda_backend.c) ------------------------------------------------------------ */

/* The argument rules are hal_check.h's. This is how its checks see the buffers of a call on
 * `dev`: sizes, and a refusal of another device's (non-pinned) memory. */
kiln_hal_check_env_t cuda_check_env(kiln_hal_device_t *dev);

/* The device view of a validated tensor (ptr NULL for an absent one). */
cuda_view_t cuda_view(const kiln_hal_tensor_t *t);

/* ---- GEMM (cuda_gemm.c: the op, on a library or Kiln's own kernel) ------------------------ */

kiln_hal_error_t *cuda_gemm(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *args);

/* ---- the GEMM library (cuda_blas_lt.c; backends/rocm/rocm_blas.c) -------------------------- */

/* One column-major product, or a strided batch of them, in BLAS terms:
 *     D'[m x n] = alpha * op(A') op(B') + beta * D' (+ bias[i] on row i of D')
 * A' is m x k after op (stored k x m when trans_a), B' is k x n after op (n x k when trans_b).
 * cuda_gemm.c maps kiln's row-major views onto it (see there). dtype_c is dtype_ab or F32;
 * bias, when not NULL, is [m] in dtype_c and is only passed with an F32 D'. */
typedef struct cuda_blas_call {
  int32_t dtype_ab, dtype_c;
  bool tf32; /* F32 inputs may use reduced-precision matrix units */
  bool trans_a, trans_b;
  int64_t m, n, k;
  const void *a, *b;
  void *d;
  int64_t lda, ldb, ldd;
  int64_t stride_a, stride_b, stride_d; /* elements between batch members */
  int64_t batch;                        /* >= 1; strides are not 0 when batch > 1 */
  float alpha, beta;
  const void *bias;
  /* dtype_ab CUDA_BLAS_FP8_E4M3 (A' and B' E4M3 codes, TN layout: trans_a, !trans_b): f32
   * scale vectors, scale_a [m] on the rows of D', scale_b [n] on its columns (cuBLASLt's
   * outer-vector scaling), applied to the f32 sums before the bias and the one rounding.
   * Only the CUDA plugin's cuBLASLt takes it; elsewhere the call is UNSUPPORTED. */
  const float *scale_a, *scale_b;
  bool bias_required; /* with a bias: UNSUPPORTED rather than an unfused bias */
} cuda_blas_call_t;
#define CUDA_BLAS_FP8_E4M3 100 /* a dtype_ab beside kiln_hal_dtype_t's: FP8 E4M3FN codes */

/* Creates the library state for stream s (handle, workspace); *out stays NULL, with no error,
 * when the plugin has no library at all (the caller then uses Kiln's own kernel). */
kiln_hal_error_t *cuda_blas_create(kiln_hal_stream_t *s, cuda_blas_t **out);
void cuda_blas_destroy(cuda_blas_t *b);
/* Enqueues the product on s's stream. *bias_done is false when the library could not fuse the
 * bias (the caller adds it); it means nothing for a call without a bias (c->bias NULL), where
 * it may be false as well, so the caller tests its own bias first. UNSUPPORTED when the
 * library has no algorithm for the call. */
kiln_hal_error_t *cuda_blas_matmul(kiln_hal_stream_t *s, const cuda_blas_call_t *c,
                                   bool *bias_done);
/* "cuBLASLt 13.0", "rocBLAS 4.1 (librocblas.so.4)", for build_info and logs. */
const char *cuda_blas_describe(void);

/* ---- collectives (cuda_nccl.c: NCCL, or RCCL on ROCm, loaded at first use) ------------ */

/* Whether the library loaded (sets KILN_HAL_CAP_COLLECTIVES); "NCCL 2.21.5 (libnccl.so.2)". */
bool cuda_nccl_available(void);
const char *cuda_nccl_describe(void);
kiln_hal_error_t *cuda_comm_get_unique_id(kiln_hal_comm_id_t *out_id);
kiln_hal_error_t *cuda_comm_create(kiln_hal_device_t *device, const kiln_hal_comm_args_t *args,
                                   kiln_hal_comm_t **out_comm);
void cuda_comm_destroy(kiln_hal_comm_t *comm);
kiln_hal_error_t *cuda_all_reduce(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a);
kiln_hal_error_t *cuda_all_gather(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a);
kiln_hal_error_t *cuda_broadcast(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a);
kiln_hal_error_t *cuda_send(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a);
kiln_hal_error_t *cuda_recv(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a);

#endif /* KILN_CUDA_INTERNAL_H */
