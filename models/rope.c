/* rope.c - rotary frequencies and the cos/sin table, computed as transformers' rope
 * initialisation functions (modeling_rope_utils.py) compute them in PyTorch float32.
 *
 * Each float32 tensor operation of the Python code is one float operation here, in the same
 * order, so the results agree bit for bit wherever PyTorch's own pow/cos are correctly rounded
 * (and within an ulp elsewhere). Notes on how PyTorch evaluates the Python:
 *   - a Python float combined with a float32 tensor is first rounded to float32;
 *   - `scalar / tensor` is `tensor.reciprocal() * scalar` (two roundings), `tensor / scalar`
 *     one division;
 *   - `base ** tensor` rounds base to float32 and raises it in float32 (done here in double
 *     and rounded once, i.e. as a correctly rounded powf);
 *   - scalar-only arithmetic (YaRN's correction range, the attention factor, the dynamic base)
 *     is Python double arithmetic.
 * The compiler must not contract a*b+c into fma: ISO C mode (no GNU extensions) keeps GCC's
 * -ffp-contract=off, and the default x86-64 target has no fma anyway.
 */
#include "models/rope.h"

#include <math.h>
#include <stdlib.h>

#include "kiln/hal.h"

#define PI_D 3.141592653589793

int64_t kiln_rope_max_positions(const kiln_model_config_t *c) {
  int64_t n = c->max_position_embeddings;
  const kiln_rope_config_t *r = &c->rope;
  if (r->kind == KILN_ROPE_DYNAMIC && r->factor >= 1 && isfinite(r->factor)) {
    int64_t orig = r->original_max_position > 0 ? r->original_max_position : n;
    double l = floor((double)orig * r->factor);
    if (l > (double)n && l < 9e18) n = (int64_t)l;
  }
  return n;
}

/* YaRN's get_mscale. */
static double yarn_mscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

/* find_correction_dim: the dimension whose frequency turns num_rotations times over orig. */
static double yarn_correction_dim(double num_rotations, int32_t dim, double base, double orig) {
  return ((double)dim * log(orig / (num_rotations * 2 * PI_D))) / (2 * log(base));
}

/* base ** (arange(0, R, 2).float() / R), element i, in float32. */
static float pos_freq(float base_f, int32_t i, int32_t r) {
  float e = (float)(2 * i) / (float)r;
  return (float)pow((double)base_f, (double)e);
}

