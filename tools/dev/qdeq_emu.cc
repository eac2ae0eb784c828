// qdeq_emu.cc - a host build of backends/cuda/cuda_qdeq.cuh (KILN_QDEQ_EMU): checks the CUDA
// backend's in-register dequantization (qdeq8, qdeq1_group) bit for bit against kiln/hal_quant.h
// on random blocks, with rows at the formats' natural alignment (the wide loads, which this
// build asserts are aligned as a GPU needs) and at odd offsets (the byte loads). No GPU needed.
// Run through tools/dev/qdeq_emu.sh; not part of the build.
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln/hal_quant.h"

#define __device__
#define __forceinline__ inline
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct emu_half {
  unsigned short bits;
};
template <typename T>
static T __ldg(const T *p) {
  if ((uintptr_t)p % alignof(T) != 0) {
    fprintf(stderr, "qdeq_emu: misaligned %zu-byte load at %p\n", sizeof(T), (const void *)p);
    abort();
  }
  T v;
  memcpy(&v, p, sizeof(v));
  return v;
}
static emu_half __ushort_as_half(unsigned short b) { return emu_half{b}; }
static float __half2float(emu_half h) { return kiln_hal_f16_to_f32(h.bits); }
static float __int_as_float(int i) {
  float f;
  memcpy(&f, &i, 4);
  return f;
}

#define KILN_QDEQ_EMU
#include "../../backends/cuda/cuda_qdeq.cuh"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (uint32_t)(g_rng >> 11);
}

static int g_fail;

static bool same(float a, float b) {
  if (isnan(a) && isnan(b)) return true;
  uint32_t x, y;
  memcpy(&x, &a, 4);
  memcpy(&y, &b, 4);
  return x == y;
}

template <int FMT, int ALN>
static void check_block(int64_t off, int64_t pad) {
  const int E = kiln_hal_qfmt_block_elems(FMT), B = kiln_hal_qfmt_block_bytes(FMT);
  const int K = 4 * 256, N = 3;
  const int64_t rs = (int64_t)(K / E) * B + pad;
  uint8_t *mem = (uint8_t *)aligned_alloc(64, (size_t)((off + N * rs + 127) / 64 * 64));
  for (int64_t i = 0; i < off + N * rs + 64; i++) mem[i] = (uint8_t)rnd();
  qgemm_w_t q;
  memset(&q, 0, sizeof(q));
  q.w = mem + off;
  q.rs = rs;
  float want[256], got[8];
  for (int n = 0; n < N; n++)
    for (int b = 0; b < K / E; b++) {
      kiln_hal_quant_dequant(FMT, q.w + n * rs + (int64_t)b * B, want);
      for (int k = 0; k < E; k += 8) {
        qdeq8<FMT, ALN>(q, n, b * E + k, got);
        for (int e = 0; e < 8; e++)
          if (!same(got[e], want[k + e]) && g_fail++ < 10)
            fprintf(stderr, "%s ALN %d off %lld: row %d weight %d: got %.9g want %.9g\n",
                    kiln_hal_qfmt_name(FMT), ALN, (long long)off, n, b * E + k + e, got[e],
                    want[k + e]);
      }
    }
  free(mem);
}

template <int FMT, int ALN>
static void check_group(int64_t off, int64_t pad, int gs, bool zeros, bool gidx) {
  const int K = 384, N = 3;
  const int G = gidx ? 7 : (K + gs - 1) / gs;
  const int64_t rs = kiln_hal_qgroup_row_bytes(FMT, K) + pad;
  uint8_t *mem = (uint8_t *)aligned_alloc(64, (size_t)((off + N * rs + 127) / 64 * 64));
  for (int64_t i = 0; i < off + N * rs + 64; i++) mem[i] = (uint8_t)rnd();
  const int64_t lds = G + 1;
  uint16_t *sc = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(N * lds));
  uint8_t *zp = (uint8_t *)malloc((size_t)(N * lds));
  int32_t *gi = (int32_t *)malloc(sizeof(int32_t) * K);
  for (int64_t i = 0; i < N * lds; i++) {
    sc[i] = (uint16_t)rnd();
    zp[i] = (uint8_t)rnd();
  }
  for (int k = 0; k < K; k++) gi[k] = (int32_t)(rnd() % (uint32_t)G);
  if (gidx) gi[5] = G, gi[100] = -1; /* out of range: NaN, no read */
  qgemm_w_t q;
  memset(&q, 0, sizeof(q));
  q.w = mem + off;
  q.rs = rs;
  q.scales = sc;
  q.lds = lds;
  q.zeros = zeros ? zp : NULL;
  q.ldz = lds;
  q.g_idx = gidx ? gi : NULL;
  q.group_size = gs;
  q.G = G;
  float got[8], want;
  for (int n = 0; n < N; n++)
    for (int k = 0; k < K; k += 8) {
      qdeq8<FMT, ALN>(q, n, k, got);
      for (int e = 0; e < 8; e++) {
        const int kk = k + e;
        const int g = gidx ? gi[kk] : kk / gs;
        if (g < 0 || g >= G) {
          want = NAN;
        } else {
          kiln_hal_qgroup_dequant(FMT, q.w + n * rs, (const uint8_t *)(sc + n * lds),
                                  zeros ? zp + n * lds : NULL, gidx ? gi : NULL, gs, kk, 1, &want);
        }
        const float one = qdeq1_group<FMT>(q, n, kk);
        if ((!same(got[e], want) || !same(one, want)) && g_fail++ < 10)
          fprintf(stderr, "%s ALN %d gs %d zeros %d g_idx %d: row %d weight %d: got %.9g / %.9g "
                  "want %.9g\n", kiln_hal_qfmt_name(FMT), ALN, gs, zeros, gidx, n, kk, got[e],
                  one, want);
      }
    }
  free(mem);
  free(sc);
  free(zp);
  free(gi);
}

