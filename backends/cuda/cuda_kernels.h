/* cuda_kernels.h - the kernel launchers of the CUDA backend, callable from its C host code.
 *
 * The host side (cuda_backend.c) validates every op against hal.h and then calls one launcher
 * with plain device pointers and shapes. A launcher sizes the grid, enqueues its kernel(s) on
 * the stream and returns the launch error (cudaGetLastError) or cudaSuccess; it never
 * synchronises. Launchers that depend on the warp width take it from the device. */
#ifndef KILN_CUDA_KERNELS_H
#define KILN_CUDA_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include "portable.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A validated tensor view: ptr is the address of element 0 (buffer base + offset). */
typedef struct cuda_view {
  void *ptr;
  int32_t dtype; /* kiln_hal_dtype_t */
  int32_t ndim;
  int64_t shape[4];
  int64_t stride[4]; /* elements */
} cuda_view_t;

/* out[t, :] = table[ids[t], :] or zeros.   table: [V, H]   ids: [T] I32   out: [T, H] */
cudaError_t cuda_launch_embedding(cudaStream_t st, cuda_view_t table, cuda_view_t ids,
                                  cuda_view_t out);

/* RMSNorm with optional fused residual (residual.ptr NULL = absent). All [T, H] / [H]. */
cudaError_t cuda_launch_rmsnorm(cudaStream_t st, int warp, cuda_view_t x, cuda_view_t residual,
                                cuda_view_t weight, cuda_view_t out, float eps, float offset);

/* LayerNorm with optional fused residual and bias (residual.ptr / bias.ptr NULL = absent).
 * x, residual, out: [T, H]; weight, bias: [H]. */
cudaError_t cuda_launch_layernorm(cudaStream_t st, int warp, cuda_view_t x, cuda_view_t residual,
                                  cuda_view_t weight, cuda_view_t bias, cuda_view_t out, float eps);

/* In-place rotary embedding of q: [T, NHQ, D] and (has_k) k: [T, NHK, D], same dtype, in one
 * launch; positions [T] I32; cos_sin [P, R] F32. */
cudaError_t cuda_launch_rope(cudaStream_t st, cuda_view_t q, cuda_view_t k, bool has_k,
                             cuda_view_t positions, cuda_view_t cos_sin, int32_t style);

/* out[t, i] = act(x[t, i]) * x[t, I + i].   x: [T, 2I]   out: [T, I] */
cudaError_t cuda_launch_silu_mul(cudaStream_t st, cuda_view_t x, cuda_view_t out, int32_t act);

/* out[t, i] = act(x[t, i]).   x, out: [T, N] */
cudaError_t cuda_launch_activation(cudaStream_t st, cuda_view_t x, cuda_view_t out, int32_t act);

/* out = a + b, all [T, H] of one float dtype. */
cudaError_t cuda_launch_add(cudaStream_t st, cuda_view_t a, cuda_view_t b, cuda_view_t out);

/* dst = src for same-shaped views of up to 4 dims (float<->float converting, or equal ints). */
cudaError_t cuda_launch_copy(cudaStream_t st, cuda_view_t src, cuda_view_t dst);

/* Scatter k, v [T, NKV, D] into dense caches [NB, NKV, BS, D] at slots [T] I32; kv_fp8: the
 * caches are U8 E4M3FN codes of x / k_scale (v_scale), hal.h's FP8 KV cache (ABI 1.7). */
cudaError_t cuda_launch_kv_write(cudaStream_t st, cuda_view_t k, cuda_view_t v, cuda_view_t k_cache,
                                 cuda_view_t v_cache, cuda_view_t slots, int kv_fp8, float k_scale,
                                 float v_scale);

/* c[b, m, n] = (beta != 0 ? beta * c[b, m, n] : 0) + (bias ? bias[n] : 0) for c: [B, M, N]
 * (3-D view; c is never read when beta == 0). bias: NULL or [N] in c's dtype, contiguous. */
cudaError_t cuda_launch_scale_bias(cudaStream_t st, cuda_view_t c, const void *bias, float beta);

/* c[i, j] = round(tmp[i * N + j] + (beta != 0 ? beta * c[i, j] : 0) + (bias ? bias[j] : 0))
 * for c: a 2-D [rows, N] view (row stride c.stride[0]); tmp: dense f32 [rows, N]. */
cudaError_t cuda_launch_gemm_finish(cudaStream_t st, cuda_view_t c, const float *tmp,
                                    const void *bias, float beta);

