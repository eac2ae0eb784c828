/* runner.h - what the engine needs from a model: one forward over a flattened batch, block
 * copies for copy-on-write, and the logits of the last forward. The real runner wraps a
 * kiln_model_t and its KV cache (kiln_runner_model_create); tests plug in a fake model with
 * the same shape of contract, so the scheduler, the block manager and the sampler can be run
 * at scale on the host.
 */
#ifndef KILN_CORE_ENGINE_RUNNER_H
#define KILN_CORE_ENGINE_RUNNER_H

#include "core/sample/sampler.h"
#include "base/status.h"
#include "models/model.h"

typedef struct kiln_runner {
  void *ctx;
  int32_t vocab_size;
  int64_t max_model_len;
  int32_t max_logits; /* most logits rows one forward returns */
  /* The device the logits live on, for the sampler (all NULL: host logits only). */
  const kiln_hal_backend_t *backend;
  kiln_hal_device_t *device;
  kiln_hal_stream_t *stream;
  kiln_status_t (*forward)(void *ctx, const kiln_batch_t *b);
  kiln_status_t (*copy_blocks)(void *ctx, const int32_t *src, const int32_t *dst, int32_t n);
  /* The logits of the last forward (rows = its num_logits). */
  void (*logits)(void *ctx, int32_t rows, kiln_sample_logits_t *out);
  void (*destroy)(void *ctx); /* may be NULL */
} kiln_runner_t;

/* A runner over a loaded model and a KV cache (both borrowed; r->destroy frees only the
 * runner's own context). Errors: KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_runner_model_init(kiln_runner_t *r, kiln_model_t *m, kiln_kv_cache_t *kv,
                                     const kiln_hal_backend_t *backend, kiln_hal_device_t *device,
                                     kiln_hal_stream_t *stream, int32_t max_logits);

#endif /* KILN_CORE_ENGINE_RUNNER_H */
