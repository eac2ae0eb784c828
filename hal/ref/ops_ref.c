/* ops_ref.c - fp64 host references for the HAL ops: obviously-correct loops, no tricks (the
 * attention reference shares a big problem's rows out over threads, each row as written). */
#define _POSIX_C_SOURCE 200809L /* sysconf, pthreads */
#include "hal/ref/ops_ref.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kiln/hal_util.h"

/* Rounds v to `bits` significant bits, round to nearest even, with quantum at least 2^min_exp
 * (the subnormal spacing); results above max_finite become infinities. Rounding straight from
 * double avoids the double rounding of going through float first. */
static double ref_round_bits(double v, int bits, int min_exp, double max_finite) {
  if (v == 0.0 || isnan(v) || isinf(v)) return v;
  int e;
  frexp(v, &e); /* v = m * 2^e, 0.5 <= |m| < 1 */
  int qexp = e - bits;
  if (qexp < min_exp) qexp = min_exp;
  double r = ldexp(nearbyint(ldexp(v, -qexp)), qexp);
  if (fabs(r) > max_finite) return v > 0 ? INFINITY : -INFINITY;
  return r;
}

double ops_ref_round(int32_t dtype, double v) {
  switch (dtype) {
    case KILN_HAL_F32: return (double)(float)v;
    case KILN_HAL_F16: return ref_round_bits(v, 11, -24, 65504.0);
    case KILN_HAL_BF16: return ref_round_bits(v, 8, -133, 3.3895313892515355e38);
    default: return v;
  }
}

void ops_ref_gemm(int64_t M, int64_t N, int64_t K, const double *a, const double *b,
                  const double *bias, double alpha, double beta, const double *c_in, double *c_out,
                  double *out_mag) {
  /* Row m's N sums at once, k ascending for each: the same additions in the same order as one
   * dot product per (m, n), so the same bits, but reading b along its rows. */
  double *accs = malloc(sizeof(double) * (size_t)(N > 0 ? 2 * N : 1));
  if (!accs) abort(); /* tests only */
  double *mags = accs + N;
  for (int64_t m = 0; m < M; m++) {
    for (int64_t n = 0; n < N; n++) accs[n] = mags[n] = 0.0;
    for (int64_t k = 0; k < K; k++) {
      const double x = a[m * K + k];
      const double *br = b + k * N;
      for (int64_t n = 0; n < N; n++) {
        accs[n] += x * br[n];
        mags[n] += fabs(x * br[n]);
      }
    }
    for (int64_t n = 0; n < N; n++) {
      double v = alpha * accs[n], mag = mags[n];
      mag *= fabs(alpha);
      if (beta != 0.0) {
        v += beta * c_in[m * N + n];
        mag += fabs(beta * c_in[m * N + n]);
      }
      if (bias) {
        v += bias[n];
        mag += fabs(bias[n]);
      }
      c_out[m * N + n] = v;
      if (out_mag) out_mag[m * N + n] = mag;
    }
  }
  free(accs);
}

/* Column n of y for every row of x: y[m, n] = sum_k x[m, k] * row[k] (+ bias[n]), in fp64,
 * with the sum of the terms' magnitudes (the tolerance's scale) in out_mag. */
static void ref_rows_times(int64_t M, int64_t N, int64_t K, const double *x, const double *row,
                           int64_t n, const double *bias, double *y_out, double *out_mag) {
  for (int64_t m = 0; m < M; m++) {
    double acc = 0.0, mag = 0.0;
    for (int64_t k = 0; k < K; k++) {
      acc += x[m * K + k] * row[k];
      mag += fabs(x[m * K + k] * row[k]);
    }
    if (bias) {
      acc += bias[n];
      mag += fabs(bias[n]);
    }
    y_out[m * N + n] = acc;
    if (out_mag) out_mag[m * N + n] = mag;
  }
}

/* An f16 (little endian at p) as a double. */
static double ref_f16(const uint8_t *p) {
  unsigned h = (unsigned)p[0] | (unsigned)p[1] << 8;
  int e = (int)(h >> 10) & 31;
  double man = (double)(h & 1023);
  double v = e == 0 ? ldexp(man, -24) : e == 31 ? (man ? NAN : INFINITY) : ldexp(1024 + man, e - 25);
  return h & 0x8000 ? -v : v;
}