/* The skinny gemm of decode (cuda_gemv.cu): c = alpha * x @ w^T + beta * c + bias, rounded
 * once. x: [M, K] with rows contiguous (row stride ldx); w: [N, K] with rows contiguous (row
 * stride ldw: a PyTorch Linear weight); c: [M, N] row-major (row stride ldc), in dtype_ab or
 * F32; bias: NULL or [N] contiguous in c's dtype; c is never read when beta == 0.
 * dtype_ab F16 or BF16; 1 <= M <= CUDA_GEMV_MAX_M; K % 8 == 0; x, w 16-byte aligned, and ldx
 * (when M > 1) and ldw (when N > 1) multiples of 8. Other calls return cudaErrorInvalidValue
 * (the alignment is the caller's to check). */
#define CUDA_GEMV_MAX_M 8
typedef struct cuda_gemv_params {
  const void *x, *w, *bias;
  void *c;
  int64_t ldx, ldw, ldc; /* elements */
  int32_t dtype_ab, dtype_c;
  int32_t M, N, K;
  float alpha, beta;
} cuda_gemv_params_t;

cudaError_t cuda_launch_gemv(cudaStream_t st, int warp, const cuda_gemv_params_t *p);

/* gemm_quant (cuda_qgemv.cu): y = x @ dequant(w)^T + bias, f32 sums rounded once to y's dtype.
 * x: [M, K] (row stride ldx elements, last dim contiguous) F32/F16/BF16; y: [M, N] (row stride
 * ldy) in x's dtype or F32; bias: NULL or [N] contiguous in y's dtype. w: row 0 of N rows of
 * `format` (kiln_hal_qfmt_t: the GGUF block formats, INT4_G/INT8_G or FP8_E4M3), row_stride
 * bytes apart, any alignment; the group formats' scales (F16, FP8's F32; row stride lds
 * elements), zeros (U8 or NULL, row stride ldz), g_idx (I32 [K] contiguous or NULL),
 * group_size and G. The caller has validated everything (hal_check.h); M <= CUDA_QGEMV_MAX_M
 * runs the decode GEMV when x is 16-byte aligned (ptr and ldx) and K % 8 == 0 (FP8: any K),
 * else the tiled kernel (force_tiled: always). */
#define CUDA_QGEMV_MAX_M 8
/* gemm_quant with x_quant = FP8_TOKEN: cuBLASLt's FP8 GEMM from this M up (KILN_CUDA_FP8_LT_MIN_M
 * overrides it), the FP8 GEMV on the codes below. */
#define CUDA_FP8_LT_MIN_M 4 /* H200: the GEMV wins at M 1-2, cuBLASLt from 4 (docs/perf.md) */
typedef struct cuda_qgemm_params {
  const void *x, *w, *bias;
  void *y;
  int64_t ldx, ldy, row_stride;
  int32_t dtype_x, dtype_y, format;
  int32_t M, N, K;
  const void *scales, *zeros;
  const int32_t *g_idx;
  int64_t lds, ldz;
  int32_t group_size, G;
  bool force_tiled;
  int32_t fp8_ks; /* FP8 GEMV: 0 = its own choice, 1 = no K split, 2 = split K over the block */
  const float *xscale; /* FP8 x_quant: x holds the codes' values (f16), row m times xscale[m] */
} cuda_qgemm_params_t;

cudaError_t cuda_launch_qgemm(cudaStream_t st, int warp, const cuda_qgemm_params_t *p);

/* x_quant = FP8_TOKEN (hal.h 1.6) of x [M, K] (F32/F16/BF16, row stride ldx): out [M, K] with
 * row stride ldo elements gets the E4M3 code bytes (mode CUDA_XQ_FP8) or the codes' values as
 * f16 / bf16 (CUDA_XQ_F16 / CUDA_XQ_BF16, exact), scales[m] the row's s_m. Bit for bit
 * kiln_hal_fp8_xquant_row. One launch, no scratch. */
enum { CUDA_XQ_FP8 = 0, CUDA_XQ_F16 = 1, CUDA_XQ_BF16 = 2 };
cudaError_t cuda_launch_fp8_xquant(cudaStream_t st, const void *x, int32_t dtype_x, int64_t ldx,
                                   int32_t M, int32_t K, void *out, int64_t ldo, int mode,
                                   float *scales);

/* Kiln's own gemm (cuda_gemm_kernel.cu; the ROCm plugin's when rocBLAS is absent), all of
 * hal.h's gemm on CUDA cores: c = alpha * a @ b + beta * c + bias per product, f32
 * accumulation, rounded once to c's dtype. Any strides (row-major, column-major or neither;
 * negative or 0), any pointer alignment, int64 sizes, batch stride 0 = broadcast. K == 0 gives
 * beta * c + bias. c is never read when beta == 0. M, N or batch == 0 does nothing. Returns
 * cudaErrorInvalidValue for a dtype pair it does not take. warp is unused (no warp-level ops). */
