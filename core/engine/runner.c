/* runner.c - the engine's runner over a real model (see runner.h). */
#include "core/engine/runner.h"

#include <stdlib.h>
#include <string.h>

typedef struct model_runner {
  kiln_model_t *m;
  kiln_kv_cache_t *kv;
  bool host_logits; /* the device's buffers are host memory: hand the sampler a pointer */
  const kiln_hal_backend_t *be;
} model_runner_t;

static kiln_status_t mr_forward(void *ctx, const kiln_batch_t *b) {
  model_runner_t *r = ctx;
  return kiln_model_forward(r->m, r->kv, b);
}

static kiln_status_t mr_copy_blocks(void *ctx, const int32_t *src, const int32_t *dst, int32_t n) {
  model_runner_t *r = ctx;
  return kiln_kv_cache_copy_blocks(r->kv, src, dst, n);
}

static void mr_logits(void *ctx, int32_t rows, kiln_sample_logits_t *out) {
  model_runner_t *r = ctx;
  memset(out, 0, sizeof(*out));
  out->tensor = kiln_model_logits(r->m, rows);
  out->num_rows = rows;
}

static void mr_destroy(void *ctx) { free(ctx); }

kiln_status_t kiln_runner_model_init(kiln_runner_t *r, kiln_model_t *m, kiln_kv_cache_t *kv,
                                     const kiln_hal_backend_t *backend, kiln_hal_device_t *device,
                                     kiln_hal_stream_t *stream, int32_t max_logits) {
  memset(r, 0, sizeof(*r));
  model_runner_t *c = calloc(1, sizeof(*c));
  if (!c) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "runner: out of memory");
  c->m = m;
  c->kv = kv;
  c->be = backend;
  r->ctx = c;
  r->vocab_size = (int32_t)kiln_model_get_config(m)->vocab_size;
  r->max_model_len = kiln_model_max_len(m);
  r->max_logits = max_logits;
  r->backend = backend;
  r->device = device;
  r->stream = stream;
  r->forward = mr_forward;
  r->copy_blocks = mr_copy_blocks;
  r->logits = mr_logits;
  r->destroy = mr_destroy;
  return NULL;
}
