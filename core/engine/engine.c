/* engine.c - libkiln's public engine (include/kiln/kiln.h): requests in, one engine thread
 * stepping the model over the scheduler's batches, outputs out.
 *
 * One step, on the engine thread:
 *   1. intake: move submitted requests into the scheduler's waiting queue; finish cancelled
 *      ones (their blocks go back now);
 *   2. schedule: the scheduler picks sequences and token counts (core/sched);
 *   3. build the flattened batch (ids, positions, slots, block tables, logits rows), run the
 *      copy-on-write block copies, then the forward;
 *   4. mark the tokens computed (full blocks enter the prefix cache); fork n > 1 prompts;
 *   5. sample every sequence that completed its tokens (core/sample), score prompt rows;
 *   6. append tokens, check stop conditions, turn new tokens into text (core/engine/textout),
 *      and deliver one event per sequence that produced something.
 * Requests reach the engine through a mutex-guarded inbox; events leave through callbacks or
 * per-request queues. Every accepted request ends with exactly one request_finished event.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "base/arena.h"
#include "core/engine/draft.h"
#include "core/engine/engine_internal.h"
#include "core/engine/metrics.h"
#include "core/engine/textout.h"
#include "core/guide/guide.h"
#include "core/sample/beam.h"
#include "base/log.h"
#include "core/sched/scheduler.h"
#include "base/strbuf.h"
#include "hal/loader.h"
#include "kiln/hal_util.h"
#include "models/hub/hub.h"
#include "models/loader/gguf.h"
#include "models/model_tokenizer.h"
#include "models/mrope.h"
#include "models/rope.h"
#include "models/template/template.h"
#include "models/vision/preproc.h"
#include "models/vision/vision.h"

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#define PROMPT_ROWS 512 /* logits rows per step for prompt logprobs */

/* ---- requests ----------------------------------------------------------------------------- */

/* One image of a request: its patches (kept for a re-encode after preemption or eviction) and,
 * while its tokens await prefill, the vision tower's output for them on the device (the
 * encoder cache: kiln_engine.enc_used counts every such buffer against enc_cap). */
typedef struct req_image {
  float *pixels; /* [t * h * w, patch_dim] */
  int32_t grid_t, grid_h, grid_w;
  int32_t start, ntok; /* its tokens in the expanded prompt */
  uint64_t enc_bytes;  /* the output's size */
  kiln_hal_buffer_t *enc;
  uint64_t enc_step; /* the step that last needed it */
} req_image_t;

typedef struct seq_state {
  uint64_t rng;
  int32_t num_out;
  kiln_textout_t *text;
  kiln_finish_reason_t finish;
  int32_t stop_token, stop_index;
  bool done; /* final event delivered */
  /* this step's result */
  bool has_token;
  int32_t token;
  float logprob;
  int32_t *top_ids;
  float *top_lps;
  /* constrained decoding: the sequence's matcher, and this step's mask job's error */
  kiln_guide_matcher_t *gm;
  const char *gerr;
  /* speculative decoding's draft model: what its KV cache holds of this sequence */
  kiln_draft_seq_t dseq;
} seq_state_t;

struct kiln_request {
  atomic_int refs;
  atomic_bool cancel;
  kiln_engine_t *eng;
  uint64_t seqno;
  kiln_sampling_params_t p; /* pointers below are owned copies */
  int32_t *stop_ids;
  char **stop;
  int32_t *bias_ids;
  float *bias_values;
  int32_t *prompt;
  int32_t num_prompt;
  /* images (vision-language models): the prompt is expanded, each image's placeholder become
   * its tokens; mrope [3 * num_prompt] are the prompt's M-RoPE positions, a generated token at
   * KV position p has p + mrope_delta on all three axes */
  req_image_t *imgs;
  kiln_seq_image_t *simgs; /* [num_imgs] for the prefix cache's hashes */
  int32_t num_imgs;
  int32_t *mrope;
  int32_t mrope_delta;
  int32_t max_tokens;  /* resolved */
  int32_t spec_k;      /* most proposals per step (0 = this request does not speculate) */
  kiln_guide_t *guide; /* constrained decoding (released when the request ends) */
  /* beam search (p.beam_width > 0; p.n is then the beam width, beam_n the sequences to
   * return): the search, each running beam's last logits row and whether it has it */
  kiln_beam_t *beam;
  int32_t beam_n;
  float *blogits; /* [W, V] */
  bool *bhave;    /* [W] */
  int32_t *bparent, *btoken;
  bool beam_touched; /* a beam got its row this step */
  uint64_t seed;
  kiln_output_fn cb;
  kiln_notify_fn notify; /* poll mode: called after each event is queued */
  void *user;
  /* engine thread */
  kiln_seq_t *seqs; /* [n] */
  seq_state_t *ss;  /* [n] */
  int32_t num_live; /* sequences created (1 until the fork, then n) */
  int32_t num_done;
  bool started, plp_sent;
  bool lost;        /* a sequence's final event could not be made: the request ends with an error */
  float *plp;       /* [P-1] prompt logprobs */
  int32_t plp_rows; /* prompt rows scored so far */
  int32_t *plp_ids; /* [P-1, k] */
  float *plp_top;
  double t_arrival, t_sched, t_first, t_last;
  kiln_request_t *next, *prev; /* inbox, then the active list */
  struct ev_node *spare; /* poll mode: a final event kept for when no other can be allocated */
  /* poll queue */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct ev_node *q_head, *q_tail;
  bool q_closed;
};

typedef struct ev_node {
  kiln_output_t out;
  struct ev_node *next;
} ev_node_t;

/* ---- the engine --------------------------------------------------------------------------- */

struct kiln_engine {
  kiln_config_t *own_config;
  /* device + model (when loaded from the config) */
  kiln_hal_registry_t *registry;
  const kiln_hal_plugin_t *plugin;
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  kiln_model_t *model;
  kiln_kv_cache_t *kvc;
  /* [parallel] tensor_parallel_size > 1: ranks 1..N-1 until the TP runner takes them (tp),
   * rank 0's communicator (tp_comm, destroyed after the model that borrows it), N (tp_size) */
  kiln_tp_ranks_t *tp;
  kiln_hal_comm_t *tp_comm;
  int32_t tp_size;
  kiln_tokenizer_t *own_tok;
  const kiln_tokenizer_t *tok;
  kiln_chat_template_t *chat; /* NULL: the tokenizer directory has no chat template */
  char *chat_error;           /* why the template failed to load, or NULL */
  char *model_path, *model_name, *device_name;
  const char *backend_name;
  int32_t *eos;
  int32_t num_eos;
  /* images: the processor's settings (has_preproc; else preproc_error says why not), the
   * encoder cache's bound and use (bytes, engine thread) */
  bool has_vision, has_preproc;
  kiln_vision_preproc_t preproc;
  char *preproc_error;
  int32_t max_images;
  uint64_t enc_cap, enc_used, step_no;
  uint64_t enc_encodes, enc_evictions;
  int32_t *b_mrope; /* [3 * max_tokens] */
  /* constrained decoding: the vocabulary index (made at the first guided request, under gmu),
   * one mask per step item, and the threads that compute them during the forward */
  pthread_mutex_t gmu;
  kiln_guide_vocab_t *gvocab;
  uint32_t *gmask; /* [max_seqs, mask words] */
  struct guide_pool *gpool;
  struct guide_job *gjobs;    /* [max_seqs] this step's */
  /* the thread that classifies a newly compiled constraint's first contexts while its prompt
   * is prefilled ([engine] guide_precompute_ms; 0 = none), made with gpool */
  struct guide_pre *gpre;
  int32_t guide_pre_ms;
  const uint32_t **item_mask; /* [max_seqs] the mask of step item s, or NULL */
  /* the engine proper */
  kiln_runner_t runner;
  kiln_kv_manager_t *kv;
  kiln_scheduler_t *sched;
  kiln_sampler_t *sampler;
  int32_t bs, max_seqs, max_tokens, max_blocks, max_logits, vocab;
  /* speculative decoding ([speculative]): k (0 = off), the n-gram lengths, the batch size
   * above which a step does not speculate, the logits rows one step may give to proposals */
  int32_t spec_k, spec_min, spec_max, spec_batch, spec_rows;
  /* method = draft: the draft model, its KV cache, its runner and block manager (draft), and
   * the per-step proposal requests (the running sequence of each, and room for k tokens) */
  bool spec_draft, force_host;
  int32_t dmax; /* most sequences a step proposes for: min(disable_by_batch_size, max_num_seqs) */
  kiln_model_t *dmodel;
  kiln_kv_cache_t *dkvc;
  kiln_draft_t *draft;
  kiln_draft_req_t *dreqs;
  kiln_seq_t **dseqs;
  int32_t *dbuf;
  char *draft_path;
  int64_t max_len;
  bool chunked;
  int32_t max_queued;
  uint64_t seed;
  bool manual;
  bool host_memory; /* the device computes in host memory (the CPU backend): no warm-up by default */
  /* per-step scratch */
  kiln_arena_t arena;
  int32_t *b_ids, *b_pos, *b_slots, *b_lens, *b_qsl, *b_tables, *b_rows;
  kiln_sample_row_t *srows;
  kiln_score_row_t *crows;
  kiln_seq_t **sseqs; /* sequence of each sample row */
  int32_t *sdraft;    /* per sample row: the proposals it verifies with the rows after it (a
                         sequence's first row), or -1 (a later row of the same group) */
  int32_t *c_pos;     /* prompt position of each score row */
  int32_t *item_row;  /* [max_seqs] the logits row each sampling item samples from */
  int32_t max_top;
  kiln_seq_t **cseqs;
  kiln_sample_out_t so;
  /* shared with other threads */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  kiln_request_t *in_head, *in_tail;
  int32_t intake_holds; /* kiln_engine_hold_intake: while > 0, in_head waits for the release */
  bool stop;
  pthread_t thread;
  bool thread_started;
  atomic_int num_queued;
  atomic_uint_fast64_t next_seqno;
  kiln_metrics_t metrics; /* under mu */
  /* engine thread */
  kiln_request_t *act_head, *act_tail;
};

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void kiln_sampling_params_init(kiln_sampling_params_t *p) {
  memset(p, 0, sizeof(*p));
  p->struct_size = sizeof(*p);
  p->n = 1;
  p->max_tokens = 16;
  p->temperature = 1.0f;
  p->top_p = 1.0f;
  p->repetition_penalty = 1.0f;
  p->skip_special_tokens = true;
  p->detokenize = true;
  p->logprobs = -1;
  p->prompt_logprobs = -1;
  p->num_speculative_tokens = -1;
  p->length_penalty = 1.0f;
}

const char *kiln_finish_reason_name(kiln_finish_reason_t r) {
  switch (r) {
    case KILN_FINISH_STOP: return "stop";
    case KILN_FINISH_LENGTH: return "length";
    case KILN_FINISH_ABORT: return "abort";
    case KILN_FINISH_ERROR: return "error";
    default: return NULL;
  }
}

uint64_t kiln_engine_seq_seed(uint64_t seed, int32_t index) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (uint64_t)(index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

kiln_kv_manager_t *kiln_engine_kv(kiln_engine_t *eng) { return eng->kv; }

kiln_kv_manager_t *kiln_engine_draft_kv(kiln_engine_t *eng) {
  return eng->draft ? kiln_draft_kv(eng->draft) : NULL;
}

/* ---- constrained decoding: masks computed while the forward runs ------------------------- */

/* One mask to compute: the allowed tokens of a matcher, plus the end-of-sequence tokens when
 * the constraint accepts. */
typedef struct guide_job {
  kiln_guide_matcher_t *m;
  uint32_t *mask;
  const kiln_request_t *r;
  const char *err; /* set when it failed */
} guide_job_t;

#define GUIDE_THREADS 2

/* Worker threads that take jobs from a batch while the engine thread runs the forward; the
 * engine thread then takes what is left and waits for the rest (guide_pool_wait). */
typedef struct guide_pool {
  pthread_t thr[GUIDE_THREADS];
  int nthr;
  pthread_mutex_t mu;
  pthread_cond_t work, done;
  guide_job_t *jobs;
  int32_t njobs, ndone;
  atomic_int next;
  uint64_t gen;
  bool stop;
  const kiln_engine_t *e;
} guide_pool_t;

static void guide_job_run(const kiln_engine_t *e, guide_job_t *j) {
  kiln_status_t st = kiln_guide_matcher_fill_mask(j->m, j->mask);
  if (st) {
    j->err = kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY
                 ? "out of memory computing the constraint's token mask"
                 : "the constraint's token mask could not be computed";
    kiln_log(KILN_LOG_ERROR, "guide: %s", kiln_status_message(st));
    kiln_status_free(st);
    return;
  }
  const kiln_request_t *r = j->r;
  if (kiln_guide_matcher_accepting(j->m)) {
    for (int32_t i = 0; !r->p.ignore_eos && i < e->num_eos; i++)
      if (e->eos[i] >= 0 && e->eos[i] < e->vocab) j->mask[e->eos[i] >> 5] |= 1u << (e->eos[i] & 31);
    for (int32_t i = 0; i < r->p.num_stop_token_ids; i++)
      j->mask[r->stop_ids[i] >> 5] |= 1u << (r->stop_ids[i] & 31);
  }
  uint32_t any = 0;
  for (int32_t w = 0; w < (e->vocab + 31) / 32; w++) any |= j->mask[w];
  if (!any)
    j->err = kiln_guide_matcher_accepting(j->m)
                 ? "the constraint's output is complete but end of sequence is not allowed "
                   "(ignore_eos): nothing may follow"
                 : "no token of the vocabulary can continue the constrained output";
}

/* Runs jobs of the current batch until none is left; returns how many it ran. */
static int32_t guide_pool_take(guide_pool_t *p) {
  int32_t n = 0;
  for (;;) {
    int32_t i = atomic_fetch_add(&p->next, 1);
    if (i >= p->njobs) return n;
    guide_job_run(p->e, &p->jobs[i]);
    n++;
  }
}

static void *guide_pool_main(void *arg) {
  guide_pool_t *p = arg;
  uint64_t seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && p->gen == seen) pthread_cond_wait(&p->work, &p->mu);
    if (p->stop) break;
    seen = p->gen;
    pthread_mutex_unlock(&p->mu);
    int32_t n = guide_pool_take(p);
    pthread_mutex_lock(&p->mu);
    p->ndone += n;
    if (p->ndone >= p->njobs) pthread_cond_broadcast(&p->done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

static void guide_pool_free(guide_pool_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = true;
  pthread_cond_broadcast(&p->work);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->nthr; i++) pthread_join(p->thr[i], NULL);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->work);
  pthread_cond_destroy(&p->done);
  free(p);
}

static guide_pool_t *guide_pool_create(const kiln_engine_t *e) {
  guide_pool_t *p = calloc(1, sizeof(*p));
  if (!p) return NULL;
  p->e = e;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->work, NULL);
  pthread_cond_init(&p->done, NULL);
  atomic_init(&p->next, 0);
  for (int i = 0; i < GUIDE_THREADS; i++) {
    if (pthread_create(&p->thr[i], NULL, guide_pool_main, p) != 0) break;
    p->nthr++;
  }
  return p; /* with no thread, the engine thread runs every job itself */
}

/* Hands a batch of jobs to the workers (they start now). */
static void guide_pool_start(guide_pool_t *p, guide_job_t *jobs, int32_t n) {
  pthread_mutex_lock(&p->mu);
  p->jobs = jobs;
  p->njobs = n;
  p->ndone = 0;
  atomic_store(&p->next, 0);
  p->gen++;
  pthread_cond_broadcast(&p->work);
  pthread_mutex_unlock(&p->mu);
}

/* Runs what the workers have not taken, then waits for the rest. */
static void guide_pool_wait(guide_pool_t *p) {
  int32_t n = guide_pool_take(p);
  pthread_mutex_lock(&p->mu);
  p->ndone += n;
  while (p->ndone < p->njobs) pthread_cond_wait(&p->done, &p->mu);
  p->njobs = 0;
  p->jobs = NULL;
  pthread_mutex_unlock(&p->mu);
}

/* ---- constrained decoding: a constraint's first contexts classified ahead ------------------ */

/* At most this many matcher states per constraint (as kiln-bench-guide's KILN_BENCH_PRECOMPUTE,
 * docs/perf.md); the time budget is [engine] guide_precompute_ms. */
#define GUIDE_PRE_STATES 4096

typedef struct guide_pre_job {
  kiln_guide_t *g; /* the job's own reference: the request may end first */
  struct guide_pre_job *next;
} guide_pre_job_t;

/* One thread taking constraints from a FIFO: kiln_guide_precompute over each, until the budget
 * or the stop flag (set at engine destroy, which then joins it). Its errors (out of memory)
 * are logged and dropped: the masks are the same without it. */
typedef struct guide_pre {
  pthread_t thr;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  guide_pre_job_t *head, *tail;
  atomic_bool stop;
  int64_t budget_us;
  kiln_engine_t *e; /* its metrics, under e->mu */
} guide_pre_t;

