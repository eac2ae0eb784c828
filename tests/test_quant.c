/* test_quant.c - cmocka tests for kiln/hal_quant.h, the GGUF block types: hand-made blocks whose
 * values were worked out by hand (the 6-bit scale/min packing of Q4_K/Q5_K, Q6_K's split
 * 4 + 2 bits, Q4_0's nibble order), then tests/quant_pack.c's quantizer round-tripping random
 * rows of every type, checked exactly against the integers it chose. FP8 E4M3FN: hand values
 * of the decode, every code against the formula, the encoder's rounding (ties to even,
 * saturation, subnormals) and round trip. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kiln/hal_quant.h"
#include "quant_pack.h"

static const int32_t k_fmts[] = {KILN_HAL_QFMT_Q4_0, KILN_HAL_QFMT_Q8_0, KILN_HAL_QFMT_Q4_K,
                                 KILN_HAL_QFMT_Q5_K, KILN_HAL_QFMT_Q6_K};

static void test_geometry(void **state) {
  (void)state;
  static const int32_t elems[] = {32, 32, 256, 256, 256}, bytes[] = {18, 34, 144, 176, 210};
  static const char *const names[] = {"q4_0", "q8_0", "q4_K", "q5_K", "q6_K"};
  for (int i = 0; i < 5; i++) {
    assert_int_equal(kiln_hal_qfmt_block_elems(k_fmts[i]), elems[i]);
    assert_int_equal(kiln_hal_qfmt_block_bytes(k_fmts[i]), bytes[i]);
    assert_string_equal(kiln_hal_qfmt_name(k_fmts[i]), names[i]);
  }
  assert_int_equal(kiln_hal_qfmt_block_elems(KILN_HAL_QFMT_NONE), 0);
  assert_int_equal(kiln_hal_qfmt_block_bytes(99), 0);
  float out[256];
  uint8_t blk[256] = {0};
  assert_int_equal(kiln_hal_quant_dequant(99, blk, out), -1);
}

static void test_q4_0_hand(void **state) {
  (void)state;
  uint8_t b[18];
  b[0] = 0x00, b[1] = 0x38; /* d = 0.5 */
  memset(b + 2, 0x80, 16);  /* low nibble 0 -> -8, high 8 -> 0 */
  b[2] = 0x9f;              /* weight 0: 15 - 8 = 7; weight 16: 9 - 8 = 1 */
  float y[32];
  assert_int_equal(kiln_hal_quant_dequant(KILN_HAL_QFMT_Q4_0, b, y), 0);
  assert_true(y[0] == 3.5f && y[16] == 0.5f);
  for (int j = 1; j < 16; j++) assert_true(y[j] == -4.0f && y[j + 16] == 0.0f);
}

static void test_q8_0_hand(void **state) {
  (void)state;
  uint8_t b[34] = {0x00, 0xc0}; /* d = -2 */
  b[2] = 0x80;                  /* -128 */
  b[3] = 0x7f;                  /* 127 */
  b[33] = 0x01;
  float y[32];
  assert_int_equal(kiln_hal_quant_dequant(KILN_HAL_QFMT_Q8_0, b, y), 0);
  assert_true(y[0] == 256.0f && y[1] == -254.0f && y[31] == -2.0f && y[2] == 0.0f);
}

/* Sub-block scales {1, 2, 3, 4, 33, 47, 50, 63} and mins {5, 6, 7, 8, 17, 34, 51, 62}, packed by
 * hand: bytes 0..3 = sc[s] | (sc[s + 4] >> 4) << 6, bytes 4..7 = m[s] | (m[s + 4] >> 4) << 6,
 * bytes 8..11 = (sc[s + 4] & 15) | (m[s + 4] & 15) << 4. E.g. byte 0 = 1 | (33 >> 4 = 2) << 6
 * = 0x81, byte 11 = (63 & 15 = 15) | (62 & 15 = 14) << 4 = 0xef. */
static const uint8_t k_scales[12] = {0x81, 0x82, 0xc3, 0xc4, 0x45, 0x86,
                                     0xc7, 0xc8, 0x11, 0x2f, 0x32, 0xef};
static const int k_sc[8] = {1, 2, 3, 4, 33, 47, 50, 63}, k_m[8] = {5, 6, 7, 8, 17, 34, 51, 62};

