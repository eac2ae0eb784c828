/* scheduler.h - iteration-level continuous batching over the paged KV cache.
 *
 * The unit of scheduling is a sequence: its tokens (prompt, then generated), how many of them
 * have keys/values in the cache (num_computed) and its block table. Each engine step the
 * scheduler picks, under max_num_seqs sequences and max_num_batched_tokens tokens:
 *   1. running sequences first, in admission order: each gets its missing tokens (1 for a
 *      decode, the next chunk for a prompt being prefilled in chunks);
 *   2. then waiting sequences, in queue order (FCFS, or by priority then arrival), as long as
 *      budget, sequence slots and blocks last, and only if nobody was preempted this step.
 * A waiting sequence first takes every cached full block of its prefix (prefix caching) and
 * computes only the rest; with chunked prefill a long prompt is split across steps and shares
 * each of them with the decodes.
 *
 * When a running sequence needs a block and none is free, the most recently admitted running
 * sequence is preempted by recompute: its blocks go back (the full ones usually stay cached),
 * num_computed drops to 0, and it goes to the front of the waiting queue with its generated
 * tokens kept; when it is admitted again its prefix is found in the cache or recomputed. If
 * the sequence asking is itself the latest admitted, it is the one preempted.
 *
 * Sequence life cycle:
 *
 *     submit ──> WAITING ──admit (prefix lookup, blocks for the first chunk)──> RUNNING
 *                  ^  ^                                                        │  │
 *                  │  └──────────── preempt (blocks released, recompute) ──────┘  │
 *                  │                                                              │
 *                  └─ (a fork of an n > 1 prompt is born RUNNING, sharing blocks) │
 *                                                                                 v
 *                 FINISHED <── stop / length / cancel / error (blocks released) ──┘
 *     (a waiting sequence can also finish: cancelled, or the engine shuts down)
 *
 * A request that could never run (prompt + max_tokens beyond the context, more blocks than
 * the pool, a prompt over the token budget with chunked prefill off) is refused by the
 * engine at submission, so nothing waits forever: the first running sequence can always
 * proceed once everything after it has been preempted.
 *
 * Thread-safety: none; the engine thread owns the scheduler and its sequences.
 */
#ifndef KILN_CORE_SCHED_SCHEDULER_H
#define KILN_CORE_SCHED_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

#include "core/kv/block_manager.h"
#include "base/status.h"

typedef enum kiln_seq_state {
  KILN_SEQ_WAITING = 0,
  KILN_SEQ_RUNNING = 1,
  KILN_SEQ_FINISHED = 2,
} kiln_seq_state_t;

/* An image's tokens in a sequence's prompt, for the prefix cache: tokens [start, start + count)
 * are the image's (all the same placeholder id), so the block hashes must tell images apart. */
typedef struct kiln_seq_image {
  int32_t start, count;
  uint64_t hash[2]; /* the image's identity (its pixels' 128-bit hash) */
} kiln_seq_image_t;

typedef struct kiln_seq {
  uint64_t arrival;   /* submission order (ties broken by index) */
  int32_t index;      /* which of the request's n sequences */
  int32_t priority;
  void *owner;        /* the engine's request */
  kiln_seq_state_t state;
  int32_t *tokens;    /* prompt then generated */
  int32_t num_tokens, cap_tokens, num_prompt;
  int32_t num_draft;  /* the last num_draft tokens are speculative proposals (not yet verified) */
  int32_t num_computed; /* tokens with keys/values in the cache */
  int32_t *blocks;      /* the block table */
  int32_t num_blocks, cap_blocks;
  kiln_kv_hash_t *hashes; /* hashes of the first num_hashes full blocks (a chain) */
  int32_t num_hashes, cap_hashes;
  int32_t num_committed;  /* leading blocks known to be in the cache (committed or found) */
  int32_t fork_n;         /* > 1: fork into fork_n sequences when the prompt is computed */
  bool no_prefix_cache;   /* prompt logprobs need every prompt row computed */
  int32_t num_cached;     /* prompt tokens taken from the prefix cache at first admission */
  bool admitted_once;
  int32_t max_logits_rows; /* > 0: rows this sequence's prefill may ask for per step */
  /* Images in the prompt (borrowed from the owner, by ascending start; forks share them): a
   * block's hash takes, besides the cache salt, the hash, start and count of every image with a
   * token in the block; images before it are in the chain through the parent hash. */
  const kiln_seq_image_t *images;
  int32_t num_images;
  struct kiln_seq *prev, *next; /* in the waiting or running list */
} kiln_seq_t;

typedef struct kiln_sched_options {
  int32_t max_num_seqs;
  int32_t max_num_batched_tokens;
  bool chunked_prefill;
  bool priority_policy; /* false = FCFS */
  uint64_t cache_salt;  /* the prefix hashes' extra key */
} kiln_sched_options_t;

/* One sequence's part of a step: tokens [start, start + count), sampling after it when the
 * step completes the sequence's tokens. The last `draft` tokens of the item are proposals: the
 * logits of the last draft + 1 positions are all needed to verify them. */
