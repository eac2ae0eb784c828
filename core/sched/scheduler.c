/* scheduler.c - continuous batching, chunked prefill, prefix reuse and preemption (see
 * scheduler.h for the policy and the sequence life cycle). */
#include "core/sched/scheduler.h"

#include <xxhash.h>

#include <stdlib.h>
#include <string.h>

struct kiln_scheduler {
  kiln_kv_manager_t *kv;
  kiln_sched_options_t o;
  int32_t bs;
  kiln_seq_t *wait_head, *wait_tail, *run_head, *run_tail;
  int32_t num_waiting, num_running;
  int32_t num_reserved; /* slots promised to the forks of running n > 1 prompts */
  kiln_sched_step_t step;
  int32_t cap_items, cap_cow;
  uint64_t preemptions, prefix_queries, prefix_hits;
  uint32_t *mark; /* [num_blocks] epoch marks for counting physical blocks once */
  uint32_t epoch;
};

/* ---- lists -------------------------------------------------------------------------------- */

static void list_unlink(kiln_seq_t **head, kiln_seq_t **tail, kiln_seq_t *q) {
  if (q->prev) q->prev->next = q->next; else *head = q->next;
  if (q->next) q->next->prev = q->prev; else *tail = q->prev;
  q->prev = q->next = NULL;
}

static void list_insert_after(kiln_seq_t **head, kiln_seq_t **tail, kiln_seq_t *after,
                              kiln_seq_t *q) {
  q->prev = after;
  q->next = after ? after->next : *head;
  if (q->next) q->next->prev = q; else *tail = q;
  if (after) after->next = q; else *head = q;
}

/* Queue order: priority (with the priority policy), then arrival, then index. */
static bool seq_before(const kiln_scheduler_t *s, const kiln_seq_t *a, const kiln_seq_t *b) {
  if (s->o.priority_policy && a->priority != b->priority) return a->priority < b->priority;
  if (a->arrival != b->arrival) return a->arrival < b->arrival;
  return a->index < b->index;
}

static void waiting_insert(kiln_scheduler_t *s, kiln_seq_t *q, bool front) {
  kiln_seq_t *after = NULL;
  if (front && !s->o.priority_policy) {
    after = NULL; /* FCFS: a preempted sequence resumes first */
  } else {
    after = s->wait_tail;
    while (after && seq_before(s, q, after)) after = after->prev;
  }
  list_insert_after(&s->wait_head, &s->wait_tail, after, q);
  q->state = KILN_SEQ_WAITING;
  s->num_waiting++;
}

/* ---- sequences ---------------------------------------------------------------------------- */

static bool grow(void **p, int32_t *cap, int32_t need, size_t elem) {
  if (need <= *cap) return true;
  int32_t c = *cap ? *cap : 16;
  while (c < need) c *= 2;
  void *np = realloc(*p, (size_t)c * elem);
  if (!np) return false;
  *p = np;
  *cap = c;
  return true;
}

kiln_status_t kiln_seq_append(kiln_seq_t *seq, int32_t token) {
  if (!grow((void **)&seq->tokens, &seq->cap_tokens, seq->num_tokens + 1, sizeof(int32_t)))
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "sequence: out of memory for %d tokens",
                            seq->num_tokens + 1);
  seq->tokens[seq->num_tokens++] = token;
  return NULL;
}

void kiln_seq_free(kiln_seq_t *seq) {
  free(seq->tokens);
  free(seq->blocks);
  free(seq->hashes);
  seq->tokens = NULL;
  seq->blocks = NULL;
  seq->hashes = NULL;
  seq->num_tokens = seq->num_blocks = seq->num_hashes = 0;
  seq->cap_tokens = seq->cap_blocks = seq->cap_hashes = 0;
}

