/* sampler.h - turns a step's logits rows into tokens and logprobs: penalties, logit bias,
 * temperature, top-k / top-p / min-p, seeded draws, and top-N logprobs.
 *
 * Two paths with one meaning: on a backend with KILN_HAL_CAP_DEVICE_SAMPLING the work runs on
 * the device through the HAL's penalize / sample / argmax / topk ops (hal.h gives their exact
 * semantics) and only ids and logprobs come back; otherwise the logits rows are read to the
 * host and the same semantics run in C. Both take the per-row uniforms from the caller, drawn
 * from each sequence's own generator, so a sequence's tokens do not depend on what else is in
 * the batch.
 *
 * Order of processing per row (vLLM's): logits -> repetition penalty (prompt + output
 * tokens) -> frequency / presence penalties (output tokens) -> logit bias (which also carries
 * the engine's -inf bans, e.g. end-of-sequence before min_tokens) -> the token mask of
 * constrained decoding (banned tokens -inf: hal.h's mask_logits on the device, or -inf biases
 * on a plugin older than ABI 1.3) -> [logprobs are taken here,
 * from the processed logits before temperature] -> temperature / top-k / top-p / min-p ->
 * the draw (greedy = argmax when temperature <= 0).
 *
 * Several sample rows may read the same logits row (n > 1 sequences forked from one prompt
 * sample their first token from the prompt's last row): the sampler never lets one row's
 * penalties leak into another's (it gathers rows into its own buffer when rows repeat or
 * penalties apply).
 *
 * Thread-safety: none; the engine thread owns a sampler.
 */
#ifndef KILN_CORE_SAMPLE_SAMPLER_H
#define KILN_CORE_SAMPLE_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"
#include "kiln/hal.h"

typedef struct kiln_sampler kiln_sampler_t;

/* Where the logits are: a device tensor [R, V] F32 (device path), or host floats
 * (host path: rows are read from the tensor, in place when its buffer is host-visible, else
 * with copy_d2h; or given directly in `host`, which the host path prefers). A device sampler
 * given only `host` samples those rows on the host. */
typedef struct kiln_sample_logits {
  kiln_hal_tensor_t tensor; /* [R, V] F32 on the sampler's device; buffer NULL = host only */
  const float *host;        /* [R, V] host logits, when the caller already has them */
  int32_t num_rows;         /* R */
} kiln_sample_logits_t;

/* One row to sample. */
typedef struct kiln_sample_row {
  int32_t logits_row;        /* which row of the logits, in [0, R) */
  float temperature;         /* <= 0: greedy */
  int32_t top_k;             /* 0 = off */
  float top_p;               /* 1 = off */
  float min_p;               /* 0 = off */
  float repetition;          /* 1 = off */
  float presence, frequency; /* 0 = off */
  float uniform;             /* in [0, 1), from the sequence's generator */
  const int32_t *prompt_ids; /* for the repetition penalty */
  int32_t num_prompt;
  const int32_t *output_ids; /* for all three penalties */
  int32_t num_output;
  const int32_t *bias_ids; /* added to the logits (may hold -INFINITY bans) */
  const float *bias_values;
  int32_t num_bias;
  int32_t num_top;      /* -1 = no logprobs; 0 = the sampled token's; k = also the top k */
  const uint32_t *mask; /* NULL, or ceil(V / 32) words: token v is allowed when bit v % 32 of
                           mask[v / 32] is set; the others get -inf after the bias */
} kiln_sample_row_t;

/* One row to score (prompt logprobs): the logprob of `token` under log_softmax(raw logits of
 * logits_row) and the top num_top alternatives. No penalties apply. */
typedef struct kiln_score_row {
  int32_t logits_row;
  int32_t token;
  int32_t num_top; /* >= 0 */
} kiln_score_row_t;

/* Results, written by kiln_sampler_run into caller-provided arrays. */
typedef struct kiln_sample_out {
  int32_t *tokens;  /* [num_samples] */
  float *logprobs;  /* [num_samples] (rows with num_top < 0 get 0) */
  int32_t *top_ids; /* [num_samples, max_top] row-major (only the first num_top used) */
  float *top_logprobs;
  float *score_logprobs;  /* [num_scores] */
  int32_t *score_top_ids; /* [num_scores, max_top] */
  float *score_top_logprobs;
} kiln_sample_out_t;

/* backend/device/stream: the device the logits live on; backend may be NULL (host only).
 * The device path is used when the device's caps include KILN_HAL_CAP_DEVICE_SAMPLING and
 * force_host is false. (The HAL reports caps per device index and a device handle does not
 * name its index, so "the device's caps" is read as: every device of the backend has the
 * cap.) max_rows bounds num_samples + num_scores per run; max_top bounds num_top; vocab is V.
 * The device path holds max_rows * V floats of device memory. Errors:
 * KILN_ERR_INVALID_ARGUMENT, KILN_ERR_OUT_OF_MEMORY (with bytes), device errors. */
kiln_status_t kiln_sampler_create(const kiln_hal_backend_t *backend, kiln_hal_device_t *device,
                                  kiln_hal_stream_t *stream, bool force_host, int32_t max_rows,
                                  int32_t max_top, int32_t vocab, kiln_sampler_t **out);
void kiln_sampler_free(kiln_sampler_t *s);
bool kiln_sampler_on_device(const kiln_sampler_t *s);

/* Samples num_samples rows and scores num_scores rows of one step's logits. Waits for the
 * results (they are on the host when it returns). Top-N entries beyond a row's num_top are
 * left untouched. Errors: KILN_ERR_INVALID_ARGUMENT naming the row and field (a row index or
 * score token out of range, num_top > max_top or > V, too many rows, a uniform outside
 * [0, 1), a NaN parameter, repetition <= 0, a NULL list or output array that is needed),
 * device errors. */
kiln_status_t kiln_sampler_run(kiln_sampler_t *s, const kiln_sample_logits_t *logits,
                               const kiln_sample_row_t *samples, int32_t num_samples,
                               const kiln_score_row_t *scores, int32_t num_scores,
                               kiln_sample_out_t *out);

/* Copies logits row `row` (V floats) to dst on the host: from the caller's host rows, the
 * tensor's host-visible memory, or with a device copy (after a stream sync). Errors: a row out
 * of range, device errors. */
kiln_status_t kiln_sampler_read_row(kiln_sampler_t *s, const kiln_sample_logits_t *logits,
                                    int32_t row, float *dst);

/* splitmix64: each sequence's generator; returns a uniform in [0, 1) with 53 random bits
 * rounded down to a float below 1. */
float kiln_sample_uniform(uint64_t *state);
/* The stream is counter-based (draw t depends only on the starting state and t), so a draw can
 * be taken ahead of time: kiln_sample_uniform_ahead(s, k) is what the (k+1)-th call of
 * kiln_sample_uniform(&s) would return, and kiln_sample_skip(&s, n) stands for n calls.
 * Speculative decoding samples the rows of a step's proposals with the draws their tokens will
 * have and then skips the ones it took, so a seeded request gives the same tokens with
 * speculation on or off. */
float kiln_sample_uniform_ahead(uint64_t state, uint64_t k);
void kiln_sample_skip(uint64_t *state, uint64_t n);

#endif /* KILN_CORE_SAMPLE_SAMPLER_H */
