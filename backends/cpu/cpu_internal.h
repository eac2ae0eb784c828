/* cpu_internal.h - private types and helpers shared by the CPU backend's source files. */
#ifndef KILN_CPU_INTERNAL_H
#define KILN_CPU_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kiln/hal.h"
#include "kiln/hal_check.h"
#include "kiln/hal_util.h"

#include "cpu_pool.h"

/* Every buffer is aligned to this many bytes (the ABI asks for at least 256). */
#define CPU_BUFFER_ALIGN 256

/* ---- handles ---------------------------------------------------------------------------- */

/* capturing and refusals are touched by any thread that allocates or captures. */
struct kiln_hal_device {
  int32_t index;
  atomic_int capturing; /* streams of this device between graph_begin and graph_end */
  atomic_uint refusals; /* buffer_alloc calls refused during a capture, ever */
};

struct kiln_hal_buffer {
  void *data;    /* CPU_BUFFER_ALIGN-aligned host memory */
  uint64_t size; /* bytes a view may touch */
};

/* One recorded op of a graph. Args are copied by value: tensors are plain views. */
typedef enum cpu_op_kind {
  CPU_OP_FILL,
  CPU_OP_COPY_D2D,
  CPU_OP_GEMM,
  CPU_OP_EMBEDDING,
  CPU_OP_RMSNORM,
  CPU_OP_ROPE,
  CPU_OP_SILU_MUL,
  CPU_OP_ADD,
  CPU_OP_COPY,
  CPU_OP_KV_WRITE,
  CPU_OP_ATTENTION,
  CPU_OP_ARGMAX,
  CPU_OP_TOPK,
  CPU_OP_PENALIZE,
  CPU_OP_SAMPLE,
  CPU_OP_LAYERNORM,
  CPU_OP_ACTIVATION,
  CPU_OP_MASK_LOGITS,
  CPU_OP_GEMM_QUANT,
  CPU_OP_COLL, /* ABI 1.5 collectives (cpu_comm.c) */
} cpu_op_kind_t;

typedef struct cpu_raw_copy {
  kiln_hal_buffer_t *dst, *src;
  uint64_t dst_offset, src_offset, size;
  uint8_t value; /* fill only */
} cpu_raw_copy_t;

typedef struct cpu_op {
  cpu_op_kind_t kind;
  union {
    cpu_raw_copy_t raw;
    kiln_hal_gemm_args_t gemm;
    kiln_hal_embedding_args_t embedding;
    kiln_hal_rmsnorm_args_t rmsnorm;
    kiln_hal_rope_args_t rope;
    kiln_hal_silu_mul_args_t silu_mul;
    kiln_hal_add_args_t add;
    kiln_hal_copy_args_t copy;
    kiln_hal_kv_write_args_t kv_write;
    kiln_hal_attention_args_t attention;
    kiln_hal_argmax_args_t argmax;
    kiln_hal_topk_args_t topk;
    kiln_hal_penalize_args_t penalize;
    kiln_hal_sample_args_t sample;
    kiln_hal_layernorm_args_t layernorm;
    kiln_hal_activation_args_t activation;
    kiln_hal_mask_args_t mask_logits;
    kiln_hal_gemm_quant_args_t gemm_quant;
    struct {
      int op; /* cpu_comm.c's COLL_* */
      kiln_hal_coll_args_t args;
    } coll;
  } u;
} cpu_op_t;

/* A stream runs ops on the calling thread. While capturing, ops are validated and appended to
 * `rec` instead. `scratch` is working memory for ops, grown on demand and kept between calls
 * (a stream is used by one thread at a time, so it needs no lock). */
struct kiln_hal_stream {
  kiln_hal_device_t *device;
  bool capturing;
  bool capture_failed;        /* an invalid call during capture: graph_end refuses */
  unsigned refusals_at_begin; /* device->refusals at graph_begin: a change fails graph_end */
  cpu_op_t *rec;
  size_t rec_len, rec_cap;
  void *scratch;
  size_t scratch_size;
};

struct kiln_hal_graph {
  cpu_op_t *ops;
  size_t len;
};

/* ---- global state (cpu_backend.c) ------------------------------------------------------- */

/* The persistent pool, created by init; NULL before init (ops then run single-threaded). */
extern cpu_pool_t *cpu_g_pool;

/* Threads the backend uses (pool workers + the calling thread). */
int cpu_num_threads(void);