int ops_ref_dequant_block(int32_t fmt, const uint8_t *blk, double *out) {
  switch (fmt) {
    case 1: /* Q4_0: 32 weights, f16 d, nibbles: low = weights 0..15, high = 16..31 */
      for (int j = 0; j < 32; j++) {
        int q = j < 16 ? blk[2 + j] % 16 : blk[2 + j - 16] / 16;
        out[j] = (double)(float)((q - 8) * ref_f16(blk));
      }
      return 32;
    case 2: /* Q8_0: f16 d, 32 int8 */
      for (int j = 0; j < 32; j++) {
        int q = blk[2 + j] < 128 ? blk[2 + j] : blk[2 + j] - 256;
        out[j] = (double)(float)(q * ref_f16(blk));
      }
      return 32;
    case 3:   /* Q4_K */
    case 4: { /* Q5_K */
      double d = ref_f16(blk), dmin = ref_f16(blk + 2);
      const uint8_t *sc = blk + 4, *qh = blk + 16, *qs = blk + (fmt == 4 ? 48 : 16);
      for (int i = 0; i < 256; i++) {
        int s = i / 32, l = i % 32, scale, min;
        if (s < 4) {
          scale = sc[s] % 64;
          min = sc[s + 4] % 64;
        } else { /* low 4 bits in bytes 8..11, top 2 bits in the top of bytes 0..7 */
          scale = sc[s + 4] % 16 + sc[s - 4] / 64 * 16;
          min = sc[s + 4] / 16 + sc[s] / 64 * 16;
        }
        int byte = qs[32 * (s / 2) + l], q = s % 2 ? byte / 16 : byte % 16;
        if (fmt == 4) q += (qh[l] >> s) % 2 * 16;
        double ds = (double)(float)(d * scale), ms = (double)(float)(dmin * min);
        out[i] = (double)(float)(ds * q - ms);
      }
      return 256;
    }
    case 5: { /* Q6_K: ql[128], qh[64], int8 scales[16], f16 d */
      double d = ref_f16(blk + 208);
      for (int i = 0; i < 256; i++) {
        int h = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
        int low_byte = blk[64 * h + l + (quarter % 2) * 32];
        int low = quarter < 2 ? low_byte % 16 : low_byte / 16;
        int high = (blk[128 + 32 * h + l] >> (2 * quarter)) % 4;
        int sc = blk[192 + i / 16] < 128 ? blk[192 + i / 16] : blk[192 + i / 16] - 256;
        double dsc = (double)(float)(d * sc);
        out[i] = (double)(float)(dsc * (low + 16 * high - 32));
      }
      return 256;
    }
    default: return 0;
  }
}

void ops_ref_gemm_quant(int64_t M, int64_t N, int64_t K, const double *x, int32_t fmt,
                        const uint8_t *w, int64_t row_stride, const double *bias, double *y_out,
                        double *out_mag) {
  double blk[256];
  double *row = malloc(sizeof(double) * (size_t)(K > 0 ? K : 1));
  if (!row) abort(); /* tests only */
  int64_t bytes = fmt == 1 ? 18 : fmt == 2 ? 34 : fmt == 3 ? 144 : fmt == 4 ? 176 : 210;
  for (int64_t n = 0; n < N; n++) {
    for (int64_t k = 0; k < K;) {
      int e = ops_ref_dequant_block(fmt, w + n * row_stride + (k / (fmt <= 2 ? 32 : 256)) * bytes,
                                    blk);
      for (int j = 0; j < e && k < K; j++) row[k++] = blk[j];
      if (!e) break;
    }
    ref_rows_times(M, N, K, x, row, n, bias, y_out, out_mag);
  }
  free(row);
}

/* An OCP FP8 E4M3FN code's value from its definition (no NaN: callers exclude 0x7F / 0xFF):
 * sign, exponent e (bias 7), mantissa m; e = 0 is subnormal. */
static double ref_e4m3(uint8_t q) {
  const int e = (q >> 3) & 15, m = q & 7;
  const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
  return q & 0x80 ? -v : v;
}