static void *guide_pre_main(void *arg) {
  guide_pre_t *p = arg;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!atomic_load(&p->stop) && !p->head) pthread_cond_wait(&p->cv, &p->mu);
    if (atomic_load(&p->stop)) break;
    guide_pre_job_t *j = p->head;
    p->head = j->next;
    if (!p->head) p->tail = NULL;
    pthread_mutex_unlock(&p->mu);
    int32_t states = 0;
    kiln_status_t st =
        kiln_guide_precompute(j->g, GUIDE_PRE_STATES, p->budget_us, &p->stop, &states);
    if (st) {
      kiln_log(KILN_LOG_WARN, "guide precompute: %s (ignored)", kiln_status_message(st));
      kiln_status_free(st);
    }
    kiln_guide_release(j->g);
    free(j);
    pthread_mutex_lock(&p->e->mu);
    p->e->metrics.guide_precompute_jobs++;
    p->e->metrics.guide_precompute_states += (uint64_t)states;
    pthread_mutex_unlock(&p->e->mu);
    pthread_mutex_lock(&p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

static guide_pre_t *guide_pre_create(kiln_engine_t *e) {
  guide_pre_t *p = calloc(1, sizeof(*p));
  if (!p) return NULL;
  p->e = e;
  p->budget_us = (int64_t)e->guide_pre_ms * 1000;
  atomic_init(&p->stop, false);
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  if (pthread_create(&p->thr, NULL, guide_pre_main, p) != 0) {
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
    return NULL;
  }
  return p;
}

/* Stops the thread (a running precomputation ends at its next state) and drops the queue. */
static void guide_pre_free(guide_pre_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  atomic_store(&p->stop, true);
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  pthread_join(p->thr, NULL);
  while (p->head) {
    guide_pre_job_t *j = p->head;
    p->head = j->next;
    kiln_guide_release(j->g);
    free(j);
  }
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  free(p);
}

/* Queues g for precomputation unless it was queued (or done) before: a compile served from the
 * vocabulary's cache returns the same object. Out of memory: skipped. */
static void guide_pre_submit(guide_pre_t *p, kiln_guide_t *g) {
  if (!p || !kiln_guide_claim_precompute(g)) return;
  guide_pre_job_t *j = malloc(sizeof(*j));
  if (!j) return;
  j->g = kiln_guide_retain(g);
  j->next = NULL;
  pthread_mutex_lock(&p->mu);
  if (p->tail)
    p->tail->next = j;
  else
    p->head = j;
  p->tail = j;
  pthread_cond_signal(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

/* The vocabulary index and the mask workers, made at the first guided request. */
static kiln_status_t guide_setup(kiln_engine_t *e) {
  pthread_mutex_lock(&e->gmu);
  kiln_status_t st = NULL;
  if (!e->gvocab) {
    kiln_guide_vocab_t *v = NULL;
    st = kiln_guide_vocab_create(e->tok, e->vocab, &v);
    uint32_t *m = st ? NULL : malloc((size_t)e->max_seqs * (size_t)kiln_guide_mask_words(v) * 4);
    guide_job_t *jobs = st ? NULL : calloc((size_t)e->max_seqs, sizeof(*jobs));
    const uint32_t **im = st ? NULL : calloc((size_t)e->max_seqs, sizeof(*im));
    guide_pool_t *pool = st || !m || !jobs || !im ? NULL : guide_pool_create(e);
    if (!st && !pool) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "constrained decoding: out of memory");
      free(m);
      free(jobs);
      free(im);
      kiln_guide_vocab_free(v);
    } else if (!st) {
      if (e->guide_pre_ms > 0 && !(e->gpre = guide_pre_create(e)))
        kiln_log(KILN_LOG_WARN,
                 "guide precompute: no thread (constraints are classified as their masks need "
                 "them)");
      e->gjobs = jobs;
      e->item_mask = im;
      e->gmask = m;
      e->gpool = pool;
      /* last, released: run_step reads it without the lock */
      __atomic_store_n(&e->gvocab, v, __ATOMIC_RELEASE);
    }
  }
  pthread_mutex_unlock(&e->gmu);
  return st;
}

/* Frees a request's matchers and its compiled constraint (when it ends). */
static void req_guide_free(kiln_request_t *r) {
  for (int32_t i = 0; r->ss && i < r->p.n; i++) {
    kiln_guide_matcher_free(r->ss[i].gm);
    r->ss[i].gm = NULL;
  }
  kiln_guide_release(r->guide);
  r->guide = NULL;
}

/* ---- request lifetime --------------------------------------------------------------------- */

static void ev_free_node(ev_node_t *n) { free(n); }

static void req_free(kiln_request_t *r) {
  int32_t n = r->p.n;
  req_guide_free(r);
  if (r->seqs)
    for (int32_t i = 0; i < n; i++) kiln_seq_free(&r->seqs[i]);
  if (r->ss)
    for (int32_t i = 0; i < n; i++) {
      kiln_textout_free(r->ss[i].text);
      free(r->ss[i].top_ids);
      free(r->ss[i].top_lps);
    }
  for (ev_node_t *e = r->q_head, *nx; e; e = nx) {
    nx = e->next;
    ev_free_node(e);
  }
  if (r->stop)
    for (int32_t i = 0; i < r->p.num_stop; i++) free(r->stop[i]);
  free(r->stop);
  free(r->stop_ids);
  free(r->bias_ids);
  free(r->bias_values);
  free(r->prompt);
  for (int32_t i = 0; r->imgs && i < r->num_imgs; i++) free(r->imgs[i].pixels);
  free(r->imgs);
  free(r->simgs);
  free(r->mrope);
  free(r->seqs);
  free(r->ss);
  free(r->plp);
  free(r->plp_ids);
  free(r->plp_top);
  free(r->spare);
  kiln_beam_free(r->beam);
  free(r->blogits);
  free(r->bhave);
  free(r->bparent);
  free(r->btoken);
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
  free(r);
}

static void req_unref(kiln_request_t *r) {
  if (r && atomic_fetch_sub(&r->refs, 1) == 1) req_free(r);
}

void kiln_request_release(kiln_request_t *req) { req_unref(req); }

void kiln_request_cancel(kiln_request_t *req) {
  if (!req) return;
  atomic_store(&req->cancel, true);
  kiln_engine_t *e = req->eng;
  pthread_mutex_lock(&e->mu);
  pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

void kiln_output_free(kiln_output_t *out) {
  if (out) ev_free_node((ev_node_t *)out); /* out is the node's first member */
}

kiln_status_t kiln_request_poll(kiln_request_t *r, int64_t timeout_ms, kiln_output_t **out) {
  *out = NULL;
  if (r->cb)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "poll: the request delivers its outputs to a callback");
  pthread_mutex_lock(&r->mu);
  if (timeout_ms != 0 && !r->q_head && !r->q_closed) {
    if (timeout_ms < 0) {
      while (!r->q_head && !r->q_closed) pthread_cond_wait(&r->cv, &r->mu);
    } else {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_sec += timeout_ms / 1000;
      ts.tv_nsec += (timeout_ms % 1000) * 1000000L;
      if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
      }
      while (!r->q_head && !r->q_closed)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) != 0) break;
    }
  }
  ev_node_t *n = r->q_head;
  if (n) {
    r->q_head = n->next;
    if (!r->q_head) r->q_tail = NULL;
    n->next = NULL;
    *out = &n->out;
  }
  pthread_mutex_unlock(&r->mu);
  return NULL;
}

/* ---- events ------------------------------------------------------------------------------- */

/* Builds one event in a single allocation (kiln_output_free frees it). */
static ev_node_t *ev_make(kiln_request_t *r, int32_t index, const char *text, size_t text_len,
                          bool with_plp, const char *error) {
  seq_state_t *ss = &r->ss[index];
  int32_t nt = ss->has_token ? 1 : 0;
  int32_t k = r->p.logprobs > 0 ? r->p.logprobs : 0;
  bool lp = r->p.logprobs >= 0 && nt;
  int32_t np = with_plp ? r->num_prompt - 1 : 0;
  int32_t pk = with_plp && r->p.prompt_logprobs > 0 ? r->p.prompt_logprobs : 0;
  size_t elen = error ? strlen(error) + 1 : 0;
  /* The matched stop string is copied too: the event may outlive the request's handle. */
  const char *stop =
      ss->finish == KILN_FINISH_STOP && ss->stop_index >= 0 ? r->stop[ss->stop_index] : NULL;
  size_t slen = stop ? strlen(stop) + 1 : 0;
  size_t sz = sizeof(ev_node_t) + (size_t)nt * 4 + (lp ? (size_t)nt * 4 * (1 + 2 * (size_t)k) : 0) +
              (size_t)np * 4 * (1 + 2 * (size_t)pk) + text_len + 1 + elen + slen + 16;
  ev_node_t *n = calloc(1, sz);
  if (!n) return NULL;
  char *p = (char *)(n + 1);
  kiln_output_t *o = &n->out;
  o->request = r;
  o->request_seq = r->seqno;
  o->user = r->user;
  o->index = index;
  o->stop_token = -1;
  if (nt) {
    int32_t *ids = (int32_t *)p;
    ids[0] = ss->token;
    o->token_ids = ids;
    o->num_tokens = 1;
    p += 4;
    if (lp) {
      float *l = (float *)p;
      l[0] = ss->logprob;
      o->logprobs = l;
      p += 4;
      if (k) {
        memcpy(p, ss->top_ids, (size_t)k * 4);
        o->top_ids = (int32_t *)p;
        p += (size_t)k * 4;
        memcpy(p, ss->top_lps, (size_t)k * 4);
        o->top_logprobs = (float *)p;
        p += (size_t)k * 4;
        o->top_n = k;
      }
    }
  }
  if (np > 0) {
    memcpy(p, r->plp, (size_t)np * 4);
    o->prompt_logprobs = (float *)p;
    p += (size_t)np * 4;
    if (pk) {
      memcpy(p, r->plp_ids, (size_t)np * pk * 4);
      o->prompt_top_ids = (int32_t *)p;
      p += (size_t)np * pk * 4;
      memcpy(p, r->plp_top, (size_t)np * pk * 4);
      o->prompt_top_logprobs = (float *)p;
      p += (size_t)np * pk * 4;
      o->prompt_top_n = pk;
    }
    o->num_prompt_logprobs = np;
  }
  if (text_len) memcpy(p, text, text_len);
  p[text_len] = '\0';
  o->text = p;
  o->text_len = text_len;
  p += text_len + 1;
  if (error) {
    memcpy(p, error, elen);
    o->error = p;
    p += elen;
  }
  if (stop) {
    memcpy(p, stop, slen);
    o->stop_str = p;
  }
  o->finish_reason = ss->finish;
  if (ss->finish == KILN_FINISH_STOP) o->stop_token = ss->stop_index < 0 ? ss->stop_token : -1;
  o->usage.prompt_tokens = r->num_prompt;
  for (int32_t i = 0; i < r->num_live; i++) o->usage.completion_tokens += r->ss[i].num_out;
  o->usage.cached_tokens = r->seqs[0].num_cached;
  double now = now_s();
  o->queue_time = r->t_sched > 0 ? r->t_sched - r->t_arrival : 0;
  o->first_token_time = r->t_first > 0 ? r->t_first - r->t_arrival : 0;
  o->time = now - r->t_arrival;
  return n;
}

/* Hands an event to the request's callback or queue. The request_finished event closes it. */
static void ev_deliver(kiln_request_t *r, ev_node_t *n) {
  if (r->cb) {
    r->cb(r->user, &n->out);
    ev_free_node(n);
    return;
  }
  pthread_mutex_lock(&r->mu);
  if (r->q_tail)
    r->q_tail->next = n;
  else
    r->q_head = n;
  r->q_tail = n;
  if (n->out.request_finished) r->q_closed = true;
  pthread_cond_broadcast(&r->cv);
  /* Under the lock, so no notification can follow the poll that takes the final event. */
  if (r->notify) r->notify(r->user);
  pthread_mutex_unlock(&r->mu);
}

/* The last resort when an event cannot be allocated: the request still gets closed. */
static void ev_deliver_final_oom(kiln_request_t *r) {
  static const char msg[] = "out of memory while delivering an output";
  if (r->cb) {
    kiln_output_t o;
    memset(&o, 0, sizeof(o));
    o.request = r;
    o.request_seq = r->seqno;
    o.user = r->user;
    o.text = "";
    o.finish_reason = KILN_FINISH_ERROR;
    o.error = msg;
    o.stop_token = -1;
    o.request_finished = true;
    r->cb(r->user, &o);
    return;
  }
  /* Poll mode: the final event allocated at submission for exactly this case. */
  ev_node_t *n = r->spare;
  r->spare = NULL;
  if (n) {
    kiln_output_t *o = &n->out;
    memset(n, 0, sizeof(*n));
    o->request = r;
    o->request_seq = r->seqno;
    o->user = r->user;
    o->text = "";
    o->finish_reason = KILN_FINISH_ERROR;
    o->error = msg;
    o->stop_token = -1;
    o->request_finished = true;
    o->usage.prompt_tokens = r->num_prompt;
  }
  pthread_mutex_lock(&r->mu);
  if (n) {
    if (r->q_tail)
      r->q_tail->next = n;
    else
      r->q_head = n;
    r->q_tail = n;
  }
  r->q_closed = true;
  pthread_cond_broadcast(&r->cv);
  if (r->notify) r->notify(r->user);
  pthread_mutex_unlock(&r->mu);
}

/* ---- finishing ---------------------------------------------------------------------------- */

static void metrics_finish(kiln_engine_t *e, kiln_request_t *r, kiln_finish_reason_t why) {
  pthread_mutex_lock(&e->mu);
  kiln_metrics_t *m = &e->metrics;
  if (why >= 1 && why <= 4) m->requests_finished[why]++;
  kiln_histogram_observe(&m->e2e_latency, now_s() - r->t_arrival);
  pthread_mutex_unlock(&e->mu);
}

static void act_unlink(kiln_engine_t *e, kiln_request_t *r) {
  if (r->prev)
    r->prev->next = r->next;
  else
    e->act_head = r->next;
  if (r->next)
    r->next->prev = r->prev;
  else
    e->act_tail = r->prev;
  r->next = r->prev = NULL;
}

/* ---- the encoder cache --------------------------------------------------------------------- */

/* Frees an image's encoder output. The stream is synchronised first: a forward still in flight
 * may read it. Engine thread. */
static void enc_free(kiln_engine_t *e, req_image_t *im) {
  if (!im->enc) return;
  if (e->runner.backend && e->runner.stream) {
    kiln_hal_error_t *he = e->runner.backend->stream_sync(e->runner.stream);
    if (he) {
      kiln_status_t st = kiln_hal_status_from_error(he, "encoder cache");
      kiln_log(KILN_LOG_WARN, "%s", kiln_status_message(st));
      kiln_status_free(st);
    }
    e->runner.backend->buffer_free(im->enc);
  }
  im->enc = NULL;
  e->enc_used -= im->enc_bytes;
}

static void enc_release_all(kiln_engine_t *e, kiln_request_t *r) {
  for (int32_t i = 0; r->imgs && i < r->num_imgs; i++) enc_free(e, &r->imgs[i]);
}

/* Frees the least recently needed encoder outputs that this step does not need until `need`
 * more bytes fit the bound (or none is left to free: the step's own images always stay). */
static void enc_evict(kiln_engine_t *e, uint64_t need) {
  while (e->enc_used + need > e->enc_cap) {
    req_image_t *best = NULL;
    for (kiln_request_t *r = e->act_head; r; r = r->next)
      for (int32_t i = 0; i < r->num_imgs; i++) {
        req_image_t *im = &r->imgs[i];
        if (im->enc && im->enc_step != e->step_no && (!best || im->enc_step < best->enc_step))
          best = im;
      }
    if (!best) return;
    enc_free(e, best);
    e->enc_evictions++;
  }
}

/* Makes sure image im's encoder output is on the device: encodes it (enqueued on the model's
 * stream, ahead of the forward that reads it) unless it still is. */
static kiln_status_t enc_ensure(kiln_engine_t *e, req_image_t *im, int32_t index) {
  im->enc_step = e->step_no;
  if (im->enc) return NULL;
  enc_evict(e, im->enc_bytes);
  const kiln_hal_backend_t *be = e->runner.backend;
  kiln_hal_error_t *he = be->buffer_alloc(e->runner.device, im->enc_bytes, 0, &im->enc);
  if (he) {
    im->enc = NULL;
    return kiln_status_annotate(kiln_hal_status_from_error(he, "encoder cache"),
                                "image %d: %.1f MiB for its encoder output", index,
                                (double)im->enc_bytes / 1048576.0);
  }
  e->enc_used += im->enc_bytes;
  e->enc_encodes++;
  const int64_t shape[2] = {im->ntok, kiln_model_get_config(e->model)->hidden_size};
  kiln_hal_tensor_t out = kiln_hal_tensor_make(im->enc, 0, kiln_model_dtype(e->model), 2, shape);
  kiln_vision_image_t vi = {im->pixels, im->grid_t, im->grid_h, im->grid_w};
  kiln_status_t st = kiln_vision_encode(e->model, &vi, 1, out);
  if (st) {
    enc_free(e, im);
    return kiln_status_annotate(st, "encoding image %d", index);
  }
  return NULL;
}

/* The step's M-RoPE positions (when a request in it has images) and its rows of image
 * embeddings, encoding the images whose rows the step holds first. */
static kiln_status_t step_images(kiln_engine_t *e, const kiln_sched_step_t *step, int32_t T,
                                 kiln_batch_t *b) {
  bool any = false;
  int32_t runs = 0;
  for (int32_t s = 0; s < step->num_items; s++) {
    const kiln_sched_item_t *it = &step->items[s];
    kiln_request_t *r = it->seq->owner;
    if (!r->mrope) continue;
    any = true;
    for (int32_t i = 0; i < r->num_imgs; i++)
      runs += r->imgs[i].start < it->start + it->count &&
              r->imgs[i].start + r->imgs[i].ntok > it->start;
  }
  if (!any) return NULL;
  int32_t *pt = e->b_mrope, *ph = pt + T, *pw = ph + T;
  kiln_batch_embed_t *em =
      runs ? kiln_arena_alloc(&e->arena, (size_t)runs * sizeof(*em), _Alignof(kiln_batch_embed_t))
           : NULL;
  if (runs && !em) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "images: out of memory");
  int32_t k = 0;
  for (int32_t s = 0; s < step->num_items; s++) {
    const kiln_sched_item_t *it = &step->items[s];
    kiln_request_t *r = it->seq->owner;
    const int32_t row0 = e->b_qsl[s], np = r->num_prompt;
    for (int32_t j = 0; j < it->count; j++) {
      const int32_t pos = it->start + j, t = row0 + j;
      if (r->mrope && pos < np) {
        pt[t] = r->mrope[pos];
        ph[t] = r->mrope[np + pos];
        pw[t] = r->mrope[2 * np + pos];
      } else {
        pt[t] = ph[t] = pw[t] = pos + (r->mrope ? r->mrope_delta : 0);
      }
    }
    for (int32_t i = 0; r->mrope && i < r->num_imgs; i++) {
      req_image_t *im = &r->imgs[i];
      int32_t a = im->start > it->start ? im->start : it->start;
      int32_t z = im->start + im->ntok < it->start + it->count ? im->start + im->ntok
                                                               : it->start + it->count;
      if (a >= z) continue;
      kiln_status_t st = enc_ensure(e, im, i);
      if (st) return st;
      const int64_t shape[2] = {im->ntok, kiln_model_get_config(e->model)->hidden_size};
      em[k++] = (kiln_batch_embed_t){
          .row = row0 + (a - it->start),
          .count = z - a,
          .first = a - im->start,
          .src = kiln_hal_tensor_make(im->enc, 0, kiln_model_dtype(e->model), 2, shape)};
    }
  }
  b->mrope_positions = e->b_mrope;
  b->num_embeds = k;
  b->embeds = em;
  return NULL;
}

/* Frees the encoder outputs whose rows the step's sequences have all computed now. */
static void step_images_done(kiln_engine_t *e, const kiln_sched_step_t *step) {
  for (int32_t s = 0; s < step->num_items; s++) {
    const kiln_seq_t *q = step->items[s].seq;
    kiln_request_t *r = q->owner;
    for (int32_t i = 0; i < r->num_imgs; i++)
      if (r->imgs[i].enc && r->imgs[i].start + r->imgs[i].ntok <= q->num_computed)
        enc_free(e, &r->imgs[i]);
  }
}

/* Ends sequence i of r with `why` (its blocks go back) and delivers its final event with the
 * text still held back; the request's last sequence also ends the request. */
static void seq_end(kiln_engine_t *e, kiln_request_t *r, int32_t i, kiln_finish_reason_t why,
                    const char *error, const char *text, size_t text_len) {
  seq_state_t *ss = &r->ss[i];
  if (ss->done) return;
  kiln_strbuf_t rest = KILN_STRBUF_INIT;
  if (ss->finish == KILN_FINISH_NONE) ss->finish = why;
  if (text_len) kiln_strbuf_append(&rest, text, text_len);
  if (ss->text && ss->stop_index < 0) {
    kiln_status_t st = kiln_textout_finish(ss->text, &rest);
    kiln_status_free(st);
    /* Bytes the detokenizer held to the very end can complete a stop string. */
    int32_t si = kiln_textout_stopped(ss->text);
    if (si >= 0 && ss->finish == KILN_FINISH_LENGTH) {
      ss->finish = KILN_FINISH_STOP;
      ss->stop_index = si;
    }
  }
  if (r->seqs[i].state != KILN_SEQ_FINISHED) kiln_scheduler_finish(e->sched, &r->seqs[i]);
  if (e->draft) kiln_draft_release(e->draft, &ss->dseq);
  ss->done = true;
  r->num_done++;
  /* A request that never forked ends all n at once (its other sequences never existed). */
  bool last = r->num_done == r->num_live;
  if (last && r->num_live < r->p.n) {
    for (int32_t j = r->num_live; j < r->p.n; j++) {
      r->ss[j].finish = ss->finish;
      r->ss[j].done = true;
    }
  }
  if (last && r->lost) {
    ss->finish = KILN_FINISH_ERROR;
    if (!error) error = "out of memory while delivering an output";
  }
  bool with_plp = !r->plp_sent && r->plp && i == 0 && r->plp_rows >= r->num_prompt - 1;
  /* A beam search's beams are not its outputs: only the request's last event goes out (its
   * hypotheses go out through beam_finish instead). */
  ev_node_t *n = r->beam && !last
                     ? NULL
                     : ev_make(r, i, kiln_strbuf_ok(&rest) ? kiln_strbuf_cstr(&rest) : "",
                               kiln_strbuf_ok(&rest) ? rest.len : 0, with_plp, error);
  kiln_strbuf_free(&rest);
  if (n && r->beam) n->out.index = 0;
  if (r->beam && !last) {
    ss->has_token = false;
    return;
  }
  if (with_plp) r->plp_sent = true;
  ss->has_token = false;
  if (last) {
    req_guide_free(r);
    enc_release_all(e, r);
    if (!r->started) atomic_fetch_sub(&e->num_queued, 1);
    r->started = true;
    metrics_finish(e, r, ss->finish);
    act_unlink(e, r);
  }
  if (n) {
    n->out.request_finished = last;
    ev_deliver(r, n);
  } else if (last) {
    ev_deliver_final_oom(r);
  } else {
    r->lost = true;
  }
  if (last) req_unref(r); /* the engine's reference */
}

