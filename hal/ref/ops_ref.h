/* ops_ref.h - fp64 host references for the HAL ops, used by the conformance suite
 * (tests/test_ops.c) and `kiln selftest` (tools/cmd_selftest.c).
 *
 * Each function implements the semantics written in hal/include/kiln/hal.h literally, with
 * plain loops in double precision, on dense row-major host arrays of doubles that already hold
 * values representable in the op's dtype. Rounding to a storage dtype happens only where the
 * header defines a rounding point inside the op (rmsnorm, layernorm's residual sum); the final
 * rounding of an output is left to the caller's tolerance. Nothing here allocates except
 * ops_ref_topk and ops_ref_sample (scratch, freed before returning); no function can fail.
 */
#ifndef KILN_HAL_REF_OPS_REF_H
#define KILN_HAL_REF_OPS_REF_H

#include <stdbool.h>
#include <stdint.h>

/* v rounded to what dtype (kiln_hal_dtype_t) holds: F32, F16 or BF16 (round to nearest even).
 * Other dtypes return v unchanged. */
double ops_ref_round(int32_t dtype, double v);

/* c_out[M,N] = alpha * (a[M,K] @ b[K,N]) + beta * c_in + bias[N]. c_in is read only when
 * beta != 0 (it may be NULL otherwise); bias may be NULL. out_mag (may be NULL) receives, per
 * element, |alpha| * sum_k |a*b| + |beta * c_in| + |bias|: the scale of the rounding error an
 * f32 accumulation may make. */
void ops_ref_gemm(int64_t M, int64_t N, int64_t K, const double *a, const double *b,
                  const double *bias, double alpha, double beta, const double *c_in, double *c_out,
                  double *out_mag);

/* The weights of one block of quantized format fmt (kiln_hal_qfmt_t) at blk, written here from
 * the format's definition (kiln/hal_quant.h) independently of that header's code: integer
 * fields decoded with plain shifts, f16 scales with ldexp, products in double, rounded to f32
 * where the definition computes in f32. Returns the block's weight count (32 or 256), or 0 for
 * an unknown format. */
int ops_ref_dequant_block(int32_t fmt, const uint8_t *blk, double *out);

/* y_out[M,N] = x[M,K] @ W^T + bias[N] for a quantized W [N, K] whose row n is the blocks at
 * w + n * row_stride (bytes). bias may be NULL. out_mag as ops_ref_gemm's. */
void ops_ref_gemm_quant(int64_t M, int64_t N, int64_t K, const double *x, int32_t fmt,
                        const uint8_t *w, int64_t row_stride, const double *bias, double *y_out,
                        double *out_mag);

/* As ops_ref_gemm_quant for a group format (hal.h: KILN_HAL_QFMT_INT4_G = 16 or INT8_G = 17):
 * row n's codes at w + n * row_stride; scales f16 (little-endian bytes) at scales + 2 * (n *
 * lds + g); zeros (NULL: symmetric 8 / 128) at zeros[n * ldz + g]; g_idx (NULL: k /
 * group_size). Decoded here from hal.h's definition with plain arithmetic, in double: the f32
 * product (q - z) * s is exact, so no rounding is modelled. FP8_E4M3 (fmt 18): scales are f32
 * (native-endian bytes) at scales + 4 * (n * lds + g), zeros and g_idx unused, and W is the
 * e4m3 value times s rounded once to f32, as hal.h defines it. */
void ops_ref_gemm_qgroup(int64_t M, int64_t N, int64_t K, const double *x, int32_t fmt,
                         const uint8_t *w, int64_t row_stride, const uint8_t *scales, int64_t lds,
                         const uint8_t *zeros, int64_t ldz, const int32_t *g_idx,
                         int32_t group_size, const double *bias, double *y_out, double *out_mag);

/* hal.h's x_quant = FP8_TOKEN on x [M, K] (values as stored, exact in f32), from its
 * definition with plain arithmetic: per row a = max |x|, s = f32(a / 448) (1 when 0), each
 * f32(x / s) rounded to the nearest E4M3FN value (ties to the even code, saturating at +-448),
 * found by search over the codes. xq_out[M * K] gets the values, s_out[M] the scales. */
void ops_ref_fp8_xquant(int64_t M, int64_t K, const double *x, double *xq_out, double *s_out);

/* The FP8 KV cache (hal.h, ABI 1.7), from its definition: the code kv_write stores for the
 * value x (an f32 value) with scale s: f32(x / s) rounded to the nearest E4M3FN value (ties to
 * the even code, saturating at +-448, NaN to 0x7F), found by search over the codes; and the
 * value attention reads for a code: s * e4m3(code) (exact in double; NaN for a NaN code). */
uint8_t ops_ref_fp8_kv_code(double x, float scale);
double ops_ref_fp8_kv_value(uint8_t code, float scale);

