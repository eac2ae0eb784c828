/* runner.c - the engine's runner over a real model, and over tensor-parallel ranks as threads
 * (see runner.h). */
#define _POSIX_C_SOURCE 200809L
#include "core/engine/runner.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hal/loader.h"

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

/* What every runner over a loaded model shares: its model, cache and backend (mr), and the
 * public fields the engine reads (r). The caller sets r->ctx and the four operations. */
static void runner_fill(kiln_runner_t *r, model_runner_t *mr, kiln_model_t *m, kiln_kv_cache_t *kv,
                        const kiln_hal_backend_t *backend, kiln_hal_device_t *device,
                        kiln_hal_stream_t *stream, int32_t max_logits) {
  mr->m = m;
  mr->kv = kv;
  mr->be = backend;
  r->vocab_size = (int32_t)kiln_model_get_config(m)->vocab_size;
  r->max_model_len = kiln_model_max_len(m);
  r->max_logits = max_logits;
  r->backend = backend;
  r->device = device;
  r->stream = stream;
}

kiln_status_t kiln_runner_model_init(kiln_runner_t *r, kiln_model_t *m, kiln_kv_cache_t *kv,
                                     const kiln_hal_backend_t *backend, kiln_hal_device_t *device,
                                     kiln_hal_stream_t *stream, int32_t max_logits) {
  memset(r, 0, sizeof(*r));
  model_runner_t *c = calloc(1, sizeof(*c));
  if (!c) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "runner: out of memory");
  runner_fill(r, c, m, kv, backend, device, stream, max_logits);
  r->ctx = c;
  r->forward = mr_forward;
  r->copy_blocks = mr_copy_blocks;
  r->logits = mr_logits;
  r->destroy = mr_destroy;
  return NULL;
}

/* ---- tensor parallelism: ranks 1..N-1 as worker threads --------------------------------------
 * Each worker owns everything of its rank and touches it only from its own thread (a stream
 * and a communicator are used by one thread at a time). The caller hands it one command at a
 * time through its mutex and condvar and waits for the result; commands go to every worker
 * before rank 0 runs its own part, so the collectives inside a forward find every rank. */

enum { TP_IDLE, TP_JOIN, TP_KV, TP_FORWARD, TP_COPY, TP_QUIT };

typedef struct tp_worker {
  struct kiln_tp_ranks *t;
  int32_t rank;
  pthread_t thread;
  bool started;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int32_t cmd;    /* TP_IDLE: nothing pending (the last command's result is in st) */
  bool opened;    /* the device and stream step has finished (st says how) */
  kiln_status_t st;
  /* the command's arguments (read by the worker while cmd is set) */
  const kiln_batch_t *batch;
  const int32_t *src, *dst;
  int32_t n, num_blocks, block_size;
  /* the rank's own */
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  kiln_hal_comm_t *comm;
  kiln_model_t *model;
  kiln_kv_cache_t *kv;
  uint64_t mem_free, mem_total;
} tp_worker_t;

struct kiln_tp_ranks {
  kiln_tp_options_t o;
  kiln_hal_comm_id_t id;
  int32_t num_workers; /* N - 1 */
  tp_worker_t *w;      /* [N - 1], rank r at w[r - 1] */
};

static kiln_status_t tp_join(tp_worker_t *w) {
  const kiln_tp_ranks_t *t = w->t;
  const kiln_hal_backend_t *be = t->o.backend;
  kiln_hal_comm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.world_size = t->o.tp_size;
  a.rank = w->rank;
  a.timeout_ms = t->o.timeout_ms;
  a.id = t->id;
  kiln_hal_error_t *he = be->comm_create(w->dev, &a, &w->comm);
  if (he) return kiln_hal_status_from_error(he, "comm_create");
  kiln_model_options_t mo = t->o.model;
  mo.tp_size = t->o.tp_size;
  mo.tp_rank = w->rank;
  mo.tp_comm = w->comm;
  mo.device_index = t->o.same_device ? t->o.device_index : t->o.device_index + w->rank;
  kiln_status_t st = kiln_model_load(t->o.path, be, w->dev, w->stream, &mo, &w->model);
  if (st) return st;
  /* What the load left free: the engine sizes the KV pool for the tightest rank. */
  he = be->device_memory(w->dev, &w->mem_free, &w->mem_total);
  return he ? kiln_hal_status_from_error(he, "reading the device's free memory") : NULL;
}