/* The finite non-negative e4m3 values, codes 0 .. 0x7E, ascending (ref_e4m3 of each). */
static double e4m3_pos[0x7F];
static pthread_once_t e4m3_once = PTHREAD_ONCE_INIT;
static void e4m3_init(void) {
  for (int q = 0; q <= 0x7E; q++) e4m3_pos[q] = ref_e4m3((uint8_t)q);
}

/* The code 0 .. 0x7E nearest to ay >= 0, ties to the even code (round to nearest even, since
 * the codes ascend with the values): a binary search for the first value >= ay, then the
 * nearer of it and its predecessor. ay beyond 448 gives 0x7E. */
static int e4m3_nearest(double ay) {
  pthread_once(&e4m3_once, e4m3_init);
  if (ay >= e4m3_pos[0x7E]) return 0x7E;
  int lo = 0, hi = 0x7E;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (e4m3_pos[mid] >= ay)
      hi = mid;
    else
      lo = mid + 1;
  }
  if (lo == 0) return 0;
  const double up = e4m3_pos[lo] - ay, down = ay - e4m3_pos[lo - 1];
  if (down < up) return lo - 1;
  if (up < down) return lo;
  return (lo & 1) ? lo - 1 : lo;
}

double ops_ref_fp8_kv_value(uint8_t code, float scale) {
  if ((code & 0x7F) == 0x7F) return NAN;
  return (double)scale * ref_e4m3(code); /* exact: a 24-bit by 4-bit product */
}

uint8_t ops_ref_fp8_kv_code(double x, float scale) {
  const float y = (float)x / scale; /* x is an f32 value (any float dtype widens exactly) */
  if (isnan(y)) return 0x7F;
  const uint8_t sign = signbit(y) ? 0x80 : 0;
  const double ay = fabs((double)y);
  return (uint8_t)(sign | e4m3_nearest(ay));
}

void ops_ref_fp8_xquant(int64_t M, int64_t K, const double *x, double *xq_out, double *s_out) {
  for (int64_t m = 0; m < M; m++) {
    double a = 0.0;
    for (int64_t k = 0; k < K; k++) a = fmax(a, fabs(x[m * K + k]));
    /* The exact quotients here are never within 2^-53 of an f32 rounding midpoint (a / 448 is
     * a / 7 scaled, a periodic binary fraction; x / s of two 24-bit values is at least ~2^-49
     * away), so rounding through double equals f32's correctly rounded division. */
    double s = (double)(float)(a / 448.0);
    if (s == 0.0) s = 1.0;
    s_out[m] = s;
    for (int64_t k = 0; k < K; k++) {
      const double v = (double)(float)(x[m * K + k] / s), av = fabs(v);
      const int best = e4m3_nearest(av);
      xq_out[m * K + k] = v < 0 ? -ref_e4m3((uint8_t)best) : ref_e4m3((uint8_t)best);
    }
  }
}

void ops_ref_gemm_qgroup(int64_t M, int64_t N, int64_t K, const double *x, int32_t fmt,
                         const uint8_t *w, int64_t row_stride, const uint8_t *scales, int64_t lds,
                         const uint8_t *zeros, int64_t ldz, const int32_t *g_idx,
                         int32_t group_size, const double *bias, double *y_out, double *out_mag) {
  double *row = malloc(sizeof(double) * (size_t)(K > 0 ? K : 1));
  if (!row) abort(); /* tests only */
  const bool four = fmt == 16;
  for (int64_t n = 0; n < N; n++) {
    const uint8_t *r = w + n * row_stride;
    for (int64_t k = 0; k < K; k++) {
      if (fmt == 18) { /* FP8 E4M3FN, f32 scales: the product rounded once to f32 */
        float s;
        memcpy(&s, scales + 4 * (n * lds + k / group_size), 4);
        row[k] = (double)(float)(ref_e4m3(r[k]) * (double)s);
        continue;
      }
      int q = four ? (k % 2 ? r[k / 2] / 16 : r[k / 2] % 16) : r[k];
      int64_t g = g_idx ? g_idx[k] : k / group_size;
      int z = zeros ? zeros[n * ldz + g] : four ? 8 : 128;
      row[k] = (double)(q - z) * ref_f16(scales + 2 * (n * lds + g));
    }
    ref_rows_times(M, N, K, x, row, n, bias, y_out, out_mag);
  }
  free(row);
}