/* Ends every live sequence of a request. */
static void req_end(kiln_engine_t *e, kiln_request_t *r, kiln_finish_reason_t why,
                    const char *error) {
  if (r->num_done == r->num_live) return;
  atomic_fetch_add(&r->refs, 1); /* the last seq_end drops the engine's reference */
  int32_t live = r->num_live;
  for (int32_t i = 0; i < live; i++)
    if (!r->ss[i].done) seq_end(e, r, i, why, error, NULL, 0);
  req_unref(r);
}

/* ---- beam search ---------------------------------------------------------------------------- */

static bool is_eos(const kiln_engine_t *e, const kiln_request_t *r, int32_t t);

/* The search is over: every beam's blocks go back, then the n best hypotheses go out, best
 * first, one event each (all their tokens, their text, their scores); the last one ends the
 * request. */
static void beam_finish(kiln_engine_t *e, kiln_request_t *r) {
  for (int32_t i = 0; i < r->num_live; i++)
    if (r->seqs[i].state != KILN_SEQ_FINISHED) kiln_scheduler_finish(e->sched, &r->seqs[i]);
  int32_t nh = kiln_beam_num_hyps(r->beam);
  if (nh > r->beam_n) nh = r->beam_n;
  if (nh == 0) {
    req_end(e, r, KILN_FINISH_ERROR, "beam search ended without a hypothesis");
    return;
  }
  int32_t completion = 0;
  for (int32_t h = 0; h < nh; h++) completion += kiln_beam_hyp(r->beam, h)->len;
  ev_node_t **evs = calloc((size_t)nh, sizeof(*evs));
  bool ok = evs != NULL;
  for (int32_t h = 0; ok && h < nh; h++) {
    const kiln_beam_hyp_t *hy = kiln_beam_hyp(r->beam, h);
    char *text = NULL;
    if (e->tok && r->p.detokenize) {
      kiln_status_t st =
          kiln_engine_detokenize(e, hy->tokens, (size_t)hy->len, r->p.skip_special_tokens, &text);
      if (st) {
        kiln_status_free(st);
        ok = false;
        break;
      }
    }
    size_t tl = text ? strlen(text) : 0;
    ev_node_t *n = calloc(1, sizeof(ev_node_t) + (size_t)hy->len * 4 + tl + 1);
    if (!n) {
      free(text);
      ok = false;
      break;
    }
    char *p = (char *)(n + 1);
    kiln_output_t *o = &n->out;
    memcpy(p, hy->tokens, (size_t)hy->len * 4);
    o->token_ids = (const int32_t *)(const void *)p;
    o->num_tokens = hy->len;
    p += (size_t)hy->len * 4;
    if (tl) memcpy(p, text, tl);
    p[tl] = '\0';
    free(text);
    o->text = p;
    o->text_len = tl;
    o->request = r;
    o->request_seq = r->seqno;
    o->user = r->user;
    o->index = h;
    int32_t last_tok = hy->tokens[hy->len - 1];
    o->finish_reason = is_eos(e, r, last_tok) ? KILN_FINISH_STOP : KILN_FINISH_LENGTH;
    o->stop_token = o->finish_reason == KILN_FINISH_STOP ? last_tok : -1;
    o->cumulative_logprob = hy->sum_logprob;
    o->beam_score = hy->score;
    o->usage.prompt_tokens = r->num_prompt;
    o->usage.completion_tokens = completion;
    o->usage.cached_tokens = r->seqs[0].num_cached;
    o->queue_time = r->t_sched > 0 ? r->t_sched - r->t_arrival : 0;
    o->first_token_time = r->t_first > 0 ? r->t_first - r->t_arrival : 0;
    o->time = now_s() - r->t_arrival;
    o->request_finished = h == nh - 1;
    evs[h] = n;
  }
  if (!ok) {
    for (int32_t h = 0; evs && h < nh; h++) free(evs[h]);
    free(evs);
    req_end(e, r, KILN_FINISH_ERROR, "out of memory while delivering the beam search's results");
    return;
  }
  for (int32_t i = 0; i < r->num_live; i++) {
    r->ss[i].done = true;
    r->ss[i].finish = evs[0]->out.finish_reason;
  }
  r->num_done = r->num_live;
  req_guide_free(r);
  enc_release_all(e, r);
  if (!r->started) atomic_fetch_sub(&e->num_queued, 1);
  r->started = true;
  metrics_finish(e, r, evs[0]->out.finish_reason);
  act_unlink(e, r);
  for (int32_t h = 0; h < nh; h++) ev_deliver(r, evs[h]);
  free(evs);
  req_unref(r); /* the engine's reference */
}

/* Every running beam has its logits row: one step of the search, then the beams are
 * reshuffled (each new beam a copy-on-write fork of its parent's block table) and take their
 * new tokens. Returns the tokens generated. */
static uint64_t beam_advance(kiln_engine_t *e, kiln_request_t *r, double t1) {
  const int32_t R = kiln_beam_num_running(r->beam), W = r->p.n;
  for (int32_t i = 0; i < R; i++)
    if (!r->bhave[i] || r->seqs[i].state != KILN_SEQ_RUNNING) return 0; /* not yet */
  int32_t nn = 0;
  kiln_status_t st =
      kiln_beam_step(r->beam, r->blogits, e->vocab, e->vocab, r->bparent, r->btoken, &nn);
  for (int32_t i = 0; i < W; i++) r->bhave[i] = false;
  if (st) {
    req_end(e, r, KILN_FINISH_ERROR, kiln_status_message(st));
    kiln_status_free(st);
    return 0;
  }
  pthread_mutex_lock(&e->mu);
  if (r->t_first == 0) {
    r->t_first = t1;
    kiln_histogram_observe(&e->metrics.time_to_first_token, t1 - r->t_arrival);
  }
  pthread_mutex_unlock(&e->mu);
  if (nn == 0) {
    beam_finish(e, r);
    return (uint64_t)R;
  }
  if (nn != r->num_live) { /* the vocabulary check at submission makes this impossible */
    req_end(e, r, KILN_FINISH_ERROR, "internal error: beam search lost a beam");
    return 0;
  }
  kiln_seq_t *ptr[1024];
  for (int32_t j = 0; j < nn; j++) ptr[j] = &r->seqs[j];
  if (!(st = kiln_scheduler_reparent(e->sched, ptr, nn, r->bparent)))
    for (int32_t j = 0; j < nn && !st; j++) {
      st = kiln_seq_append(&r->seqs[j], r->btoken[j]);
      r->ss[j].num_out = r->seqs[j].num_tokens - r->num_prompt;
    }
  if (st) {
    req_end(e, r, KILN_FINISH_ERROR, kiln_status_message(st));
    kiln_status_free(st);
    return 0;
  }
  return (uint64_t)nn;
}

/* ---- submission --------------------------------------------------------------------------- */

static kiln_status_t bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static kiln_status_t bad(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_status_t st = kiln_status_makev(KILN_ERR_INVALID_ARGUMENT, fmt, ap);
  va_end(ap);
  return st;
}

static kiln_status_t check_params(const kiln_engine_t *e, const kiln_sampling_params_t *p) {
  if ((int)p->guide < KILN_GUIDE_NONE || (int)p->guide > KILN_GUIDE_GRAMMAR)
    return bad("guide: unknown kind %d", (int)p->guide);
  if (p->guide != KILN_GUIDE_NONE && !e->tok)
    return bad("constrained decoding (guide %s) needs a tokenizer; the model has none",
               kiln_guide_kind_name(p->guide));
  if (p->guide != KILN_GUIDE_NONE && p->guide != KILN_GUIDE_JSON_OBJECT && !p->guide_spec)
    return bad("guide %s: guide_spec is missing", kiln_guide_kind_name(p->guide));
  if (p->n < 1 || p->n > e->max_seqs)
    return bad("n must be in [1, %d] (max_num_seqs), got %d", e->max_seqs, p->n);
  if (p->max_tokens < -1 || p->max_tokens == 0)
    return bad("max_tokens must be >= 1 (or -1 for the rest of the context), got %d",
               p->max_tokens);
  if (p->min_tokens < 0) return bad("min_tokens must be >= 0, got %d", p->min_tokens);
  if (!(p->temperature >= 0 && p->temperature <= 100))
    return bad("temperature must be in [0, 100], got %g", (double)p->temperature);
  if (!(p->top_p > 0 && p->top_p <= 1))
    return bad("top_p must be in (0, 1], got %g", (double)p->top_p);
  if (p->top_k < 0) return bad("top_k must be >= 0 (0 = off), got %d", p->top_k);
  if (!(p->min_p >= 0 && p->min_p <= 1))
    return bad("min_p must be in [0, 1], got %g", (double)p->min_p);
  if (!(p->repetition_penalty > 0 && p->repetition_penalty <= 100))
    return bad("repetition_penalty must be in (0, 100], got %g", (double)p->repetition_penalty);
  if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2))
    return bad("presence_penalty must be in [-2, 2], got %g", (double)p->presence_penalty);
  if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2))
    return bad("frequency_penalty must be in [-2, 2], got %g", (double)p->frequency_penalty);
  if (p->num_stop_token_ids < 0 || (p->num_stop_token_ids && !p->stop_token_ids))
    return bad("stop_token_ids: bad list");
  for (int32_t i = 0; i < p->num_stop_token_ids; i++)
    if (p->stop_token_ids[i] < 0 || p->stop_token_ids[i] >= e->vocab)
      return bad("stop_token_ids[%d] = %d is outside the vocabulary [0, %d)", i,
                 p->stop_token_ids[i], e->vocab);
  if (p->num_stop < 0 || (p->num_stop && !p->stop)) return bad("stop: bad list");
  for (int32_t i = 0; i < p->num_stop; i++)
    if (!p->stop[i] || !p->stop[i][0]) return bad("stop[%d] is empty", i);
  if (p->num_stop && !e->tok) return bad("stop strings need a tokenizer; the model has none");
  if (p->num_logit_bias < 0 || (p->num_logit_bias && (!p->logit_bias_ids || !p->logit_bias_values)))
    return bad("logit_bias: bad list");
  for (int32_t i = 0; i < p->num_logit_bias; i++) {
    if (p->logit_bias_ids[i] < 0 || p->logit_bias_ids[i] >= e->vocab)
      return bad("logit_bias: token %d is outside the vocabulary [0, %d)", p->logit_bias_ids[i],
                 e->vocab);
    if (!(p->logit_bias_values[i] >= -100 && p->logit_bias_values[i] <= 100))
      return bad("logit_bias: the value for token %d must be in [-100, 100], got %g",
                 p->logit_bias_ids[i], (double)p->logit_bias_values[i]);
  }
  if (p->logprobs < -1 || p->logprobs > 20)
    return bad("logprobs must be in [0, 20], got %d", p->logprobs);
  if (p->prompt_logprobs < -1 || p->prompt_logprobs > 20)
    return bad("prompt_logprobs must be in [0, 20], got %d", p->prompt_logprobs);
  if (p->beam_width < 0 || p->beam_width > e->max_seqs || p->beam_width > 1024)
    return bad("beam_width must be in [0, %d] (max_num_seqs, at most 1024; 0 = off), got %d",
               e->max_seqs < 1024 ? e->max_seqs : 1024, p->beam_width);
  if (p->beam_width > 0) {
    int32_t num_eos = p->ignore_eos ? 0 : e->num_eos;
    int32_t k = (num_eos + p->num_stop_token_ids + 1 > 2 ? num_eos + p->num_stop_token_ids + 1 : 2) *
                p->beam_width;
    if (p->n > p->beam_width)
      return bad("n (%d) must be <= beam_width (%d) with beam search", p->n, p->beam_width);
    if (k > e->vocab)
      return bad("beam_width %d needs a vocabulary of at least %d tokens (the model has %d)",
                 p->beam_width, k, e->vocab);
    if (!isfinite(p->length_penalty))
      return bad("length_penalty must be a finite number, got %g", (double)p->length_penalty);
    if (p->early_stopping < KILN_EARLY_STOPPING_FALSE || p->early_stopping > KILN_EARLY_STOPPING_NEVER)
      return bad("early_stopping must be 0 (false), 1 (true) or 2 (never), got %d",
                 p->early_stopping);
    if (p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f)
      return bad("beam search does not take repetition_penalty, presence_penalty or "
                 "frequency_penalty");
    if (p->num_logit_bias) return bad("beam search does not take logit_bias");
    if (p->logprobs >= 0) return bad("beam search does not take logprobs");
    if (p->prompt_logprobs >= 0) return bad("beam search does not take prompt_logprobs");
    if (p->min_tokens > 0) return bad("beam search does not take min_tokens");
    if (p->num_stop) return bad("beam search does not take stop strings (stop)");
    if (p->guide != KILN_GUIDE_NONE) return bad("beam search does not take a guide");
  } else if (p->early_stopping != 0 || p->length_penalty != 1.0f) {
    return bad("length_penalty and early_stopping need beam search (beam_width > 0)");
  }
  if (p->num_speculative_tokens < -1 || p->num_speculative_tokens > 32)
    return bad("num_speculative_tokens must be in [0, 32], or -1 for the engine's "
               "([speculative] num_speculative_tokens), got %d",
               p->num_speculative_tokens);
  return NULL;
}

static void *dup_mem(const void *src, size_t n) {
  if (!n) return NULL;
  void *d = malloc(n);
  if (d) memcpy(d, src, n);
  return d;
}

/* A request's images, prepared at submission: the expanded prompt and its M-RoPE positions. */
typedef struct img_prep {
  int32_t *ids; /* the expanded prompt [n] */
  int32_t n;
  req_image_t *imgs;
  kiln_seq_image_t *simgs;
  int32_t num;
  int32_t *mrope; /* [3 * n] */
  int32_t delta;
} img_prep_t;

static void img_prep_free(img_prep_t *p) {
  for (int32_t i = 0; p->imgs && i < p->num; i++) free(p->imgs[i].pixels);
  free(p->imgs);
  free(p->simgs);
  free(p->ids);
  free(p->mrope);
  memset(p, 0, sizeof(*p));
}

/* Image i's patches from the caller's pixel values or its encoded bytes, and its identity. */
static kiln_status_t prepare_image(kiln_engine_t *e, const kiln_image_input_t *in, int32_t i,
                                   req_image_t *out, uint64_t hash[2]) {
  const kiln_model_config_t *c = kiln_model_get_config(e->model);
  const kiln_vision_config_t *vc = &c->vision;
  const int64_t pdim = vc->in_channels * vc->temporal_patch_size * vc->patch_size * vc->patch_size;
  if (in->pixel_values) {
    if (in->grid_t != 1)
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "image %d: grid_t is %d: videos (several frames) are not supported "
                              "yet; an image has grid_t 1",
                              i, in->grid_t);
    kiln_vision_image_t vi = {in->pixel_values, in->grid_t, in->grid_h, in->grid_w};
    if (kiln_vision_image_tokens(e->model, &vi) < 0 || in->grid_h > 65536 || in->grid_w > 65536)
      return bad("image %d: grid %d x %d x %d is not whole %lld x %lld merge units", i, in->grid_t,
                 in->grid_h, in->grid_w, (long long)vc->spatial_merge_size,
                 (long long)vc->spatial_merge_size);
    size_t bytes = (size_t)in->grid_h * (size_t)in->grid_w * (size_t)pdim * sizeof(float);
    if (!(out->pixels = dup_mem(in->pixel_values, bytes)))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "image %d: out of memory", i);
    out->grid_t = 1;
    out->grid_h = in->grid_h;
    out->grid_w = in->grid_w;
    XXH3_state_t hs;
    XXH3_128bits_reset(&hs);
    const int32_t g[4] = {0x70697865 /* "pixe": not a decoded image's hash */, 1, in->grid_h,
                          in->grid_w};
    XXH3_128bits_update(&hs, g, sizeof(g));
    XXH3_128bits_update(&hs, in->pixel_values, bytes);
    XXH128_hash_t h = XXH3_128bits_digest(&hs);
    hash[0] = h.low64;
    hash[1] = h.high64;
  } else {
    if (!in->data || !in->size) return bad("image %d: no image data (0 bytes)", i);
    if (!e->has_preproc)
      return bad("image %d: the model's image processor settings are missing: %s", i,
                 e->preproc_error ? e->preproc_error : "not loaded");
    char what[32];
    snprintf(what, sizeof(what), "image %d", i);
    kiln_image_t img;
    kiln_status_t st = kiln_image_decode(in->data, in->size, what, NULL, &img);
    if (st) return st;
    kiln_image_patches_t pt;
    st = kiln_image_preprocess(&e->preproc, &img, &pt);
    kiln_image_free(&img);
    if (st) return kiln_status_annotate(st, "%s", what);
    if (pt.patch_dim != pdim || pt.grid_t != 1) {
      kiln_image_patches_free(&pt);
      return bad(
          "image %d: the image processor (%s) makes patches of %lld values, the vision "
          "tower takes %lld",
          i, e->preproc.source, (long long)pt.patch_dim, (long long)pdim);
    }
    out->pixels = pt.pixels; /* taken */
    out->grid_t = pt.grid_t;
    out->grid_h = pt.grid_h;
    out->grid_w = pt.grid_w;
    hash[0] = pt.hash[0];
    hash[1] = pt.hash[1];
  }
  kiln_vision_image_t vi = {out->pixels, out->grid_t, out->grid_h, out->grid_w};
  int64_t nt = kiln_vision_image_tokens(e->model, &vi);
  if (nt < 1 || nt > e->max_len)
    return bad("image %d: %lld tokens (grid %d x %d), beyond the model's context of %lld", i,
               (long long)nt, out->grid_h, out->grid_w, (long long)e->max_len);
  out->ntok = (int32_t)nt;
  out->enc_bytes =
      (uint64_t)nt * (uint64_t)c->hidden_size * kiln_hal_dtype_size(kiln_model_dtype(e->model));
  if (out->enc_bytes > e->enc_cap)
    return bad(
        "image %d: its encoder output (%lld tokens, %llu bytes) is larger than the "
        "encoder cache ([model] encoder_cache_mb: %llu bytes)",
        i, (long long)nt, (unsigned long long)out->enc_bytes, (unsigned long long)e->enc_cap);
  return NULL;
}

/* Checks a request's images against the model and the prompt (ids[n], with one placeholder per
 * image), prepares each, expands the prompt and computes its M-RoPE positions into *out. */