static kiln_status_t check(const kiln_rope_config_t *rc, int64_t max_pos) {
  if (!rc) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "rope: no config");
  int32_t r = rc->rotary_dim;
  if (r <= 0 || r % 2 != 0 || r / 2 > KILN_ROPE_MAX_FREQS)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "rope: rotary_dim %d must be even and in [2, %d]", r,
                            2 * KILN_ROPE_MAX_FREQS);
  if (!(rc->theta > 0) || !isfinite(rc->theta) || !isfinite((float)rc->theta))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "rope: theta %g must be a positive finite number", rc->theta);
  if (rc->kind < KILN_ROPE_DEFAULT || rc->kind > KILN_ROPE_YARN)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "rope: kind %d is not a rope kind",
                            rc->kind);
  if (rc->kind != KILN_ROPE_DEFAULT && (!(rc->factor >= 1) || !isfinite(rc->factor)))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "rope: factor %g must be a finite number >= 1", rc->factor);
  if ((rc->kind == KILN_ROPE_DYNAMIC || rc->kind == KILN_ROPE_YARN ||
       rc->kind == KILN_ROPE_LLAMA3) &&
      rc->original_max_position <= 0 && max_pos <= 0)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "rope: original_max_position %lld and max_position_embeddings %lld: "
                            "one must be positive",
                            (long long)rc->original_max_position, (long long)max_pos);
  if (rc->kind == KILN_ROPE_DYNAMIC && r <= 2)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "rope: dynamic scaling needs rotary_dim > 2, got %d", r);
  if (rc->kind == KILN_ROPE_LLAMA3 &&
      (!(rc->low_freq_factor > 0) || !(rc->high_freq_factor > rc->low_freq_factor) ||
       !isfinite(rc->high_freq_factor)))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "rope: llama3 needs 0 < low_freq_factor < high_freq_factor, got %g "
                            "and %g",
                            rc->low_freq_factor, rc->high_freq_factor);
  if (rc->kind == KILN_ROPE_YARN) {
    if (!(rc->theta > 1))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "rope: yarn needs theta > 1, got %g",
                              rc->theta);
    if (!(rc->beta_fast > 0) || !(rc->beta_slow > 0) || !isfinite(rc->beta_fast) ||
        !isfinite(rc->beta_slow))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "rope: yarn beta_fast %g and beta_slow %g must be positive",
                              rc->beta_fast, rc->beta_slow);
    if (!(rc->attention_factor >= 0) || !isfinite(rc->attention_factor) || !isfinite(rc->mscale) ||
        !isfinite(rc->mscale_all_dim))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "rope: yarn attention_factor %g, mscale %g, mscale_all_dim %g must "
                              "be finite (attention_factor >= 0)",
                              rc->attention_factor, rc->mscale, rc->mscale_all_dim);
  }
  if (rc->n_freq_factors != 0 && rc->n_freq_factors != r / 2)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "rope: %d freq_factors, want rotary_dim / 2 = %d", rc->n_freq_factors,
                            r / 2);
  for (int32_t i = 0; i < rc->n_freq_factors; i++)
    if (!(rc->freq_factors[i] > 0) || !isfinite(rc->freq_factors[i]))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "rope: freq_factors[%d] = %g must be a positive finite number", i,
                              (double)rc->freq_factors[i]);
  return NULL;
}

/* _compute_llama3_parameters, on the default frequencies in inv[]. */
static void llama3(const kiln_rope_config_t *rc, float *inv, int32_t half) {
  double old_context_len = (double)rc->original_max_position;
  double low_freq_wavelen = old_context_len / rc->low_freq_factor;
  double high_freq_wavelen = old_context_len / rc->high_freq_factor;
  float factor = (float)rc->factor;
  float two_pi = (float)(2 * PI_D), old_f = (float)old_context_len;
  float low_wl = (float)low_freq_wavelen, high_wl = (float)high_freq_wavelen;
  float lff = (float)rc->low_freq_factor;
  float span = (float)(rc->high_freq_factor - rc->low_freq_factor);
  for (int32_t i = 0; i < half; i++) {
    float wavelen = (1.0f / inv[i]) * two_pi;
    /* wavelen < high_freq_wavelen: keep; wavelen > low_freq_wavelen: divide by factor */
    float inv_llama = wavelen > low_wl ? inv[i] / factor : inv[i];
    float smooth = ((1.0f / wavelen) * old_f - lff) / span;
    float smoothed = (1.0f - smooth) * inv_llama / factor + smooth * inv_llama;
    bool medium = !(wavelen < high_wl) && !(wavelen > low_wl);
    inv[i] = medium ? smoothed : inv_llama;
  }
}

