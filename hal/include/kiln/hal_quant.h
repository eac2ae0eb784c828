/* hal_quant.h - header-only definitions of the quantized weight formats (the GGUF block types
 * Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, the group formats INT4_G / INT8_G that GPTQ and AWQ
 * checkpoints are repacked into, and FP8_E4M3 for FP8 checkpoints): geometry and exact
 * dequantization to f32, for hosts and backends alike. Everything is static inline (like
 * hal_util.h); installed with the SDK.
 *
 * The formats, as GGUF/ggml define them (little endian, f16 = IEEE binary16; a row of K
 * weights is K / elems consecutive blocks, K a multiple of the block's elems):
 *
 *   Q4_0  32 weights, 18 bytes: f16 d; u8 qs[16].
 *         w[j] = ((qs[j] & 15) - 8) * d,  w[j + 16] = ((qs[j] >> 4) - 8) * d      (j < 16)
 *   Q8_0  32 weights, 34 bytes: f16 d; i8 qs[32].      w[j] = qs[j] * d
 *   Q4_K  256 weights (8 sub-blocks of 32), 144 bytes: f16 d; f16 dmin; u8 scales[12];
 *         u8 qs[128]. Sub-block s has a 6-bit scale sc[s] and a 6-bit min m[s], packed:
 *           s < 4:  sc[s] = scales[s] & 63           m[s] = scales[s + 4] & 63
 *           s >= 4: sc[s] = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4
 *                   m[s]  = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4
 *         (bytes 0..7 hold sub-blocks 0..3's values in their low 6 bits and the top 2 bits of
 *         sub-blocks 4..7's; bytes 8..11 hold the low 4 bits of sub-blocks 4..7's, scale in
 *         the low nibble, min in the high one). The 4-bit quant q of weight 64c + l (c < 4,
 *         l < 32) is qs[32c + l] & 15 (sub-block 2c); of weight 64c + 32 + l it is
 *         qs[32c + l] >> 4 (sub-block 2c + 1). Then, in f32 and in this order:
 *           w = (d * sc[s]) * q - (dmin * m[s])
 *   Q5_K  256 weights, 176 bytes: f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128].
 *         As Q4_K, with a fifth bit: q of a weight with index 32s + l in sub-block s gets
 *         16 * ((qh[l] >> s) & 1) added (q in 0..31).
 *   Q6_K  256 weights (16 sub-blocks of 16), 210 bytes: u8 ql[128]; u8 qh[64]; i8 scales[16];
 *         f16 d. In half h (weights 128h .. 128h + 127; ql += 64h, qh += 32h) and for l < 32:
 *           weight 128h + l      low = ql[l] & 15        high = qh[l] & 3
 *           weight 128h + 32 + l low = ql[l + 32] & 15   high = (qh[l] >> 2) & 3
 *           weight 128h + 64 + l low = ql[l] >> 4        high = (qh[l] >> 4) & 3
 *           weight 128h + 96 + l low = ql[l + 32] >> 4   high = (qh[l] >> 6) & 3
 *         q = (low | high << 4) - 32 (in -32..31), and w = (d * scales[i / 16]) * q for the
 *         weight of index i in the block.
 * kiln_hal_quant_dequant() computes exactly these f32 values (every product of an f16 and a
 * small integer is exact in f32; the K-quants' two roundings are the ones written above).
 *
 * The group formats (KILN_HAL_QFMT_INT4_G, INT8_G; the layout is hal.h's kiln_hal_qweight_t)
 * have no blocks: W[n, k] = (float)(q - z) * s with q the code, z the zero point and s the f16
 * scale of (n, g(k)); kiln_hal_qgroup_dequant() computes it (exact in f32). The host builds
 * that layout from the Hugging Face checkpoints, whose tensors per Linear of in_features K,
 * out_features N, G groups are (all int32 little endian, bit 0 the lowest):
 *   GPTQ (AutoGPTQ / GPTQModel / optimum, bits b = 4 or 8, P = 32 / b values per word)
 *     qweight int32 [K / P, N]: code of (k, n) = (qweight[k / P][n] >> (b * (k % P))) & (2^b-1)
 *             (packed along K, lowest bits first).
 *     qzeros  int32 [G, N / P]: stored zero of (g, n) = (qzeros[g][n / P] >> (b * (n % P)))
 *             & (2^b - 1) (packed along N). checkpoint_format "gptq" (v1, the default) stores
 *             z - 1, so z = stored + 1 (a symmetric 4-bit checkpoint stores 7 = 0x77777777 per
 *             word for z = 8; a stored 15 means z = 16, which v1 cannot express otherwise);
 *             "gptq_v2" stores z itself.
 *     scales  f16 [G, N].   g_idx int32 [K]: g(k) (k / group_size unless desc_act).
 *   AWQ (AutoAWQ, version "gemm", 4 bits)
 *     qweight int32 [K, N / 8], packed along N in AWQ's interleaved order: the 8 nibbles of
 *             word (k, j), lowest first, hold columns 8j + 0, 2, 4, 6, 1, 3, 5, 7; so column
 *             8j + c is nibble kiln_hal_awq_nibble(c) = {0, 4, 1, 5, 2, 6, 3, 7}[c].
 *     qzeros  int32 [G, N / 8] in the same order; z is the stored value as is.
 *     scales  f16 [G, N]; g(k) = k / group_size (no g_idx).
 *
 * FP8_E4M3 (hal.h's layout: one OCP E4M3FN code per weight, [N, K]-major, F32 scales [N, G]):
 * W[n, k] = kiln_hal_fp8_e4m3_to_f32(q) * s(n, k / group_size), one f32 rounding;
 * kiln_hal_fp8_dequant() computes it. E4M3FN: bit 7 sign, bits 6..3 exponent e (bias 7), bits
 * 2..0 mantissa m; e > 0: 2^(e-7) (1 + m/8), e = 0: 2^-6 (m/8); 0x7F / 0xFF NaN, no
 * infinities; 0x7E = 448, 0x08 = 2^-6, 0x01 = 2^-9, 0x38 = 1, 0xB8 = -1. Example: code 0x4B
 * (e = 9, m = 3) is 2^2 * 1.375 = 5.5; with s = 0.01f, W = f32(5.5 * 0.01f). The host builds
 * the layout from Hugging Face FP8 checkpoints (all [out N, in K] row-major, codes F8_E4M3):
 *   compressed-tensors (llm-compressor "float-quantized"): weight_scale [1] / [] (per tensor:
 *     every row gets it) or [N, 1] (per channel): scales [N, 1], group_size = K.
 *   block FP8 (quant_method "fp8", weight_block_size [128, 128]; DeepSeek-V3, transformers'
 *     FineGrainedFP8): weight_scale_inv F32 [ceil(N / 128), ceil(K / 128)], multiplied in
 *     despite its name: row n takes block row n / 128, so scales [N, ceil(K / 128)],
 *     group_size 128.
 *   on-the-fly FP8 of a float checkpoint: s(n) = max_k |w[n, k]| / 448 (f32), q =
 *     kiln_hal_f32_to_fp8_e4m3(w / s) (round to nearest even, saturating).
 */