/* ---- validation (cpu_backend.c): the rules are hal_check.h's ------------------------------ */

/* How hal_check.h's checks see this backend's buffers. */
extern const kiln_hal_check_env_t cpu_check_env;

/* INVALID_ARGUMENT error with a printf-style message. */
kiln_hal_error_t *cpu_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Host address of element 0 of a (validated) view. */
static inline void *cpu_tensor_ptr(const kiln_hal_tensor_t *t) {
  return (char *)t->buffer->data + t->offset;
}

/* Returns stream scratch of at least `bytes` bytes (64-byte aligned), or NULL on OOM. The
 * pointer stays valid until the next call on the same stream. */
void *cpu_scratch(kiln_hal_stream_t *stream, size_t bytes);

/* Runs fn over row ranges covering [0, rows): on the pool when rows * elems_per_row is large
 * enough to pay for waking it, else on the calling thread. */
typedef void (*cpu_rows_fn)(void *ctx, int64_t r0, int64_t r1, int thread);
void cpu_parallel_rows(int64_t rows, int64_t elems_per_row, cpu_rows_fn fn, void *ctx);

/* ---- ops: each validates, then (unless dry_run) executes. ------------------------------- */

kiln_hal_error_t *cpu_gemm(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *a, bool dry_run);
kiln_hal_error_t *cpu_embedding(kiln_hal_stream_t *s, const kiln_hal_embedding_args_t *a,
                                bool dry_run);
kiln_hal_error_t *cpu_rmsnorm(kiln_hal_stream_t *s, const kiln_hal_rmsnorm_args_t *a,
                              bool dry_run);
kiln_hal_error_t *cpu_layernorm(kiln_hal_stream_t *s, const kiln_hal_layernorm_args_t *a,
                                bool dry_run);
kiln_hal_error_t *cpu_activation(kiln_hal_stream_t *s, const kiln_hal_activation_args_t *a,
                                 bool dry_run);
kiln_hal_error_t *cpu_rope(kiln_hal_stream_t *s, const kiln_hal_rope_args_t *a, bool dry_run);
kiln_hal_error_t *cpu_silu_mul(kiln_hal_stream_t *s, const kiln_hal_silu_mul_args_t *a,
                               bool dry_run);
kiln_hal_error_t *cpu_add(kiln_hal_stream_t *s, const kiln_hal_add_args_t *a, bool dry_run);
kiln_hal_error_t *cpu_copy(kiln_hal_stream_t *s, const kiln_hal_copy_args_t *a, bool dry_run);
kiln_hal_error_t *cpu_kv_write(kiln_hal_stream_t *s, const kiln_hal_kv_write_args_t *a,
                               bool dry_run);
kiln_hal_error_t *cpu_attention(kiln_hal_stream_t *s, const kiln_hal_attention_args_t *a,
                                bool dry_run);
kiln_hal_error_t *cpu_argmax(kiln_hal_stream_t *s, const kiln_hal_argmax_args_t *a, bool dry_run);
kiln_hal_error_t *cpu_topk(kiln_hal_stream_t *s, const kiln_hal_topk_args_t *a, bool dry_run);
kiln_hal_error_t *cpu_penalize(kiln_hal_stream_t *s, const kiln_hal_penalize_args_t *a,
                               bool dry_run);
kiln_hal_error_t *cpu_sample(kiln_hal_stream_t *s, const kiln_hal_sample_args_t *a, bool dry_run);
kiln_hal_error_t *cpu_mask_logits(kiln_hal_stream_t *s, const kiln_hal_mask_args_t *a,
                                  bool dry_run);

/* gemm_quant (cpu_qgemm.c): the GGUF block formats, every one of them (KILN_HAL_CAP_QUANT). */
kiln_hal_error_t *cpu_gemm_quant(kiln_hal_stream_t *s, const kiln_hal_gemm_quant_args_t *a,
                                 bool dry_run);

/* Collectives over POSIX shared memory (cpu_comm.c, docs/parallel.md). op: 1 all_reduce,
 * 2 all_gather, 3 broadcast, 4 send, 5 recv. */
kiln_hal_error_t *cpu_comm_get_unique_id(kiln_hal_comm_id_t *out_id);
kiln_hal_error_t *cpu_comm_create(kiln_hal_device_t *device, const kiln_hal_comm_args_t *args,
                                  kiln_hal_comm_t **out_comm);