static kiln_status_t prepare_images(kiln_engine_t *e, const kiln_image_input_t *in, int32_t nimg,
                                    const int32_t *ids, int32_t n, img_prep_t *out) {
  memset(out, 0, sizeof(*out));
  if (nimg < 0) return bad("num_images must be >= 0, got %d", nimg);
  if (nimg > 0 && !e->has_vision)
    return bad("%d image%s given, but model %s takes text only (it has no vision tower)", nimg,
               nimg == 1 ? "" : "s", e->model_name ? e->model_name : "(custom)");
  if (nimg > 0 && !in) return bad("images: NULL with num_images %d", nimg);
  if (nimg > e->max_images)
    return bad("%d images, more than [model] max_images_per_prompt (%d)", nimg, e->max_images);
  const kiln_model_config_t *c = kiln_model_get_config(e->model);
  int32_t ph = 0;
  for (int32_t i = 0; i < n; i++) ph += ids[i] == c->image_token_id;
  if (ph != nimg)
    return bad(
        "the prompt has %d image placeholder%s (token %d, <|image_pad|>) for %d image%s: "
        "each image needs exactly one, where it goes",
        ph, ph == 1 ? "" : "s", c->image_token_id, nimg, nimg == 1 ? "" : "s");
  if (nimg == 0) return NULL; /* a text prompt */
  if (!(out->imgs = calloc((size_t)(nimg ? nimg : 1), sizeof(*out->imgs))) ||
      !(out->simgs = calloc((size_t)(nimg ? nimg : 1), sizeof(*out->simgs))))
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "images: out of memory");
  out->num = nimg;
  int64_t total = n - nimg;
  kiln_status_t st = NULL;
  for (int32_t i = 0; i < nimg; i++) {
    if ((st = prepare_image(e, &in[i], i, &out->imgs[i], out->simgs[i].hash))) return st;
    total += out->imgs[i].ntok;
  }
  if (total >= e->max_len)
    return bad(
        "the prompt has %lld tokens with its images' (%lld before), beyond the model's "
        "context of %lld tokens",
        (long long)total, (long long)n, (long long)e->max_len);
  out->n = (int32_t)total;
  kiln_mrope_grid_t *grids = calloc((size_t)(nimg ? nimg : 1), sizeof(*grids));
  out->ids = malloc((size_t)total * 4);
  out->mrope = malloc((size_t)total * 3 * 4);
  if (!grids || !out->ids || !out->mrope) {
    free(grids);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "images: out of memory");
  }
  int32_t k = 0, im = 0;
  for (int32_t i = 0; i < n; i++) {
    if (ids[i] != c->image_token_id) {
      out->ids[k++] = ids[i];
      continue;
    }
    req_image_t *ri = &out->imgs[im];
    ri->start = k;
    out->simgs[im] = (kiln_seq_image_t){
        .start = k, .count = ri->ntok, .hash = {out->simgs[im].hash[0], out->simgs[im].hash[1]}};
    grids[im] = (kiln_mrope_grid_t){ri->grid_t, ri->grid_h, ri->grid_w};
    for (int32_t j = 0; j < ri->ntok; j++) out->ids[k++] = c->image_token_id;
    im++;
  }
  st = kiln_mrope_positions(c, out->ids, out->n, grids, nimg, out->mrope, &out->delta);
  free(grids);
  return st;
}

kiln_status_t kiln_engine_submit(kiln_engine_t *e, const kiln_request_desc_t *d,
                                 kiln_request_t **out) {
  *out = NULL;
  img_prep_t ip;
  memset(&ip, 0, sizeof(ip));
  const int32_t nimg =
      d->struct_size >= offsetof(kiln_request_desc_t, num_images) + sizeof(d->num_images)
          ? d->num_images
          : 0;
  /* A caller built against an older kiln.h passes a shorter struct: the fields it does not
   * know keep their defaults. */
  kiln_sampling_params_t given;
  kiln_sampling_params_init(&given);
  if (d->params) {
    size_t n = d->params->struct_size < sizeof(given) ? d->params->struct_size : sizeof(given);
    memcpy(&given, d->params, n);
    given.struct_size = sizeof(given);
  }
  const kiln_sampling_params_t *p = &given;
  kiln_guide_t *guide = NULL;
  kiln_status_t st = check_params(e, p);
  if (st) goto rejected;
  /* Beam search runs beam_width sequences (forked from the prompt like n > 1) and returns n. */
  const int32_t beam_n = given.beam_width > 0 ? given.n : 0;
  if (beam_n) given.n = given.beam_width;
  if (p->guide != KILN_GUIDE_NONE &&
      ((st = guide_setup(e)) ||
       (st = kiln_guide_compile(e->gvocab, p->guide, p->guide_spec, p->guide_spec_len, &guide))))
    goto rejected;
  /* its first contexts, classified while the prompt is tokenized and prefilled (e->gpre was
   * set, if at all, under gmu in guide_setup above) */
  if (guide) guide_pre_submit(e->gpre, guide);
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  if (d->prompt) {
    if (!e->tok) {
      st = bad("a text prompt needs a tokenizer; the model has none (give token ids)");
      goto rejected;
    }
    if ((st = kiln_tokenizer_encode(e->tok, d->prompt, strlen(d->prompt), true, &ids)))
      goto rejected;
  } else if (d->prompt_ids && d->num_prompt_ids > 0) {
    for (int32_t i = 0; i < d->num_prompt_ids; i++)
      if (d->prompt_ids[i] < 0 || d->prompt_ids[i] >= e->vocab) {
        st = bad("prompt token %d (position %d) is outside the vocabulary [0, %d)",
                 d->prompt_ids[i], i, e->vocab);
        goto rejected;
      }
  }
  int32_t np = d->prompt ? (int32_t)ids.len : d->num_prompt_ids;
  if (np <= 0 || (!d->prompt && !d->prompt_ids)) {
    kiln_tokens_free(&ids);
    st = bad("the prompt is empty");
    goto rejected;
  }
  if (nimg != 0 || e->has_vision) {
    if ((st = prepare_images(e, nimg > 0 ? d->images : NULL, nimg,
                             d->prompt ? ids.ids : d->prompt_ids, np, &ip))) {
      kiln_tokens_free(&ids);
      goto rejected;
    }
    if (nimg == 0) {
      img_prep_free(&ip); /* text only: the prompt stays as it is */
    } else {
      np = ip.n;
    }
  }
  int64_t max_tokens = p->max_tokens < 0 ? e->max_len - np : p->max_tokens;
  if ((int64_t)np >= e->max_len || np + max_tokens > e->max_len) {
    kiln_tokens_free(&ids);
    st =
        bad("the prompt has %d tokens and max_tokens is %lld: %lld in all, beyond the model's "
            "context of %lld tokens",
            np, (long long)(p->max_tokens < 0 ? 1 : max_tokens),
            (long long)np + (p->max_tokens < 0 ? 1 : max_tokens), (long long)e->max_len);
    goto rejected;
  }
  int64_t blocks = ((int64_t)np + max_tokens + e->bs - 1) / e->bs;
  if (blocks > kiln_kv_num_blocks(e->kv)) {
    kiln_tokens_free(&ids);
    st = bad("the request needs %lld KV blocks (%lld tokens of %d) but the pool has %d",
             (long long)blocks, (long long)np + max_tokens, e->bs, kiln_kv_num_blocks(e->kv));
    goto rejected;
  }
  if (beam_n) { /* every beam may diverge right after the prompt */
    int64_t pb = np / e->bs, gb = (max_tokens + e->bs - 1) / e->bs + 1;
    if (pb + (int64_t)p->n * gb > kiln_kv_num_blocks(e->kv)) {
      kiln_tokens_free(&ids);
      st = bad("beam search with beam_width %d over %d prompt tokens and max_tokens %lld may "
               "need %lld KV blocks but the pool has %d",
               p->n, np, (long long)max_tokens, (long long)(pb + (int64_t)p->n * gb),
               kiln_kv_num_blocks(e->kv));
      goto rejected;
    }
  }
  if (!e->chunked && np > e->max_tokens) {
    kiln_tokens_free(&ids);
    st =
        bad("the prompt has %d tokens, more than max_num_batched_tokens (%d), and chunked "
            "prefill is off",
            np, e->max_tokens);
    goto rejected;
  }
  kiln_request_t *r = calloc(1, sizeof(*r));
  if (!r) {
    kiln_tokens_free(&ids);
    img_prep_free(&ip);
    kiln_guide_release(guide);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "submit: out of memory");
  }
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  atomic_init(&r->refs, 2);
  atomic_init(&r->cancel, false);
  r->eng = e;
  r->p = *p;
  r->p.stop_token_ids = NULL;
  r->p.stop = NULL;
  r->p.logit_bias_ids = NULL;
  r->p.logit_bias_values = NULL;
  r->p.guide_spec = NULL; /* compiled into r->guide */
  r->guide = guide;
  r->cb = d->on_output;
  r->notify = d->struct_size >= offsetof(kiln_request_desc_t, on_queued) + sizeof(d->on_queued)
                  ? d->on_queued
                  : NULL;
  r->user = d->user;
  r->num_prompt = np;
  r->max_tokens = (int32_t)max_tokens;
  /* Speculation keeps greedy output exactly; sampled and constrained requests do not take it
   * (no rejection sampling yet; a constraint's masks follow one token a step). */
  r->spec_k = p->num_speculative_tokens >= 0 && p->num_speculative_tokens < e->spec_k
                  ? p->num_speculative_tokens
                  : e->spec_k;
  if (guide || beam_n) r->spec_k = 0;
  r->beam_n = beam_n;
  bool oom = false;
  if (ip.ids) {
    r->prompt = ip.ids; /* take the expanded prompt and the images */
    r->imgs = ip.imgs;
    r->simgs = ip.simgs;
    r->num_imgs = ip.num;
    r->mrope = ip.mrope;
    r->mrope_delta = ip.delta;
    memset(&ip, 0, sizeof(ip));
  } else if (d->prompt) {
    r->prompt = ids.ids; /* take the buffer */
    ids.ids = NULL;
  } else {
    oom |= !(r->prompt = dup_mem(d->prompt_ids, (size_t)np * 4));
  }
  kiln_tokens_free(&ids);
  if (p->num_stop_token_ids)
    oom |= !(r->stop_ids = dup_mem(p->stop_token_ids, (size_t)p->num_stop_token_ids * 4));
  if (p->num_logit_bias) {
    oom |= !(r->bias_ids = dup_mem(p->logit_bias_ids, (size_t)p->num_logit_bias * 4));
    oom |= !(r->bias_values = dup_mem(p->logit_bias_values, (size_t)p->num_logit_bias * 4));
  }
  if (p->num_stop) {
    r->stop = calloc((size_t)p->num_stop, sizeof(char *));
    oom |= !r->stop;
    for (int32_t i = 0; r->stop && i < p->num_stop; i++) oom |= !(r->stop[i] = strdup(p->stop[i]));
  }
  r->p.num_stop = r->stop ? p->num_stop : 0;
  if (!d->on_output) oom |= !(r->spare = calloc(1, sizeof(ev_node_t)));
  r->seqs = calloc((size_t)p->n, sizeof(*r->seqs));
  r->ss = calloc((size_t)p->n, sizeof(*r->ss));
  oom |= !r->seqs || !r->ss;
  int32_t topk = p->logprobs > 0 ? p->logprobs : 0;
  for (int32_t i = 0; !oom && i < p->n; i++) {
    seq_state_t *ss = &r->ss[i];
    ss->stop_token = -1;
    ss->stop_index = -1;
    if (topk) {
      oom |= !(ss->top_ids = calloc((size_t)topk, 4));
      oom |= !(ss->top_lps = calloc((size_t)topk, 4));
    }
    if (!oom && e->tok && p->detokenize && !beam_n) {
      st = kiln_textout_create(e->tok, p->skip_special_tokens, (const char *const *)r->stop,
                               r->p.num_stop, p->include_stop_str_in_output, &ss->text);
      if (st) {
        kiln_status_free(st);
        st = NULL;
        oom = true;
      }
    }
  }
  if (!oom && guide) {
    /* sequence 0's matcher; forks copy it */
    kiln_status_t gst = kiln_guide_matcher_create(guide, &r->ss[0].gm);
    oom |= gst != NULL;
    kiln_status_free(gst);
  }
  if (!oom && p->prompt_logprobs >= 0 && np > 1) {
    size_t k = (size_t)(p->prompt_logprobs > 0 ? p->prompt_logprobs : 0);
    oom |= !(r->plp = calloc((size_t)np - 1, 4));
    if (k) {
      oom |= !(r->plp_ids = calloc(((size_t)np - 1) * k, 4));
      oom |= !(r->plp_top = calloc(((size_t)np - 1) * k, 4));
    }
  }
  if (!oom && beam_n) {
    int32_t eos[64], ne = 0;
    for (int32_t i = 0; i < p->num_stop_token_ids && ne < 64; i++) eos[ne++] = p->stop_token_ids[i];
    for (int32_t i = 0; !p->ignore_eos && i < e->num_eos && ne < 64; i++) eos[ne++] = e->eos[i];
    kiln_beam_opts_t bo = {.width = p->n, .length_penalty = p->length_penalty,
                           .early_stopping = (kiln_beam_early_stop_t)p->early_stopping,
                           .max_new_tokens = (int32_t)max_tokens, .eos = eos, .num_eos = ne};
    kiln_status_t bst = kiln_beam_create(&bo, &r->beam);
    oom |= bst != NULL;
    kiln_status_free(bst);
    oom |= !(r->blogits = malloc((size_t)p->n * (size_t)e->vocab * sizeof(float)));
    oom |= !(r->bhave = calloc((size_t)p->n, sizeof(bool)));
    oom |= !(r->bparent = calloc((size_t)p->n, sizeof(int32_t)));
    oom |= !(r->btoken = calloc((size_t)p->n, sizeof(int32_t)));
  }
  kiln_seq_t *q = r->seqs ? &r->seqs[0] : NULL;
  if (!oom) {
    q->owner = r;
    q->priority = p->priority;
    q->fork_n = p->n;
    q->no_prefix_cache = p->prompt_logprobs >= 0;
    q->max_logits_rows = p->prompt_logprobs >= 0 ? PROMPT_ROWS : 0;
    q->num_prompt = np;
    q->images = r->simgs;
    q->num_images = r->num_imgs;
    for (int32_t i = 0; !oom && i < np; i++) {
      kiln_status_t ast = kiln_seq_append(q, r->prompt[i]);
      oom = ast != NULL;
      kiln_status_free(ast);
    }
  }
  if (oom) {
    req_free(r);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "submit: out of memory");
  }
  r->seed =
      p->has_seed ? p->seed : kiln_engine_seq_seed(e->seed, (int32_t)atomic_load(&e->next_seqno));
  for (int32_t i = 0; i < p->n; i++) r->ss[i].rng = kiln_engine_seq_seed(r->seed, i);
  r->num_live = 1;
  r->t_arrival = now_s();
  pthread_mutex_lock(&e->mu);
  if (e->stop) {
    pthread_mutex_unlock(&e->mu);
    req_free(r);
    return kiln_status_make(KILN_ERR_UNAVAILABLE, "the engine is shutting down");
  }
  if (e->max_queued > 0 && atomic_load(&e->num_queued) >= e->max_queued) {
    e->metrics.requests_rejected++;
    pthread_mutex_unlock(&e->mu);
    req_free(r);
    return kiln_status_make(KILN_ERR_UNAVAILABLE,
                            "the queue is full: %d requests are waiting (max_queued_requests)",
                            e->max_queued);
  }
  r->seqno = atomic_fetch_add(&e->next_seqno, 1);
  q->arrival = r->seqno;
  atomic_fetch_add(&e->num_queued, 1);
  e->metrics.requests_submitted++;
  if (e->in_tail)
    e->in_tail->next = r;
  else
    e->in_head = r;
  e->in_tail = r;
  pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
  *out = r;
  return NULL;
rejected:
  kiln_guide_release(guide);
  img_prep_free(&ip);
  pthread_mutex_lock(&e->mu);
  e->metrics.requests_rejected++;
  pthread_mutex_unlock(&e->mu);
  return st;
}

/* ---- one step ----------------------------------------------------------------------------- */

/* Moves the inbox into the scheduler and ends cancelled requests. */
static void intake(kiln_engine_t *e, kiln_request_t *in) {
  for (kiln_request_t *r = in, *nx; r; r = nx) {
    nx = r->next;
    r->next = NULL;
    r->prev = e->act_tail;
    if (e->act_tail)
      e->act_tail->next = r;
    else
      e->act_head = r;
    e->act_tail = r;
    kiln_scheduler_add(e->sched, &r->seqs[0]);
  }
  for (kiln_request_t *r = e->act_head, *nx; r; r = nx) {
    nx = r->next;
    if (atomic_load(&r->cancel)) req_end(e, r, KILN_FINISH_ABORT, NULL);
  }
}

static bool is_eos(const kiln_engine_t *e, const kiln_request_t *r, int32_t t) {
  for (int32_t i = 0; i < r->p.num_stop_token_ids; i++)
    if (r->stop_ids[i] == t) return true;
  if (r->p.ignore_eos) return false;
  for (int32_t i = 0; i < e->num_eos; i++)
    if (e->eos[i] == t) return true;
  return false;
}

/* Fills a sample row for sequence q (index i of r): penalties over its tokens, the request's
 * logit bias plus -inf bans on stop tokens before min_tokens. `ahead` > 0: the row after the
 * sequence's first `ahead` proposals, as if they were its output already. */
static kiln_status_t fill_row(kiln_engine_t *e, kiln_request_t *r, int32_t i, int32_t row,
                              const uint32_t *mask, int32_t ahead, kiln_sample_row_t *sr) {
  kiln_seq_t *q = &r->seqs[i];
  seq_state_t *ss = &r->ss[i];
  memset(sr, 0, sizeof(*sr));
  sr->logits_row = row;
  sr->temperature = r->p.temperature;
  sr->top_k = r->p.top_k;
  sr->top_p = r->p.top_p;
  sr->min_p = r->p.min_p;
  sr->repetition = r->p.repetition_penalty;
  sr->presence = r->p.presence_penalty;
  sr->frequency = r->p.frequency_penalty;
  /* A proposal's row (ahead > 0, after the sequence's own row took its draw) gets the draw
   * the token at that place will have; the ones taken are skipped after verification. */
  sr->uniform = ahead ? kiln_sample_uniform_ahead(ss->rng, (uint64_t)(ahead - 1))
                      : kiln_sample_uniform(&ss->rng);
  sr->num_top = r->p.logprobs;
  sr->mask = mask;
  if (sr->repetition != 1.0f || sr->presence != 0 || sr->frequency != 0) {
    sr->prompt_ids = q->tokens;
    sr->num_prompt = q->num_prompt;
    sr->output_ids = q->tokens + q->num_prompt;
    sr->num_output = q->num_tokens - q->num_draft - q->num_prompt + ahead;
  }
  bool ban = ss->num_out + ahead < r->p.min_tokens;
  int32_t nb = r->p.num_logit_bias +
               (ban ? r->p.num_stop_token_ids + (r->p.ignore_eos ? 0 : e->num_eos) : 0);
  if (nb) {
    int32_t *ids = kiln_arena_alloc(&e->arena, (size_t)nb * 4, 4);
    float *vals = kiln_arena_alloc(&e->arena, (size_t)nb * 4, 4);
    if (!ids || !vals) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "sampling: out of memory");
    int32_t k = 0;
    for (int32_t j = 0; j < r->p.num_logit_bias; j++, k++) {
      ids[k] = r->bias_ids[j];
      vals[k] = r->bias_values[j];
    }
    if (ban) {
      for (int32_t j = 0; j < r->p.num_stop_token_ids; j++, k++) {
        ids[k] = r->stop_ids[j];
        vals[k] = -INFINITY;
      }
      for (int32_t j = 0; !r->p.ignore_eos && j < e->num_eos; j++, k++) {
        ids[k] = e->eos[j];
        vals[k] = -INFINITY;
      }
    }
    sr->bias_ids = ids;
    sr->bias_values = vals;
    sr->num_bias = k;
  }
  return NULL;
}