#ifndef KILN_HAL_QUANT_H
#define KILN_HAL_QUANT_H

#include <stdint.h>
#include <string.h>

#include "kiln/hal.h"
#include "kiln/hal_util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Weights per block of fmt (32 or 256); 0 for an unknown format. */
static inline int32_t kiln_hal_qfmt_block_elems(int32_t fmt) {
  switch (fmt) {
    case KILN_HAL_QFMT_Q4_0:
    case KILN_HAL_QFMT_Q8_0: return 32;
    case KILN_HAL_QFMT_Q4_K:
    case KILN_HAL_QFMT_Q5_K:
    case KILN_HAL_QFMT_Q6_K: return 256;
    default: return 0;
  }
}

/* Bytes per block of fmt; 0 for an unknown format. */
static inline int32_t kiln_hal_qfmt_block_bytes(int32_t fmt) {
  switch (fmt) {
    case KILN_HAL_QFMT_Q4_0: return 18;
    case KILN_HAL_QFMT_Q8_0: return 34;
    case KILN_HAL_QFMT_Q4_K: return 144;
    case KILN_HAL_QFMT_Q5_K: return 176;
    case KILN_HAL_QFMT_Q6_K: return 210;
    default: return 0;
  }
}

static inline const char *kiln_hal_qfmt_name(int32_t fmt) {
  switch (fmt) {
    case KILN_HAL_QFMT_Q4_0: return "q4_0";
    case KILN_HAL_QFMT_Q8_0: return "q8_0";
    case KILN_HAL_QFMT_Q4_K: return "q4_K";
    case KILN_HAL_QFMT_Q5_K: return "q5_K";
    case KILN_HAL_QFMT_Q6_K: return "q6_K";
    case KILN_HAL_QFMT_INT4_G: return "int4_g";
    case KILN_HAL_QFMT_INT8_G: return "int8_g";
    case KILN_HAL_QFMT_FP8_E4M3: return "fp8_e4m3";
    default: return "invalid";
  }
}

