/* quant_pack.c - the test-side quantizer of quant_pack.h. */
#include "quant_pack.h"

#include <math.h>
#include <string.h>

#include "kiln/hal_quant.h"

static int clampi(long v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : (int)v; }

/* Stores f as f16 at p and returns the f16 value as f32 (what a reader will see). */
static float put_f16(uint8_t *p, float f) {
  uint16_t h = kiln_hal_f32_to_f16(f);
  p[0] = (uint8_t)h;
  p[1] = (uint8_t)(h >> 8);
  return kiln_hal_f16_to_f32(h);
}

/* The 12 scale bytes of Q4_K/Q5_K from 8 6-bit scales and mins. */
static void pack_k_scales(const int32_t *sc, const int32_t *m, uint8_t *out) {
  for (int s = 0; s < 4; s++) {
    out[s] = (uint8_t)(sc[s] | (sc[s + 4] >> 4) << 6);
    out[s + 4] = (uint8_t)(m[s] | (m[s + 4] >> 4) << 6);
    out[s + 8] = (uint8_t)((sc[s + 4] & 15) | (m[s + 4] & 15) << 4);
  }
}

/* Q4_K (nmax 15) and Q5_K (nmax 31): w = (d * sc) * q - dmin * m per 32-weight sub-block. */
static void pack_k(const float *x, int nmax, uint8_t *out, quant_ints_t *qi) {
  float scale[8], mn[8], smax = 0, mmax = 0;
  for (int s = 0; s < 8; s++) {
    float lo = 0, hi = 0;
    for (int l = 0; l < 32; l++) {
      float v = x[32 * s + l];
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
    scale[s] = (hi - lo) / (float)nmax;
    mn[s] = -lo;
    if (scale[s] > smax) smax = scale[s];
    if (mn[s] > mmax) mmax = mn[s];
  }
  qi->d = put_f16(out, smax / 63.0f);
  qi->dmin = put_f16(out + 2, mmax / 63.0f);
  for (int s = 0; s < 8; s++) {
    qi->sc[s] = qi->d > 0 ? clampi(lrintf(scale[s] / qi->d), 0, 63) : 0;
    qi->m[s] = qi->dmin > 0 ? clampi(lrintf(mn[s] / qi->dmin), 0, 63) : 0;
    const float ds = qi->d * (float)qi->sc[s], ms = qi->dmin * (float)qi->m[s];
    for (int l = 0; l < 32; l++)
      qi->q[32 * s + l] = ds > 0 ? clampi(lrintf((x[32 * s + l] + ms) / ds), 0, nmax) : 0;
  }
  pack_k_scales(qi->sc, qi->m, out + 4);
  const int five = nmax == 31;
  uint8_t *qh = out + 16, *qs = out + (five ? 48 : 16);
  if (five) memset(qh, 0, 32);
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) {
      int lo = qi->q[64 * c + l], hi = qi->q[64 * c + 32 + l];
      qs[32 * c + l] = (uint8_t)((lo & 15) | (hi & 15) << 4);
      if (five) qh[l] |= (uint8_t)((lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1));
    }
}

static void pack_q6_k(const float *x, uint8_t *out, quant_ints_t *qi) {
  float scale[16], smax = 0;
  for (int s = 0; s < 16; s++) {
    float amax = 0;
    for (int l = 0; l < 16; l++) amax = fmaxf(amax, fabsf(x[16 * s + l]));
    scale[s] = amax / 31.0f;
    smax = fmaxf(smax, scale[s]);
  }
  qi->d = put_f16(out + 208, smax / 127.0f);
  int8_t *scales = (int8_t *)(out + 192);
  for (int s = 0; s < 16; s++) {
    qi->sc[s] = qi->d > 0 ? clampi(lrintf(scale[s] / qi->d), -128, 127) : 0;
    scales[s] = (int8_t)qi->sc[s];
    const float ds = qi->d * (float)qi->sc[s];
    for (int l = 0; l < 16; l++)
      qi->q[16 * s + l] = ds != 0 ? clampi(lrintf(x[16 * s + l] / ds), -32, 31) : 0;
  }
  memset(out, 0, 192);
  for (int h = 0; h < 2; h++) {
    uint8_t *ql = out + 64 * h, *qh = out + 128 + 32 * h;
    const int32_t *q = qi->q + 128 * h;
    for (int l = 0; l < 32; l++) {
      int q1 = q[l] + 32, q2 = q[l + 32] + 32, q3 = q[l + 64] + 32, q4 = q[l + 96] + 32;
      ql[l] = (uint8_t)((q1 & 15) | (q3 & 15) << 4);
      ql[l + 32] = (uint8_t)((q2 & 15) | (q4 & 15) << 4);
      qh[l] = (uint8_t)((q1 >> 4) | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6);
    }
  }
}

void quant_pack_block(int32_t fmt, const float *x, uint8_t *out, quant_ints_t *ints) {
  quant_ints_t tmp;
  quant_ints_t *qi = ints ? ints : &tmp;
  memset(qi, 0, sizeof(*qi));
  switch (fmt) {
    case KILN_HAL_QFMT_Q4_0: {
      float amax = 0, max = 0;
      for (int j = 0; j < 32; j++)
        if (fabsf(x[j]) > amax) {
          amax = fabsf(x[j]);
          max = x[j];
        }
      qi->d = put_f16(out, max / -8.0f); /* the largest magnitude maps to q = 0 (-8) */
      for (int j = 0; j < 32; j++)
        qi->q[j] = qi->d != 0 ? clampi(lrintf(x[j] / qi->d) + 8, 0, 15) : 8;
      for (int j = 0; j < 16; j++) out[2 + j] = (uint8_t)(qi->q[j] | qi->q[j + 16] << 4);
      break;
    }
    case KILN_HAL_QFMT_Q8_0: {
      float amax = 0;
      for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
      qi->d = put_f16(out, amax / 127.0f);
      for (int j = 0; j < 32; j++) {
        qi->q[j] = qi->d > 0 ? clampi(lrintf(x[j] / qi->d), -127, 127) : 0;
        out[2 + j] = (uint8_t)(int8_t)qi->q[j];
      }
      break;
    }
    case KILN_HAL_QFMT_Q4_K: pack_k(x, 15, out, qi); break;
    case KILN_HAL_QFMT_Q5_K: pack_k(x, 31, out, qi); break;
    case KILN_HAL_QFMT_Q6_K: pack_q6_k(x, out, qi); break;
    default: break;
  }
}

void quant_pack_row(int32_t fmt, const float *x, int64_t n, uint8_t *out) {
  const int64_t be = kiln_hal_qfmt_block_elems(fmt), bb = kiln_hal_qfmt_block_bytes(fmt);
  for (int64_t b = 0; b < n / be; b++) quant_pack_block(fmt, x + b * be, out + b * bb, NULL);
}