void ops_ref_embedding(int64_t V, int64_t H, const double *table, int64_t T, const int32_t *ids,
                       double *out) {
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h++) {
      out[t * H + h] = (ids[t] >= 0 && ids[t] < V) ? table[(int64_t)ids[t] * H + h] : 0.0;
    }
  }
}

void ops_ref_rmsnorm(int32_t dtype, int64_t T, int64_t H, const double *x, double *residual,
                     const double *weight, double eps, double weight_offset, double *out) {
  for (int64_t t = 0; t < T; t++) {
    double ss = 0.0;
    for (int64_t h = 0; h < H; h++) {
      double s = x[t * H + h];
      if (residual) {
        s = ops_ref_round(dtype, s + residual[t * H + h]);
        residual[t * H + h] = s;
      }
      ss += s * s;
    }
    double inv = 1.0 / sqrt(ss / (double)H + eps);
    for (int64_t h = 0; h < H; h++) {
      double s = residual ? residual[t * H + h] : x[t * H + h];
      double n = ops_ref_round(dtype, s * inv);
      out[t * H + h] = ops_ref_round(dtype, n * (weight[h] + weight_offset));
    }
  }
}

void ops_ref_layernorm(int32_t dtype, int64_t T, int64_t H, const double *x, double *residual,
                       const double *weight, const double *bias, double eps, double *out) {
  for (int64_t t = 0; t < T; t++) {
    const double *s = x + t * H;
    if (residual) {
      for (int64_t h = 0; h < H; h++)
        residual[t * H + h] = ops_ref_round(dtype, x[t * H + h] + residual[t * H + h]);
      s = residual + t * H;
    }
    double sum = 0.0;
    for (int64_t h = 0; h < H; h++) sum += s[h];
    double mean = H ? sum / (double)H : 0.0, var = 0.0;
    for (int64_t h = 0; h < H; h++) var += (s[h] - mean) * (s[h] - mean);
    var = H ? var / (double)H : 0.0;
    double inv = 1.0 / sqrt(var + eps);
    for (int64_t h = 0; h < H; h++)
      out[t * H + h] = (s[h] - mean) * inv * weight[h] + (bias ? bias[h] : 0.0);
  }
}

void ops_ref_rope_table(int64_t P, int64_t R, double theta, float *cos_sin) {
  for (int64_t p = 0; p < P; p++) {
    for (int64_t i = 0; i < R / 2; i++) {
      double f = pow(theta, -2.0 * (double)i / (double)R);
      cos_sin[p * R + i] = (float)cos((double)p * f);
      cos_sin[p * R + R / 2 + i] = (float)sin((double)p * f);
    }
  }
}

void ops_ref_rope(int32_t style, int64_t T, int64_t NH, int64_t D, int64_t R,
                  const int32_t *positions, int64_t P, const double *cos_sin, double *x) {
  for (int64_t t = 0; t < T; t++) {
    int64_t pos = positions[t];
    if (pos < 0 || pos >= P) continue;
    for (int64_t h = 0; h < NH; h++) {
      double *row = x + (t * NH + h) * D;
      for (int64_t i = 0; i < R / 2; i++) {
        double c = cos_sin[pos * R + i], s = cos_sin[pos * R + R / 2 + i];
        int64_t i0 = style == 0 ? i : 2 * i;
        int64_t i1 = style == 0 ? i + R / 2 : 2 * i + 1;
        double x0 = row[i0], x1 = row[i1];
        row[i0] = x0 * c - x1 * s;
        row[i1] = x1 * c + x0 * s;
      }
    }
  }
}

double ops_ref_act(int32_t act, double x) {
  switch (act) {
    case 0: return x / (1.0 + exp(-x));
    case 1: {
      const double k = sqrt(2.0 / 3.14159265358979323846);
      return 0.5 * x * (1.0 + tanh(k * (x + 0.044715 * x * x * x)));
    }
    case 2: return 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
    case 3: return x / (1.0 + exp(-1.702 * x));
    default: return NAN;
  }
}