static void test_k_scale_min_hand(void **state) {
  (void)state;
  for (int s = 0; s < 8; s++) {
    int sc, m;
    kiln_hal_quant_k_scale_min(k_scales, s, &sc, &m);
    assert_int_equal(sc, k_sc[s]);
    assert_int_equal(m, k_m[s]);
  }
}

/* Q4_K with d = 1, dmin = 0.5, and in chunk c byte l = (l & 15) | (15 - (l & 15)) << 4: weight
 * 64c + l is sc[2c] * (l & 15) - m[2c] / 2; weight 64c + 32 + l is
 * sc[2c + 1] * (15 - (l & 15)) - m[2c + 1] / 2. Q5_K adds qh[l] = 0xa5 ^ l: bit s of qh[l] is
 * the fifth bit of sub-block s. */
static void check_k_hand(int five) {
  uint8_t b[176] = {0x00, 0x3c, 0x00, 0x38}; /* d = 1, dmin = 0.5 */
  memcpy(b + 4, k_scales, 12);
  uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
  for (int l = 0; l < 32; l++) {
    if (five) qh[l] = (uint8_t)(0xa5 ^ l);
    for (int c = 0; c < 4; c++) qs[32 * c + l] = (uint8_t)((l & 15) | (15 - (l & 15)) << 4);
  }
  float y[256];
  assert_int_equal(kiln_hal_quant_dequant(five ? KILN_HAL_QFMT_Q5_K : KILN_HAL_QFMT_Q4_K, b, y), 0);
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) {
      int s0 = 2 * c, s1 = 2 * c + 1;
      int q0 = l & 15, q1 = 15 - (l & 15);
      if (five) {
        q0 += 16 * (((0xa5 ^ l) >> s0) & 1);
        q1 += 16 * (((0xa5 ^ l) >> s1) & 1);
      }
      assert_true(y[64 * c + l] == (float)(k_sc[s0] * q0) - 0.5f * (float)k_m[s0]);
      assert_true(y[64 * c + 32 + l] == (float)(k_sc[s1] * q1) - 0.5f * (float)k_m[s1]);
    }
  /* Spot values: weight 0 = 1 * 0 - 2.5; weight 255 (sub-block 7, l = 31: q = 0) = -31, and
   * for Q5_K its fifth bit is bit 7 of 0xa5 ^ 31 = 0xba: set, so 63 * 16 - 31 = 977. */
  assert_true(y[0] == (five ? 16.0f * 1 * ((0xa5 >> 0) & 1) - 2.5f : -2.5f));
  assert_true(y[255] == (five ? 977.0f : -31.0f));
}

static void test_q4_k_hand(void **state) {
  (void)state;
  check_k_hand(0);
}

static void test_q5_k_hand(void **state) {
  (void)state;
  check_k_hand(1);
}

/* Q6_K, d = 0.25, values worked out by hand from ql = 0x21 / 0xf0, qh = 0xe4 (bits 11 10 01 00). */
static void test_q6_k_hand(void **state) {
  (void)state;
  uint8_t b[210] = {0};
  b[208] = 0x00, b[209] = 0x34; /* d = 0.25 */
  int8_t *sc = (int8_t *)(b + 192);
  for (int i = 0; i < 16; i++) sc[i] = (int8_t)(i - 8);
  sc[0] = -3, sc[2] = 5, sc[4] = 7, sc[6] = -128, sc[8] = 1, sc[12] = 2;
  b[0] = 0x21;        /* ql[0] */
  b[32] = 0xf0;       /* ql[32] */
  b[128] = 0xe4;      /* qh[0] */
  b[64] = 0x0f;       /* ql[64]: second half, l = 0 */
  b[128 + 32] = 0x03; /* qh[32] */
  float y[256];
  assert_int_equal(kiln_hal_quant_dequant(KILN_HAL_QFMT_Q6_K, b, y), 0);
  assert_true(y[0] == 23.25f);   /* low 1, high 0: q = -31; (0.25 * -3) * -31 */
  assert_true(y[32] == -20.0f);  /* low 0, high 1: q = -16; (0.25 * 5) * -16 */
  assert_true(y[64] == 3.5f);    /* low 2, high 2: q = 2; (0.25 * 7) * 2 */
  assert_true(y[96] == -992.0f); /* low 15, high 3: q = 31; (0.25 * -128) * 31 */
  assert_true(y[128] == 7.75f);  /* low 15, high 3: q = 31; 0.25 * 1 * 31 */
  assert_true(y[192] == -16.0f); /* low 0, high 0: q = -32; 0.25 * 2 * -32 */
  /* Everything else has all-zero bits: q = -32. */
  for (int i = 0; i < 256; i++) {
    if (i == 0 || i == 32 || i == 64 || i == 96 || i == 128 || i == 192) continue;
    assert_true(y[i] == (0.25f * (float)sc[i / 16]) * -32.0f);
  }
}