static kiln_status_t tp_run(tp_worker_t *w, int32_t cmd) {
  const kiln_hal_backend_t *be = w->t->o.backend;
  kiln_status_t st = NULL;
  switch (cmd) {
  case TP_JOIN:
    return tp_join(w);
  case TP_KV:
    return kiln_model_kv_create(w->model, w->num_blocks, w->block_size, &w->kv);
  case TP_FORWARD:
    st = kiln_model_forward(w->model, w->kv, w->batch);
    break;
  case TP_COPY:
    st = kiln_kv_cache_copy_blocks(w->kv, w->src, w->dst, w->n);
    break;
  default:
    return NULL;
  }
  /* Wait for the stream: an error the device reports while the forward runs belongs to this
   * step, and rank 0's logits are complete only when every rank's all_reduce is (the ranks are
   * tied by them anyway, so this costs no extra round trip). */
  if (!st) {
    kiln_hal_error_t *he = be->stream_sync(w->stream);
    if (he) st = kiln_hal_status_from_error(he, "stream_sync");
  }
  return st;
}

static void *tp_main(void *arg) {
  tp_worker_t *w = arg;
  kiln_tp_ranks_t *t = w->t;
  const kiln_hal_backend_t *be = t->o.backend;
  const int32_t di = t->o.same_device ? t->o.device_index : t->o.device_index + w->rank;
  kiln_hal_error_t *he = be->device_open(di, &w->dev);
  if (!he) he = be->stream_create(w->dev, &w->stream);
  kiln_status_t st = he ? kiln_hal_status_from_error(he, "opening the device") : NULL;
  if (st) st = kiln_status_annotate(st, "device %d", (int)di);
  pthread_mutex_lock(&w->mu);
  w->st = st;
  w->opened = true;
  pthread_cond_broadcast(&w->cv);
  for (;;) {
    while (w->cmd == TP_IDLE) pthread_cond_wait(&w->cv, &w->mu);
    const int32_t cmd = w->cmd;
    if (cmd == TP_QUIT) break;
    pthread_mutex_unlock(&w->mu);
    st = w->dev && w->stream ? tp_run(w, cmd) : NULL;
    pthread_mutex_lock(&w->mu);
    kiln_status_free(w->st);
    w->st = st;
    w->cmd = TP_IDLE;
    pthread_cond_broadcast(&w->cv);
  }
  pthread_mutex_unlock(&w->mu);
  /* The KV cache before its model, the model before the communicator it borrows. */
  kiln_kv_cache_free(w->kv);
  kiln_model_free(w->model);
  if (w->comm) be->comm_destroy(w->comm);
  if (w->stream) be->stream_destroy(w->stream);
  if (w->dev) be->device_close(w->dev);
  return NULL;
}

