/* block_manager.h - the paged KV cache's bookkeeping: which block holds what, who uses it,
 * and which full blocks can be reused by a later request with the same prefix.
 *
 * The pool has num_blocks fixed-size blocks of block_size token slots (the device memory
 * lives in the model's KV cache; this is only the host-side ledger). A sequence owns a block
 * table: the ordered list of block ids that hold its tokens 0, 1, 2, ... (token t lives in
 * slot table[t / BS] * BS + t % BS). Blocks are reference counted: sequences forked from one
 * prompt (n > 1) and requests with a common prefix share blocks.
 *
 * Prefix caching. A full block whose keys/values are computed gets a hash
 *     h = XXH3-128(parent hash, the block's block_size token ids, extra key)
 * (parent = the previous block's hash, zero for the first block; extra = e.g. a cache salt),
 * so a hash names the whole prefix up to the end of the block, not just the block. A new
 * request walks its prompt's full blocks, looks each hash up and takes every block found
 * (until the first miss) instead of computing it. When a block's last user lets go, it keeps
 * its hash and contents and goes to the tail of the free list, so it can still be found;
 * allocation takes from the head, evicting (unhashing) the least recently freed block.
 * Blocks freed without a hash go to the head: they are reused before any cached block.
 *
 * Block life cycle:
 *
 *                 alloc (head of free list; drops a stale hash)
 *      +------+ ------------------------------------------> +--------+
 *      | FREE |                                              | IN USE |  ref >= 1
 *      |      | <------------------------------------------- | (raw)  |  fork / share: ref++
 *      +------+   last release, no hash: to the HEAD          +--------+
 *        ^  |                                                    |
 *        |  | evict: a FREE+CACHED block                          | commit(hash): the block is
 *        |  | taken by alloc loses its hash                      | full and computed
 *        |  v                                                    v
 *      +--------+   last release: to the TAIL (LRU)          +--------+
 *      | FREE + | <----------------------------------------- | IN USE |
 *      | CACHED |                                            | +CACHED|
 *      +--------+ -----------------------------------------> +--------+
 *                   lookup hit: ref = 1, out of the free list   lookup hit: ref++
 *
 * Copy-on-write: a sequence about to write into a block with ref > 1 (the shared, partly
 * filled last block of a fork) calls kiln_kv_cow: it gets a fresh block, the caller copies
 * the contents on the device (kiln_kv_cache_copy_blocks) and the old block loses one ref.
 * Full cached blocks are never written again, so they are never copied.
 *
 * Invariants (kiln_kv_check verifies them, for tests): a block is in the free list iff its
 * ref is 0; free count = blocks in the free list; every hash-table entry is a block whose
 * hash it is, and each hash appears at most once.
 *
 * Thread-safety: none; the engine thread owns the manager.
 */
#ifndef KILN_CORE_KV_BLOCK_MANAGER_H
#define KILN_CORE_KV_BLOCK_MANAGER_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"

typedef struct kiln_kv_hash {
  uint64_t lo, hi;
} kiln_kv_hash_t;

typedef struct kiln_kv_manager kiln_kv_manager_t;

typedef struct kiln_kv_stats {
  int32_t num_blocks;
  int32_t num_free;        /* ref == 0 (includes cached ones) */
  int32_t num_cached;      /* blocks holding a hash (in use or free) */
  uint64_t evictions;      /* cached blocks reused for something else */
  uint64_t lookups, hits;  /* kiln_kv_lookup calls and hits (blocks) */
} kiln_kv_stats_t;

/* num_blocks in [1, 2^30], block_size in [1, 4096]. Errors: KILN_ERR_INVALID_ARGUMENT,
 * KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_kv_manager_create(int32_t num_blocks, int32_t block_size, bool prefix_caching,
                                     kiln_kv_manager_t **out);
void kiln_kv_manager_free(kiln_kv_manager_t *m);

int32_t kiln_kv_block_size(const kiln_kv_manager_t *m);
int32_t kiln_kv_num_blocks(const kiln_kv_manager_t *m);
int32_t kiln_kv_num_free(const kiln_kv_manager_t *m);
bool kiln_kv_prefix_caching(const kiln_kv_manager_t *m);
void kiln_kv_stats(const kiln_kv_manager_t *m, kiln_kv_stats_t *out);

/* Takes a free block (ref = 1). Returns -1 when none is free. */
int32_t kiln_kv_alloc(kiln_kv_manager_t *m);
/* One more user of an in-use block. */
void kiln_kv_ref(kiln_kv_manager_t *m, int32_t block);
/* One user less; at zero the block becomes free (kept findable if it has a hash). */
void kiln_kv_release(kiln_kv_manager_t *m, int32_t block);
int32_t kiln_kv_refcount(const kiln_kv_manager_t *m, int32_t block);

/* The hash of a full block: parent = the previous block's hash (NULL for the first). */
kiln_kv_hash_t kiln_kv_hash_block(const kiln_kv_hash_t *parent, const int32_t *tokens,
                                  int32_t block_size, uint64_t extra);

/* Finds a cached block with this hash and takes a reference on it (ref++, leaving the free
 * list if it was free). Returns the block or -1. Counts a lookup (and a hit). Without prefix
 * caching always -1. */
int32_t kiln_kv_lookup(kiln_kv_manager_t *m, kiln_kv_hash_t h);
/* Like kiln_kv_lookup but takes no reference and counts nothing (for "would it hit?"). */
int32_t kiln_kv_peek(const kiln_kv_manager_t *m, kiln_kv_hash_t h);

/* Marks an in-use, full, computed block as holding hash h. If another block already holds
 * h, this one stays unhashed (the first copy wins) and false is returned. */
bool kiln_kv_commit(kiln_kv_manager_t *m, int32_t block, kiln_kv_hash_t h);

/* Copy-on-write for a shared block (ref > 1): allocates a fresh block (ref 1) and drops one
 * reference of `block`. Returns the new block, or -1 when none is free (nothing changes). */
int32_t kiln_kv_cow(kiln_kv_manager_t *m, int32_t block);

/* Drops every cached hash of a free block (e.g. after the weights change). */
void kiln_kv_reset_cache(kiln_kv_manager_t *m);

/* Checks every invariant; returns NULL or a KILN_ERR_INTERNAL naming the broken one. */
kiln_status_t kiln_kv_check(const kiln_kv_manager_t *m);

#endif /* KILN_CORE_KV_BLOCK_MANAGER_H */