/* Whether fmt is a group format: codes [N, K]-major with separate scales (INT4_G, INT8_G,
 * FP8_E4M3). */
static inline int kiln_hal_qfmt_is_group(int32_t fmt) {
  return fmt == KILN_HAL_QFMT_INT4_G || fmt == KILN_HAL_QFMT_INT8_G ||
         fmt == KILN_HAL_QFMT_FP8_E4M3;
}

/* Bits per code of a group format (4 or 8); 0 for any other format. */
static inline int kiln_hal_qfmt_group_bits(int32_t fmt) {
  if (fmt == KILN_HAL_QFMT_INT4_G) return 4;
  return fmt == KILN_HAL_QFMT_INT8_G || fmt == KILN_HAL_QFMT_FP8_E4M3 ? 8 : 0;
}

/* The dtype of a group format's scales: KILN_HAL_F32 for FP8_E4M3, else KILN_HAL_F16. */
static inline int32_t kiln_hal_qgroup_scale_dtype(int32_t fmt) {
  return fmt == KILN_HAL_QFMT_FP8_E4M3 ? KILN_HAL_F32 : KILN_HAL_F16;
}

/* Bytes of a row of K codes of a group format. */
static inline int64_t kiln_hal_qgroup_row_bytes(int32_t fmt, int64_t K) {
  return fmt == KILN_HAL_QFMT_INT4_G ? (K + 1) / 2 : K;
}