/* Refreshes the gauges and the scheduler's counters in the shared metrics. */
static void update_gauges(kiln_engine_t *e) {
  int64_t running = 0, waiting = 0;
  for (kiln_request_t *r = e->act_head; r; r = r->next) {
    bool run = false;
    for (int32_t i = 0; i < r->num_live; i++) run |= r->seqs[i].state == KILN_SEQ_RUNNING;
    if (run)
      running++;
    else
      waiting++;
  }
  uint64_t q = 0, h = 0;
  kiln_scheduler_prefix_stats(e->sched, &q, &h);
  int32_t nb = kiln_kv_num_blocks(e->kv), nf = kiln_kv_num_free(e->kv);
  pthread_mutex_lock(&e->mu);
  kiln_metrics_t *m = &e->metrics;
  m->requests_running = running;
  m->requests_waiting = waiting;
  m->prefix_cache_queries = q;
  m->prefix_cache_hits = h;
  m->kv_blocks_total = nb;
  m->kv_blocks_used = nb - nf;
  m->kv_usage = nb ? (double)(nb - nf) / (double)nb : 0.0;
  pthread_mutex_unlock(&e->mu);
}

/* Ends every request with a sequence in the step (a forward or sampling failure). */
/* The step's requests stay alive while it delivers (a request whose handle is released is
 * freed by its final event, and a step can list it more than once). */
static void step_hold(const kiln_sched_step_t *step, int delta) {
  for (int32_t i = 0; i < step->num_items; i++) {
    kiln_request_t *r = step->items[i].seq->owner;
    if (delta > 0)
      atomic_fetch_add(&r->refs, 1);
    else
      req_unref(r);
  }
}

static void fail_step(kiln_engine_t *e, const kiln_sched_step_t *step, kiln_status_t st) {
  char msg[512];
  snprintf(msg, sizeof(msg), "%s", kiln_status_message(st));
  kiln_log(KILN_LOG_ERROR, "engine step failed: %s", msg);
  kiln_status_free(st);
  step_hold(step, +1);
  for (int32_t i = 0; i < step->num_items; i++) {
    kiln_request_t *r = step->items[i].seq->owner;
    if (r->num_done < r->num_live) req_end(e, r, KILN_FINISH_ERROR, msg);
  }
  step_hold(step, -1);
}

/* Takes sample row j's token as sequence q's next: appends it, advances its constraint, checks
 * the stop conditions and delivers the event. Returns false when the sequence ended. */
static bool seq_take(kiln_engine_t *e, kiln_seq_t *q, int32_t j, kiln_strbuf_t *text, double t1,
                     uint64_t *gen) {
  kiln_request_t *r = q->owner;
  int32_t i = q->index;
  seq_state_t *ss = &r->ss[i];
  int32_t tok = e->so.tokens[j];
  ss->has_token = true;
  ss->token = tok;
  ss->logprob = e->so.logprobs[j];
  if (r->p.logprobs > 0) {
    memcpy(ss->top_ids, e->so.top_ids + (size_t)j * e->max_top, (size_t)r->p.logprobs * 4);
    memcpy(ss->top_lps, e->so.top_logprobs + (size_t)j * e->max_top, (size_t)r->p.logprobs * 4);
  }
  kiln_status_t ast = kiln_seq_append(q, tok);
  if (ast) {
    ss->has_token = false;
    req_end(e, r, KILN_FINISH_ERROR, kiln_status_message(ast));
    kiln_status_free(ast);
    return false;
  }
  ss->num_out++;
  (*gen)++;
  /* the constraint follows every token but end of sequence (allowed only where it accepts) */
  bool gdone = false;
  if (ss->gm && !is_eos(e, r, tok)) {
    if (!kiln_guide_matcher_accept_token(ss->gm, tok)) {
      char msg[160];
      snprintf(msg, sizeof(msg), "internal error: the constraint refused sampled token %d",
               (int)tok);
      req_end(e, r, KILN_FINISH_ERROR, msg);
      return false;
    }
    gdone = kiln_guide_matcher_finished(ss->gm);
  }
  pthread_mutex_lock(&e->mu);
  if (r->t_first == 0) {
    r->t_first = t1;
    kiln_histogram_observe(&e->metrics.time_to_first_token, t1 - r->t_arrival);
  } else if (i == 0) {
    kiln_histogram_observe(&e->metrics.inter_token_latency, t1 - r->t_last);
  }
  pthread_mutex_unlock(&e->mu);
  if (i == 0) r->t_last = t1;
  kiln_finish_reason_t fin = KILN_FINISH_NONE;
  text->len = 0;
  if (text->data) text->data[0] = '\0';
  if (ss->num_out > r->p.min_tokens && is_eos(e, r, tok)) {
    fin = KILN_FINISH_STOP;
    ss->stop_token = tok;
  } else if (ss->text) {
    int32_t stopped = -1;
    kiln_status_t tst =
        kiln_textout_push(ss->text, tok, ss->num_out >= r->p.min_tokens, text, &stopped);
    if (tst) {
      req_end(e, r, KILN_FINISH_ERROR, kiln_status_message(tst));
      kiln_status_free(tst);
      return false;
    }
    if (stopped >= 0) {
      fin = KILN_FINISH_STOP;
      ss->stop_index = stopped;
    }
  }
  if (fin == KILN_FINISH_NONE && gdone) fin = KILN_FINISH_STOP; /* nothing may follow */
  if (fin == KILN_FINISH_NONE && (ss->num_out >= r->max_tokens || q->num_tokens >= e->max_len))
    fin = KILN_FINISH_LENGTH;
  const char *tx = kiln_strbuf_ok(text) && text->len ? kiln_strbuf_cstr(text) : "";
  size_t tl = kiln_strbuf_ok(text) ? text->len : 0;
  if (fin != KILN_FINISH_NONE) {
    ss->finish = fin;
    seq_end(e, r, i, fin, NULL, tx, tl);
    return false;
  }
  bool with_plp = !r->plp_sent && r->plp && i == 0 && r->plp_rows >= r->num_prompt - 1;
  ev_node_t *n = ev_make(r, i, tx, tl, with_plp, NULL);
  if (with_plp) r->plp_sent = true;
  if (n)
    ev_deliver(r, n);
  else
    req_end(e, r, KILN_FINISH_ERROR, "out of memory while delivering an output");
  ss->has_token = false;
  return !ss->done;
}

/* ---- speculative decoding: n-gram proposals ------------------------------------------------- */

/* Prompt lookup: the longest suffix of tokens[0, n) of ngram_max down to ngram_min tokens that
 * occurred earlier, at its latest earlier occurrence; the tokens that followed it there (at
 * most k, and only tokens before n) go to out. Returns how many. */
int32_t kiln_spec_ngram_propose(const int32_t *tokens, int32_t n, int32_t ngram_min,
                                int32_t ngram_max, int32_t k, int32_t *out) {
  if (k <= 0) return 0;
  for (int32_t len = ngram_max < n - 1 ? ngram_max : n - 1; len >= ngram_min && len >= 1; len--) {
    const int32_t *suf = tokens + (n - len);
    for (int32_t i = n - len - 1; i >= 0; i--) {
      if (tokens[i] != suf[0] || memcmp(tokens + i, suf, (size_t)len * sizeof(int32_t)) != 0)
        continue;
      int32_t from = i + len, m = n - from < k ? n - from : k;
      memcpy(out, tokens + from, (size_t)m * sizeof(int32_t));
      return m;
    }
  }
  return 0;
}

/* method = draft: the draft's proposals for the sequences gathered in e->dreqs (one batched
 * greedy run of the draft model), appended to each as drafts. A draft that fails (a device
 * error) only means no proposals in this step. */
static void spec_draft_run(kiln_engine_t *e, int32_t nd) {
  kiln_status_t st = kiln_draft_propose(e->draft, e->dreqs, nd);
  if (st) {
    KILN_LOG_W("speculative decoding: the draft model failed, no proposals in this step: %s",
               kiln_status_message(st));
    kiln_status_free(st);
  }
  for (int32_t i = 0; i < nd; i++) {
    kiln_seq_t *q = e->dseqs[i];
    int32_t added = 0;
    for (; added < e->dreqs[i].k; added++) {
      kiln_status_t ast = kiln_seq_append(q, e->dreqs[i].out[added]);
      if (ast) { /* out of memory: fewer proposals */
        kiln_status_free(ast);
        break;
      }
    }
    q->num_draft = added;
  }
  pthread_mutex_lock(&e->mu);
  e->metrics.spec_draft_seconds = kiln_draft_seconds(e->draft);
  pthread_mutex_unlock(&e->mu);
}

/* method = draft: sequences that are not running (preempted) give their draft blocks back. */
static void spec_draft_release_idle(kiln_engine_t *e) {
  for (kiln_request_t *r = e->act_head; r; r = r->next)
    for (int32_t i = 0; i < r->num_live; i++)
      if (r->seqs[i].state != KILN_SEQ_RUNNING && r->ss[i].dseq.num_blocks)
        kiln_draft_release(e->draft, &r->ss[i].dseq);
}

/* Before scheduling: every running sequence loses the proposals of a step that did not run
 * them (and the draft model, with method = draft, what it held past the sequence's own
 * tokens); then, unless more than disable_by_batch_size sequences are running, each decoding
 * sequence of a request that speculates gets up to k proposals (fewer where max_tokens or the
 * context would be passed, and within the step's rows for proposals). */
static void spec_propose(kiln_engine_t *e) {
  const bool on =
      e->spec_k > 0 && kiln_scheduler_num_running(e->sched) <= e->spec_batch && e->spec_rows > 0;
  int32_t rows = e->spec_rows;
  int32_t buf[64];
  int32_t nd = 0;
  if (e->draft) spec_draft_release_idle(e);
  for (kiln_seq_t *q = kiln_scheduler_running_head(e->sched); q; q = q->next) {
    if (q->num_draft) kiln_seq_drop_drafts(q);
    kiln_request_t *r = q->owner;
    if (e->draft) kiln_draft_sync(e->draft, &r->ss[q->index].dseq, q->tokens, q->num_tokens);
    if (!on || rows <= 0) continue;
    if (r->spec_k <= 0 || q->fork_n > 1 || q->num_tokens <= q->num_prompt ||
        q->num_computed != q->num_tokens - 1)
      continue; /* not a decode */
    const seq_state_t *ss = &r->ss[q->index];
    int64_t k = r->spec_k;
    if (k > r->max_tokens - ss->num_out - 1) k = r->max_tokens - ss->num_out - 1;
    if (k > e->max_len - q->num_tokens - 1) k = e->max_len - q->num_tokens - 1;
    if (k > rows) k = rows;
    if (k > (int64_t)(sizeof(buf) / sizeof(buf[0]))) k = sizeof(buf) / sizeof(buf[0]);
    if (k <= 0) continue;
    if (e->draft) { /* proposed below, for all of them at once */
      if (k > KILN_DRAFT_MAX_K) k = KILN_DRAFT_MAX_K;
      if (nd >= e->dmax) continue;
      e->dreqs[nd] = (kiln_draft_req_t){.seq = &r->ss[q->index].dseq,
                                        .tokens = q->tokens,
                                        .num_tokens = q->num_tokens,
                                        .k = (int32_t)k,
                                        .out = e->dbuf + (size_t)nd * KILN_DRAFT_MAX_K};
      e->dseqs[nd++] = q;
      rows -= (int32_t)k;
      continue;
    }
    int32_t m =
        kiln_spec_ngram_propose(q->tokens, q->num_tokens, e->spec_min, e->spec_max, (int32_t)k, buf);
    int32_t added = 0;
    for (; added < m; added++) {
      kiln_status_t ast = kiln_seq_append(q, buf[added]);
      if (ast) { /* out of memory: fewer proposals */
        kiln_status_free(ast);
        break;
      }
    }
    q->num_draft = added;
    rows -= added;
  }
  if (nd) spec_draft_run(e, nd);
}

/* The models' graph counters into the metrics (kiln_metrics_t graph_replays...), under e->mu.
 * With tensor parallelism, rank 0's model (every rank runs the same forwards). */
static void graph_counts(kiln_engine_t *e, kiln_metrics_t *m) {
  kiln_model_graph_stats_t g;
  if (e->model) {
    kiln_model_graph_stats(e->model, &g);
    m->graph_replays = (uint64_t)(g.replays - g.multi_replays);
    m->graph_multi_replays = (uint64_t)g.multi_replays;
    m->eager_forwards = (uint64_t)g.eager_forwards;
  }
  if (e->dmodel) {
    kiln_model_graph_stats(e->dmodel, &g);
    m->draft_graph_replays = (uint64_t)g.replays;
    m->draft_eager_forwards = (uint64_t)g.eager_forwards;
  }
}

static kiln_status_t run_step(kiln_engine_t *e, bool *idle) {
  kiln_sched_step_t *step;
  if (e->spec_k > 0) spec_propose(e);
  kiln_status_t st = kiln_scheduler_schedule(e->sched, &step);
  if (st) return st;
  *idle = step->num_items == 0;
  if (step->num_preempted) {
    pthread_mutex_lock(&e->mu);
    e->metrics.preemptions += (uint64_t)step->num_preempted;
    pthread_mutex_unlock(&e->mu);
  }
  if (!step->num_items) return NULL;
  kiln_arena_free(&e->arena);
  e->step_no++;
  double t0 = now_s();
  /* Build the batch. */
  int32_t T = 0, R = 0, nsamp = 0, nscore = 0;
  e->b_qsl[0] = 0;
  for (int32_t s = 0; s < step->num_items; s++) {
    const kiln_sched_item_t *it = &step->items[s];
    kiln_seq_t *q = it->seq;
    kiln_request_t *r = q->owner;
    if (!r->started) {
      r->started = true;
      r->t_sched = t0;
      atomic_fetch_sub(&e->num_queued, 1);
      pthread_mutex_lock(&e->mu);
      kiln_histogram_observe(&e->metrics.queue_time, t0 - r->t_arrival);
      pthread_mutex_unlock(&e->mu);
    }
    bool plp = q->index == 0 && r->plp && !r->plp_sent;
    for (int32_t j = 0; j < it->count; j++) {
      int32_t pos = it->start + j;
      e->b_ids[T] = q->tokens[pos];
      e->b_pos[T] = pos;
      e->b_slots[T] = q->blocks[pos / e->bs] * e->bs + pos % e->bs;
      if (plp && pos + 1 < r->num_prompt) {
        e->crows[nscore] = (kiln_score_row_t){
            .logits_row = R, .token = q->tokens[pos + 1], .num_top = r->p.prompt_logprobs};
        e->cseqs[nscore] = q;
        e->c_pos[nscore++] = pos;
        e->b_rows[R++] = T;
      } else if (it->sample && j >= it->count - 1 - it->draft) {
        e->b_rows[R++] = T; /* the last position, and one per proposal before it */
      }
      if (it->sample && j == it->count - 1 - it->draft) e->item_row[s] = R - 1;
      T++;
    }
    e->b_lens[s] = it->start + it->count;
    e->b_qsl[s + 1] = T;
    memcpy(e->b_tables + (size_t)s * e->max_blocks, q->blocks, (size_t)q->num_blocks * 4);
  }
  if (step->num_cow &&
      (st = e->runner.copy_blocks(e->runner.ctx, step->cow_src, step->cow_dst, step->num_cow))) {
    fail_step(e, step, st);
    return NULL;
  }
  kiln_batch_t b = {.num_tokens = T,
                    .num_seqs = step->num_items,
                    .token_ids = e->b_ids,
                    .positions = e->b_pos,
                    .slot_mapping = e->b_slots,
                    .seq_lens = e->b_lens,
                    .query_start_loc = e->b_qsl,
                    .block_tables = e->b_tables,
                    .max_blocks_per_seq = e->max_blocks,
                    .num_logits = R,
                    .logits_rows = e->b_rows};
  if (e->has_vision && (st = step_images(e, step, T, &b))) {
    fail_step(e, step, st);
    return NULL;
  }
  /* Constrained sequences' masks, computed by the guide workers while the forward runs. */
  int32_t njobs = 0;
  const bool guided = __atomic_load_n(&e->gvocab, __ATOMIC_ACQUIRE) != NULL;
  if (guided) {
    const int32_t W = kiln_guide_mask_words(e->gvocab);
    for (int32_t s = 0; s < step->num_items; s++) {
      const kiln_sched_item_t *it = &step->items[s];
      kiln_request_t *r = it->seq->owner;
      e->item_mask[s] = NULL;
      if (!it->sample || !r->guide || !r->ss[it->seq->index].gm) continue;
      e->gjobs[njobs] = (guide_job_t){
          .m = r->ss[it->seq->index].gm, .mask = e->gmask + (size_t)s * (size_t)W, .r = r};
      e->item_mask[s] = e->gjobs[njobs++].mask;
    }
    if (njobs) guide_pool_start(e->gpool, e->gjobs, njobs);
  }
  st = e->runner.forward(e->runner.ctx, &b);
  if (njobs) guide_pool_wait(e->gpool);
  if (st) {
    fail_step(e, step, st);
    return NULL;
  }
  kiln_scheduler_update_computed(e->sched, step);
  if (e->enc_used) step_images_done(e, step);
  /* Sample rows (forking n > 1 prompts first: the children share the parent's row). */
  kiln_sample_logits_t lg;
  bool have_lg = false;
  for (int32_t s = 0; s < step->num_items && !st; s++) {
    const kiln_sched_item_t *it = &step->items[s];
    kiln_seq_t *q = it->seq;
    kiln_request_t *r = q->owner;
    if (!it->sample || q->state != KILN_SEQ_RUNNING) continue;
    int32_t first = q->index, last = q->index;
    if (q->fork_n > 1) {
      kiln_seq_t *after = q;
      for (int32_t c = 1; c < q->fork_n && !st; c++) {
        if ((st = kiln_scheduler_fork(e->sched, q, &r->seqs[c]))) break;
        r->seqs[c].index = c;
        kiln_scheduler_add_running_after(e->sched, after, &r->seqs[c]);
        after = &r->seqs[c];
        r->num_live = c + 1;
      }
      kiln_scheduler_fork_done(e->sched, q, r->num_live - 1);
      last = r->num_live - 1;
    }
    if (r->beam) { /* beam search: keep the row of each running beam this item computed */
      if (!have_lg) {
        e->runner.logits(e->runner.ctx, R, &lg);
        have_lg = true;
      }
      int32_t nr = kiln_beam_num_running(r->beam);
      if (q->index < nr) {
        st = kiln_sampler_read_row(e->sampler, &lg, e->item_row[s],
                                   r->blogits + (size_t)q->index * (size_t)e->vocab);
        r->bhave[q->index] = true;
        r->beam_touched = true;
      }
      continue;
    }
    const uint32_t *mask = guided ? e->item_mask[s] : NULL;
    const char *gerr = NULL;
    if (mask) { /* this item's job (a fork shares its parent's first mask) */
      for (int32_t j = 0; j < njobs; j++)
        if (e->gjobs[j].mask == mask) gerr = e->gjobs[j].err;
      for (int32_t i = first + 1; i <= last && !st; i++) {
        kiln_status_t gst = kiln_guide_matcher_clone(r->ss[first].gm, &r->ss[i].gm);
        if (gst) st = gst;
      }
    }
    for (int32_t i = first; i <= last && !st; i++) {
      r->ss[i].gerr = gerr;
      st = fill_row(e, r, i, e->item_row[s], gerr ? NULL : mask, 0, &e->srows[nsamp]);
      e->sdraft[nsamp] = i == q->index ? it->draft : 0;
      e->sseqs[nsamp++] = &r->seqs[i];
    }
    for (int32_t d = 1; d <= it->draft && !st; d++) { /* the rows that verify the proposals */
      st = fill_row(e, r, q->index, e->item_row[s] + d, NULL, d, &e->srows[nsamp]);
      e->sdraft[nsamp] = -1;
      e->sseqs[nsamp++] = q;
    }
  }
  if (st) {
    fail_step(e, step, st);
    return NULL;
  }
  if (!have_lg) e->runner.logits(e->runner.ctx, R, &lg);
  if ((nsamp || nscore) &&
      (st = kiln_sampler_run(e->sampler, &lg, e->srows, nsamp, e->crows, nscore, &e->so))) {
    fail_step(e, step, st);
    return NULL;
  }
  /* Prompt logprobs. */
  for (int32_t c = 0; c < nscore; c++) {
    kiln_request_t *r = e->cseqs[c]->owner;
    int32_t pos = e->c_pos[c], k = r->p.prompt_logprobs;
    r->plp[pos] = e->so.score_logprobs[c];
    r->plp_rows++; /* rows scored again after a preemption count twice: only "all done" matters */
    if (k > 0) {
      memcpy(r->plp_ids + (size_t)pos * k, e->so.score_top_ids + (size_t)c * e->max_top,
             (size_t)k * 4);
      memcpy(r->plp_top + (size_t)pos * k, e->so.score_top_logprobs + (size_t)c * e->max_top,
             (size_t)k * 4);
    }
  }
  /* Tokens: append, check the stop conditions, deliver. */
  step_hold(step, +1);
  double t1 = now_s();
  kiln_strbuf_t text = KILN_STRBUF_INIT;
  uint64_t gen = 0, spec_drafts = 0, spec_tokens = 0, spec_accepted = 0;
  for (int32_t j = 0; j < nsamp; j++) {
    kiln_seq_t *q = e->sseqs[j];
    kiln_request_t *r = q->owner;
    int32_t i = q->index;
    seq_state_t *ss = &r->ss[i];
    if (ss->done) continue; /* its request ended earlier in this loop */
    if (ss->gerr) {
      req_end(e, r, KILN_FINISH_ERROR, ss->gerr);
      continue;
    }
    if (e->sdraft[j] < 0) continue; /* a proposal's row: taken with its sequence's first */
    int32_t take = 1, nd = e->sdraft[j];
    if (nd > 0) {
      /* Verification: the proposals the model's own tokens (greedy or sampled, row by row with
       * the draws they will have) agree with. With a proposal x that is certain (n-gram), taking
       * x when the row samples y = x and y otherwise is speculative sampling's accept-with-
       * probability-min(1, p(x)/q(x)) with q = 1 and its residual p without x: every token
       * comes from the target distribution, with its top-k/top-p/min-p and penalties. */
      int32_t base = q->num_tokens - q->num_draft, a = 0;
      while (a < nd && e->so.tokens[j + a] == q->tokens[base + a]) a++;
      kiln_scheduler_accept_drafts(e->sched, q, a);
      /* The draft model keeps what it was fed of the accepted ones. They are no longer counted
       * in q->num_tokens (accept_drafts leaves the sequence's own tokens; the accepted ones
       * are appended below, with the same values, as the step's output), but they are still in
       * q->tokens: syncing to num_tokens alone dropped every fed proposal, so each catch-up
       * recomputed all of them (a + 1 tokens instead of one or two). */
      if (e->draft) kiln_draft_sync(e->draft, &ss->dseq, q->tokens, q->num_tokens + a);
      kiln_sample_skip(&ss->rng, (uint64_t)a); /* the draws of the accepted proposals' rows */
      take = a + 1; /* the accepted proposals and the model's next token */
      spec_drafts++;
      spec_tokens += (uint64_t)nd;
      spec_accepted += (uint64_t)a;
    }
    for (int32_t t = 0; t < take; t++)
      if (!seq_take(e, q, j + t, &text, t1, &gen)) break;
  }
  kiln_strbuf_free(&text);
  /* Beam searches whose beams all have their rows take a step. */
  for (int32_t s = 0; s < step->num_items; s++) {
    kiln_request_t *r = step->items[s].seq->owner;
    if (!r->beam || !r->beam_touched) continue;
    r->beam_touched = false;
    if (r->num_done < r->num_live) gen += beam_advance(e, r, t1);
  }
  /* A prompt-logprobs sequence that finished its prompt rows no longer needs them. */
  for (int32_t s = 0; s < step->num_items; s++) {
    kiln_seq_t *q = step->items[s].seq;
    if (q->state == KILN_SEQ_RUNNING && q->num_computed >= q->num_prompt) q->max_logits_rows = 0;
  }
  int64_t alloc = 0, used = 0;
  kiln_scheduler_slot_usage(e->sched, &alloc, &used);
  pthread_mutex_lock(&e->mu);
  kiln_metrics_t *m = &e->metrics;
  m->steps++;
  m->generation_tokens += gen;
  m->spec_drafts += spec_drafts;
  m->spec_draft_tokens += spec_tokens;
  m->spec_accepted_tokens += spec_accepted;
  graph_counts(e, m);
  for (int32_t s = 0; s < step->num_items; s++) {
    const kiln_sched_item_t *it = &step->items[s];
    int32_t np = it->seq->num_prompt;
    if (it->start < np)
      m->prompt_tokens +=
          (uint64_t)((it->start + it->count < np ? it->start + it->count : np) - it->start);
  }
  kiln_histogram_observe(&m->tokens_per_step, (double)T);
  m->kv_waste = alloc ? (double)(alloc - used) / (double)alloc : 0.0;
  pthread_mutex_unlock(&e->mu);
  step_hold(step, -1);
  update_gauges(e);
  return NULL;
}

