/* cuda_internal.h - private types and helpers shared by the CUDA backend's host C files. */
#ifndef KILN_CUDA_INTERNAL_H
#define KILN_CUDA_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cublasLt.h>

#include "kiln/hal.h"
#include "kiln/hal_check.h"
#include "kiln/hal_util.h"

#include "cuda_kernels.h"
#include "portable.h"

/* cudaMalloc aligns to 256 bytes at least, which the ABI asks for. */

/* Workspace each stream hands cuBLASLt (NVIDIA recommends 32 MiB on Hopper). */
#define CUDA_GEMM_WORKSPACE_BYTES (32u << 20)
/* f32 staging for gemms with a half-precision output and a bias or beta != 0 (cuda_gemm.c):
 * the product is formed in f32 here, row chunk by row chunk, then rounded once. */
#define CUDA_GEMM_STAGE_BYTES (32u << 20)
/* Attention's split-KV scratch (cuda_attention_mma.cuh): partial (max, sum, output) states of
 * the decode rows, f32. Fixed per stream so captured graphs replay against the same address;
 * a launch whose splits would not fit uses fewer (down to none). */
#define CUDA_ATTN_SCRATCH_BYTES (16u << 20)
/* Heuristic results cached per stream (plans keyed by shape, layout and alignment). */
#define CUDA_GEMM_CACHE_SIZE 64

/* ---- handles ----------------------------------------------------------------------------- */

struct kiln_hal_device {
  int32_t index;
  int32_t warp_size;
  int32_t sm_count;
  int64_t smem_optin;   /* max dynamic shared memory per block after opt-in, bytes */
  atomic_int capturing; /* streams of this device inside graph_begin..graph_end */
};

struct kiln_hal_buffer {
  kiln_hal_device_t *device;
  void *ptr;     /* device address (pinned: host address, also valid on the device) */
  uint64_t size; /* bytes */
  bool pinned;
};

/* One cached GEMM plan: the key fields describe the call, the rest is what cuBLASLt needs. */
typedef struct cuda_gemm_plan {
  bool used;
  uint64_t stamp; /* LRU clock */
  /* key */
  int32_t dtype_ab, dtype_c, compute;
  int32_t trans_a, trans_b; /* of the cuBLASLt operands (A' = b, B' = a) */
  int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
  int32_t align_a, align_b, align_c, epilogue;
  /* value */
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
} cuda_gemm_plan_t;

/* A stream owns its cuBLASLt handle, workspace and plan cache: it is used by one thread at a
 * time (hal.h), so none of these needs a lock. */
struct kiln_hal_stream {
  kiln_hal_device_t *device;
  cudaStream_t stream;
  cublasLtHandle_t lt;
  void *workspace;
  size_t workspace_size;
  float *stage;       /* CUDA_GEMM_STAGE_BYTES of f32 staging, fixed for the stream's life */
  void *attn_scratch; /* CUDA_ATTN_SCRATCH_BYTES for attention's split-KV partials, likewise */
  cuda_gemm_plan_t plans[CUDA_GEMM_CACHE_SIZE];
  uint64_t clock;
  bool capturing; /* between graph_begin and graph_end */
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
/* Same for a failed cuBLASLt call. */
kiln_hal_error_t *cuda_err_blas(cublasStatus_t s, const char *what);

/* Makes the stream's device current on the calling thread. */
kiln_hal_error_t *cuda_stream_enter(kiln_hal_stream_t *s);

/* ---- validation (cuda_backend.c) ------------------------------------------------------------ */

/* The argument rules are hal_check.h's. This is how its checks see the buffers of a call on
 * `dev`: sizes, and a refusal of another device's (non-pinned) memory. */
kiln_hal_check_env_t cuda_check_env(kiln_hal_device_t *dev);

/* The device view of a validated tensor (ptr NULL for an absent one). */
cuda_view_t cuda_view(const kiln_hal_tensor_t *t);

/* ---- GEMM (cuda_gemm.c) -------------------------------------------------------------------- */

kiln_hal_error_t *cuda_gemm(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *args);
/* Releases the stream's cached plans. */
void cuda_gemm_plans_release(kiln_hal_stream_t *s);

#endif /* KILN_CUDA_INTERNAL_H */
