/* guide.h - constrained decoding for the engine: a constraint (JSON Schema, regex, choice,
 * GBNF grammar; kiln_guide_kind_t) compiled once per tokenizer, and per sequence a matcher that
 * says which tokens may come next and follows the tokens that do.
 *
 * Pieces:
 *   - kiln_guide_vocab_t: the tokenizer's vocabulary indexed once: every token's bytes (as
 *     they appear in the middle of a text), a byte trie over them, and two caches shared by
 *     every constraint on this vocabulary: compiled constraints by (kind, spec) hash, and token
 *     classifications by grammar context (below). Special tokens and tokens without bytes are
 *     never allowed; end-of-sequence is the engine's business (allowed where the matcher is
 *     accepting).
 *   - kiln_guide_t: a compiled constraint (grammar.h's byte-level grammar), refcounted.
 *   - kiln_guide_matcher_t: one sequence's position: a set of pushdown stacks over grammar
 *     positions (hash-consed nodes, so equal stacks are one node and sets dedupe by id).
 *
 * The mask. For a stack whose top is grammar position p0 under positions p1, p2 (its "context
 * chain"), most tokens are decided by the chain alone: walking the token's bytes never pops
 * past p2. Those are precomputed once per chain, over the vocabulary trie (a DFA built lazily
 * over sets of stack nodes makes the walk cost about one table lookup per trie node): the
 * accepted tokens as a bitset or a list, and the "uncertain" ones, those that pop past p2
 * after k bytes, as a trie of their remaining bytes. At run time a stack's mask is the
 * chain's accepted set plus the uncertain tokens whose rest the real stack below p2 accepts
 * (a walk over that small trie). The chain classification is cached per constraint and, by a
 * hash of the grammar text it depends on, per vocabulary, so the JSON rules every schema shares
 * are classified once per tokenizer. A matcher also keeps the masks of its last few states.
 *
 * Thread-safety: a vocabulary and a compiled constraint may be used from any number of
 * threads (the caches lock); a matcher belongs to one thread at a time. */
#ifndef KILN_CORE_GUIDE_GUIDE_H
#define KILN_CORE_GUIDE_GUIDE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "core/guide/grammar.h"
#include "kiln/kiln.h"
#include "models/tokenizer/tokenizer.h"

typedef struct kiln_guide_vocab kiln_guide_vocab_t;
typedef struct kiln_guide kiln_guide_t;
typedef struct kiln_guide_matcher kiln_guide_matcher_t;

/* Indexes the tokenizer's vocabulary for a model of vocab_size logits (ids at or above the
 * tokenizer's size are never allowed). The tokenizer must outlive the index. */
kiln_status_t kiln_guide_vocab_create(const kiln_tokenizer_t *tok, int32_t vocab_size,
                                      kiln_guide_vocab_t **out);
/* The same from explicit token byte strings (tests, benchmarks): tokens[i] (lens[i] bytes)
 * is token i's text; special[i] (may be NULL) marks tokens never allowed. */
kiln_status_t kiln_guide_vocab_create_bytes(int32_t vocab_size, const char *const *tokens,
                                            const size_t *lens, const bool *special,
                                            kiln_guide_vocab_t **out);
void kiln_guide_vocab_free(kiln_guide_vocab_t *v);
int32_t kiln_guide_vocab_size(const kiln_guide_vocab_t *v);
/* 32-bit words in a mask: ceil(vocab_size / 32). */
int32_t kiln_guide_mask_words(const kiln_guide_vocab_t *v);
/* Token id's bytes as the index holds them (NULL when the token is never allowed). */
const uint8_t *kiln_guide_vocab_token(const kiln_guide_vocab_t *v, int32_t id, size_t *len);

/* Compiles a constraint (spec: see kiln_guide_kind_t; len 0 = NUL-terminated), or takes it
 * from the vocabulary's cache. v may be NULL: a grammar matcher over bytes only (tests).
 * Errors: KILN_ERR_INVALID_ARGUMENT naming the kind's field and the reason. */
kiln_status_t kiln_guide_compile(kiln_guide_vocab_t *v, kiln_guide_kind_t kind, const char *spec,
                                 size_t len, kiln_guide_t **out);