void kiln_engine_hold_intake(kiln_engine_t *e, bool hold) {
  pthread_mutex_lock(&e->mu);
  if (hold)
    e->intake_holds++;
  else if (e->intake_holds > 0 && --e->intake_holds == 0)
    pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

kiln_status_t kiln_engine_step(kiln_engine_t *e, bool *idle) {
  pthread_mutex_lock(&e->mu);
  kiln_request_t *in = e->intake_holds ? NULL : e->in_head;
  if (in) e->in_head = e->in_tail = NULL;
  pthread_mutex_unlock(&e->mu);
  intake(e, in);
  kiln_status_t st = run_step(e, idle);
  if (*idle) update_gauges(e);
  return st;
}

static void *engine_main(void *arg) {
  kiln_engine_t *e = arg;
  for (;;) {
    pthread_mutex_lock(&e->mu);
    /* Held intake (kiln_engine_hold_intake) leaves new requests queued; shutdown takes them. */
    while (!e->stop && (!e->in_head || e->intake_holds) && !e->act_head)
      pthread_cond_wait(&e->cv, &e->mu);
    bool stop = e->stop;
    kiln_request_t *in = e->intake_holds && !stop ? NULL : e->in_head;
    if (in) e->in_head = e->in_tail = NULL;
    pthread_mutex_unlock(&e->mu);
    intake(e, in);
    if (stop) break;
    bool idle = false;
    kiln_status_t st = run_step(e, &idle);
    if (idle) update_gauges(e);
    if (st) { /* host out-of-memory in the scheduler: end what runs, keep serving */
      kiln_log(KILN_LOG_ERROR, "engine: %s", kiln_status_message(st));
      char msg[256];
      snprintf(msg, sizeof(msg), "%s", kiln_status_message(st));
      kiln_status_free(st);
      bool ended = false;
      for (kiln_request_t *r = e->act_head, *nx; r; r = nx) {
        nx = r->next;
        if (r->seqs[0].state == KILN_SEQ_RUNNING) {
          req_end(e, r, KILN_FINISH_ERROR, msg);
          ended = true;
        }
      }
      /* Nothing ran: admitting the first waiting request failed. It fails too, or the engine
       * would retry it forever while memory stays short. */
      kiln_seq_t *w = kiln_scheduler_waiting_head(e->sched);
      if (!ended && w) req_end(e, w->owner, KILN_FINISH_ERROR, msg);
    } else if (idle && e->act_head) {
      /* Requests wait but none fits now (cannot happen with a sound scheduler: every request
       * fits the pool alone). Wait for news rather than spin. */
      pthread_mutex_lock(&e->mu);
      if (!e->stop && !e->in_head) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10000000L;
        if (ts.tv_nsec >= 1000000000L) {
          ts.tv_sec++;
          ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
      }
      pthread_mutex_unlock(&e->mu);
    }
  }
  return NULL;
}

/* ---- creation ----------------------------------------------------------------------------- */

static kiln_status_t alloc_scratch(kiln_engine_t *e) {
  size_t S = (size_t)e->max_seqs + (size_t)e->spec_rows, T = (size_t)e->max_tokens,
         L = (size_t)e->max_logits;
  size_t rows = S + PROMPT_ROWS;
  e->b_ids = malloc(T * 4);
  e->b_pos = malloc(T * 4);
  e->b_slots = malloc(T * 4);
  if (e->has_vision && !(e->b_mrope = malloc(T * 3 * 4)))
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "engine: out of memory for step buffers");
  e->b_lens = malloc(S * 4);
  e->b_qsl = malloc((S + 1) * 4);
  e->b_tables = calloc(S * (size_t)e->max_blocks, 4);
  e->b_rows = malloc(L * 4);
  e->item_row = malloc(S * 4);
  e->sdraft = malloc(S * 4);
  if (e->spec_draft) {
    e->dreqs = calloc((size_t)e->dmax, sizeof(*e->dreqs));
    e->dseqs = calloc((size_t)e->dmax, sizeof(*e->dseqs));
    e->dbuf = calloc((size_t)e->dmax * KILN_DRAFT_MAX_K, 4);
    if (!e->dreqs || !e->dseqs || !e->dbuf)
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "engine: out of memory for step buffers");
  }
  e->srows = malloc(S * sizeof(*e->srows));
  e->sseqs = malloc(S * sizeof(*e->sseqs));
  e->crows = malloc(PROMPT_ROWS * sizeof(*e->crows));
  e->cseqs = malloc(PROMPT_ROWS * sizeof(*e->cseqs));
  e->c_pos = malloc(PROMPT_ROWS * 4);
  e->so.tokens = malloc(S * 4);
  e->so.logprobs = malloc(S * 4);
  e->so.top_ids = malloc(S * (size_t)e->max_top * 4);
  e->so.top_logprobs = malloc(S * (size_t)e->max_top * 4);
  e->so.score_logprobs = malloc(PROMPT_ROWS * 4);
  e->so.score_top_ids = malloc(PROMPT_ROWS * (size_t)e->max_top * 4);
  e->so.score_top_logprobs = malloc(PROMPT_ROWS * (size_t)e->max_top * 4);
  (void)rows;
  if (!e->b_ids || !e->b_pos || !e->b_slots || !e->b_lens || !e->b_qsl || !e->b_tables ||
      !e->b_rows || !e->item_row || !e->sdraft || !e->srows || !e->sseqs || !e->crows || !e->cseqs || !e->c_pos ||
      !e->so.tokens || !e->so.logprobs || !e->so.top_ids || !e->so.top_logprobs ||
      !e->so.score_logprobs || !e->so.score_top_ids || !e->so.score_top_logprobs)
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "engine: out of memory for step buffers");
  return NULL;
}

static int32_t dtype_of(const char *name) {
  if (!strcmp(name, "float32")) return KILN_HAL_F32;
  if (!strcmp(name, "float16")) return KILN_HAL_F16;
  if (!strcmp(name, "bfloat16")) return KILN_HAL_BF16;
  return -1;
}

static const char *engine_config_get(void *ctx, const char *plugin, const char *key) {
  char section[160];
  snprintf(section, sizeof(section), "plugin.%s", plugin);
  return kiln_config_get_raw((const kiln_config_t *)ctx, section, key);
}

/* The index-th key of [plugin.<plugin>] (host->config_key of ABI 1.1). */
static const char *engine_config_key(void *ctx, const char *plugin, int32_t index) {
  char section[160];
  snprintf(section, sizeof(section), "plugin.%s", plugin);
  return index < 0 ? NULL
                   : kiln_config_section_key((const kiln_config_t *)ctx, section, (size_t)index);
}

/* [speculative] method = draft: loads the draft model on the target's device (before the KV
 * pools are sized, so that its weights come out of the budget) and checks that it shares the
 * target's vocabulary: the vocabulary size, BOS and EOS ids, and where both have a
 * tokenizer, its size, special ids and the ids of a probe text. */
static kiln_status_t load_draft(kiln_engine_t *e, const kiln_config_t *cfg,
                                const kiln_model_options_t *tmo) {
  kiln_model_location_t *loc = malloc(sizeof(*loc));
  if (!loc) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kiln_status_t st = kiln_model_resolve(cfg, e->draft_path, loc);
  if (!st) {
    free(e->draft_path);
    if (!(e->draft_path = strdup(loc->path)))
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  }
  free(loc);
  if (st) return kiln_status_annotate(st, "speculative.draft_model");
  const char *path = e->draft_path;
  kiln_model_config_t mc;
  size_t plen = strlen(path);
  if (plen > 5 && !strcmp(path + plen - 5, ".gguf")) {
    kiln_weights_t *w = NULL;
    st = kiln_gguf_open(path, &mc, &w);
    kiln_weights_free(w);
  } else {
    st = kiln_model_config_load(path, &mc);
  }
  if (st) return kiln_status_annotate(st, "speculative.draft_model %s", path);
  kiln_model_options_t mo = *tmo;
  /* Under tensor parallelism the draft is not sharded: it runs whole on rank 0's device (its
   * forwards are rank 0's alone; only the target's verification runs on every rank). */
  mo.tp_size = 0;
  mo.tp_rank = 0;
  mo.tp_comm = NULL;
  mo.max_seqs = e->dmax;
  mo.max_logits = e->dmax; /* one row per sequence and draft forward */
  /* Its catch-up after a verification is two tokens per sequence (kiln_draft_propose), then
   * one token a forward: two-token graphs where the target has multi-token ones ([graph]
   * multi_token, load_model). */
  mo.graph_max_query_len = tmo->graph_max_query_len > 1 ? 2 : 1;
  int64_t len = kiln_rope_max_positions(&mc);
  if (mo.max_model_len > 0 && mo.max_model_len < len) len = mo.max_model_len;
  mo.max_blocks_per_seq = (int32_t)((len + e->bs - 1) / e->bs);
  const kiln_model_config_t *tc = kiln_model_get_config(e->model);
  if (mc.vocab_size != tc->vocab_size)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "speculative.draft_model %s has a vocabulary of %lld tokens, the "
                            "model %s has %lld: the draft needs the target's tokenizer",
                            path, (long long)mc.vocab_size, e->model_path,
                            (long long)tc->vocab_size);
  bool same_eos = mc.num_eos == tc->num_eos;
  for (int32_t i = 0; same_eos && i < mc.num_eos; i++)
    same_eos = mc.eos_token_ids[i] == tc->eos_token_ids[i];
  if (mc.bos_token_id != tc->bos_token_id || !same_eos)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "speculative.draft_model %s has BOS %d and %d EOS id(s) (first %d), "
                            "the model %s has BOS %d and %d (first %d): the draft needs the "
                            "target's tokenizer",
                            path, mc.bos_token_id, mc.num_eos,
                            mc.num_eos ? mc.eos_token_ids[0] : -1, e->model_path,
                            tc->bos_token_id, tc->num_eos, tc->num_eos ? tc->eos_token_ids[0] : -1);
  if (kiln_model_has_vision(e->model))
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "speculative.method = draft: the model %s is a vision-language "
                            "model, which draft speculation does not support",
                            e->model_path);
  kiln_tokenizer_t *dtok = NULL;
  if (e->tok && !(st = kiln_model_open_tokenizer(path, &dtok, NULL, NULL, NULL)) && dtok) {
    static const char probe[] = "Hello, world! The quick brown fox: 12345 <|im_start|> \xc3\xa9t\xc3\xa9";
    kiln_tokens_t a = KILN_TOKENS_INIT, b = KILN_TOKENS_INIT;
    bool same = kiln_tokenizer_vocab_size(dtok) == kiln_tokenizer_vocab_size(e->tok) &&
                kiln_tokenizer_bos_id(dtok) == kiln_tokenizer_bos_id(e->tok) &&
                kiln_tokenizer_eos_id(dtok) == kiln_tokenizer_eos_id(e->tok);
    kiln_status_t s1 = kiln_tokenizer_encode(e->tok, probe, sizeof(probe) - 1, true, &a);
    kiln_status_t s2 = kiln_tokenizer_encode(dtok, probe, sizeof(probe) - 1, true, &b);
    if (!s1 && !s2)
      same = same && a.len == b.len && !memcmp(a.ids, b.ids, a.len * sizeof(*a.ids));
    else
      same = false;
    kiln_status_free(s1);
    kiln_status_free(s2);
    kiln_tokens_free(&a);
    kiln_tokens_free(&b);
    kiln_tokenizer_free(dtok);
    if (!same)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "speculative.draft_model %s: its tokenizer differs from the one of "
                              "the model %s (vocabulary size, special ids or the ids of a probe "
                              "text): the draft needs the target's tokenizer",
                              path, e->model_path);
  }
  if (st) return kiln_status_annotate(st, "speculative.draft_model %s", path);
  if ((st = kiln_model_load(path, e->plugin ? &e->plugin->table : NULL, e->dev, e->stream, &mo,
                            &e->dmodel)))
    return kiln_status_annotate(st, "speculative.draft_model %s", path);
  return NULL;
}