static void seq_release_blocks(kiln_scheduler_t *s, kiln_seq_t *q) {
  /* Last block first: the prefix's blocks are freed last, so they are evicted last. */
  for (int32_t i = q->num_blocks - 1; i >= 0; i--) kiln_kv_release(s->kv, q->blocks[i]);
  q->num_blocks = 0;
  q->num_committed = 0;
  q->num_computed = 0;
}

/* The extra key of block i: the cache salt, mixed with every image that has a token in it. */
static uint64_t block_extra(const kiln_scheduler_t *s, const kiln_seq_t *q, int32_t i) {
  const int64_t b0 = (int64_t)i * s->bs, b1 = b0 + s->bs;
  uint64_t x = s->o.cache_salt;
  for (int32_t k = 0; k < q->num_images; k++) {
    const kiln_seq_image_t *im = &q->images[k];
    if (im->start >= b1 || (int64_t)im->start + im->count <= b0) continue;
    uint64_t v[5] = {x, (uint64_t)im->start, (uint64_t)im->count, im->hash[0], im->hash[1]};
    x = XXH3_64bits(v, sizeof(v));
  }
  return x;
}

/* Hashes of the full blocks among the first n tokens (extending the chain as needed). */
static bool seq_hash_upto(kiln_scheduler_t *s, kiln_seq_t *q, int32_t nblocks) {
  if (nblocks <= q->num_hashes) return true;
  if (!grow((void **)&q->hashes, &q->cap_hashes, nblocks, sizeof(kiln_kv_hash_t))) return false;
  for (int32_t i = q->num_hashes; i < nblocks; i++)
    q->hashes[i] = kiln_kv_hash_block(i ? &q->hashes[i - 1] : NULL, q->tokens + (size_t)i * s->bs,
                                      s->bs, block_extra(s, q, i));
  q->num_hashes = nblocks;
  return true;
}

/* ---- create ------------------------------------------------------------------------------- */

kiln_status_t kiln_scheduler_create(kiln_kv_manager_t *kv, const kiln_sched_options_t *o,
                                    kiln_scheduler_t **out) {
  *out = NULL;
  if (o->max_num_seqs < 1 || o->max_num_batched_tokens < 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "scheduler: max_num_seqs %d and max_num_batched_tokens %d must be >= 1",
                            o->max_num_seqs, o->max_num_batched_tokens);
  kiln_scheduler_t *s = calloc(1, sizeof(*s));
  if (s) s->mark = calloc((size_t)kiln_kv_num_blocks(kv), sizeof(*s->mark));
  if (!s || !s->mark) {
    if (s) free(s);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "scheduler: out of memory");
  }
  s->kv = kv;
  s->o = *o;
  s->bs = kiln_kv_block_size(kv);
  *out = s;
  return NULL;
}

void kiln_scheduler_free(kiln_scheduler_t *s) {
  if (!s) return;
  free(s->step.items);
  free(s->step.cow_src);
  free(s->step.cow_dst);
  free(s->mark);
  free(s);
}

void kiln_scheduler_add(kiln_scheduler_t *s, kiln_seq_t *seq) { waiting_insert(s, seq, false); }

void kiln_scheduler_add_running_after(kiln_scheduler_t *s, kiln_seq_t *after, kiln_seq_t *seq) {
  list_insert_after(&s->run_head, &s->run_tail, after, seq);
  seq->state = KILN_SEQ_RUNNING;
  s->num_running++;
  if (s->num_reserved > 0) s->num_reserved--; /* a fork takes one of its promised slots */
}

/* A running prompt that has not forked yet gives back the slots promised to its forks. */
static void unreserve(kiln_scheduler_t *s, kiln_seq_t *q) {
  if (q->state == KILN_SEQ_RUNNING && q->fork_n > 1) s->num_reserved -= q->fork_n - 1;
}

void kiln_scheduler_fork_done(kiln_scheduler_t *s, kiln_seq_t *parent, int32_t made) {
  /* Forks that could not be made (out of memory) give their promised slots back. */
  if (parent->fork_n > 1) s->num_reserved -= parent->fork_n - 1 - made;
  parent->fork_n = 0;
}