/* One more reference to g (a worker that may outlive the request); kiln_guide_release drops
 * it. Returns g. */
kiln_guide_t *kiln_guide_retain(kiln_guide_t *g);
void kiln_guide_release(kiln_guide_t *g);
const kiln_grammar_t *kiln_guide_grammar(const kiln_guide_t *g);

/* Cache statistics of a vocabulary: constraints compiled and found in the cache, context
 * chains classified and found in the cache; of the classified, those derived from a bounded
 * repetition's unbounded rule (walking only the tokens longer than the link's count), and the
 * links taken as their unbounded rule's classification (no token is long enough to tell). */
typedef struct kiln_guide_stats {
  uint64_t compiles, compile_hits;
  uint64_t classified, class_hits;
  uint64_t class_bytes;
  uint64_t derived, derived_same;
} kiln_guide_stats_t;
void kiln_guide_vocab_stats(kiln_guide_vocab_t *v, kiln_guide_stats_t *out);

/* ---- matchers --------------------------------------------------------------------------- */

kiln_status_t kiln_guide_matcher_create(kiln_guide_t *g, kiln_guide_matcher_t **out);
/* A copy at the same position (n > 1 sequences forked from one). */
kiln_status_t kiln_guide_matcher_clone(const kiln_guide_matcher_t *m, kiln_guide_matcher_t **out);
void kiln_guide_matcher_free(kiln_guide_matcher_t *m);
/* Back to the start (a preempted sequence recomputing its output does not need it: the
 * matcher stays at the output's end). */
void kiln_guide_matcher_reset(kiln_guide_matcher_t *m);

/* The tokens allowed next: bit t of mask[t / 32] (kiln_guide_mask_words words; end of
 * sequence not included: see accepting). Errors: out of memory; KILN_ERR_INVALID_ARGUMENT
 * for a matcher without a vocabulary. */
kiln_status_t kiln_guide_matcher_fill_mask(kiln_guide_matcher_t *m, uint32_t *mask);
/* The output so far is complete (end of sequence may come now). */
bool kiln_guide_matcher_accepting(const kiln_guide_matcher_t *m);
/* Complete, and nothing can follow: the sequence is over. */
bool kiln_guide_matcher_finished(const kiln_guide_matcher_t *m);
/* Follows a token (its bytes); false, with the matcher unchanged, when the constraint does not
 * allow it here. */
bool kiln_guide_matcher_accept_token(kiln_guide_matcher_t *m, int32_t id);
bool kiln_guide_matcher_accept_bytes(kiln_guide_matcher_t *m, const void *bytes, size_t n);
/* Stack nodes held, and a compaction now (it happens by itself beyond 65536 nodes): keeps only
 * the nodes the current position reaches (tests). False when out of memory (unchanged). */
int32_t kiln_guide_matcher_nodes(const kiln_guide_matcher_t *m);
bool kiln_guide_matcher_compact(kiln_guide_matcher_t *m);

/* Classifies ahead the contexts of gd's first steps, so that fill_mask finds them cached: the
 * matcher states reachable from the start, nearest first (a breadth-first walk over bytes,
 * every state a token boundary may fall on), each state's contexts as fill_mask would meet
 * them, until max_states states, budget_us microseconds (<= 0: no limit) or *stop (may be
 * NULL). Meant for a worker thread while the request's prompt is prefilled: a matcher that
 * needs a context being classified here waits for it (no context is classified twice), and
 * the masks are the same with or without it. *states_out (may be NULL): the states done.
 * Errors: out of memory. */
kiln_status_t kiln_guide_precompute(kiln_guide_t *gd, int32_t max_states, int64_t budget_us,
                                    const atomic_bool *stop, int32_t *states_out);
/* True the first time only (atomically), for one compiled constraint: the caller is the one to
 * precompute it. A compile served from the vocabulary's cache returns the same object, so a
 * schema that comes again is not precomputed again (a constraint evicted from the cache and
 * compiled anew is a new object). */
bool kiln_guide_claim_precompute(kiln_guide_t *g);

#endif /* KILN_CORE_GUIDE_GUIDE_H */
