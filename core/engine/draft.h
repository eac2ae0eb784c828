/* draft.h - speculative decoding's draft model ([speculative] method = draft): a second,
 * smaller model with the target's vocabulary that proposes k tokens per speculating sequence
 * by running greedily (argmax) for k steps, batched over the sequences that speculate in a
 * step. It has its own runner (its model and KV cache), its own block manager (no prefix
 * caching: its blocks never outlive the sequence that wrote them, so no hash can name a
 * rejected token) and its own greedy sampler.
 *
 * Each sequence has a kiln_draft_seq_t: the draft's block table and how many of the
 * sequence's tokens the draft holds keys/values for. A proposal first catches the draft up on
 * the tokens it has not seen (the prompt at first, in forwards of at most max_tokens tokens,
 * like the target's chunked prefill; after that always the last two tokens, one of which it may
 * hold already, so that every sequence's catch-up has the same length and the batch replays the
 * draft's two-token graph), which gives the first proposal, then feeds each proposal to get the
 * next (k - 1 one-token forwards). After the target's verification, kiln_draft_sync trims the
 * draft to the prefix of what it was fed that the sequence kept (its blocks past that go back);
 * the engine passes the accepted proposals as part of the sequence's tokens.
 *
 * Thread-safety: none; the engine thread owns it.
 */
#ifndef KILN_CORE_ENGINE_DRAFT_H
#define KILN_CORE_ENGINE_DRAFT_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"
#include "core/engine/runner.h"
#include "core/kv/block_manager.h"

#define KILN_DRAFT_MAX_K 32

typedef struct kiln_draft kiln_draft_t;

/* One sequence's draft state (zeroed = nothing held). */
typedef struct kiln_draft_seq {
  int32_t *blocks; /* [max_blocks] the draft's block table (allocated at first use) */
  int32_t num_blocks;
  int32_t len;  /* tokens 0..len-1 have keys/values in the draft's cache */
  int32_t base; /* tokens 0..base-1 of those are the sequence's own; base..len-1 were proposals
                   fed back (prop[0..len-base)), kept only if the sequence accepts them */
  int32_t prop[KILN_DRAFT_MAX_K];
} kiln_draft_seq_t;

typedef struct kiln_draft_options {
  kiln_runner_t runner; /* taken over (runner.destroy is called by kiln_draft_free) */
  int32_t num_blocks, block_size;
  int32_t max_seqs;   /* most sequences per proposal call */
  int32_t max_tokens; /* most tokens per draft forward */
  bool force_host_sampling;
} kiln_draft_options_t;

/* Errors: KILN_ERR_INVALID_ARGUMENT, KILN_ERR_OUT_OF_MEMORY (the runner is destroyed then). */
kiln_status_t kiln_draft_create(const kiln_draft_options_t *o, kiln_draft_t **out);
void kiln_draft_free(kiln_draft_t *d);

/* The draft's block manager (tests check that every block is free). */
kiln_kv_manager_t *kiln_draft_kv(kiln_draft_t *d);
/* Seconds spent in the draft's forwards and sampling so far. */
double kiln_draft_seconds(const kiln_draft_t *d);
/* Starts kiln_draft_seconds from 0 again (after the engine's start-up warm-up). */
void kiln_draft_zero_seconds(kiln_draft_t *d);

/* tokens[0, n): the sequence's own tokens now (no unverified proposals). Keeps what the draft
 * holds of them (the fed proposals the sequence accepted) and releases the blocks past it. */
void kiln_draft_sync(kiln_draft_t *d, kiln_draft_seq_t *s, const int32_t *tokens, int32_t n);
/* Releases every block of s and its table (preemption, finish, cancel, abort). */
void kiln_draft_release(kiln_draft_t *d, kiln_draft_seq_t *s);

typedef struct kiln_draft_req {
  kiln_draft_seq_t *seq;
  const int32_t *tokens; /* the sequence's tokens, all its own (synced) */
  int32_t num_tokens;
  int32_t k;    /* in: most proposals (<= KILN_DRAFT_MAX_K); out: how many were made */
  int32_t *out; /* [k] the proposals */
} kiln_draft_req_t;

/* Proposes for n <= max_seqs sequences at once. A sequence whose draft blocks cannot be had
 * gets fewer proposals (as many as the blocks it got allow) or none (its draft state is
 * released then, so that the others can go on); a sequence longer than the draft's context
 * gets none. Errors: the draft's forward or sampling (every k is 0 then and nothing the draft
 * held is lost). */
kiln_status_t kiln_draft_propose(kiln_draft_t *d, kiln_draft_req_t *reqs, int32_t n);

#endif /* KILN_CORE_ENGINE_DRAFT_H */