void kiln_scheduler_finish(kiln_scheduler_t *s, kiln_seq_t *seq) {
  unreserve(s, seq);
  if (seq->state == KILN_SEQ_RUNNING) {
    list_unlink(&s->run_head, &s->run_tail, seq);
    s->num_running--;
  } else if (seq->state == KILN_SEQ_WAITING) {
    list_unlink(&s->wait_head, &s->wait_tail, seq);
    s->num_waiting--;
  }
  seq_release_blocks(s, seq);
  seq->state = KILN_SEQ_FINISHED;
}

kiln_status_t kiln_scheduler_fork(kiln_scheduler_t *s, const kiln_seq_t *parent, kiln_seq_t *child) {
  kiln_seq_t c = *parent;
  c.tokens = NULL;
  c.blocks = NULL;
  c.hashes = NULL;
  c.cap_tokens = c.cap_blocks = c.cap_hashes = 0;
  c.prev = c.next = NULL;
  c.fork_n = 0;
  if (!grow((void **)&c.tokens, &c.cap_tokens, parent->num_tokens + 1, sizeof(int32_t)) ||
      !grow((void **)&c.blocks, &c.cap_blocks, parent->num_blocks + 1, sizeof(int32_t)) ||
      !grow((void **)&c.hashes, &c.cap_hashes, parent->num_hashes + 1, sizeof(kiln_kv_hash_t))) {
    kiln_seq_free(&c);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "fork: out of memory");
  }
  memcpy(c.tokens, parent->tokens, (size_t)parent->num_tokens * sizeof(int32_t));
  memcpy(c.blocks, parent->blocks, (size_t)parent->num_blocks * sizeof(int32_t));
  if (parent->num_hashes)
    memcpy(c.hashes, parent->hashes, (size_t)parent->num_hashes * sizeof(kiln_kv_hash_t));
  for (int32_t i = 0; i < parent->num_blocks; i++) kiln_kv_ref(s->kv, parent->blocks[i]);
  *child = c;
  return NULL;
}

kiln_status_t kiln_scheduler_reparent(kiln_scheduler_t *s, kiln_seq_t *const *seqs, int32_t n,
                                      const int32_t *parent) {
  if (n <= 0) return NULL;
  for (int32_t j = 0; j < n; j++)
    if (parent[j] < 0 || parent[j] >= n)
      return kiln_status_make(KILN_ERR_INTERNAL, "reparent: beam %d's parent %d is not in [0, %d)",
                              (int)j, (int)parent[j], (int)n);
  kiln_seq_t *tmp = calloc((size_t)n, sizeof(*tmp));
  if (!tmp) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "reparent: out of memory");
  for (int32_t j = 0; j < n; j++) {
    kiln_status_t st = kiln_scheduler_fork(s, seqs[parent[j]], &tmp[j]);
    if (st) {
      for (int32_t k = 0; k < j; k++) {
        seq_release_blocks(s, &tmp[k]);
        kiln_seq_free(&tmp[k]);
      }
      free(tmp);
      return st;
    }
  }
  for (int32_t j = 0; j < n; j++) {
    kiln_seq_t *q = seqs[j];
    for (int32_t i = q->num_blocks - 1; i >= 0; i--) kiln_kv_release(s->kv, q->blocks[i]);
    q->num_blocks = 0;
    kiln_seq_free(q);
    kiln_seq_t *c = &tmp[j];
    q->tokens = c->tokens;
    q->num_tokens = c->num_tokens;
    q->cap_tokens = c->cap_tokens;
    q->num_draft = c->num_draft;
    q->num_computed = c->num_computed;
    q->blocks = c->blocks;
    q->num_blocks = c->num_blocks;
    q->cap_blocks = c->cap_blocks;
    q->hashes = c->hashes;
    q->num_hashes = c->num_hashes;
    q->cap_hashes = c->cap_hashes;
    q->num_committed = c->num_committed;
  }
  free(tmp);
  return NULL;
}

