/* engine_internal.h - the engine's entry points for libkiln's own tools and tests: creation
 * from a parsed config or around a given runner, and stepping by hand (no engine thread) so a
 * test can drive the scheduler deterministically. */
#ifndef KILN_CORE_ENGINE_ENGINE_INTERNAL_H
#define KILN_CORE_ENGINE_ENGINE_INTERNAL_H

#include "base/config.h"
#include "core/engine/runner.h"
#include "core/kv/block_manager.h"
#include "kiln/kiln.h"
#include "models/tokenizer/tokenizer.h"

typedef struct kiln_engine_setup {
  const kiln_config_t *config; /* [engine], [cache], [scheduler], [server] keys; required */
  /* With runner.forward set, the engine uses this runner (taking ownership: runner.destroy
   * is called at the end) and a pool of num_blocks blocks, instead of loading [model] path. */
  kiln_runner_t runner;
  int32_t num_blocks;
  const kiln_tokenizer_t *tokenizer; /* borrowed, optional (with a runner) */
  const int32_t *eos_ids;            /* with a runner */
  int32_t num_eos;
  bool manual;       /* no engine thread: the caller calls kiln_engine_step */
  uint64_t encoder_cache_bytes; /* > 0: the encoder cache's bound, instead of [model]
                                   encoder_cache_mb (tests) */
  bool force_host_sampling;
} kiln_engine_setup_t;

kiln_status_t kiln_engine_create_setup(const kiln_engine_setup_t *setup, kiln_engine_t **out);

/* Manual mode: takes in what was submitted, handles cancellations and runs one step.
 * *idle = true when there was nothing to do. */
kiln_status_t kiln_engine_step(kiln_engine_t *eng, bool *idle);

/* For tests: the block manager (to check invariants and that every block is free). */
kiln_kv_manager_t *kiln_engine_kv(kiln_engine_t *eng);

/* For tests: the draft model's block manager (NULL unless [speculative] method = draft). */
kiln_kv_manager_t *kiln_engine_draft_kv(kiln_engine_t *eng);

/* For tests: the model loaded from the config (NULL with a custom runner). */
kiln_model_t *kiln_engine_model(kiln_engine_t *e);

/* For tests: images encoded so far, encoder outputs evicted at the bound, bytes held now.
 * Engine thread (or manual mode). */
void kiln_engine_encoder_stats(const kiln_engine_t *e, uint64_t *encodes, uint64_t *evictions,
                               uint64_t *bytes_used);

/* Speculative decoding's n-gram proposer (prompt lookup): the longest suffix of tokens[0, n),
 * ngram_max down to ngram_min tokens, that occurred earlier; at its latest earlier occurrence,
 * the tokens that followed it (at most k, all before n) are written to out. Returns how many
 * (0: no match). */
int32_t kiln_spec_ngram_propose(const int32_t *tokens, int32_t n, int32_t ngram_min,
                                int32_t ngram_max, int32_t k, int32_t *out);

/* The generator state a request's sequence `index` starts from. */
uint64_t kiln_engine_seq_seed(uint64_t seed, int32_t index);

#endif /* KILN_CORE_ENGINE_ENGINE_INTERNAL_H */
