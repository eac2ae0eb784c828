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
  }
  printf("qdeq_emu: %s (%d mismatches)\n", g_fail ? "FAILED" : "ok", g_fail);
  return g_fail ? 1 : 0;
}