void cpu_comm_destroy(kiln_hal_comm_t *comm);
kiln_hal_error_t *cpu_coll_run(kiln_hal_stream_t *s, int op, const kiln_hal_coll_args_t *a,
                               bool dry_run);

/* OpenBLAS configuration (cpu_gemm.c): called by init with the pool's thread count. */
void cpu_gemm_init(int threads);
const char *cpu_gemm_blas_name(void);

/* ---- vector kernels (cpu_vec.c): AVX2/F16C/FMA (AVX-512F for the attention tiles) when the
 * CPU has them, else scalar. --------------------------------------------------------------- */

/* Picks the kernels for this CPU; safe to call more than once. */
void cpu_vec_init(void);
/* Space-separated ISA features the kernels use ("avx2 fma f16c"), for device_info. */
const char *cpu_vec_features(void);
/* Whether the AVX2/FMA/F16C kernels were selected (other files' kernels follow it). */
bool cpu_vec_avx2(void);

/* dst[i] = (float)src[i] for a contiguous run of a float dtype. */
void cpu_vec_to_f32(int32_t dtype, const void *src, float *dst, int64_t n);
/* dst[i] = round(src[i]) to a float dtype (round to nearest even). */
void cpu_vec_from_f32(int32_t dtype, const float *src, void *dst, int64_t n);
/* x[i] = round_to(dtype, x[i]) in place. */
void cpu_vec_round(int32_t dtype, float *x, int64_t n);
/* sum a[i] * b[i] with b in a float dtype. */
float cpu_vec_dot(int32_t dtype, const float *a, const void *b, int64_t n);
/* y[i] += alpha * x[i] with x in a float dtype. */
void cpu_vec_axpy(int32_t dtype, float alpha, const void *x, float *y, int64_t n);
/* Attention tiles over key/value rows gathered through a block table (k[j], v[j]: row j, D
 * contiguous elements in a float dtype), for nq queries that share them (the query heads of a
 * KV head). Each row is loaded and widened once per group of up to 4 queries.
 *   qk: s[i*lds + j] = sum_d q[i*D + d] * k[j][d]                       i < nq, j < nk
 *   pv: acc[i*D + d] = acc[i*D + d] * corr[i] + sum_j w[i*ldw + j] * v[j][d]    (q, w, acc F32)
 * pf is NULL or nk more row pointers (NULL entries skipped), of a later tile, that are
 * prefetched into L2 a few at a time while the tile runs. */
void cpu_vec_qk_tile(int32_t dtype, const float *q, int64_t nq, int64_t D, const void *const *k,
                     int64_t nk, float *s, int64_t lds, const void *const *pf);
void cpu_vec_pv_tile(int32_t dtype, const float *w, int64_t ldw, int64_t nq, const void *const *v,
                     int64_t nk, int64_t D, const float *corr, float *acc, const void *const *pf);
/* max(x[0..n)), ignoring NaN; -inf when n == 0. */
float cpu_vec_max(const float *x, int64_t n);
/* x[i] = exp(x[i] - m) (0 for x[i] == -inf); returns the sum. */
float cpu_vec_exp_sum(float *x, int64_t n, float m);
/* g[i] = act(g[i]) * u[i] for a kiln_hal_act_t. */
void cpu_vec_act_mul(int32_t act, float *g, const float *u, int64_t n);
/* x[i] = act(x[i]) for a kiln_hal_act_t. */
void cpu_vec_act(int32_t act, float *x, int64_t n);

/* Small-M GEMM micro-kernels over a column range [n0, n1): out[m*ldo + n] = sum_k
 * a[m*K + k] * B(k, n) for m < M, with B in a half dtype (F16/BF16) or F32 and
 *   colb: B(k, n) = b[n*ldb + k]   (K contiguous, a PyTorch Linear weight)
 *   rowb: B(k, n) = b[k*ldb + n]   (N contiguous) */
void cpu_vec_gemm_colb(int32_t dtype, int64_t M, int64_t K, const float *a, const void *b,
                       int64_t ldb, int64_t n0, int64_t n1, float *out, int64_t ldo);
void cpu_vec_gemm_rowb(int32_t dtype, int64_t M, int64_t K, const float *a, const void *b,
                       int64_t ldb, int64_t n0, int64_t n1, float *out, int64_t ldo);

#endif /* KILN_CPU_INTERNAL_H */