/* ---- scheduling --------------------------------------------------------------------------- */

void kiln_seq_drop_drafts(kiln_seq_t *q) {
  q->num_tokens -= q->num_draft;
  q->num_draft = 0;
  if (q->num_computed > q->num_tokens) q->num_computed = q->num_tokens;
}

/* Keeps only the first `keep` of q's drafts (not computed yet). */
static void seq_trim_drafts(kiln_seq_t *q, int32_t keep) {
  if (keep < 0) keep = 0;
  if (keep >= q->num_draft) return;
  q->num_tokens -= q->num_draft - keep;
  q->num_draft = keep;
}

void kiln_scheduler_accept_drafts(kiln_scheduler_t *s, kiln_seq_t *q, int32_t accepted) {
  if (accepted < 0) accepted = 0;
  if (accepted > q->num_draft) accepted = q->num_draft;
  int32_t real = q->num_tokens - q->num_draft;
  q->num_tokens = real;
  q->num_draft = 0;
  q->num_computed = real + accepted;
  /* The blocks past the computed tokens held only rejected drafts: back to the pool (last
   * first; they have no hash, so they are reused first). */
  int32_t need = (q->num_computed + s->bs - 1) / s->bs;
  while (q->num_blocks > need) kiln_kv_release(s->kv, q->blocks[--q->num_blocks]);
}

static void preempt(kiln_scheduler_t *s, kiln_seq_t *q) {
  kiln_seq_drop_drafts(q);
  unreserve(s, q);
  list_unlink(&s->run_head, &s->run_tail, q);
  s->num_running--;
  seq_release_blocks(s, q);
  waiting_insert(s, q, true);
  s->preemptions++;
  s->step.num_preempted++;
}

static bool step_push_cow(kiln_scheduler_t *s, int32_t src, int32_t dst) {
  kiln_sched_step_t *st = &s->step;
  int32_t cap = s->cap_cow;
  if (!grow((void **)&st->cow_src, &cap, st->num_cow + 1, sizeof(int32_t))) return false;
  cap = s->cap_cow;
  if (!grow((void **)&st->cow_dst, &cap, st->num_cow + 1, sizeof(int32_t))) return false;
  s->cap_cow = cap;
  st->cow_src[st->num_cow] = src;
  st->cow_dst[st->num_cow] = dst;
  st->num_cow++;
  return true;
}

/* Gives q the blocks (and copy-on-write copies) that writing tokens [num_computed,
 * num_computed + count) needs. Returns 1 on success, 0 when the pool is short (nothing is
 * kept: blocks taken here are given back), -1 when out of host memory. */
static int seq_reserve(kiln_scheduler_t *s, kiln_seq_t *q, int32_t count) {
  int32_t need = (q->num_computed + count + s->bs - 1) / s->bs;
  if (!grow((void **)&q->blocks, &q->cap_blocks, need, sizeof(int32_t))) return -1;
  int32_t first = q->num_computed / s->bs; /* the block the first new token goes into */
  int32_t cow_from = -1;
  if (first < q->num_blocks && kiln_kv_refcount(s->kv, q->blocks[first]) > 1) {
    int32_t nb = kiln_kv_cow(s->kv, q->blocks[first]);
    if (nb < 0) return 0;
    if (!step_push_cow(s, q->blocks[first], nb)) {
      kiln_kv_ref(s->kv, q->blocks[first]);
      kiln_kv_release(s->kv, nb);
      return -1;
    }
    cow_from = q->blocks[first];
    q->blocks[first] = nb;
  }
  int32_t had = q->num_blocks;
  while (q->num_blocks < need) {
    int32_t b = kiln_kv_alloc(s->kv);
    if (b < 0) {
      while (q->num_blocks > had) kiln_kv_release(s->kv, q->blocks[--q->num_blocks]);
      if (cow_from >= 0) { /* undo the copy-on-write */
        kiln_kv_ref(s->kv, cow_from);
        kiln_kv_release(s->kv, q->blocks[first]);
        q->blocks[first] = cow_from;
        s->step.num_cow--;
      }
      return 0;
    }
    q->blocks[q->num_blocks++] = b;
  }
  return 1;
}

