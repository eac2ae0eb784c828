/* ops_ref.c - fp64 host references for the HAL ops: obviously-correct loops, no tricks. */
#include "hal/ref/ops_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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
  for (int64_t m = 0; m < M; m++) {
    for (int64_t n = 0; n < N; n++) {
      double acc = 0.0, mag = 0.0;
      for (int64_t k = 0; k < K; k++) {
        acc += a[m * K + k] * b[k * N + n];
        mag += fabs(a[m * K + k] * b[k * N + n]);
      }
      double v = alpha * acc;
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

int64_t ops_ref_attention(const ops_ref_attention_params_t *p, const double *q,
                          const double *k_cache, const double *v_cache, const int32_t *block_table,
                          const int32_t *seq_lens, const int32_t *qsl, double *out) {
  int64_t nan_reads = 0;
  const int64_t NH = p->NH, NKV = p->NKV, D = p->D, BS = p->BS;
  for (int64_t s = 0; s < p->num_seqs; s++) {
    int64_t q_len = qsl[s + 1] - qsl[s], seq_len = seq_lens[s];
    double *scores = malloc(sizeof(double) * (size_t)(seq_len > 0 ? seq_len : 1));
    if (!scores) abort();
    for (int64_t i = 0; i < q_len; i++) {
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
    }
    free(scores);
  }
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