/* ---- the quantizer round trip ------------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in [-1, 1) */
  g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
  return (float)((double)(g_rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* The format's value of weight i from the integers quant_pack chose, written from the spec. */
static float value_of(int32_t fmt, const quant_ints_t *qi, int i) {
  switch (fmt) {
    case KILN_HAL_QFMT_Q4_0: return (float)(qi->q[i] - 8) * qi->d;
    case KILN_HAL_QFMT_Q8_0: return (float)qi->q[i] * qi->d;
    case KILN_HAL_QFMT_Q6_K: return (qi->d * (float)qi->sc[i / 16]) * (float)qi->q[i];
    default:
      return (qi->d * (float)qi->sc[i / 32]) * (float)qi->q[i] - qi->dmin * (float)qi->m[i / 32];
  }
}

static void test_round_trip(void **state) {
  (void)state;
  /* Step bound per type (amax 1 -> the spacing of the integers): the error of a weight is at
   * most about one spacing of its sub-block (half from rounding the weight, the rest from the
   * rounded sub-block scale). */
  static const float bound[] = {1.0f / 8, 1.0f / 127, 2.0f / 15, 2.0f / 31, 1.0f / 31};
  for (int f = 0; f < 5; f++) {
    const int32_t fmt = k_fmts[f];
    const int be = kiln_hal_qfmt_block_elems(fmt);
    for (int trial = 0; trial < 50; trial++) {
      float x[256], y[256];
      uint8_t blk[256];
      quant_ints_t qi;
      const float amp = trial == 0 ? 0.0f : trial < 25 ? 1.0f : (float)trial * 0.37f;
      for (int i = 0; i < be; i++) x[i] = amp * frand();
      if (trial == 1) x[3] = 1.0f; /* an exact extreme */
      quant_pack_block(fmt, x, blk, &qi);
      assert_int_equal(kiln_hal_quant_dequant(fmt, blk, y), 0);
      double err2 = 0, x2 = 0;
      for (int i = 0; i < be; i++) {
        assert_true(y[i] == value_of(fmt, &qi, i)); /* the bits decode to the chosen integers */
        assert_true(fabsf(y[i] - x[i]) <= 1.05f * bound[f] * (amp > 0 ? amp : 1) + 1e-6f);
        err2 += (double)(y[i] - x[i]) * (y[i] - x[i]);
        x2 += (double)x[i] * x[i];
      }
      if (amp > 0) assert_true(sqrt(err2 / x2) < (f == 1 ? 0.02 : 0.15));
    }
  }
}

/* quant_pack_row is block after block. */
static void test_pack_row(void **state) {
  (void)state;
  float x[512];
  for (int i = 0; i < 512; i++) x[i] = frand();
  for (int f = 0; f < 5; f++) {
    const int be = kiln_hal_qfmt_block_elems(k_fmts[f]), bb = kiln_hal_qfmt_block_bytes(k_fmts[f]);
    uint8_t row[2 * 210], blk[210];
    quant_pack_row(k_fmts[f], x, 2 * be, row);
    quant_pack_block(k_fmts[f], x + be, blk, NULL);
    assert_memory_equal(row + bb, blk, (size_t)bb);
  }
}

/* ---- FP8 E4M3FN -------------------------------------------------------------------------- */

static void test_fp8_hand(void **state) {
  (void)state;
  assert_true(kiln_hal_fp8_e4m3_to_f32(0x7E) == 448.0f);
  assert_true(kiln_hal_fp8_e4m3_to_f32(0xFE) == -448.0f);
  assert_true(kiln_hal_fp8_e4m3_to_f32(0x01) == 0x1p-9f);
  assert_true(kiln_hal_fp8_e4m3_to_f32(0x07) == 7 * 0x1p-9f);
  assert_true(kiln_hal_fp8_e4m3_to_f32(0x08) == 0x1p-6f);
  assert_true(kiln_hal_fp8_e4m3_to_f32(0x38) == 1.0f);
  assert_true(kiln_hal_fp8_e4m3_to_f32(0xB8) == -1.0f);
  assert_true(kiln_hal_fp8_e4m3_to_f32(0x4B) == 5.5f); /* e = 9, m = 3: 4 * 1.375 */
  assert_true(kiln_hal_fp8_e4m3_to_f32(0x00) == 0.0f);
  assert_true(signbit(kiln_hal_fp8_e4m3_to_f32(0x80)));
  assert_true(isnan(kiln_hal_fp8_e4m3_to_f32(0x7F)));
  assert_true(isnan(kiln_hal_fp8_e4m3_to_f32(0xFF)));
  assert_true(kiln_hal_fp8_e4m3_is_nan(0x7F) && kiln_hal_fp8_e4m3_is_nan(0xFF));
  assert_false(kiln_hal_fp8_e4m3_is_nan(0x7E));
  /* Every code against the definition, and back. */
  for (int q = 0; q < 256; q++) {
    if (kiln_hal_fp8_e4m3_is_nan((uint8_t)q)) continue;
    const int e = (q >> 3) & 15, m = q & 7;
    double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    if (q & 0x80) v = -v;
    assert_true((double)kiln_hal_fp8_e4m3_to_f32((uint8_t)q) == v);
    assert_int_equal(kiln_hal_f32_to_fp8_e4m3((float)v), q);
  }
}

static void test_fp8_encode(void **state) {
  (void)state;
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(1.0625f), 0x38); /* tie 1 | 1.125: even 1 */
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(1.1875f), 0x3A); /* tie 1.125 | 1.25: even 1.25 */
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(1.07f), 0x39);   /* above the tie */
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(-1.07f), 0xB9);
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(460.0f), 0x7E); /* rounds to 448 */
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(1e6f), 0x7E);   /* saturates */
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(-INFINITY), 0xFE);
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(NAN), 0x7F);
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(1.5f * 0x1p-9f), 0x02); /* tie 1 | 2: even 2 */
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(0.5f * 0x1p-9f), 0x00); /* tie 0 | 1: even 0 */
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(0.6f * 0x1p-9f), 0x01);
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(7.5f * 0x1p-9f), 0x08); /* tie 7 | 8: 2^-6 */
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(1e-30f), 0x00);
  assert_int_equal(kiln_hal_f32_to_fp8_e4m3(-1e-30f), 0x80);
  /* Random values: the nearest code (ties to even) found by search. */
  srand(17);
  for (int i = 0; i < 20000; i++) {
    const float x = (float)ldexp((double)rand() / RAND_MAX * 2 - 1, rand() % 24 - 14);
    const uint8_t q = kiln_hal_f32_to_fp8_e4m3(x);
    const double d = fabs((double)kiln_hal_fp8_e4m3_to_f32(q) - x);
    for (int c = 0; c < 256; c++) {
      if (kiln_hal_fp8_e4m3_is_nan((uint8_t)c)) continue;
      const double dc = fabs((double)kiln_hal_fp8_e4m3_to_f32((uint8_t)c) - x);
      if (fabs(x) <= 448.0f && dc < d) fail_msg("x = %a: code 0x%02x, 0x%02x is nearer", x, q, c);
      if (dc == d && c != q && (c & 0x7F) != (q & 0x7F) && (q & 1))
        fail_msg("x = %a: tie to odd code 0x%02x (0x%02x)", x, q, c);
    }
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_geometry),   cmocka_unit_test(test_q4_0_hand),
      cmocka_unit_test(test_q8_0_hand),  cmocka_unit_test(test_k_scale_min_hand),
      cmocka_unit_test(test_q4_k_hand),  cmocka_unit_test(test_q5_k_hand),
      cmocka_unit_test(test_q6_k_hand),  cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_pack_row),   cmocka_unit_test(test_fp8_hand),
      cmocka_unit_test(test_fp8_encode),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