void ops_ref_act_mul(int32_t act, int64_t T, int64_t I, const double *x, double *out) {
  for (int64_t t = 0; t < T; t++) {
    for (int64_t i = 0; i < I; i++) {
      out[t * I + i] = ops_ref_act(act, x[t * 2 * I + i]) * x[t * 2 * I + I + i];
    }
  }
}

void ops_ref_activation(int32_t act, int64_t n, const double *x, double *out) {
  for (int64_t i = 0; i < n; i++) out[i] = ops_ref_act(act, x[i]);
}

/* One query row of ops_ref_attention: row i of sequence s, every head; scores has room for
 * seq_lens[s] values. Returns the NaN cache values it read. */
static int64_t ref_attention_row(const ops_ref_attention_params_t *p, const double *q,
                                 const double *k_cache, const double *v_cache,
                                 const int32_t *block_table, const int32_t *seq_lens,
                                 const int32_t *qsl, int64_t s, int64_t i, double *scores,
                                 double *out) {
  int64_t nan_reads = 0;
  const int64_t NH = p->NH, NKV = p->NKV, D = p->D, BS = p->BS;
  int64_t q_len = qsl[s + 1] - qsl[s], seq_len = seq_lens[s];
  int64_t row = qsl[s] + i;
  int64_t pos = seq_len - q_len + i;
  for (int64_t h = 0; h < NH; h++) {
    int64_t kvh = h / (NH / NKV);
    const double *qv = q + (row * NH + h) * D;
    double *o = out + (row * NH + h) * D;
    double mx = -INFINITY;
    int64_t nvis = 0;
    for (int64_t j = 0; j < seq_len; j++) {
      bool vis =
          (!p->causal || j <= pos) && (p->sliding_window <= 0 || j > pos - p->sliding_window);
      scores[j] = -INFINITY;
      if (!vis) continue;
      int64_t blk = block_table[s * p->MB + j / BS];
      const double *kv = k_cache + ((blk * NKV + kvh) * BS + j % BS) * D;
      double dot = 0.0;
      for (int64_t d = 0; d < D; d++) {
        if (isnan(kv[d])) nan_reads++;
        dot += qv[d] * kv[d];
      }
      double sc = p->scale * dot;
      if (p->softcap > 0) sc = p->softcap * tanh(sc / p->softcap);
      scores[j] = sc;
      if (sc > mx) mx = sc;
      nvis++;
    }
    for (int64_t d = 0; d < D; d++) o[d] = 0.0;
    if (nvis == 0) continue;
    double sum = 0.0;
    for (int64_t j = 0; j < seq_len; j++) {
      if (scores[j] == -INFINITY) continue;
      sum += exp(scores[j] - mx);
    }
    for (int64_t j = 0; j < seq_len; j++) {
      if (scores[j] == -INFINITY) continue;
      double w = exp(scores[j] - mx) / sum;
      int64_t blk = block_table[s * p->MB + j / BS];
      const double *vv = v_cache + ((blk * NKV + kvh) * BS + j % BS) * D;
      for (int64_t d = 0; d < D; d++) {
        if (isnan(vv[d])) nan_reads++;
        o[d] += w * vv[d];
      }
    }
  }
  return nan_reads;
}

/* The rows of a big problem are shared out over threads: thread t of n takes rows t, t + n,
 * t + 2n, ... of the flattened query rows (each row computed exactly as above, by one thread,
 * so the output does not depend on the split). Small problems stay on the calling thread. */
typedef struct ref_attn_job {
  const ops_ref_attention_params_t *p;
  const double *q, *k_cache, *v_cache;
  const int32_t *block_table, *seq_lens, *qsl;
  double *out;
  int64_t first, step, max_len, nan_reads;
  bool oom;
} ref_attn_job_t;

static void *ref_attention_rows(void *arg) {
  ref_attn_job_t *j = arg;
  double *scores = malloc(sizeof(double) * (size_t)(j->max_len > 0 ? j->max_len : 1));
  if (!scores) {
    j->oom = true;
    return NULL;
  }
  const int64_t S = j->p->num_seqs, T = j->qsl[S];
  int64_t s = 0;
  for (int64_t r = j->first; r < T; r += j->step) {
    while (r >= j->qsl[s + 1]) s++;
    j->nan_reads += ref_attention_row(j->p, j->q, j->k_cache, j->v_cache, j->block_table,
                                      j->seq_lens, j->qsl, s, r - j->qsl[s], scores, j->out);
  }
  free(scores);
  return NULL;
}