/* Opens the backend and loads the model, tokenizer and KV pool named by the config. */
static kiln_status_t load_model(kiln_engine_t *e, const kiln_config_t *cfg, int32_t *num_blocks) {
  /* [model] path: a local path, or a Hub id resolved through the Hub cache (models/hub). */
  kiln_model_location_t *loc = malloc(sizeof(*loc));
  if (!loc) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kiln_status_t st = kiln_model_resolve(cfg, NULL, loc);
  char pathbuf[4096];
  memcpy(pathbuf, loc->path, sizeof(pathbuf));
  free(loc);
  if (st) return st;
  const char *path = pathbuf;
  if (!(e->model_path = strdup(path)))
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kiln_hal_registry_options_t ro = {0};
  ro.config_path = kiln_config_get_string(cfg, "backend", "path");
  ro.num_threads = (int32_t)kiln_config_get_int(cfg, "backend", "threads");
  ro.config_get = engine_config_get;
  ro.config_key = engine_config_key;
  ro.config_ctx = (void *)cfg;
  st = kiln_hal_registry_create(&ro, &e->registry);
  if (!st)
    st = kiln_hal_registry_open(e->registry, kiln_config_get_string(cfg, "backend", "name"),
                                &e->plugin);
  if (st) return st;
  const kiln_hal_backend_t *be = &e->plugin->table;
  e->backend_name = be->name;
  int32_t di = (int32_t)kiln_config_get_int(cfg, "backend", "device");
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  kiln_hal_error_t *he = be->device_info(di, &info);
  if (!he) he = be->device_open(di, &e->dev);
  if (!he) he = be->stream_create(e->dev, &e->stream);
  if (he) return kiln_hal_status_from_error(he, "opening the device");
  if (!(e->device_name = strdup(info.name)))
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  e->host_memory = (info.caps & KILN_HAL_CAP_HOST_MEMORY) != 0;
  const int32_t tp = (int32_t)kiln_config_get_int(cfg, "parallel", "tensor_parallel_size");
  e->tp_size = tp > 1 ? tp : 1;
  kiln_model_options_t mo = {0};
  mo.dtype = dtype_of(kiln_config_get_string(cfg, "model", "dtype"));
  mo.quantization = strcmp(kiln_config_get_string(cfg, "model", "quantization"), "fp8") == 0
                        ? KILN_QUANT_FP8
                        : KILN_QUANT_NONE;
  const char *fw = kiln_config_get_string(cfg, "model", "fp8_weights");
  mo.fp8_weights = !strcmp(fw, "keep")    ? KILN_FP8_WEIGHTS_KEEP
                   : !strcmp(fw, "widen") ? KILN_FP8_WEIGHTS_WIDEN
                                          : KILN_FP8_WEIGHTS_AUTO;
  mo.fp8_activations =
      !strcmp(kiln_config_get_string(cfg, "model", "fp8_activations"), "dynamic")
          ? KILN_FP8_ACT_DYNAMIC
          : KILN_FP8_ACT_NONE;
  mo.kv_dtype = !strcmp(kiln_config_get_string(cfg, "cache", "dtype"), "fp8_e4m3")
                    ? KILN_KV_DTYPE_FP8_E4M3
                    : KILN_KV_DTYPE_AUTO;
  mo.max_tokens = e->max_tokens;
  mo.max_seqs = e->max_seqs;
  mo.max_logits = e->max_logits;
  mo.max_model_len = kiln_config_get_int(cfg, "model", "max_model_len");
  mo.device_index = di;
  mo.graphs = kiln_config_get_bool(cfg, "graph", "enabled");
  mo.num_capture_sizes =
      (int32_t)kiln_config_get_int_list(cfg, "graph", "capture_sizes", &mo.capture_sizes);
  /* Speculation verifies k proposals as k + 1 rows per sequence, for at most dmax sequences a
   * step: multi-token decode graphs for those batches. */
  const bool multi = kiln_config_get_bool(cfg, "graph", "multi_token");
  if (e->spec_k > 0 && multi) {
    mo.graph_max_query_len = e->spec_k + 1;
    mo.graph_query_max_seqs = e->dmax;
  }
  /* The block-table width depends on the context: read the config (or the GGUF header) first
   * and size it for the rope table's rows, capped by max_model_len. */
  kiln_model_config_t mc;
  size_t plen = strlen(path);
  if (plen > 5 && !strcmp(path + plen - 5, ".gguf")) {
    kiln_weights_t *w = NULL; /* the header only: mapping the file is cheap */
    st = kiln_gguf_open(path, &mc, &w);
    kiln_weights_free(w);
  } else {
    st = kiln_model_config_load(path, &mc);
  }
  if (st) return st;
  int64_t len = kiln_rope_max_positions(&mc);
  if (mo.max_model_len > 0 && mo.max_model_len < len) len = mo.max_model_len;
  mo.max_blocks_per_seq = (int32_t)((len + e->bs - 1) / e->bs);
  if (tp > 1) {
    /* Tensor parallelism (docs/parallel.md "Engine"): ranks 1..N-1 are threads of the runner
     * that load their shards while this thread loads rank 0's; the model layer refuses what it
     * does not shard (vision tower, GGUF, quantized weights, heads N does not divide). */
    if (!(info.caps & KILN_HAL_CAP_COLLECTIVES))
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "[parallel] tensor_parallel_size = %d: device %d of backend %s has no "
                              "collectives; use tensor_parallel_size = 1",
                              (int)tp, (int)di, be->name);
    int32_t ndev = 0;
    if (!e->host_memory && (he = be->device_count(&ndev)))
      return kiln_hal_status_from_error(he, "counting the devices");
    if (!e->host_memory && (int64_t)di + tp > ndev)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "[parallel] tensor_parallel_size = %d from [backend] device = %d "
                              "needs devices %d..%d, and backend %s has %d",
                              (int)tp, (int)di, (int)di, (int)(di + tp - 1), be->name, (int)ndev);
    kiln_tp_options_t to;
    memset(&to, 0, sizeof(to));
    to.path = path;
    to.backend = be;
    to.tp_size = tp;
    to.device_index = di;
    to.same_device = e->host_memory; /* the cpu backend: every rank on its one device */
    to.model = mo;
    if ((st = kiln_tp_ranks_start(&to, e->dev, &e->tp_comm, &e->tp))) return st;
    mo.tp_size = tp;
    mo.tp_rank = 0;
    mo.tp_comm = e->tp_comm;
  }
  st = kiln_model_load(path, be, e->dev, e->stream, &mo, &e->model);
  if (e->tp) { /* the workers' loads too; rank 0's error first (they usually agree) */
    kiln_status_t ws = kiln_tp_ranks_wait(e->tp);
    if (st)
      kiln_status_free(ws);
    else
      st = ws;
  }
  if (st) return st;
  const kiln_model_config_t *c = kiln_model_get_config(e->model);
  e->max_len = kiln_model_max_len(e->model);
  e->max_blocks = (int32_t)((e->max_len + e->bs - 1) / e->bs);
  if (!(e->model_name = strdup(c->architecture[0] ? c->architecture : c->model_type)))
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  /* Tokenizer: tokenizer.json beside the model (a directory, or a .gguf file's folder), else
   * the one in a .gguf file's metadata. A broken chat template must not stop completions from
   * being served: keep the reason and report it to whoever asks for a chat. */
  kiln_status_t ct = NULL;
  kiln_tokenizer_source_t src;
  if ((st = kiln_model_open_tokenizer(path, &e->own_tok, &e->chat, &ct, &src))) return st;
  e->tok = e->own_tok;
  if (src == KILN_TOKENIZER_GGUF)
    KILN_LOG_I("tokenizer: from the metadata of %s (no tokenizer.json beside it)", path);
  if (ct) {
    KILN_LOG_W("chat template of %s: %s", path, kiln_status_message(ct));
    e->chat_error = strdup(kiln_status_message(ct));
    kiln_status_free(ct);
  }
  if (c->num_eos > 0) {
    if (!(e->eos = dup_mem(c->eos_token_ids, (size_t)c->num_eos * 4)))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    e->num_eos = c->num_eos;
  }
  if (e->spec_draft && (st = load_draft(e, cfg, &mo))) return st;
  /* The KV pool: [cache] num_blocks, or what the memory budget leaves after the weights and
   * the activations (both already allocated by the load, the draft model's too), capped at
   * what max_num_seqs sequences of the full context could ever use. With a draft model, its
   * pool takes [speculative] draft_kv_fraction of the budget (0: the share that gives it as
   * many blocks as the target's pool); with [cache] num_blocks set, the draft gets as many
   * blocks, or with draft_kv_fraction f, f / (1 - f) of the target pool's bytes. */
  uint64_t block_bytes = kiln_model_kv_block_bytes(e->model, e->bs);
  uint64_t dblock_bytes = e->dmodel ? kiln_model_kv_block_bytes(e->dmodel, e->bs) : 0;
  double dfrac = kiln_config_get_float(cfg, "speculative", "draft_kv_fraction");
  int64_t nb = kiln_config_get_int(cfg, "cache", "num_blocks"), dnb = 0;
  int64_t cap = (int64_t)e->max_seqs * e->max_blocks + 1;
  if (e->dmodel && nb > 0)
    dnb = dfrac > 0 ? (int64_t)((double)nb * dfrac / (1.0 - dfrac) * (double)block_bytes /
                                (double)dblock_bytes)
                    : nb;
  if (nb <= 0) {
    uint64_t free_b = 0, total_b = 0;
    if ((he = be->device_memory(e->dev, &free_b, &total_b)))
      return kiln_hal_status_from_error(he, "reading the device's free memory");
    double util = kiln_config_get_float(cfg, "cache", "gpu_memory_utilization");
    double reserve = (1.0 - util) * (double)total_b;
    double budget = (double)free_b - reserve;
    /* Under TP every rank gets rank 0's block count: size it for the tightest device (block
     * bytes are per rank and the same on every rank). Read after every rank's load. */
    for (int32_t r = 1; e->tp && !e->host_memory && r < tp; r++) {
      uint64_t rf = 0, rt = 0;
      kiln_tp_ranks_memory(e->tp, r, &rf, &rt);
      double rb = (double)rf - (1.0 - util) * (double)rt;
      if (rb < budget) budget = rb;
    }
    if (info.caps & KILN_HAL_CAP_HOST_MEMORY) {
      /* Host memory is shared with everything else on the machine: at most 2 GiB unless
       * [cache] num_blocks asks for more; under TP the ranks' pools share both (the free
       * memory and the cap), so each takes 1/N. */
      if (budget > 2.0 * 1073741824.0) budget = 2.0 * 1073741824.0;
      if (e->tp) budget /= (double)tp;
    }
    if (e->dmodel && budget > 0) {
      double share = dfrac > 0 ? dfrac
                               : (double)dblock_bytes / (double)(block_bytes + dblock_bytes);
      dnb = (int64_t)(budget * share / (double)dblock_bytes);
      budget -= budget * share;
    }
    nb = budget > 0 ? (int64_t)(budget / (double)block_bytes) : 0;
    if (nb > cap) nb = cap;
    if (nb < 1)
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY,
                              "no memory left for the KV cache: %.1f MiB free of %.1f MiB, "
                              "gpu_memory_utilization %.2f keeps %.1f MiB back, and one block "
                              "takes %.2f MiB; lower max_num_batched_tokens or raise "
                              "gpu_memory_utilization",
                              (double)free_b / 1048576.0, (double)total_b / 1048576.0, util,
                              reserve / 1048576.0, (double)block_bytes / 1048576.0);
  }
  if (nb > (1 << 30)) nb = 1 << 30;
  if ((st = kiln_model_kv_create(e->model, (int32_t)nb, e->bs, &e->kvc))) return st;
  kiln_model_graphs_capture(e->model, e->kvc,
                            kiln_config_get_float(cfg, "graph", "capture_budget_s"));
  if (e->dmodel) {
    int64_t dmax_blocks = (kiln_model_max_len(e->dmodel) + e->bs - 1) / e->bs;
    int64_t dcap = (int64_t)e->max_seqs * dmax_blocks + 1;
    if (dnb > dcap) dnb = dcap;
    if (dnb > (1 << 30)) dnb = 1 << 30;
    if (dnb < 1)
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY,
                              "no memory left for the draft model's KV cache "
                              "(speculative.draft_model %s); raise "
                              "speculative.draft_kv_fraction or gpu_memory_utilization",
                              e->draft_path);
    if ((st = kiln_model_kv_create(e->dmodel, (int32_t)dnb, e->bs, &e->dkvc))) return st;
    kiln_model_graphs_capture(e->dmodel, e->dkvc,
                              kiln_config_get_float(cfg, "graph", "capture_budget_s"));
    kiln_draft_options_t dopt = {.num_blocks = (int32_t)dnb,
                                 .block_size = e->bs,
                                 .max_seqs = e->dmax,
                                 .max_tokens = e->max_tokens,
                                 .force_host_sampling = e->force_host};
    if ((st = kiln_runner_model_init(&dopt.runner, e->dmodel, e->dkvc, be, e->dev, e->stream,
                                     e->dmax)))
      return st;
    if ((st = kiln_draft_create(&dopt, &e->draft))) return st;
    kiln_log(KILN_LOG_INFO, "draft model %s: KV cache of %lld blocks (%.1f MiB)", e->draft_path,
             (long long)dnb, (double)dnb * (double)dblock_bytes / 1048576.0);
  }
  *num_blocks = (int32_t)nb;
  if (kiln_model_has_vision(e->model)) {
    e->has_vision = true;
    e->max_images = (int32_t)kiln_config_get_int(cfg, "model", "max_images_per_prompt");
    /* Without the processor's settings, images given as pixel values still work; encoded
     * images are refused with the reason. */
    kiln_status_t pst = kiln_vision_preproc_load(path, &e->preproc);
    e->preproc.threads = (int32_t)kiln_config_get_int(cfg, "model", "image_threads");
    if (pst) {
      if (kiln_status_code(pst) == KILN_ERR_OUT_OF_MEMORY) return pst;
      KILN_LOG_W("%s: %s", path, kiln_status_message(pst));
      e->preproc_error = strdup(kiln_status_message(pst));
      kiln_status_free(pst);
    } else {
      e->has_preproc = true;
    }
  }
  kiln_log(KILN_LOG_INFO, "KV cache: %lld blocks of %d tokens, %lld tokens in %s (%.1f MiB%s)",
           (long long)nb, e->bs, (long long)nb * e->bs, kiln_model_kv_dtype_name(e->model),
           (double)nb * (double)block_bytes / 1048576.0, e->tp ? " on each rank" : "");
  if (e->tp) {
    kiln_tp_ranks_t *t = e->tp;
    e->tp = NULL; /* the runner's now, even if this fails */
    kiln_log(KILN_LOG_INFO, "tensor parallelism: %d ranks as threads (%s)", (int)tp,
             e->host_memory ? "all on the one device" : "one device each, from [backend] device");
    return kiln_runner_tp_init(&e->runner, t, (int32_t)nb, e->bs, e->model, e->kvc, be, e->dev,
                               e->stream, e->max_logits);
  }
  return kiln_runner_model_init(&e->runner, e->model, e->kvc, be, e->dev, e->stream, e->max_logits);
}

/* ---- warm-up ([engine] warmup) -------------------------------------------------------------
 * A GPU backend pays for a kernel the first time it runs it (lazy module loading) and for a
 * GEMM shape the first time it meets it (cuBLASLt's algorithm choice): a cold process's first
 * 512-token prefill of a 7B model took 59-79 ms on an H200 against 14 ms warm. Before the
 * engine thread starts, warm-up runs dummy requests through the whole path (scheduler, model,
 * sampler, decode graphs), one after the other, stepping the engine itself: greedy prefills of
 * several lengths up to max_num_batched_tokens (each then one decode step), a sampled request
 * (the top-k / top-p kernels) and, on a vision-language model, one 448 x 448 image given as
 * pixel values (the vision tower's kernels). Then the block manager and the scheduler are made
 * afresh and the metrics zeroed, so nothing of it shows: no cached prefix, no counted request,
 * request numbers from 0 (a request's default seed derives from its number). A size that
 * cannot fit the KV pool is skipped. */

#define WARMUP_MAX_REQS 8

static bool warmup_id_ok(const kiln_model_config_t *c, int32_t id) {
  return id != c->image_token_id && id != c->video_token_id && id != c->vision_start_token_id &&
         id != c->vision_end_token_id;
}

/* Fills ids[0..n) with ordinary token ids (never a vision special token). */
static void warmup_ids(const kiln_model_config_t *c, int32_t vocab, int32_t *ids, int32_t n,
                       uint32_t salt) {
  const int32_t span = vocab < 30000 ? vocab : 30000;
  uint32_t x = 2463534242u ^ salt;
  for (int32_t i = 0; i < n; i++) {
    int32_t id;
    do {
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      id = (int32_t)(x % (uint32_t)span);
    } while (!warmup_id_ok(c, id));
    ids[i] = id;
  }
}

/* Submits one dummy request and steps the engine until it ends. *ran is false when it was
 * refused at submission (it does not fit this pool): not an error. */
static kiln_status_t warmup_one(kiln_engine_t *e, const int32_t *ids, int32_t n,
                                const kiln_sampling_params_t *sp, const kiln_image_input_t *img,
                                bool *ran) {
  *ran = false;
  kiln_request_desc_t d;
  memset(&d, 0, sizeof(d));
  d.struct_size = sizeof(d);
  d.prompt_ids = ids;
  d.num_prompt_ids = n;
  d.params = sp;
  d.images = img;
  d.num_images = img ? 1 : 0;
  kiln_request_t *r = NULL;
  kiln_status_t st = kiln_engine_submit(e, &d, &r);
  if (st) {
    kiln_log(KILN_LOG_DEBUG, "warm-up: a %d-token request skipped: %s", n, kiln_status_message(st));
    kiln_status_free(st);
    return NULL;
  }
  bool done = false, failed = false;
  char why[256] = "";
  for (int32_t guard = 0; !done && guard < 100000; guard++) {
    bool idle = false;
    if ((st = kiln_engine_step(e, &idle))) break;
    kiln_output_t *o = NULL;
    while (!kiln_request_poll(r, 0, &o) && o) {
      if (o->finish_reason == KILN_FINISH_ERROR && !failed) {
        failed = true;
        snprintf(why, sizeof(why), "%s", o->error ? o->error : "failed");
      }
      done = done || o->request_finished;
      kiln_output_free(o);
      o = NULL;
    }
    if (idle && !done && !e->act_head && !e->in_head) break; /* nothing left to run */
  }
  kiln_request_release(r);
  if (st) return st;
  if (failed) return kiln_status_make(KILN_ERR_INTERNAL, "warm-up request of %d tokens: %s", n, why);
  *ran = done;
  return NULL;
}

/* The KV cache's configuration in the metrics (block size, [cache] dtype, bytes per token). */
static void engine_kv_metrics(kiln_engine_t *e) {
  e->metrics.kv_block_size = e->bs;
  e->metrics.kv_cache_dtype = e->model ? kiln_model_kv_dtype_name(e->model) : NULL;
  e->metrics.kv_bytes_per_token =
      e->model && e->bs > 0 ? (int64_t)(kiln_model_kv_block_bytes(e->model, e->bs) / (uint64_t)e->bs)
                            : 0;
}