typedef struct cuda_gemm_kernel_params {
  const void *a, *b, *bias; /* bias: NULL or [N] contiguous in c's dtype */
  void *c;
  int32_t dtype_ab, dtype_c; /* a, b: F32/F16/BF16 (the same); c: dtype_ab or F32 */
  int64_t M, N, K, batch;
  int64_t a_rs, a_cs, a_bs; /* element strides of a[batch][m][k]: row (m), col (k), batch */
  int64_t b_rs, b_cs, b_bs; /* b[batch][k][n]: row (k), col (n), batch */
  int64_t c_rs, c_bs;       /* c[batch][m][n]: row stride, batch stride; column stride 1 */
  float alpha, beta;
} cuda_gemm_kernel_params_t;

cudaError_t cuda_launch_gemm_kernel(cudaStream_t st, int warp, const cuda_gemm_kernel_params_t *p);

typedef struct cuda_attention_params {
  cuda_view_t q, out;            /* [T, NH, D] */
  const void *k_cache, *v_cache; /* dense [NB, NKV, BS, D] */
  const int32_t *block_table;    /* [S, MB], row stride bt_stride */
  const int32_t *seq_lens;       /* [S], stride seq_lens_stride */
  const int32_t *qsl;            /* [S + 1], stride qsl_stride */
  int64_t bt_stride, seq_lens_stride, qsl_stride;
  int32_t num_seqs, max_query_len, max_seq_len;
  int32_t num_blocks, num_kv_heads, block_size, max_blocks;
  float scale, softcap; /* FP8 cache: scale already multiplied by k_scale (hal.h allows it) */
  int32_t sliding_window;
  bool causal;
  /* The FP8 KV cache (ABI 1.7): the caches hold E4M3FN codes, read as e4m3(code) in q's dtype
   * (exact); every output is multiplied by v_scale (1 for a float cache: exact). */
  bool kv_fp8;
  float v_scale;
  /* the device and the stream's scratch (split-KV partial states; fixed address per stream) */
  int32_t sm_count;
  int64_t smem_optin;
  void *scratch;
  int64_t scratch_bytes;
} cuda_attention_params_t;

/* Paged attention (cuda_attention.cu). Head dims up to 256. f16/bf16 with head dim 64, 80, 96,
 * 128 or 256 run on tensor cores (split-KV for short queries, FlashAttention-2 style tiles for
 * long ones); everything else on a CUDA-core kernel. */
cudaError_t cuda_launch_attention(cudaStream_t st, int warp, const cuda_attention_params_t *p);

/* argmax over rows of logits [S, V] F32; logprob.ptr NULL = absent. */
cudaError_t cuda_launch_argmax(cudaStream_t st, int warp, cuda_view_t logits, cuda_view_t ids,
                               cuda_view_t logprob);

/* top-k (k = values.shape[1]); lse.ptr NULL = absent. */
cudaError_t cuda_launch_topk(cudaStream_t st, int warp, cuda_view_t logits, cuda_view_t values,
                             cuda_view_t ids, cuda_view_t lse);

typedef struct cuda_penalize_params {
  cuda_view_t logits;                     /* [S, V] F32 */
  cuda_view_t prompt_ids, prompt_offsets; /* ptr NULL = absent */
  cuda_view_t output_ids, output_offsets;
  cuda_view_t repetition, frequency, presence;
  cuda_view_t bias_ids, bias_values, bias_offsets;
} cuda_penalize_params_t;

/* Penalties in place. smem_limit: the device's opt-in shared memory per block (bytes); the
 * launcher returns cudaErrorInvalidValue when V needs more. */
cudaError_t cuda_launch_penalize(cudaStream_t st, int warp, const cuda_penalize_params_t *p,
                                 int64_t smem_limit);

/* Bytes of shared memory penalize needs for a vocabulary of V. */
int64_t cuda_penalize_smem_bytes(int64_t V);

/* Token masks (ABI 1.3) in place: logits [S, V] F32, mask [M, W] I32 bits, rows [S] I32
 * (ptr NULL = row s uses mask row s). */
cudaError_t cuda_launch_mask_logits(cudaStream_t st, cuda_view_t logits, cuda_view_t mask,
                                    cuda_view_t rows);

typedef struct cuda_sample_params {
  cuda_view_t logits;                                    /* [S, V] F32 */
  cuda_view_t temperature, top_k, top_p, min_p, uniform; /* [S] */
  cuda_view_t out_ids, out_logprob;                      /* out_logprob.ptr NULL = absent */
} cuda_sample_params_t;

cudaError_t cuda_launch_sample(cudaStream_t st, int warp, const cuda_sample_params_t *p);

#ifdef __cplusplus
}
#endif

#endif /* KILN_CUDA_KERNELS_H */