#define REF_ATTN_MAX_THREADS 32
#define REF_ATTN_THREAD_WORK 5.0e7 /* multiply-adds below which one thread does it all */

int64_t ops_ref_attention(const ops_ref_attention_params_t *p, const double *q,
                          const double *k_cache, const double *v_cache, const int32_t *block_table,
                          const int32_t *seq_lens, const int32_t *qsl, double *out) {
  double work = 0;
  int64_t max_len = 0;
  for (int64_t s = 0; s < p->num_seqs; s++) {
    work += (double)(qsl[s + 1] - qsl[s]) * (double)seq_lens[s] * (double)(p->NH * p->D);
    if (seq_lens[s] > max_len) max_len = seq_lens[s];
  }
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int n = work < REF_ATTN_THREAD_WORK || cpus < 2 ? 1
          : cpus > REF_ATTN_MAX_THREADS           ? REF_ATTN_MAX_THREADS
                                                  : (int)cpus;
  ref_attn_job_t jobs[REF_ATTN_MAX_THREADS];
  pthread_t th[REF_ATTN_MAX_THREADS];
  bool started[REF_ATTN_MAX_THREADS] = {false};
  for (int t = 0; t < n; t++)
    jobs[t] = (ref_attn_job_t){p, q, k_cache, v_cache, block_table, seq_lens, qsl, out,
                               t, n, max_len, 0, false};
  for (int t = 1; t < n; t++) started[t] = pthread_create(&th[t], NULL, ref_attention_rows, &jobs[t]) == 0;
  ref_attention_rows(&jobs[0]);
  int64_t nan_reads = jobs[0].nan_reads;
  bool oom = jobs[0].oom;
  for (int t = 1; t < n; t++) {
    if (started[t])
      pthread_join(th[t], NULL);
    else
      ref_attention_rows(&jobs[t]); /* no thread: this one does its share */
    nan_reads += jobs[t].nan_reads;
    oom = oom || jobs[t].oom;
  }
  if (oom) abort();
  return nan_reads;
}

double ops_ref_logsumexp(int64_t V, const double *row) {
  double mx = -INFINITY;
  for (int64_t v = 0; v < V; v++) mx = row[v] > mx ? row[v] : mx;
  if (mx == -INFINITY) return -INFINITY;
  double sum = 0.0;
  for (int64_t v = 0; v < V; v++) sum += exp(row[v] - mx);
  return mx + log(sum);
}

int32_t ops_ref_argmax(int64_t V, const double *row, double *out_logprob) {
  int64_t best = 0;
  for (int64_t v = 1; v < V; v++) {
    if (row[v] > row[best]) best = v;
  }
  if (out_logprob) *out_logprob = row[best] - ops_ref_logsumexp(V, row);
  return (int32_t)best;
}

/* Orders indices by value descending, then index ascending. */
typedef struct ref_ranked {
  double value;
  int64_t index;
} ref_ranked_t;

static int ref_ranked_cmp(const void *pa, const void *pb) {
  const ref_ranked_t *a = pa, *b = pb;
  if (a->value > b->value) return -1;
  if (a->value < b->value) return 1;
  return a->index < b->index ? -1 : (a->index > b->index);
}

static ref_ranked_t *ref_rank(int64_t V, const double *values) {
  ref_ranked_t *r = malloc(sizeof(*r) * (size_t)V);
  if (!r) abort();
  for (int64_t v = 0; v < V; v++) {
    r[v].value = values[v];
    r[v].index = v;
  }
  qsort(r, (size_t)V, sizeof(*r), ref_ranked_cmp);
  return r;
}

void ops_ref_topk(int64_t V, const double *row, int64_t k, int32_t *out_ids, double *out_values) {
  ref_ranked_t *r = ref_rank(V, row);
  for (int64_t i = 0; i < k; i++) {
    out_ids[i] = (int32_t)r[i].index;
    out_values[i] = r[i].value;
  }
  free(r);
}