static bool step_push_item(kiln_scheduler_t *s, kiln_seq_t *q, int32_t count) {
  kiln_sched_step_t *st = &s->step;
  if (!grow((void **)&st->items, &s->cap_items, st->num_items + 1, sizeof(kiln_sched_item_t)))
    return false;
  st->items[st->num_items++] = (kiln_sched_item_t){
      .seq = q, .start = q->num_computed, .count = count, .draft = q->num_draft,
      .sample = q->num_computed + count == q->num_tokens};
  st->num_tokens += count;
  return true;
}

/* Takes the cached blocks of q's prefix (never its last token: something must be computed to
 * produce logits). */
static bool seq_lookup_prefix(kiln_scheduler_t *s, kiln_seq_t *q) {
  if (!kiln_kv_prefix_caching(s->kv) || q->no_prefix_cache) return true;
  int32_t full = (q->num_tokens - 1) / s->bs;
  if (!seq_hash_upto(s, q, full)) return false;
  if (!grow((void **)&q->blocks, &q->cap_blocks, full, sizeof(int32_t))) return false;
  int32_t i = 0;
  for (; i < full; i++) {
    int32_t b = kiln_kv_lookup(s->kv, q->hashes[i]);
    if (b < 0) break;
    q->blocks[q->num_blocks++] = b;
  }
  q->num_committed = i;
  q->num_computed = i * s->bs;
  return true;
}

static int32_t chunk_for(const kiln_scheduler_t *s, const kiln_seq_t *q, int32_t budget) {
  int32_t want = q->num_tokens - q->num_computed;
  if (q->max_logits_rows > 0 && want > q->max_logits_rows) want = q->max_logits_rows;
  return want < budget ? want : budget;
}

kiln_status_t kiln_scheduler_schedule(kiln_scheduler_t *s, kiln_sched_step_t **out) {
  kiln_sched_step_t *st = &s->step;
  st->num_items = st->num_tokens = st->num_cow = st->num_preempted = 0;
  *out = st;
  int32_t budget = s->o.max_num_batched_tokens;
  /* 1. Running sequences, in admission order. */
  for (kiln_seq_t *q = s->run_head, *next; q && budget > 0; q = next) {
    next = q->next;
    int32_t count = chunk_for(s, q, budget);
    if (count <= 0) continue;
    if (q->num_draft > 0 && count < q->num_tokens - q->num_computed) /* the budget: fewer drafts */
      seq_trim_drafts(q, q->num_draft - (q->num_tokens - q->num_computed - count));
    if (!s->o.chunked_prefill && count < q->num_tokens - q->num_computed) continue;
    for (;;) {
      int r = seq_reserve(s, q, count);
      if (r < 0) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "scheduler: out of memory");
      if (r > 0) break;
      if (q->num_draft > 0) { /* the pool is short: no drafts rather than a preemption */
        count -= q->num_draft;
        seq_trim_drafts(q, 0);
        continue;
      }
      kiln_seq_t *victim = s->run_tail;
      if (victim == next) next = NULL; /* the loop ends at the victim */
      preempt(s, victim);
      if (victim == q) break;
    }
    if (q->state != KILN_SEQ_RUNNING) break; /* q preempted itself: nobody after it runs */
    if (!step_push_item(s, q, count))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "scheduler: out of memory");
    budget -= count;
  }
  /* 2. Waiting sequences, in queue order, when nothing was preempted. */
  while (st->num_preempted == 0 && budget > 0 && s->wait_head) {
    kiln_seq_t *q = s->wait_head;
    int32_t slots = q->fork_n > 1 ? q->fork_n : 1;
    if (s->num_running + s->num_reserved + slots > s->o.max_num_seqs) break;
    if (!seq_lookup_prefix(s, q))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "scheduler: out of memory");
    int32_t cached = q->num_computed;
    int32_t count = chunk_for(s, q, budget);
    int r = 0;
    if (s->o.chunked_prefill || count == q->num_tokens - q->num_computed)
      r = seq_reserve(s, q, count);
    if (r <= 0) {
      seq_release_blocks(s, q); /* give back the prefix blocks; try again next step */
      if (r < 0) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "scheduler: out of memory");
      break;
    }
    s->prefix_queries += (uint64_t)q->num_tokens;
    s->prefix_hits += (uint64_t)cached;
    if (!q->admitted_once) q->num_cached = cached;
    q->admitted_once = true;
    list_unlink(&s->wait_head, &s->wait_tail, q);
    s->num_waiting--;
    list_insert_after(&s->run_head, &s->run_tail, s->run_tail, q);
    q->state = KILN_SEQ_RUNNING;
    s->num_running++;
    s->num_reserved += slots - 1;
    if (!step_push_item(s, q, count))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "scheduler: out of memory");
    budget -= count;
  }
  return NULL;
}