/* out[T,H] = table[ids[t], :], or zeros for an id outside [0, V). */
void ops_ref_embedding(int64_t V, int64_t H, const double *table, int64_t T, const int32_t *ids,
                       double *out);

/* RMSNorm with the header's rounding points (dtype is the storage dtype):
 *   s = round(x + residual) (or x);  residual = s;
 *   out = round(round(s / sqrt(mean(s^2) + eps)) * (w + weight_offset)).
 * residual may be NULL (no residual); when present it is updated in place. */
void ops_ref_rmsnorm(int32_t dtype, int64_t T, int64_t H, const double *x, double *residual,
                     const double *weight, double eps, double weight_offset, double *out);

/* LayerNorm with the header's rounding points (dtype is the storage dtype):
 *   s = round(x + residual) (or x);  residual = s;
 *   out = (s - mean) / sqrt(var + eps) * w + bias   (biased variance; out left unrounded).
 * residual may be NULL (no residual); when present it is updated in place. bias may be NULL. */
void ops_ref_layernorm(int32_t dtype, int64_t T, int64_t H, const double *x, double *residual,
                       const double *weight, const double *bias, double eps, double *out);

/* The [P, R] cos/sin table for inverse frequencies theta^(-2i/R), i < R/2, computed in double
 * and stored as f32 (what the host uploads). */
void ops_ref_rope_table(int64_t P, int64_t R, double theta, float *cos_sin);

/* Rotary embedding in place on x[T, NH, D]; style is kiln_hal_rope_style_t; cos_sin is the
 * [P, R] table (as doubles). A position outside [0, P) leaves its row unchanged. */
void ops_ref_rope(int32_t style, int64_t T, int64_t NH, int64_t D, int64_t R,
                  const int32_t *positions, int64_t P, const double *cos_sin, double *x);

/* act(x) for kiln_hal_act_t act (NaN for an unknown one). */
double ops_ref_act(int32_t act, double x);

/* out[t, i] = act(x[t, i]) * x[t, I + i];  x: [T, 2I], out: [T, I]. */
/* out[i] = act(x[i]) for i < n. */
void ops_ref_activation(int32_t act, int64_t n, const double *x, double *out);

void ops_ref_act_mul(int32_t act, int64_t T, int64_t I, const double *x, double *out);

typedef struct ops_ref_attention_params {
  int64_t num_seqs, NH, NKV, D, BS, MB;
  double scale;
  bool causal;
  int32_t sliding_window; /* 0 = unlimited */
  double softcap;         /* 0 = off */
} ops_ref_attention_params_t;

/* Paged attention. q, out: [T, NH, D]; k_cache, v_cache: [NB, NKV, BS, D]; block_table:
 * [S, MB]; seq_lens: [S]; qsl: [S + 1]. Writes only rows [qsl[0], qsl[S]) of out. Returns the
 * number of cache elements read that were NaN (a reference bug or a test setup error: the
 * caller keeps unused cache slots NaN to catch kernels that read them). */
int64_t ops_ref_attention(const ops_ref_attention_params_t *p, const double *q,
                          const double *k_cache, const double *v_cache, const int32_t *block_table,
                          const int32_t *seq_lens, const int32_t *qsl, double *out);

/* logsumexp of row[0..V). */
double ops_ref_logsumexp(int64_t V, const double *row);

/* argmax (lowest index among equal maxima); out_logprob (may be NULL) = log_softmax[id]. */
int32_t ops_ref_argmax(int64_t V, const double *row, double *out_logprob);

/* The k largest entries, descending, ties by lower index first. */
void ops_ref_topk(int64_t V, const double *row, int64_t k, int32_t *out_ids, double *out_values);

/* Penalties for one row, in place on logits[0..V) in the order the header lists them:
 * repetition (when has_rep), then frequency/presence (when has_freq), then bias (when
 * nbias > 0). Ids outside [0, V) are ignored everywhere. */
void ops_ref_penalize_row(int64_t V, double *logits, const int32_t *prompt, int64_t nprompt,
                          const int32_t *output, int64_t noutput, bool has_rep, double rep,
                          bool has_freq, double freq, double pres, const int32_t *bias_ids,
                          const double *bias_values, int64_t nbias);

/* The header's sampling rule for one row. *out_margin (may be NULL) receives the smallest
 * distance, relative to the quantities compared, between any decision the rule makes (top_p
 * cut, min_p cut, the uniform draw against a CDF boundary) and its threshold: a caller that
 * compares against an f32 implementation re-draws parameters when it is tiny. */
int32_t ops_ref_sample(int64_t V, const double *logits, double temperature, int32_t top_k,
                       double top_p, double min_p, double uniform, double *out_margin);

#endif /* KILN_HAL_REF_OPS_REF_H */