void ops_ref_penalize_row(int64_t V, double *logits, const int32_t *prompt, int64_t nprompt,
                          const int32_t *output, int64_t noutput, bool has_rep, double rep,
                          bool has_freq, double freq, double pres, const int32_t *bias_ids,
                          const double *bias_values, int64_t nbias) {
  if (has_rep) {
    bool *seen = calloc((size_t)V, sizeof(bool));
    if (!seen) abort();
    for (int64_t i = 0; i < nprompt; i++) {
      if (prompt[i] >= 0 && prompt[i] < V) seen[prompt[i]] = true;
    }
    for (int64_t i = 0; i < noutput; i++) {
      if (output[i] >= 0 && output[i] < V) seen[output[i]] = true;
    }
    for (int64_t v = 0; v < V; v++) {
      if (seen[v]) logits[v] = logits[v] > 0 ? logits[v] / rep : logits[v] * rep;
    }
    free(seen);
  }
  if (has_freq) {
    int64_t *count = calloc((size_t)V, sizeof(int64_t));
    if (!count) abort();
    for (int64_t i = 0; i < noutput; i++) {
      if (output[i] >= 0 && output[i] < V) count[output[i]]++;
    }
    for (int64_t v = 0; v < V; v++) {
      logits[v] -= freq * (double)count[v] + pres * (count[v] > 0 ? 1.0 : 0.0);
    }
    free(count);
  }
  for (int64_t i = 0; i < nbias; i++) {
    if (bias_ids[i] >= 0 && bias_ids[i] < V) logits[bias_ids[i]] += bias_values[i];
  }
}

int32_t ops_ref_sample(int64_t V, const double *logits, double temperature, int32_t top_k,
                       double top_p, double min_p, double uniform, double *out_margin) {
  double margin = INFINITY;
  int32_t result = -1;
  if (temperature <= 0) {
    result = ops_ref_argmax(V, logits, NULL);
    if (out_margin) *out_margin = margin;
    return result;
  }
  /* calloc: zeroed, so no element is ever read uninitialised (and V == 0 still allocates) */
  double *p = calloc((size_t)V + 1, sizeof(double));
  bool *keep = calloc((size_t)V + 1, sizeof(bool));
  if (!p || !keep) abort();
  double mx = -INFINITY, sum = 0.0;
  for (int64_t v = 0; v < V; v++) mx = logits[v] / temperature > mx ? logits[v] / temperature : mx;
  for (int64_t v = 0; v < V; v++) sum += exp(logits[v] / temperature - mx);
  for (int64_t v = 0; v < V; v++) p[v] = exp(logits[v] / temperature - mx) / sum;
  ref_ranked_t *r = ref_rank(V, p);
  double pmax = r[0].value, before = 0.0;
  for (int64_t rank = 0; rank < V; rank++) {
    int64_t v = r[rank].index;
    bool k = true;
    if (rank > 0) {
      if (top_k > 0 && rank >= top_k) k = false;
      if (k && top_p < 1) {
        if (!(before < top_p)) k = false;
        margin = fmin(margin, fabs(before - top_p));
      }
      if (top_k > 0 && rank >= top_k) {
        /* already cut by top_k: the min_p decision cannot matter */
      } else if (min_p > 0) {
        double thr = min_p * pmax;
        if (!(p[v] >= thr)) k = false;
        margin = fmin(margin, fabs(p[v] - thr) / pmax);
      }
    }
    keep[v] = k;
    before += p[v];
  }
  free(r);
  double W = 0.0;
  for (int64_t v = 0; v < V; v++) {
    if (keep[v]) W += p[v];
  }
  double cum = 0.0, target = uniform * W;
  int64_t last_kept = 0;
  for (int64_t v = 0; v < V; v++) {
    if (!keep[v]) continue;
    last_kept = v;
    cum += p[v];
    margin = fmin(margin, fabs(cum - target) / W);
    if (result < 0 && cum > target) result = (int32_t)v;
  }
  if (result < 0) result = (int32_t)last_kept;
  free(p);
  free(keep);
  if (out_margin) *out_margin = margin;
  return result;
}
