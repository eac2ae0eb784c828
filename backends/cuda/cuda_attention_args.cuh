/* cuda_attention_args.cuh - what the attention dispatcher (cuda_attention.cu) and the
 * tensor-core kernels (cuda_attention_mma.cuh, one cuda_attention_dNNN.cu per head dim) share:
 * the kernel arguments, the launch plan, and the head-dim launchers. */
#ifndef KILN_CUDA_ATTENTION_ARGS_CUH
#define KILN_CUDA_ATTENTION_ARGS_CUH

#include <math.h>
#include <stdint.h>

#include "cuda_kernels.h"

/* Arguments of the tensor-core kernels: the validated op plus the launch plan. */
typedef struct att_mma_args {
  cuda_attention_params_t p;
  float *part_acc;       /* [nsplit, part_rows, D] f32 partial outputs (scratch), unnormalised */
  float *part_ml;        /* [nsplit, part_rows, 2] their (max, sum), base-2 logits */
  long long part_rows;   /* S * qd * NH: row (s * qd + i) * NH + h of decode query i of s */
  int32_t group;         /* G = NH / NKV query heads per KV head */
  int32_t qd;            /* 0: the prefill kernel takes every sequence; else the decode kernel,
                            for sequences with 1 <= q_len <= qd */
  int32_t decode_mtiles; /* 16-row tiles per (sequence, KV head) in the decode kernel */
  int32_t nsplit;        /* context splits of the decode kernel (1: no split, no combine) */
  int32_t seq_base;      /* first sequence of this launch */
  int32_t bs_shift;      /* log2(block_size), or -1 when it is not a power of two */
  float scale_log2;      /* scale * log2(e) */
  bool q_vec, o_vec;     /* q / out rows allow 16-byte accesses */
} att_mma_args_t;

/* The launch plan, from num_seqs, max_query_len and max_seq_len only (never from the metadata
 * on the device), so a captured graph replays correctly for any batch within those bounds:
 *   - when max_query_len * G <= 64 (or max_query_len == 1): the decode kernel takes every
 *     sequence (qd = max_query_len); when S * NKV * row tiles fill at most half of one wave
 *     (per_sm CTAs on each SM) the context is split to fill the wave, with at least two K/V
 *     tiles (of tk keys) per split at max_seq_len, at most 256 splits, and only as many as the
 *     scratch holds (else fewer, down to no split);
 *   - otherwise the prefill kernel takes every sequence (qd = 0): its 64-row tiles serve the
 *     decodes of a mixed batch too, the warps without rows skipping the math. */
static inline void att_mma_plan(const cuda_attention_params_t *p, int tk, int D, int per_sm,
                                att_mma_args_t *a) {
  const long long NH = p->q.shape[1], NKV = p->num_kv_heads, S = p->num_seqs;
  const long long G = NH / NKV;
  long long qd_max = 64 / G;
  if (qd_max < 1) qd_max = 1;
  const long long qd = p->max_query_len <= qd_max ? p->max_query_len : 0;
  const long long mtiles = (qd * G + 15) / 16;
  long long nsplit = 1;
  const long long rows = S * qd * NH;
  if (qd > 0 && rows <= INT32_MAX) {
    const long long base = S * NKV * mtiles, wave = (long long)per_sm * p->sm_count;
    if (2 * base <= wave) {
      long long want = wave / base;
      const long long cap = ((long long)p->max_seq_len + tk - 1) / tk / 2;
      if (want > cap) want = cap;
      if (want > 256) want = 256; /* ATT_MAX_SPLITS */
      const long long per_split = rows * (D + 2) * (long long)sizeof(float);
      const long long fit = per_split > 0 ? p->scratch_bytes / per_split : 0;
      if (want > fit) want = fit;
      if (want > 1) nsplit = want;
    }
  }
  a->group = (int32_t)G;
  a->qd = (int32_t)qd;
  a->decode_mtiles = (int32_t)mtiles;
  a->nsplit = (int32_t)nsplit;
  a->part_rows = rows;
  a->part_acc = (float *)p->scratch;
  a->part_ml = nsplit > 1 ? a->part_acc + nsplit * rows * D : NULL;
  a->bs_shift = -1;
  for (int sh = 0; sh < 31; sh++)
    if ((1LL << sh) == (long long)p->block_size) a->bs_shift = sh;
  a->scale_log2 = p->scale * 1.4426950408889634f;
  a->q_vec = (uintptr_t)p->q.ptr % 16 == 0 && p->q.stride[0] % 8 == 0 && p->q.stride[1] % 8 == 0;
  a->o_vec =
      (uintptr_t)p->out.ptr % 16 == 0 && p->out.stride[0] % 8 == 0 && p->out.stride[1] % 8 == 0;
}

#ifdef __cplusplus
extern "C" {
#endif

/* Tensor-core attention for f16/bf16 q with head dim NNN (p->q.shape[2] == NNN) and 16-byte
 * aligned caches. cudaErrorNotSupported (before any launch) when this device lacks the shared
 * memory or the dtype is not f16/bf16. */
cudaError_t cuda_attention_mma_d64(cudaStream_t st, const cuda_attention_params_t *p);
cudaError_t cuda_attention_mma_d80(cudaStream_t st, const cuda_attention_params_t *p);
cudaError_t cuda_attention_mma_d96(cudaStream_t st, const cuda_attention_params_t *p);
cudaError_t cuda_attention_mma_d128(cudaStream_t st, const cuda_attention_params_t *p);
cudaError_t cuda_attention_mma_d256(cudaStream_t st, const cuda_attention_params_t *p);

#ifdef __cplusplus
}
#endif

#endif /* KILN_CUDA_ATTENTION_ARGS_CUH */