/* The nibble (0..7, lowest first) of an AWQ word that holds column c (0..7) of its eight. */
static inline int kiln_hal_awq_nibble(int c) {
  static const int8_t pos[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  return pos[c & 7];
}

static inline float kiln_hal_quant_f16(const uint8_t *p) {
  return kiln_hal_f16_to_f32((uint16_t)(p[0] | p[1] << 8));
}

/* The 6-bit scale and min of sub-block s (0..7) of a Q4_K/Q5_K block's 12 scale bytes. */
static inline void kiln_hal_quant_k_scale_min(const uint8_t *scales, int s, int *out_sc,
                                              int *out_m) {
  if (s < 4) {
    *out_sc = scales[s] & 63;
    *out_m = scales[s + 4] & 63;
  } else {
    *out_sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4;
    *out_m = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4;
  }
}

/* Dequantizes one block of fmt at blk into out[0 .. block_elems). blk needs no alignment.
 * Returns 0, or -1 for an unknown format (out untouched). */
static inline int kiln_hal_quant_dequant(int32_t fmt, const uint8_t *blk, float *out) {
  switch (fmt) {
    case KILN_HAL_QFMT_Q4_0: {
      const float d = kiln_hal_quant_f16(blk);
      const uint8_t *qs = blk + 2;
      for (int j = 0; j < 16; j++) {
        out[j] = (float)((qs[j] & 15) - 8) * d;
        out[j + 16] = (float)((qs[j] >> 4) - 8) * d;
      }
      return 0;
    }
    case KILN_HAL_QFMT_Q8_0: {
      const float d = kiln_hal_quant_f16(blk);
      for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)blk[2 + j] * d;
      return 0;
    }
    case KILN_HAL_QFMT_Q4_K:
    case KILN_HAL_QFMT_Q5_K: {
      const int five = fmt == KILN_HAL_QFMT_Q5_K;
      const float d = kiln_hal_quant_f16(blk), dmin = kiln_hal_quant_f16(blk + 2);
      const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + (five ? 48 : 16);
      for (int s = 0; s < 8; s++) {
        int sc, m;
        kiln_hal_quant_k_scale_min(scales, s, &sc, &m);
        const float ds = d * (float)sc, ms = dmin * (float)m;
        const uint8_t *q = qs + 32 * (s / 2);
        const int shift = (s & 1) * 4;
        for (int l = 0; l < 32; l++) {
          int v = (q[l] >> shift) & 15;
          if (five) v |= ((qh[l] >> s) & 1) << 4;
          out[32 * s + l] = ds * (float)v - ms;
        }
      }
      return 0;
    }
    case KILN_HAL_QFMT_Q6_K: {
      const float d = kiln_hal_quant_f16(blk + 208);
      const int8_t *scales = (const int8_t *)(blk + 192);
      for (int h = 0; h < 2; h++) {
        const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        float *y = out + 128 * h;
        const int8_t *sc = scales + 8 * h;
        for (int l = 0; l < 32; l++) {
          const int q1 = ((ql[l] & 15) | (qh[l] & 3) << 4) - 32;
          const int q2 = ((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32;
          const int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
          const int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
          const int is = l / 16;
          y[l] = (d * (float)sc[is]) * (float)q1;
          y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
          y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
          y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
        }
      }
      return 0;
    }
    default: return -1;
  }
}

/* The value of an FP8 E4M3FN code (exact; NaN for 0x7F / 0xFF). */
static inline float kiln_hal_fp8_e4m3_to_f32(uint8_t q) {
  const uint32_t e = (q >> 3) & 15, m = q & 7, sign = (uint32_t)(q >> 7) << 31;
  uint32_t bits;
  if (e == 15 && m == 7) {
    bits = sign | 0x7FC00000u;
  } else if (e) { /* 2^(e-7) (1 + m/8): f32 exponent field e - 7 + 127 */
    bits = sign | (e + 120) << 23 | m << 20;
  } else { /* m * 2^-9, exact */
    float v = (float)m * 0x1p-9f;
    memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float v;
  memcpy(&v, &bits, 4);
  return v;
}

/* Whether q is an E4M3FN NaN code (0x7F, 0xFF). */
static inline int kiln_hal_fp8_e4m3_is_nan(uint8_t q) { return (q & 0x7F) == 0x7F; }

/* x rounded to nearest even to E4M3FN, saturating: |x| >= 448 (and infinities) gives +-448
 * (0x7E / 0xFE), NaN gives 0x7F. */
static inline uint8_t kiln_hal_f32_to_fp8_e4m3(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return 0x7F;                    /* NaN */
  if (bits >= 0x43E00000u) return (uint8_t)(sign | 0x7E); /* >= 448 */
  if (bits < 0x3C800000u) { /* below 2^-6: subnormal codes m * 2^-9, m = rne(|x| * 2^9) */
    float a;
    memcpy(&a, &bits, 4);
    const float t = a * 512.0f; /* exact, < 8 */
    int m = (int)t;
    const float r = t - (float)m; /* exact */
    if (r > 0.5f || (r == 0.5f && (m & 1))) m++;
    return (uint8_t)(sign | m); /* m == 8 is 0x08 = 2^-6 */
  }
  /* Normal: keep 3 of the 23 mantissa bits, rounding to nearest even. */
  const uint32_t r = bits + 0x7FFFFu + ((bits >> 20) & 1);
  uint32_t code = (((r >> 23) - 120) << 3) | ((r >> 20) & 7);
  if (code > 0x7E) code = 0x7E; /* not reached (|x| < 448 rounds to 448 at most): a guard */
  return (uint8_t)(sign | code);
}

/* hal.h's x_quant = KILN_HAL_XQUANT_FP8_TOKEN on one row of n f32 values (the definition):
 * a = max |x[i]|, s = a / 448 (1 when that is 0), codes[i] = kiln_hal_f32_to_fp8_e4m3(x[i] /
 * s); returns s. codes may be NULL (only s is wanted); vals, when not NULL, receives the codes'
 * values e4m3_to_f32(codes[i]) (exact in f32). */
static inline float kiln_hal_fp8_xquant_row(const float *x, int64_t n, uint8_t *codes,
                                            float *vals) {
  float a = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    const float v = x[i] < 0 ? -x[i] : x[i];
    if (v > a) a = v;
  }
  float s = a / 448.0f;
  if (s == 0.0f) s = 1.0f;
  for (int64_t i = 0; i < n; i++) {
    const uint8_t q = kiln_hal_f32_to_fp8_e4m3(x[i] / s);
    if (codes) codes[i] = q;
    if (vals) vals[i] = kiln_hal_fp8_e4m3_to_f32(q);
  }
  return s;
}

/* out[i] = W[n, k0 + i] for i < count, an FP8_E4M3 row: codes row, its G f32 scales srow
 * (unaligned is fine), group g = k / group_size. */
static inline void kiln_hal_fp8_dequant(const uint8_t *row, const uint8_t *srow, int32_t group_size,
                                        int64_t k0, int64_t count, float *out) {
  for (int64_t i = 0; i < count; i++) {
    const int64_t k = k0 + i;
    float s;
    memcpy(&s, srow + 4 * (k / group_size), 4);
    out[i] = kiln_hal_fp8_e4m3_to_f32(row[k]) * s;
  }
}

/* The code q of weight k of a row of a group format (hal.h's layout). */
static inline int kiln_hal_qgroup_code(int32_t fmt, const uint8_t *row, int64_t k) {
  return fmt == KILN_HAL_QFMT_INT4_G ? (row[k / 2] >> (4 * (k % 2))) & 15 : row[k];
}

/* out[i] = W[n, k0 + i] for i < count, from row n's codes (row), its scales (srow: G f16, or
 * G f32 for FP8_E4M3; unaligned is fine), its zeros (zrow: G bytes, or NULL for the
 * symmetric 8 / 128) and g_idx (K entries, or NULL: g = k / group_size). The caller has
 * checked every g(k) < G. */
static inline void kiln_hal_qgroup_dequant(int32_t fmt, const uint8_t *row, const uint8_t *srow,
                                           const uint8_t *zrow, const int32_t *g_idx,
                                           int32_t group_size, int64_t k0, int64_t count,
                                           float *out) {
  if (fmt == KILN_HAL_QFMT_FP8_E4M3) {
    kiln_hal_fp8_dequant(row, srow, group_size, k0, count, out);
    return;
  }
  const int sym = fmt == KILN_HAL_QFMT_INT4_G ? 8 : 128;
  for (int64_t i = 0; i < count; i++) {
    const int64_t k = k0 + i, g = g_idx ? (int64_t)g_idx[k] : k / group_size;
    const int z = zrow ? zrow[g] : sym;
    out[i] = (float)(kiln_hal_qgroup_code(fmt, row, k) - z) * kiln_hal_quant_f16(srow + 2 * g);
  }
}

#ifdef __cplusplus
}
#endif

#endif /* KILN_HAL_QUANT_H */
