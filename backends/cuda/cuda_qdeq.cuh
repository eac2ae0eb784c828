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
} qgemm_w_t;

/* One weight (n, k) of a group format, with any k (the tails of K % 8 != 0). */
template <int FMT>
static __device__ __forceinline__ float qdeq1_group(const qgemm_w_t &q, int64_t n, int k) {
  const uint8_t *row = q.w + n * q.rs;
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