void kiln_scheduler_update_computed(kiln_scheduler_t *s, const kiln_sched_step_t *step) {
  for (int32_t i = 0; i < step->num_items; i++) {
    kiln_seq_t *q = step->items[i].seq;
    if (q->state != KILN_SEQ_RUNNING) continue;
    q->num_computed = step->items[i].start + step->items[i].count;
    if (!kiln_kv_prefix_caching(s->kv) || q->no_prefix_cache) continue;
    int32_t real = q->num_tokens - q->num_draft; /* a block with a draft is never cached */
    int32_t full = (q->num_computed < real ? q->num_computed : real) / s->bs;
    if (full <= q->num_committed || !seq_hash_upto(s, q, full)) continue; /* OOM: skip caching */
    for (int32_t b = q->num_committed; b < full; b++) kiln_kv_commit(s->kv, q->blocks[b], q->hashes[b]);
    q->num_committed = full;
  }
}

int32_t kiln_scheduler_num_running(const kiln_scheduler_t *s) { return s->num_running; }
int32_t kiln_scheduler_num_waiting(const kiln_scheduler_t *s) { return s->num_waiting; }
kiln_seq_t *kiln_scheduler_running_head(const kiln_scheduler_t *s) { return s->run_head; }
kiln_seq_t *kiln_scheduler_waiting_head(const kiln_scheduler_t *s) { return s->wait_head; }
uint64_t kiln_scheduler_num_preemptions(const kiln_scheduler_t *s) { return s->preemptions; }

void kiln_scheduler_prefix_stats(const kiln_scheduler_t *s, uint64_t *queries, uint64_t *hits) {
  *queries = s->prefix_queries;
  *hits = s->prefix_hits;
}

void kiln_scheduler_slot_usage(const kiln_scheduler_t *s, int64_t *allocated, int64_t *used) {
  kiln_scheduler_t *m = (kiln_scheduler_t *)s; /* the epoch marks are scratch */
  if (++m->epoch == 0) {
    memset(m->mark, 0, (size_t)kiln_kv_num_blocks(s->kv) * sizeof(*m->mark));
    m->epoch = 1;
  }
  int64_t a = 0, u = 0;
  for (const kiln_seq_t *q = s->run_head; q; q = q->next)
    for (int32_t i = 0; i < q->num_blocks; i++) {
      int32_t b = q->blocks[i];
      if (m->mark[b] == m->epoch) continue; /* a shared block counts once */
      m->mark[b] = m->epoch;
      int32_t filled = q->num_computed - i * s->bs;
      a += s->bs;
      u += filled <= 0 ? 0 : filled >= s->bs ? s->bs : filled;
    }
  *allocated = a;
  *used = u;
}
