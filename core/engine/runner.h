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

/* ---- tensor parallelism: ranks as threads (docs/parallel.md "Engine") ----------------------
 * Rank 0 is the caller's: the engine loads its shard and KV cache as usual, with the
 * communicator kiln_tp_ranks_start made for it. Ranks 1..N-1 are worker threads, each with its
 * own device handle (the same device index on a host-memory device, else device_index + rank),
 * stream, communicator (all made from one comm_get_unique_id, comm_create called concurrently
 * in every rank), kiln_model_t shard and KV cache of rank 0's block count. The TP runner hands
 * every forward and block copy to all ranks and waits for all; the scheduler, block manager and
 * sampler run once, on rank 0. The sequence:
 *
 *   kiln_tp_ranks_start     workers open their devices; all ranks join the communicator;
 *                           the workers start loading their shards
 *   (the caller loads rank 0's shard with *out_comm0)
 *   kiln_tp_ranks_wait      every worker's load finished (their errors, naming the rank)
 *   kiln_tp_ranks_budget    a worker's device memory after its load (for the KV budget)
 *   kiln_runner_tp_init     the workers' KV caches, and the runner (which takes the ranks)
 *
 * kiln_tp_ranks_free joins the workers and frees what they hold, at any point of this. */
typedef struct kiln_tp_ranks kiln_tp_ranks_t;

typedef struct kiln_tp_options {
  const char *path; /* the model, as rank 0 loads it */
  const kiln_hal_backend_t *backend;
  int32_t tp_size;      /* N >= 2 */
  int32_t device_index; /* rank 0's device ([backend] device) */
  bool same_device;     /* every rank on device_index (the cpu backend: host memory) */
  int32_t timeout_ms;   /* the communicator's wait for a peer; 0 = the backend's default */
  kiln_model_options_t model; /* rank 0's options: workers take them with their tp_rank */
} kiln_tp_options_t;

/* Starts ranks 1..N-1 and makes rank 0's communicator on dev0 (*out_comm0, the caller's to
 * destroy after rank 0's model). Nothing is left running on failure. Errors: the backend has no
 * collectives (KILN_ERR_UNSUPPORTED, naming [parallel] tensor_parallel_size and the backend), a
 * rank's device or stream (naming the rank and its device), comm_create. */
kiln_status_t kiln_tp_ranks_start(const kiln_tp_options_t *o, kiln_hal_device_t *dev0,
                                  kiln_hal_comm_t **out_comm0, kiln_tp_ranks_t **out);
/* Waits for the workers' loads; the first failing rank's error, naming it. */
kiln_status_t kiln_tp_ranks_wait(kiln_tp_ranks_t *t);
/* Rank r's (1..N-1) device memory as read right after its load. */
void kiln_tp_ranks_memory(const kiln_tp_ranks_t *t, int32_t rank, uint64_t *out_free,
                          uint64_t *out_total);
void kiln_tp_ranks_free(kiln_tp_ranks_t *t);

/* Creates every worker's KV cache with num_blocks blocks of block_size tokens and makes r a
 * runner over all ranks: rank 0 is m and kv (borrowed, as kiln_runner_model_init), run in the
 * calling thread. Takes t in every case (r->destroy frees it; on error it is freed here).
 * A step fails if any rank fails, with that rank's message. */
kiln_status_t kiln_runner_tp_init(kiln_runner_t *r, kiln_tp_ranks_t *t, int32_t num_blocks,
                                  int32_t block_size, kiln_model_t *m, kiln_kv_cache_t *kv,
                                  const kiln_hal_backend_t *backend, kiln_hal_device_t *device,
                                  kiln_hal_stream_t *stream, int32_t max_logits);

#endif /* KILN_CORE_ENGINE_RUNNER_H */