/* A random finite f32 scale: any sign, exponents over the whole range (subnormals and ones
 * past 2^120, where the fast decode's s * 256 overflows), now and then a power of two. */
static float rnd_scale() {
  uint32_t b = rnd();
  if ((b & 0x7F800000u) == 0x7F800000u) b ^= 0x00800000u; /* inf/NaN exponent: make it finite */
  if (rnd() % 4 == 0) b = (b & 0x807F0000u) | (0x3F000000u + ((rnd() % 8) << 23)); /* typical */
  float f;
  memcpy(&f, &b, 4);
  return f;
}

/* FP8_E4M3: every code (each row of the matrix holds all 256 in a random order, then random
 * codes), random scales, the 16-weight pieces (GEMV), the 8-weight ones (tiled) and single
 * weights (tails) against kiln_hal_fp8_dequant. */
template <int ALN>
static void check_fp8(int64_t off, int64_t pad, int K, int gs) {
  const int N = 3, G = (K + gs - 1) / gs;
  const int64_t rs = K + pad;
  uint8_t *mem = (uint8_t *)aligned_alloc(64, (size_t)((off + N * rs + 127) / 64 * 64));
  for (int64_t i = 0; i < off + N * rs + 64; i++) mem[i] = (uint8_t)rnd();
  for (int n = 0; n < N; n++) {
    uint8_t *row = mem + off + n * rs;
    for (int k = 0; k < K && k < 256; k++) row[k] = (uint8_t)k;
    for (int k = (K < 256 ? K : 256) - 1; k > 0; k--) { /* shuffle the first 256 */
      const int j = (int)(rnd() % (uint32_t)(k + 1));
      const uint8_t t = row[k];
      row[k] = row[j], row[j] = t;
    }
  }
  const int64_t lds = G + 2;
  float *sc = (float *)malloc(sizeof(float) * (size_t)(N * lds));
  for (int64_t i = 0; i < N * lds; i++) sc[i] = rnd_scale();
  qgemm_w_t q;
  memset(&q, 0, sizeof(q));
  q.w = mem + off;
  q.rs = rs;
  q.fscales = sc;
  q.lds = lds;
  q.group_size = gs;
  q.G = G;
  q.gshift = G == 1 ? 31 : -1;
  for (int sh = 0; sh < 31 && q.gshift < 0; sh++)
    if (gs == 1 << sh) q.gshift = sh;
  float want[16], got[16];
  for (int n = 0; n < N; n++) {
    const uint8_t *row = q.w + n * rs;
    const float *srow = sc + n * lds;
    for (int k = 0; k < K; k++) {
      kiln_hal_fp8_dequant(row, (const uint8_t *)srow, gs, k, 1, want);
      const float one = qdeq1_group<KILN_HAL_QFMT_FP8_E4M3>(q, n, k);
      if (!same(one, want[0]) && g_fail++ < 10)
        fprintf(stderr, "fp8 qdeq1 gs %d: row %d weight %d (code 0x%02x, s %a): got %a want %a\n",
                gs, n, k, row[k], (double)srow[k / gs], (double)one, (double)want[0]);
    }
    for (int k = 0; k + 8 <= K; k += 8) {
      kiln_hal_fp8_dequant(row, (const uint8_t *)srow, gs, k, 8, want);
      qdeq8<KILN_HAL_QFMT_FP8_E4M3, ALN < 8 ? ALN : 8>(q, n, k, got);
      for (int e = 0; e < 8; e++)
        if (!same(got[e], want[e]) && g_fail++ < 10)
          fprintf(stderr, "fp8 qdeq8 ALN %d gs %d: row %d weight %d (code 0x%02x): got %a want "
                  "%a\n", ALN, gs, n, k + e, row[k + e], (double)got[e], (double)want[e]);
    }
    for (int k = 0; k + 16 <= K; k += 16) { /* the GEMV's load, then its decode */
      kiln_hal_fp8_dequant(row, (const uint8_t *)srow, gs, k, 16, want);
      uint32_t c[4];
      ld16<ALN>(row + k, c);
      fp8_deq_piece<16>(q, srow, k, c, got);
      for (int e = 0; e < 16; e++)
        if (!same(got[e], want[e]) && g_fail++ < 10)
          fprintf(stderr, "fp8 piece16 ALN %d gs %d: row %d weight %d (code 0x%02x): got %a "
                  "want %a\n", ALN, gs, n, k + e, row[k + e], (double)got[e], (double)want[e]);
    }
  }
  free(mem);
  free(sc);
}

