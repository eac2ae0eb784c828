/* cuda_qdeq.cuh - the exact dequantization of gemm_quant's formats in registers (cuda_qgemv.cu
 * says what and why). KILN_QDEQ_EMU: a host build (tools/dev/qdeq_emu.sh, not part of the
 * build) that supplies the few CUDA primitives used here and checks qdeq8 / qdeq1_group
 * against kiln/hal_quant.h on random blocks at every alignment, without a GPU. */
#ifndef KILN_CUDA_QDEQ_CUH
#define KILN_CUDA_QDEQ_CUH

#include <stddef.h>
#include <stdint.h>

#include "kiln/hal.h"

#if !defined(KILN_QDEQ_EMU)
#include "cuda_common.cuh"
#endif

/* ---- loads of a few bytes at a known alignment (little endian words) --------------------- */

static __device__ __forceinline__ uint32_t qb(const uint8_t *p) { return (uint32_t)__ldg(p); }

template <int ALN>
static __device__ __forceinline__ uint32_t ld2(const uint8_t *p) {
  if constexpr (ALN >= 2) {
    return (uint32_t)__ldg(reinterpret_cast<const unsigned short *>(p));
  } else {
    return qb(p) | qb(p + 1) << 8;
  }
}

template <int ALN>
static __device__ __forceinline__ uint32_t ld4(const uint8_t *p) {
  if constexpr (ALN >= 4) {
    return __ldg(reinterpret_cast<const unsigned int *>(p));
  } else {
    return ld2<ALN>(p) | ld2<ALN>(p + 2) << 16;
  }
}

template <int ALN>
static __device__ __forceinline__ void ld8(const uint8_t *p, uint32_t v[2]) {
  if constexpr (ALN >= 8) {
    const uint2 u = __ldg(reinterpret_cast<const uint2 *>(p));
    v[0] = u.x;
    v[1] = u.y;
  } else {
    v[0] = ld4<ALN>(p);
    v[1] = ld4<ALN>(p + 4);
  }
}

/* Byte e (0..7) of an 8-byte pair of words. */
static __device__ __forceinline__ int byte8(const uint32_t v[2], int e) {
  return (int)((v[e >> 2] >> (8 * (e & 3))) & 0xffu);
}

static __device__ __forceinline__ float qf16(uint32_t bits) {
  return __half2float(__ushort_as_half((unsigned short)(bits & 0xffffu)));
}

/* min(a, b) for alignments at compile time. */
template <int A, int B>
struct qmin {
  static constexpr int v = A < B ? A : B;
};

/* What a kernel needs of W besides its format (a template argument). */
typedef struct qgemm_w {
  const uint8_t *w;               /* row 0 */
  int64_t rs;                     /* row stride, bytes */
  const unsigned short *scales;   /* group formats: f16 [N, G], row stride lds */
  int64_t lds;
  const uint8_t *zeros;           /* U8 [N, G], row stride ldz, or NULL (symmetric) */
  int64_t ldz;
  const int32_t *g_idx;           /* [K] or NULL */
  int32_t group_size, G;
  const float *fscales;           /* FP8_E4M3: f32 [N, G], row stride lds (scales unused) */
  int32_t gshift;                 /* FP8_E4M3: k >> gshift is k / group_size, or -1 (divide) */
  const float *xsc;               /* FP8 x_quant: row m's scale s_m (x holds code values) */
} qgemm_w_t;

/* ---- FP8 E4M3FN ------------------------------------------------------------------------- */

template <int ALN>
static __device__ __forceinline__ void ld16(const uint8_t *p, uint32_t v[4]) {
  if constexpr (ALN >= 16) {
    const uint4 u = __ldg(reinterpret_cast<const uint4 *>(p));
    v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
  } else {
    ld8<ALN>(p, v);
    ld8<ALN>(p + 8, v + 2);
  }
}