static kiln_status_t engine_warmup(kiln_engine_t *e, const kiln_config_t *cfg) {
  const char *mode = kiln_config_get_string(cfg, "engine", "warmup");
  if (!strcmp(mode, "off") || (!strcmp(mode, "auto") && e->host_memory)) return NULL;
  const kiln_model_config_t *c = kiln_model_get_config(e->model);
  const double t0 = now_s();
  int64_t limit = e->max_tokens;
  if (limit > e->max_len - 2) limit = e->max_len - 2;
  const int32_t want[] = {e->max_tokens, 2048, 512, 128, 32};
  int32_t sizes[8], ns = 0;
  for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
    int32_t n = want[i] < limit ? want[i] : (int32_t)limit;
    bool dup = n < 1;
    for (int32_t j = 0; j < ns; j++) dup = dup || sizes[j] == n;
    if (!dup) sizes[ns++] = n;
  }
  int32_t maxn = ns ? sizes[0] : 0;
  for (int32_t i = 1; i < ns; i++) maxn = sizes[i] > maxn ? sizes[i] : maxn;
  if (maxn < 16) maxn = 16;
  int32_t *ids = malloc((size_t)maxn * sizeof(*ids));
  if (!ids) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "warm-up: out of memory");
  kiln_sampling_params_t sp;
  kiln_sampling_params_init(&sp);
  sp.max_tokens = 2;
  sp.ignore_eos = true;
  kiln_status_t st = NULL;
  int32_t ran_n = 0, ran_tokens = 0;
  bool ran = false;
  for (int32_t i = 0; !st && i < ns && ran_n < WARMUP_MAX_REQS; i++) {
    warmup_ids(c, e->vocab, ids, sizes[i], (uint32_t)i);
    st = warmup_one(e, ids, sizes[i], &sp, NULL, &ran);
    ran_n += ran;
    ran_tokens += ran ? sizes[i] : 0;
  }
  if (!st) { /* the sampled path: temperature, top-k, top-p */
    kiln_sampling_params_t ss = sp;
    ss.temperature = 0.8f;
    ss.top_p = 0.9f;
    ss.top_k = 40;
    ss.seed = 1;
    ss.has_seed = true;
    warmup_ids(c, e->vocab, ids, 16, 99u);
    st = warmup_one(e, ids, 16, &ss, NULL, &ran);
    ran_n += ran;
  }
  bool image = false;
  if (!st && e->has_vision && e->max_images > 0 && c->image_token_id >= 0) {
    /* 448 x 448 pixels: 32 x 32 patches, 256 prompt tokens after the 2 x 2 merge */
    const kiln_vision_config_t *v = &c->vision;
    const int32_t gh = 32, gw = 32;
    const int64_t rowlen = v->in_channels * v->temporal_patch_size * v->patch_size * v->patch_size;
    float *px = malloc((size_t)(gh * gw) * (size_t)rowlen * sizeof(float));
    if (!px) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "warm-up: out of memory");
    for (int64_t i = 0; px && i < (int64_t)gh * gw * rowlen; i++)
      px[i] = (float)((i * 37) % 101 - 50) / 64.0f;
    if (px) {
      kiln_image_input_t img = {.pixel_values = px, .grid_t = 1, .grid_h = gh, .grid_w = gw};
      int32_t n = 0;
      if (c->vision_start_token_id >= 0) ids[n++] = c->vision_start_token_id;
      ids[n++] = c->image_token_id;
      if (c->vision_end_token_id >= 0) ids[n++] = c->vision_end_token_id;
      warmup_ids(c, e->vocab, ids + n, 8, 7u);
      n += 8;
      st = warmup_one(e, ids, n, &sp, &img, &ran);
      ran_n += ran;
      image = ran;
      free(px);
    }
  }
  free(ids);
  if (st) return kiln_status_annotate(st, "[engine] warmup (set it to off to skip)");
  /* Afresh: no warm-up prefix in the cache, no counted request, numbers from 0. */
  kiln_scheduler_free(e->sched);
  e->sched = NULL;
  kiln_kv_manager_free(e->kv);
  e->kv = NULL;
  const int32_t nb = e->metrics.kv_blocks_total;
  if ((st = kiln_kv_manager_create(nb, e->bs,
                                   kiln_config_get_bool(cfg, "cache", "enable_prefix_caching"),
                                   &e->kv)))
    return st;
  kiln_sched_options_t so = {
      .max_num_seqs = e->max_seqs,
      .max_num_batched_tokens = e->max_tokens,
      .chunked_prefill = e->chunked,
      .priority_policy = !strcmp(kiln_config_get_string(cfg, "scheduler", "policy"), "priority")};
  if ((st = kiln_scheduler_create(e->kv, &so, &e->sched))) return st;
  pthread_mutex_lock(&e->mu);
  kiln_metrics_init(&e->metrics);
  e->metrics.kv_blocks_total = nb;
  engine_kv_metrics(e);
  e->metrics.warmup_requests = (uint64_t)ran_n;
  e->metrics.warmup_seconds = now_s() - t0;
  pthread_mutex_unlock(&e->mu);
  e->enc_encodes = e->enc_evictions = 0;
  atomic_store(&e->next_seqno, 0);
  if (e->draft) kiln_draft_zero_seconds(e->draft);
  kiln_log(KILN_LOG_INFO, "warm-up: %d requests (%d prompt tokens%s) in %.3f s", ran_n,
           ran_tokens + 16, image ? ", one 448x448 image" : "", e->metrics.warmup_seconds);
  return NULL;
}

kiln_status_t kiln_engine_create_setup(const kiln_engine_setup_t *su, kiln_engine_t **out) {
  *out = NULL;
  kiln_engine_t *e = calloc(1, sizeof(*e));
  if (!e) {
    if (su->runner.forward && su->runner.destroy) su->runner.destroy(su->runner.ctx); /* ours */
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "engine: out of memory");
  }
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  pthread_mutex_init(&e->gmu, NULL);
  kiln_metrics_init(&e->metrics);
  const kiln_config_t *cfg = su->config;
  e->bs = atoi(kiln_config_get_string(cfg, "cache", "block_size"));
  e->max_seqs = (int32_t)kiln_config_get_int(cfg, "engine", "max_num_seqs");
  e->max_tokens = (int32_t)kiln_config_get_int(cfg, "engine", "max_num_batched_tokens");
  e->seed = (uint64_t)kiln_config_get_int(cfg, "engine", "seed");
  e->guide_pre_ms = (int32_t)kiln_config_get_int(cfg, "engine", "guide_precompute_ms");
  e->chunked = kiln_config_get_bool(cfg, "scheduler", "enable_chunked_prefill");
  e->max_queued = (int32_t)kiln_config_get_int(cfg, "server", "max_queued_requests");
  kiln_status_t st = NULL;
  /* [speculative]: proposals take logits rows beyond the usual ones (at most k for each of
   * disable_by_batch_size sequences a step). */
  e->spec_min = (int32_t)kiln_config_get_int(cfg, "speculative", "ngram_min");
  e->spec_max = (int32_t)kiln_config_get_int(cfg, "speculative", "ngram_max");
  e->spec_batch = (int32_t)kiln_config_get_int(cfg, "speculative", "disable_by_batch_size");
  const char *method = kiln_config_get_string(cfg, "speculative", "method");
  e->spec_draft = !strcmp(method, "draft");
  if (!strcmp(method, "ngram") || e->spec_draft)
    e->spec_k = (int32_t)kiln_config_get_int(cfg, "speculative", "num_speculative_tokens");
  e->force_host = su->force_host_sampling;
  if (e->spec_draft) {
    char dp[4096];
    st = kiln_config_get_path(cfg, "speculative", "draft_model", dp, sizeof(dp));
    if (!st && !dp[0])
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "speculative.method = draft needs speculative.draft_model (a "
                            "smaller model with the same tokenizer)");
    if (!st && su->runner.forward)
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "speculative.method = draft needs the model loaded from [model] path "
                            "(not a given runner)");
    if (!st && !(e->draft_path = strdup(dp)))
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "engine: out of memory");
  }
  if (!st && e->spec_min > e->spec_max)
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "speculative.ngram_min (%d) is larger than speculative.ngram_max (%d)",
                          e->spec_min, e->spec_max);
  int32_t sb = e->spec_batch < e->max_seqs ? e->spec_batch : e->max_seqs;
  e->dmax = sb;
  e->spec_rows = e->spec_k * sb;
  e->max_logits = e->max_seqs + PROMPT_ROWS + e->spec_rows;
  e->max_top = 20;
  e->manual = su->manual;
  e->enc_cap = su->encoder_cache_bytes
                   ? su->encoder_cache_bytes
                   : (uint64_t)kiln_config_get_int(cfg, "model", "encoder_cache_mb") << 20;
  int32_t num_blocks = su->num_blocks;
  if (st) {
    if (su->runner.forward && su->runner.destroy) su->runner.destroy(su->runner.ctx);
  } else if (su->runner.forward) {
    e->runner = su->runner;
    e->tok = su->tokenizer;
    e->max_len = su->runner.max_model_len;
    e->max_blocks = (int32_t)((e->max_len + e->bs - 1) / e->bs);
    e->backend_name = "custom";
    if (su->num_eos > 0 && !(e->eos = dup_mem(su->eos_ids, (size_t)su->num_eos * 4)))
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "engine: out of memory");
    e->num_eos = su->num_eos;
    if (e->runner.max_logits < e->max_logits) {
      e->max_logits = e->runner.max_logits;
      /* a runner with fewer rows: fewer of them for proposals */
      int32_t left = e->max_logits - e->max_seqs - PROMPT_ROWS;
      if (e->spec_rows > left) e->spec_rows = left > 0 ? left : 0;
    }
  } else {
    st = load_model(e, cfg, &num_blocks);
  }
  e->vocab = e->runner.vocab_size;
  if (!st)
    st = kiln_kv_manager_create(
        num_blocks, e->bs, kiln_config_get_bool(cfg, "cache", "enable_prefix_caching"), &e->kv);
  if (!st) {
    kiln_sched_options_t so = {
        .max_num_seqs = e->max_seqs,
        .max_num_batched_tokens = e->max_tokens,
        .chunked_prefill = e->chunked,
        .priority_policy = !strcmp(kiln_config_get_string(cfg, "scheduler", "policy"), "priority")};
    st = kiln_scheduler_create(e->kv, &so, &e->sched);
  }
  if (!st)
    st = kiln_sampler_create(e->runner.backend, e->runner.device, e->runner.stream,
                             su->force_host_sampling, e->max_seqs + PROMPT_ROWS + e->spec_rows,
                             e->max_top,
                             e->vocab, &e->sampler);
  if (!st) st = alloc_scratch(e);
  if (!st) {
    e->metrics.kv_blocks_total = kiln_kv_num_blocks(e->kv);
    engine_kv_metrics(e);
    if (!e->manual && !su->runner.forward) st = engine_warmup(e, cfg);
  }
  if (!st) {
    if (!e->manual) {
      if (pthread_create(&e->thread, NULL, engine_main, e) != 0)
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "engine: cannot start the engine thread");
      else
        e->thread_started = true;
    }
  }
  if (st) {
    kiln_engine_destroy(e);
    return st;
  }
  *out = e;
  return NULL;
}

kiln_status_t kiln_engine_create(const char *config_path, const char *const *overrides,
                                 int32_t num_overrides, kiln_engine_t **out) {
  *out = NULL;
  kiln_config_t *cfg = NULL;
  kiln_status_t st = kiln_config_create(&cfg);
  if (!st && config_path) st = kiln_config_load_file(cfg, config_path);
  for (int32_t i = 0; !st && i < num_overrides; i++) st = kiln_config_set(cfg, overrides[i]);
  kiln_engine_setup_t su;
  memset(&su, 0, sizeof(su));
  su.config = cfg;
  if (!st) st = kiln_engine_create_setup(&su, out);
  if (st) {
    kiln_config_free(cfg);
    return st;
  }
  (*out)->own_config = cfg;
  return NULL;
}

bool kiln_engine_config_key(int32_t index, const char **section, const char **key,
                            const char **type, const char **help) {
  if (index < 0) return false;
  return kiln_config_row_info((size_t)index, section, key, type, NULL, help);
}

void kiln_engine_destroy(kiln_engine_t *e) {
  if (!e) return;
  pthread_mutex_lock(&e->mu);
  e->stop = true;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
  if (e->thread_started) pthread_join(e->thread, NULL);
  /* Whatever is still queued or running ends now, with its final event. */
  if (e->sched) {
    pthread_mutex_lock(&e->mu);
    kiln_request_t *in = e->in_head;
    e->in_head = e->in_tail = NULL;
    pthread_mutex_unlock(&e->mu);
    intake(e, in);
    while (e->act_head) req_end(e, e->act_head, KILN_FINISH_ABORT, NULL);
  }
  guide_pre_free(e->gpre); /* its queued jobs release their constraints */
  guide_pool_free(e->gpool);
  kiln_guide_vocab_free(e->gvocab); /* every request ended above, releasing its constraint */
  free(e->gmask);
  free(e->gjobs);
  free(e->item_mask);
  pthread_mutex_destroy(&e->gmu);
  kiln_sampler_free(e->sampler);
  kiln_scheduler_free(e->sched);
  kiln_kv_manager_free(e->kv);
  if (e->runner.destroy) e->runner.destroy(e->runner.ctx);
  kiln_draft_free(e->draft); /* every sequence gave its draft blocks back above */
  kiln_kv_cache_free(e->dkvc);
  kiln_model_free(e->dmodel);
  free(e->draft_path);
  free(e->dreqs);
  free(e->dseqs);
  free(e->dbuf);
  kiln_tp_ranks_free(e->tp); /* ranks not yet handed to a runner (a failed create) */
  kiln_kv_cache_free(e->kvc);
  kiln_model_free(e->model);
  if (e->tp_comm) e->plugin->table.comm_destroy(e->tp_comm);
  kiln_tokenizer_free(e->own_tok);
  kiln_chat_template_free(e->chat);
  free(e->chat_error);
  if (e->plugin) {
    if (e->stream) e->plugin->table.stream_destroy(e->stream);
    if (e->dev) e->plugin->table.device_close(e->dev);
  }
  kiln_hal_registry_free(e->registry);
  kiln_config_free(e->own_config);
  free(e->model_path);
  free(e->model_name);
  free(e->device_name);
  free(e->eos);
  free(e->b_ids);
  free(e->b_pos);
  free(e->b_slots);
  free(e->b_mrope);
  free(e->preproc_error);
  free(e->b_lens);
  free(e->b_qsl);
  free(e->b_tables);
  free(e->b_rows);
  free(e->item_row);
  free(e->sdraft);
  free(e->srows);
  free(e->sseqs);
  free(e->crows);
  free(e->cseqs);
  free(e->c_pos);
  free(e->so.tokens);
  free(e->so.logprobs);
  free(e->so.top_ids);
  free(e->so.top_logprobs);
  free(e->so.score_logprobs);
  free(e->so.score_top_ids);
  free(e->so.score_top_logprobs);
  kiln_arena_free(&e->arena);
  pthread_mutex_destroy(&e->mu);
  pthread_cond_destroy(&e->cv);
  free(e);
}

void kiln_engine_encoder_stats(const kiln_engine_t *e, uint64_t *encodes, uint64_t *evictions,
                               uint64_t *bytes_used) {
  *encodes = e->enc_encodes;
  *evictions = e->enc_evictions;
  *bytes_used = e->enc_used;
}

kiln_model_t *kiln_engine_model(kiln_engine_t *e) { return e->model; }

int32_t kiln_engine_max_images(const kiln_engine_t *e) { return e->has_vision ? e->max_images : 0; }

void kiln_engine_get_info_sized(const kiln_engine_t *e, kiln_engine_info_t *out, size_t size) {
  kiln_engine_info_t i;
  memset(&i, 0, sizeof(i));
  i.model_path = e->model_path ? e->model_path : "";
  i.model_name = e->model_name ? e->model_name : "";
  i.backend = e->backend_name ? e->backend_name : "";
  i.device = e->device_name ? e->device_name : "";
  i.vocab_size = e->vocab;
  i.max_model_len = e->max_len;
  i.block_size = e->bs;
  i.num_blocks = e->kv ? kiln_kv_num_blocks(e->kv) : 0;
  i.max_num_seqs = e->max_seqs;
  i.max_num_batched_tokens = e->max_tokens;
  i.has_tokenizer = e->tok != NULL;
  i.kv_cache_dtype = e->model ? kiln_model_kv_dtype_name(e->model) : "";
  i.quantization = e->model ? kiln_model_quantization(e->model) : "";
  memcpy(out, &i, size < sizeof(i) ? size : sizeof(i));
}

/* The entry point of programs built before kiln_engine_info_t grew kv_cache_dtype. */
void(kiln_engine_get_info)(const kiln_engine_t *e, kiln_engine_info_t *out) {
  kiln_engine_get_info_sized(e, out, offsetof(kiln_engine_info_t, kv_cache_dtype));
}

kiln_status_t kiln_engine_tokenize(const kiln_engine_t *e, const char *text, size_t len,
                                   bool add_special, int32_t **out_ids, int32_t *out_n) {
  *out_ids = NULL;
  *out_n = 0;
  if (!e->tok) return bad("the model has no tokenizer (no tokenizer.json beside it)");
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  kiln_status_t st = kiln_tokenizer_encode(e->tok, text, len, add_special, &ids);
  if (st) return st;
  *out_ids = ids.ids;
  *out_n = (int32_t)ids.len;
  return NULL;
}

kiln_status_t kiln_engine_detokenize(const kiln_engine_t *e, const int32_t *ids, size_t n,
                                     bool skip_special, char **out_text) {
  *out_text = NULL;
  if (!e->tok) return bad("the model has no tokenizer (no tokenizer.json beside it)");
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_status_t st = kiln_tokenizer_decode(e->tok, ids, n, skip_special, &sb);
  if (!st && !(*out_text = strdup(kiln_strbuf_ok(&sb) ? kiln_strbuf_cstr(&sb) : "")))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "detokenize: out of memory");
  kiln_strbuf_free(&sb);
  return st;
}

/* Parses an optional JSON argument of kiln_engine_apply_chat_template: NULL/empty = absent. */
static kiln_status_t chat_arg(const char *text, size_t len, const char *what, kiln_json_type_t want,
                              kiln_json_doc_t **out_doc) {
  *out_doc = NULL;
  if (!text || !len) return NULL;
  kiln_status_t st = kiln_json_parse(text, len, what, out_doc);
  if (st) return st;
  const kiln_json_t *root = kiln_json_root(*out_doc);
  if (kiln_json_type(root) != want && kiln_json_type(root) != KILN_JSON_NULL)
    return bad("%s must be a JSON %s, not %s", what, kiln_json_type_name(want),
               kiln_json_type_name(kiln_json_type(root)));
  return NULL;
}

bool kiln_engine_chat_template_source(const kiln_engine_t *e, bool tools, const char **out_src,
                                      size_t *out_len, bool *out_renders_tools) {
  *out_src = NULL;
  if (out_len) *out_len = 0;
  if (out_renders_tools) *out_renders_tools = false;
  const kiln_template_t *t = e->chat ? kiln_chat_template_select(e->chat, tools) : NULL;
  if (!t) return false;
  *out_src = kiln_template_source(t, out_len);
  if (out_renders_tools) *out_renders_tools = kiln_template_uses_variable(t, "tools");
  return true;
}

kiln_status_t kiln_engine_apply_chat_template(const kiln_engine_t *e, const kiln_chat_args_t *a,
                                              char **out_prompt, size_t *out_len) {
  *out_prompt = NULL;
  if (out_len) *out_len = 0;
  if (!e->chat) {
    if (e->chat_error)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "the model's chat template is broken: %s",
                              e->chat_error);
    return kiln_status_make(KILN_ERR_NOT_FOUND,
                            "the model has no chat template (no chat_template in its "
                            "tokenizer_config.json and no chat_template.jinja)");
  }
  kiln_json_doc_t *msgs = NULL, *tools = NULL, *extra = NULL;
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_status_t st;
  if ((st = chat_arg(a->messages_json, a->messages_len, "messages", KILN_JSON_ARRAY, &msgs)) ||
      (st = chat_arg(a->tools_json, a->tools_len, "tools", KILN_JSON_ARRAY, &tools)) ||
      (st =
           chat_arg(a->extra_json, a->extra_len, "chat_template_kwargs", KILN_JSON_OBJECT, &extra)))
    goto done;
  if (!msgs) {
    st = bad("messages: a JSON array is required");
    goto done;
  }
  kiln_template_vars_t v;
  memset(&v, 0, sizeof(v));
  v.messages = kiln_json_root(msgs);
  v.tools = tools && kiln_json_type(kiln_json_root(tools)) == KILN_JSON_ARRAY
                ? kiln_json_root(tools)
                : NULL;
  v.extra = extra && kiln_json_type(kiln_json_root(extra)) == KILN_JSON_OBJECT
                ? kiln_json_root(extra)
                : NULL;
  v.add_generation_prompt = a->add_generation_prompt;
  if ((st = kiln_chat_template_render(e->chat, &v, &sb))) goto done;
  if (!kiln_strbuf_ok(&sb) || !(*out_prompt = kiln_strbuf_detach(&sb, out_len)))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "chat template: out of memory");
done:
  kiln_strbuf_free(&sb);
  kiln_json_doc_free(msgs);
  kiln_json_doc_free(tools);
  kiln_json_doc_free(extra);
  return st;
}

void kiln_engine_get_metrics_sized(kiln_engine_t *e, kiln_metrics_t *out, size_t size) {
  if (size > sizeof(*out)) size = sizeof(*out);
  pthread_mutex_lock(&e->mu);
  memcpy(out, &e->metrics, size);
  pthread_mutex_unlock(&e->mu);
}

/* The entry point of programs built before the struct grew (see kiln.h). */
void(kiln_engine_get_metrics)(kiln_engine_t *e, kiln_metrics_t *out) {
  kiln_engine_get_metrics_sized(e, out, offsetof(kiln_metrics_t, spec_drafts));
}