typedef struct kiln_sched_item {
  kiln_seq_t *seq;
  int32_t start, count;
  int32_t draft;
  bool sample;
} kiln_sched_item_t;

typedef struct kiln_sched_step {
  kiln_sched_item_t *items; /* scheduled sequences, running ones first */
  int32_t num_items;
  int32_t num_tokens;
  int32_t *cow_src, *cow_dst; /* block copies to run before the forward */
  int32_t num_cow;
  int32_t num_preempted;      /* sequences preempted this step */
} kiln_sched_step_t;

typedef struct kiln_scheduler kiln_scheduler_t;

/* The scheduler borrows kv (it must outlive it). */
kiln_status_t kiln_scheduler_create(kiln_kv_manager_t *kv, const kiln_sched_options_t *o,
                                    kiln_scheduler_t **out);
void kiln_scheduler_free(kiln_scheduler_t *s);

/* Adds a new sequence (state WAITING) to the waiting queue, in policy order. */
void kiln_scheduler_add(kiln_scheduler_t *s, kiln_seq_t *seq);
/* Adds a forked sequence as RUNNING right after `after` (which is running). */
void kiln_scheduler_add_running_after(kiln_scheduler_t *s, kiln_seq_t *after, kiln_seq_t *seq);
/* Removes a sequence from whichever queue holds it, releases its blocks and marks it
 * FINISHED. */
void kiln_scheduler_finish(kiln_scheduler_t *s, kiln_seq_t *seq);

/* Plans one step. The plan (and its arrays) stays valid until the next call. Errors:
 * KILN_ERR_OUT_OF_MEMORY only (growing a block table). */
kiln_status_t kiln_scheduler_schedule(kiln_scheduler_t *s, kiln_sched_step_t **out);

/* After the forward: num_computed += count for every item, and newly full blocks are hashed
 * and committed to the prefix cache (only blocks without a draft token). */
void kiln_scheduler_update_computed(kiln_scheduler_t *s, const kiln_sched_step_t *step);

/* Drops a sequence's drafts that were not computed (the step did not schedule them). */
void kiln_seq_drop_drafts(kiln_seq_t *seq);
/* After the forward that verified q's drafts: the first `accepted` drafts stay computed, the
 * others are removed from its tokens, and the blocks past the computed tokens are released.
 * Then num_tokens = the tokens before the drafts and num_computed = num_tokens + accepted: the
 * engine appends the accepted drafts again (the same ids) and the bonus token, so the sequence
 * ends with one token to compute, as after any decode. */
void kiln_scheduler_accept_drafts(kiln_scheduler_t *s, kiln_seq_t *q, int32_t accepted);

/* Appends a generated token to a sequence. Errors: KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_seq_append(kiln_seq_t *seq, int32_t token);
/* Makes `child` (zeroed by the caller) a fork of `parent`: the same tokens, blocks (one more
 * reference each) and hashes. Errors: KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_scheduler_fork(kiln_scheduler_t *s, const kiln_seq_t *parent, kiln_seq_t *child);
/* Beam search's reshuffle of one request's beams: seqs[0..n) (all RUNNING, every token
 * computed) each become a fork of seqs[parent[j]] as they were before the call (tokens, block
 * table with one more reference per block, hashes), keeping their own place in the running
 * list; their old blocks are released after every new table took its references, so a block
 * that some new beam still uses stays. Nothing else changes (no counters move). Errors:
 * KILN_ERR_OUT_OF_MEMORY (nothing changed), KILN_ERR_INTERNAL for a parent out of range. */
kiln_status_t kiln_scheduler_reparent(kiln_scheduler_t *s, kiln_seq_t *const *seqs, int32_t n,
                                      const int32_t *parent);
/* Ends a parent's fork after `made` children were added (kiln_scheduler_add_running_after):
 * the slots promised at admission for children not made are given back. */
void kiln_scheduler_fork_done(kiln_scheduler_t *s, kiln_seq_t *parent, int32_t made);
/* Frees a sequence's arrays (its blocks must already be released). */
void kiln_seq_free(kiln_seq_t *seq);

int32_t kiln_scheduler_num_running(const kiln_scheduler_t *s);
int32_t kiln_scheduler_num_waiting(const kiln_scheduler_t *s);
kiln_seq_t *kiln_scheduler_running_head(const kiln_scheduler_t *s);
kiln_seq_t *kiln_scheduler_waiting_head(const kiln_scheduler_t *s);
uint64_t kiln_scheduler_num_preemptions(const kiln_scheduler_t *s);
/* Prompt tokens looked up in the prefix cache at admission, and of those found there. */
void kiln_scheduler_prefix_stats(const kiln_scheduler_t *s, uint64_t *queries, uint64_t *hits);
/* Token slots in blocks held by running sequences, and of those the ones holding a token
 * (the rest is waste: the unfilled tail of each last block). Shared blocks count once per
 * sequence. */
void kiln_scheduler_slot_usage(const kiln_scheduler_t *s, int64_t *allocated, int64_t *used);

#endif /* KILN_CORE_SCHED_SCHEDULER_H */
