/* rope.h - the host-built cos/sin table that expresses every rotary scaling variant.
 *
 * The HAL's rope op reads row p of a [P, R] F32 table: cos(p * f_i) for i < R/2, then
 * sin(p * f_i), each already multiplied by the attention factor (YaRN). R = rotary_dim.
 * The frequencies follow Hugging Face transformers' rope initialisation functions exactly,
 * computed the way PyTorch does (inv_freq in float32, p * inv_freq rounded to float32, then
 * cos/sin of that float), so fp32 logits agree to ~1e-6:
 *   default  inv_freq_i = 1 / theta^(2i / R)
 *   linear   inv_freq_i / factor
 *   dynamic  theta' = theta * ((factor * L / orig) - (factor - 1))^(R / (R - 2)) with
 *            L = floor(orig * factor). Transformers recomputes theta' from the running sequence
 *            length, so a key cached early would be rotated differently from one computed
 *            later; Kiln fixes L at the longest context (as vLLM does), so a cached key never
 *            changes, and agrees with transformers exactly at length L.
 *   llama3   low/high frequency bands with smooth interpolation (Llama 3.1)
 *   yarn     ramp between interpolation and extrapolation, cos/sin scaled by the attention
 *            factor (0.1 ln(factor) + 1 unless given; mscale/mscale_all_dim as DeepSeek)
 *   freq_factors (GGUF rope_freqs): inv_freq_i / freq_factors[i], after the above.
 */
#ifndef KILN_MODELS_ROPE_H
#define KILN_MODELS_ROPE_H

#include <stdint.h>

#include "base/status.h"
#include "models/model_config.h"

/* The longest context the rope table must cover for this config: max_position_embeddings,
 * or original_max_position * factor for dynamic scaling when that is larger. */
int64_t kiln_rope_max_positions(const kiln_model_config_t *c);

/* Fills inv_freq[0 .. rotary_dim/2) (float32, as PyTorch computes it) and *out_attn_factor. */
kiln_status_t kiln_rope_inv_freq(const kiln_rope_config_t *rc, int64_t max_position_embeddings,
                                 float *inv_freq, float *out_attn_factor);

/* Fills table[P * R] (R = rc->rotary_dim) for positions 0 .. P-1. */
kiln_status_t kiln_rope_build_table(const kiln_rope_config_t *rc, int64_t max_position_embeddings,
                                    int64_t P, float *table);

#endif /* KILN_MODELS_ROPE_H */