static void tp_post(tp_worker_t *w, int32_t cmd) {
  pthread_mutex_lock(&w->mu);
  while (w->cmd != TP_IDLE) pthread_cond_wait(&w->cv, &w->mu);
  w->cmd = cmd;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Waits for w's command; its error (taken), annotated with the rank. */
static kiln_status_t tp_result(tp_worker_t *w) {
  pthread_mutex_lock(&w->mu);
  while (w->cmd != TP_IDLE) pthread_cond_wait(&w->cv, &w->mu);
  kiln_status_t st = w->st;
  w->st = NULL;
  pthread_mutex_unlock(&w->mu);
  return st ? kiln_status_annotate(st, "tensor parallelism: rank %d", (int)w->rank) : NULL;
}

/* Waits for every worker; the first error (by rank) is kept, the others freed. */
static kiln_status_t tp_results(kiln_tp_ranks_t *t, kiln_status_t first) {
  for (int32_t i = 0; i < t->num_workers; i++) {
    kiln_status_t st = tp_result(&t->w[i]);
    if (!first)
      first = st;
    else
      kiln_status_free(st);
  }
  return first;
}

void kiln_tp_ranks_free(kiln_tp_ranks_t *t) {
  if (!t) return;
  for (int32_t i = 0; i < t->num_workers; i++) {
    tp_worker_t *w = &t->w[i];
    if (w->started) {
      tp_post(w, TP_QUIT); /* after any command in flight */
      pthread_join(w->thread, NULL);
    }
    kiln_status_free(w->st);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
  }
  free(t->w);
  free(t);
}

kiln_status_t kiln_tp_ranks_start(const kiln_tp_options_t *o, kiln_hal_device_t *dev0,
                                  kiln_hal_comm_t **out_comm0, kiln_tp_ranks_t **out) {
  *out = NULL;
  *out_comm0 = NULL;
  const kiln_hal_backend_t *be = o->backend;
  if (!KILN_HAL_HAS(be, comm_create) || !be->comm_get_unique_id || !be->comm_create ||
      !be->comm_destroy || !KILN_HAL_HAS(be, all_reduce) || !be->all_reduce)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "[parallel] tensor_parallel_size = %d: backend %s has no collectives "
                            "(hal.h ABI 1.5); use tensor_parallel_size = 1 or a backend with them",
                            (int)o->tp_size, be->name);
  if (o->tp_size < 2 || o->tp_size > KILN_HAL_COMM_MAX_RANKS)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "[parallel] tensor_parallel_size = %d: must be 1..%d", (int)o->tp_size,
                            KILN_HAL_COMM_MAX_RANKS);
  kiln_tp_ranks_t *t = calloc(1, sizeof(*t));
  if (!t || !(t->w = calloc((size_t)o->tp_size - 1, sizeof(*t->w)))) {
    free(t);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "tensor parallelism: out of memory");
  }
  t->o = *o;
  t->o.model.capture_sizes = NULL; /* borrowed for rank 0's load only; graphs are off under TP */
  t->o.model.num_capture_sizes = 0;
  kiln_hal_error_t *he = be->comm_get_unique_id(&t->id);
  kiln_status_t st = he ? kiln_hal_status_from_error(he, "comm_get_unique_id") : NULL;
  for (int32_t i = 0; i < o->tp_size - 1; i++) {
    tp_worker_t *w = &t->w[i];
    w->t = t;
    w->rank = i + 1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    t->num_workers = i + 1;
    if (st) continue;
    if (pthread_create(&w->thread, NULL, tp_main, w) != 0)
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY,
                            "tensor parallelism: cannot start the thread of rank %d", (int)w->rank);
    else
      w->started = true;
  }
  /* Every worker has its device before anyone joins the communicator: a rank that cannot open
   * its device would otherwise leave the others waiting in comm_create until the timeout. */
  for (int32_t i = 0; i < t->num_workers; i++) {
    tp_worker_t *w = &t->w[i];
    if (!w->started) continue;
    pthread_mutex_lock(&w->mu);
    while (!w->opened) pthread_cond_wait(&w->cv, &w->mu);
    kiln_status_t ws = w->st;
    w->st = NULL;
    pthread_mutex_unlock(&w->mu);
    if (ws) ws = kiln_status_annotate(ws, "tensor parallelism: rank %d", (int)w->rank);
    if (!st)
      st = ws;
    else
      kiln_status_free(ws);
  }
  if (st) {
    kiln_tp_ranks_free(t);
    return st;
  }
  for (int32_t i = 0; i < t->num_workers; i++) tp_post(&t->w[i], TP_JOIN);
  kiln_hal_comm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.world_size = o->tp_size;
  a.rank = 0;
  a.timeout_ms = o->timeout_ms;
  a.id = t->id;
  if ((he = be->comm_create(dev0, &a, out_comm0))) {
    /* The workers' comm_create fails too (rank 0 never arrives): wait for them, then go. */
    st = kiln_status_annotate(kiln_hal_status_from_error(he, "comm_create"),
                              "tensor parallelism: rank 0");
    kiln_status_free(tp_results(t, NULL));
    kiln_tp_ranks_free(t);
    *out_comm0 = NULL;
    return st;
  }
  *out = t;
  return NULL;
}