static void check_fp8s() {
  /* {K, group_size}: per channel (gs = K, also an odd K), blocks of 128 with a partial one,
   * and group sizes that split pieces */
  static const int cases[][2] = {{512, 512}, {3584, 3584}, {777, 777}, {1000, 128}, {512, 128},
                                 {384, 64},  {520, 20},    {384, 48},  {300, 7},    {256, 256},
                                 {40, 16},   {24, 1}};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const int K = cases[i][0], gs = cases[i][1];
    if (K % 16 == 0) check_fp8<16>(0, 0, K, gs);
    if (K % 16 == 0) check_fp8<16>(32, 16, K, gs);
    check_fp8<1>(3, 1, K, gs);
    check_fp8<1>(1, 5, K, gs);
  }
}

/* Every code times a few scales, one by one (also the NaN codes and -0). */
static void check_fp8_codes() {
  static const float scales[] = {1.0f, -1.0f, 0.01f, 0x1p-140f, 0x1p121f, -0x1p127f, 3e-39f};
  for (int c = 0; c < 256; c++)
    for (size_t i = 0; i < sizeof(scales) / sizeof(scales[0]); i++) {
      alignas(16) uint8_t al[16];
      memset(al, c, sizeof(al));
      float s = scales[i], want = kiln_hal_fp8_e4m3_to_f32((uint8_t)c) * s, got[16];
      uint32_t w[4];
      ld16<16>(al, w);
      qgemm_w_t q;
      memset(&q, 0, sizeof(q));
      q.group_size = 16;
      q.G = 1;
      q.gshift = 31;
      fp8_deq_piece<16>(q, &s, 0, w, got);
      for (int e = 0; e < 16; e++)
        if (!same(got[e], want) && g_fail++ < 10)
          fprintf(stderr, "fp8 code 0x%02x s %a: got %a want %a\n", c, (double)s,
                  (double)got[e], (double)want);
      if (!same(fp8_e4m3((uint32_t)c), kiln_hal_fp8_e4m3_to_f32((uint8_t)c)) && g_fail++ < 10)
        fprintf(stderr, "fp8 code 0x%02x: exact decode differs\n", c);
    }
}

template <int FMT, int NAT>
static void check_fmt() {
  check_block<FMT, NAT>(0, 0);
  check_block<FMT, NAT>(NAT * 3, NAT * 2);
  check_block<FMT, 1>(1, 3);
  check_block<FMT, 1>(7, 0);
}

template <int FMT>
static void check_groups() {
  const int gss[] = {32, 64, 128, 384, 48, 20};
  for (int gi = 0; gi < 6; gi++)
    for (int v = 0; v < 4; v++) {
      check_group<FMT, 8>(0, 0, gss[gi], v & 1, v & 2);
      check_group<FMT, 8>(16, 8, gss[gi], v & 1, v & 2);
      check_group<FMT, 1>(3, 1, gss[gi], v & 1, v & 2);
    }
}

int main() {
  for (int rep = 0; rep < 20; rep++) {
    check_fmt<KILN_HAL_QFMT_Q4_0, 2>();
    check_fmt<KILN_HAL_QFMT_Q8_0, 2>();
    check_fmt<KILN_HAL_QFMT_Q4_K, 8>();
    check_fmt<KILN_HAL_QFMT_Q5_K, 8>();
    check_fmt<KILN_HAL_QFMT_Q6_K, 2>();
    check_groups<KILN_HAL_QFMT_INT4_G>();
    check_groups<KILN_HAL_QFMT_INT8_G>();
    check_fp8s();
  }
  check_fp8_codes();
  printf("qdeq_emu: %s (%d mismatches)\n", g_fail ? "FAILED" : "ok", g_fail);
  return g_fail ? 1 : 0;
}