/* The group of column k of an FP8 row. */
static __device__ __forceinline__ int fp8_group(const qgemm_w_t &q, int k) {
  return q.gshift >= 0 ? k >> q.gshift : k / q.group_size;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
/* The four codes of c (little endian) as two f16x2 (codes 0, 1 and 2, 3), exactly: sm_89+
 * converts e4m3 pairs in hardware, NaN codes to NaN. */
static __device__ __forceinline__ void fp8x4_f16x2(uint32_t c, uint32_t &h01, uint32_t &h23) {
  asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, lo;\n\t"
      "cvt.rn.f16x2.e4m3x2 %1, hi;\n\t}"
      : "=r"(h01), "=r"(h23)
      : "r"(c));
}

/* w[e] = e4m3(byte e of c) * s, one f32 rounding each (f16 holds every e4m3 value). */
template <int NW>
static __device__ __forceinline__ void fp8_deq(const uint32_t *c, float s, float *w) {
#pragma unroll
  for (int i = 0; i < NW / 4; i++) {
    uint32_t a, b;
    fp8x4_f16x2(c[i], a, b);
    w[4 * i] = qf16(a) * s;
    w[4 * i + 1] = qf16(a >> 16) * s;
    w[4 * i + 2] = qf16(b) * s;
    w[4 * i + 3] = qf16(b >> 16) * s;
  }
}
#else
/* Nonzero when a byte of c is a NaN code (its low 7 bits all set). */
static __device__ __forceinline__ uint32_t fp8_nan4(uint32_t c) {
  return ((c & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
}

/* w[e] = e4m3(byte e of c) * s, one f32 rounding each. The bits sign << 15 | (q & 0x7F) << 7
 * are an f16 worth exactly e4m3(q) / 256 for every non-NaN q (exponent field e: 2^(e - 15)
 * (1 + m/8); e = 0: the f16 subnormal (m/8) 2^-14), so f32(f16) * (s * 256) is the real
 * e4m3(q) * s, rounded once, whenever s * 256 is finite; NaN codes and such s take the
 * exact decode. Three integer ops per pair of codes, an exact widening and a product. */
template <int NW>
static __device__ __forceinline__ void fp8_deq(const uint32_t *c, float s, float *w) {
  const float s256 = s * 256.0f;
  uint32_t bad = 0;
#pragma unroll
  for (int i = 0; i < NW / 4; i++) bad |= fp8_nan4(c[i]);
  if (bad == 0 && fabsf(s256) < INFINITY) {
#pragma unroll
    for (int i = 0; i < NW / 4; i++) {
      const uint32_t ev = ((c[i] << 7) & 0x3F803F80u) | ((c[i] << 8) & 0x80008000u); /* 0, 2 */
      const uint32_t od = ((c[i] >> 1) & 0x3F803F80u) | (c[i] & 0x80008000u);        /* 1, 3 */
      w[4 * i] = qf16(ev) * s256;
      w[4 * i + 1] = qf16(od) * s256;
      w[4 * i + 2] = qf16(ev >> 16) * s256;
      w[4 * i + 3] = qf16(od >> 16) * s256;
    }
  } else {
#pragma unroll
    for (int e = 0; e < NW; e++) w[e] = fp8_e4m3((c[e / 4] >> (8 * (e % 4))) & 0xffu) * s;
  }
}
#endif

/* w[e] = W[n, k + e] for e < NW of an FP8 row: row's codes c[NW / 4] already loaded, its
 * scales srow, k % NW == 0, k + NW <= K. One group for all NW (the common case: group_size a
 * multiple of NW, or G == 1): one scale; else a scale per weight. */
template <int NW>
static __device__ __forceinline__ void fp8_deq_piece(const qgemm_w_t &q, const float *srow,
                                                     int k, const uint32_t *c, float *w) {
  const int g = fp8_group(q, k);
  if (q.G == 1 || fp8_group(q, k + NW - 1) == g) {
    fp8_deq<NW>(c, __ldg(srow + g), w);
  } else {
#pragma unroll
    for (int e = 0; e < NW; e++)
      w[e] = fp8_e4m3((c[e / 4] >> (8 * (e % 4))) & 0xffu) * __ldg(srow + fp8_group(q, k + e));
  }
}

/* One weight (n, k) of a group format, with any k (the tails of K % 8 != 0). */
template <int FMT>
static __device__ __forceinline__ float qdeq1_group(const qgemm_w_t &q, int64_t n, int k) {
  const uint8_t *row = q.w + n * q.rs;
  if constexpr (FMT == KILN_HAL_QFMT_FP8_E4M3) /* group < G: hal_check ties G to K */
    return fp8_e4m3(qb(row + k)) * __ldg(q.fscales + n * q.lds + fp8_group(q, k));
  const int code = FMT == KILN_HAL_QFMT_INT4_G ? (int)((qb(row + k / 2) >> (4 * (k & 1))) & 15)
                                              : (int)qb(row + k);
  const int g = q.g_idx ? __ldg(q.g_idx + k) : k / q.group_size;
  if (g < 0 || g >= q.G) return __int_as_float(0x7fc00000); /* NaN: see the file comment */
  const int z = q.zeros ? (int)qb(q.zeros + n * q.ldz + g)
                        : (FMT == KILN_HAL_QFMT_INT4_G ? 8 : 128);
  return (float)(code - z) * qf16(__ldg(q.scales + n * q.lds + g));
}

/* w[e] = W[n, k + e] for e < 8; k % 8 == 0 and k + 8 <= K. */
template <int FMT, int ALN>
static __device__ __forceinline__ void qdeq8(const qgemm_w_t &q, int64_t n, int k, float w[8]) {
  const uint8_t *row = q.w + n * q.rs;
  if constexpr (FMT == KILN_HAL_QFMT_Q4_0) {
    constexpr int A = qmin<ALN, 2>::v;
    const uint8_t *blk = row + (int64_t)(k / 32) * 18;
    const int j = k % 32; /* 0, 8: low nibbles of qs[j..]; 16, 24: high nibbles of qs[j-16..] */
    const float d = qf16(ld2<A>(blk));
    uint32_t v[2];
    ld8<A>(blk + 2 + (j & 15), v);
    const int sh = j >= 16 ? 4 : 0;
#pragma unroll
    for (int e = 0; e < 8; e++) w[e] = (float)(((byte8(v, e) >> sh) & 15) - 8) * d;
  } else if constexpr (FMT == KILN_HAL_QFMT_Q8_0) {
    constexpr int A = qmin<ALN, 2>::v;
    const uint8_t *blk = row + (int64_t)(k / 32) * 34;
    const float d = qf16(ld2<A>(blk));
    uint32_t v[2];
    ld8<A>(blk + 2 + k % 32, v);
#pragma unroll
    for (int e = 0; e < 8; e++) w[e] = (float)(int8_t)byte8(v, e) * d;
  } else if constexpr (FMT == KILN_HAL_QFMT_Q4_K || FMT == KILN_HAL_QFMT_Q5_K) {
    constexpr bool five = FMT == KILN_HAL_QFMT_Q5_K;
    constexpr int A = qmin<ALN, 8>::v;
    const uint8_t *blk = row + (int64_t)(k / 256) * (five ? 176 : 144);
    const int i = k % 256, s = i / 32, l0 = i % 32;
    const uint32_t dd = ld4<qmin<A, 4>::v>(blk);
    const float d = qf16(dd), dmin = qf16(dd >> 16);
    /* scales[0..11] at bytes 4..15: sc[0..3] (4..7) and the rest (8..15) */
    const uint32_t s03 = ld4<qmin<A, 4>::v>(blk + 4);
    uint32_t s4b[2];
    ld8<A>(blk + 8, s4b);
    const uint32_t sb[3] = {s03, s4b[0], s4b[1]};
#define QSC(idx) ((int)((sb[(idx) >> 2] >> (8 * ((idx) & 3))) & 0xffu))
    int sc, m;
    if (s < 4) {
      sc = QSC(s) & 63;
      m = QSC(s + 4) & 63;
    } else {
      sc = (QSC(s + 4) & 15) | (QSC(s - 4) >> 6) << 4;
      m = (QSC(s + 4) >> 4) | (QSC(s) >> 6) << 4;
    }
#undef QSC
    const float ds = d * (float)sc, ms = dmin * (float)m;
    uint32_t v[2];
    ld8<A>(blk + (five ? 48 : 16) + 32 * (s / 2) + l0, v);
    const int sh = (s & 1) * 4;
    uint32_t h[2] = {0, 0};
    if constexpr (five) ld8<A>(blk + 16 + l0, h);
#pragma unroll
    for (int e = 0; e < 8; e++) {
      int qv = (byte8(v, e) >> sh) & 15;
      if constexpr (five) qv |= ((byte8(h, e) >> s) & 1) << 4;
      w[e] = fmaf(ds, (float)qv, -ms); /* ds * qv is exact: one rounding, as hal_quant.h */
    }
  } else if constexpr (FMT == KILN_HAL_QFMT_Q6_K) {
    constexpr int A = qmin<ALN, 2>::v;
    const uint8_t *blk = row + (int64_t)(k / 256) * 210;
    const int i = k % 256, hf = i / 128, r = i % 128, jq = r / 32, l0 = r % 32;
    const float d = qf16(ld2<A>(blk + 208));
    const int sc = (int)(int8_t)qb(blk + 192 + i / 16);
    const float dsc = d * (float)sc;
    uint32_t lo[2], hi[2];
    ld8<A>(blk + 64 * hf + (jq & 1) * 32 + l0, lo);
    ld8<A>(blk + 128 + 32 * hf + l0, hi);
    const int shl = jq >= 2 ? 4 : 0, shh = 2 * jq;
#pragma unroll
    for (int e = 0; e < 8; e++) {
      const int qv = (((byte8(lo, e) >> shl) & 15) | ((byte8(hi, e) >> shh) & 3) << 4) - 32;
      w[e] = dsc * (float)qv;
    }
  } else if constexpr (FMT == KILN_HAL_QFMT_FP8_E4M3) {
    uint32_t c[2];
    ld8<qmin<ALN, 8>::v>(row + k, c);
    fp8_deq_piece<8>(q, q.fscales + n * q.lds, k, c, w);
  } else { /* INT4_G, INT8_G */
    constexpr int A = qmin<ALN, 8>::v;
    int code[8];
    if constexpr (FMT == KILN_HAL_QFMT_INT4_G) {
      const uint32_t c = ld4<qmin<A, 4>::v>(row + k / 2);
#pragma unroll
      for (int e = 0; e < 8; e++) code[e] = (int)((c >> (4 * e)) & 15);
    } else {
      uint32_t c[2];
      ld8<A>(row + k, c);
#pragma unroll
      for (int e = 0; e < 8; e++) code[e] = byte8(c, e);
    }
    constexpr int sym = FMT == KILN_HAL_QFMT_INT4_G ? 8 : 128;
    const unsigned short *srow = q.scales + n * q.lds;
    const uint8_t *zrow = q.zeros ? q.zeros + n * q.ldz : NULL;
    if (!q.g_idx && k / q.group_size == (k + 7) / q.group_size) { /* one group for the 8 */
      const int g = k / q.group_size; /* < G: hal_check ties G to ceil(K / group_size) */
      const int z = zrow ? (int)qb(zrow + g) : sym;
      const float s = qf16(__ldg(srow + g));
#pragma unroll
      for (int e = 0; e < 8; e++) w[e] = (float)(code[e] - z) * s;
    } else {
#pragma unroll
      for (int e = 0; e < 8; e++) {
        const int g = q.g_idx ? __ldg(q.g_idx + k + e) : (k + e) / q.group_size;
        if (g < 0 || g >= q.G) {
          w[e] = __int_as_float(0x7fc00000);
        } else {
          const int z = zrow ? (int)qb(zrow + g) : sym;
          w[e] = (float)(code[e] - z) * qf16(__ldg(srow + g));
        }
      }
    }
  }
}

#endif /* KILN_CUDA_QDEQ_CUH */