kiln_status_t kiln_tp_ranks_wait(kiln_tp_ranks_t *t) { return tp_results(t, NULL); }

void kiln_tp_ranks_memory(const kiln_tp_ranks_t *t, int32_t rank, uint64_t *out_free,
                          uint64_t *out_total) {
  const tp_worker_t *w = &t->w[rank - 1];
  *out_free = w->mem_free;
  *out_total = w->mem_total;
}

typedef struct tp_runner {
  model_runner_t r0; /* rank 0, in the calling thread */
  kiln_tp_ranks_t *t;
} tp_runner_t;

static kiln_status_t tpr_forward(void *ctx, const kiln_batch_t *b) {
  tp_runner_t *r = ctx;
  kiln_tp_ranks_t *t = r->t;
  for (int32_t i = 0; i < t->num_workers; i++) {
    t->w[i].batch = b; /* read by the worker only while the command is set */
    tp_post(&t->w[i], TP_FORWARD);
  }
  kiln_status_t st = kiln_model_forward(r->r0.m, r->r0.kv, b);
  if (st) st = kiln_status_annotate(st, "tensor parallelism: rank 0");
  return tp_results(t, st);
}

static kiln_status_t tpr_copy_blocks(void *ctx, const int32_t *src, const int32_t *dst,
                                     int32_t n) {
  tp_runner_t *r = ctx;
  kiln_tp_ranks_t *t = r->t;
  for (int32_t i = 0; i < t->num_workers; i++) {
    t->w[i].src = src;
    t->w[i].dst = dst;
    t->w[i].n = n;
    tp_post(&t->w[i], TP_COPY);
  }
  kiln_status_t st = kiln_kv_cache_copy_blocks(r->r0.kv, src, dst, n);
  if (st) st = kiln_status_annotate(st, "tensor parallelism: rank 0");
  return tp_results(t, st);
}

static void tpr_logits(void *ctx, int32_t rows, kiln_sample_logits_t *out) {
  tp_runner_t *r = ctx;
  mr_logits(&r->r0, rows, out); /* every rank holds the full logits: rank 0's feed the sampler */
}

static void tpr_destroy(void *ctx) {
  tp_runner_t *r = ctx;
  kiln_tp_ranks_free(r->t);
  free(r);
}

kiln_status_t kiln_runner_tp_init(kiln_runner_t *r, kiln_tp_ranks_t *t, int32_t num_blocks,
                                  int32_t block_size, kiln_model_t *m, kiln_kv_cache_t *kv,
                                  const kiln_hal_backend_t *backend, kiln_hal_device_t *device,
                                  kiln_hal_stream_t *stream, int32_t max_logits) {
  memset(r, 0, sizeof(*r));
  for (int32_t i = 0; i < t->num_workers; i++) {
    t->w[i].num_blocks = num_blocks;
    t->w[i].block_size = block_size;
    tp_post(&t->w[i], TP_KV);
  }
  kiln_status_t st = tp_results(t, NULL);
  tp_runner_t *c = st ? NULL : calloc(1, sizeof(*c));
  if (!st && !c) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "runner: out of memory");
  if (st) {
    kiln_tp_ranks_free(t);
    return st;
  }
  runner_fill(r, &c->r0, m, kv, backend, device, stream, max_logits);
  c->t = t;
  r->ctx = c;
  r->forward = tpr_forward;
  r->copy_blocks = tpr_copy_blocks;
  r->logits = tpr_logits;
  r->destroy = tpr_destroy;
  return NULL;
}