/* _compute_yarn_parameters' frequencies; returns the attention factor. */
static double yarn(const kiln_rope_config_t *rc, int64_t max_pos, float *inv, int32_t r) {
  int32_t half = r / 2;
  double factor = rc->factor;
  double orig = (double)(rc->original_max_position > 0 ? rc->original_max_position : max_pos);
  double attn = rc->attention_factor;
  if (!(attn > 0)) {
    if (rc->mscale != 0 && rc->mscale_all_dim != 0)
      attn = yarn_mscale(factor, rc->mscale) / yarn_mscale(factor, rc->mscale_all_dim);
    else
      attn = yarn_mscale(factor, 1.0);
  }
  double low = yarn_correction_dim(rc->beta_fast, r, rc->theta, orig);
  double high = yarn_correction_dim(rc->beta_slow, r, rc->theta, orig);
  if (rc->truncate) {
    low = floor(low);
    high = ceil(high);
  }
  if (low < 0) low = 0;
  if (high > r - 1) high = r - 1;
  if (low == high) high += 0.001; /* linear_ramp_factor: prevent singularity */
  float base_f = (float)rc->theta, factor_f = (float)factor;
  float low_f = (float)low, range_f = (float)(high - low);
  for (int32_t i = 0; i < half; i++) {
    float pf = pos_freq(base_f, i, r);
    float extrapolation = 1.0f / pf;
    float interpolation = 1.0f / (factor_f * pf);
    float ramp = ((float)i - low_f) / range_f;
    ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
    float extrapolation_factor = 1.0f - ramp;
    inv[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return attn;
}

kiln_status_t kiln_rope_inv_freq(const kiln_rope_config_t *rc, int64_t max_position_embeddings,
                                 float *inv_freq, float *out_attn_factor) {
  kiln_status_t st = check(rc, max_position_embeddings);
  if (st) return st;
  int32_t r = rc->rotary_dim, half = r / 2;
  double attn = 1.0;
  if (rc->kind == KILN_ROPE_YARN) {
    attn = yarn(rc, max_position_embeddings, inv_freq, r);
  } else {
    double base = rc->theta;
    if (rc->kind == KILN_ROPE_DYNAMIC) {
      /* _compute_dynamic_ntk_parameters at seq_len = L (see rope.h) */
      double orig = (double)(rc->original_max_position > 0 ? rc->original_max_position
                                                           : max_position_embeddings);
      double seq_len = floor(orig * rc->factor);
      if (seq_len < orig) seq_len = orig;
      base = base * pow((rc->factor * seq_len / orig) - (rc->factor - 1), (double)r / (r - 2));
    }
    float base_f = (float)base;
    if (!(base_f > 0) || !isfinite(base_f))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "rope: the scaled base %g is not a finite float", base);
    for (int32_t i = 0; i < half; i++) inv_freq[i] = 1.0f / pos_freq(base_f, i, r);
    if (rc->kind == KILN_ROPE_LINEAR) {
      float f = (float)rc->factor;
      for (int32_t i = 0; i < half; i++) inv_freq[i] /= f;
    } else if (rc->kind == KILN_ROPE_LLAMA3) {
      llama3(rc, inv_freq, half);
    }
  }
  for (int32_t i = 0; i < rc->n_freq_factors; i++) inv_freq[i] /= rc->freq_factors[i];
  for (int32_t i = 0; i < half; i++)
    if (!isfinite(inv_freq[i]) || !(inv_freq[i] >= 0))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "rope: inv_freq[%d] = %g is not a finite non-negative number "
                              "(theta %g, factor %g, kind %d)",
                              i, (double)inv_freq[i], rc->theta, rc->factor, rc->kind);
  float attn_f = (float)attn;
  if (!isfinite(attn_f) || !(attn_f > 0))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "rope: attention factor %g is not a positive finite number", attn);
  if (out_attn_factor) *out_attn_factor = attn_f;
  return NULL;
}

kiln_status_t kiln_rope_build_table(const kiln_rope_config_t *rc, int64_t max_position_embeddings,
                                    int64_t P, float *table) {
  float inv[KILN_ROPE_MAX_FREQS];
  float attn = 1.0f;
  if (P < 0 || (rc && rc->rotary_dim > 0 && P > INT64_MAX / rc->rotary_dim))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "rope: table of %lld positions",
                            (long long)P);
  kiln_status_t st = kiln_rope_inv_freq(rc, max_position_embeddings, inv, &attn);
  if (st) return st;
  int32_t r = rc->rotary_dim, half = r / 2;
  for (int64_t p = 0; p < P; p++) {
    float *row = table + p * r;
    float pf = (float)p; /* position_ids.float() */
    for (int32_t i = 0; i < half; i++) {
      float fr = pf * inv[i]; /* inv_freq @ position_ids: one product per element */
      row[i] = (float)cos((double)fr) * attn;
      row[half + i] = (float)sin((double)fr) * attn;
    }
  }
  return NULL;
}
