/* block_manager.c - the KV block ledger (see block_manager.h for the life cycle).
 *
 * Free list: an intrusive doubly linked list over block ids (prev/next arrays), head =
 * next to allocate. Hash table: open addressing with linear probing over block ids, sized
 * to a power of two >= 2 * num_blocks so it never fills; deletion shifts later entries back
 * (no tombstones), so lookups stay short however long the engine runs.
 */
#include "core/kv/block_manager.h"

#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

typedef struct kv_block {
  int32_t ref;
  int32_t prev, next; /* free-list links; -1 = none */
  bool in_free;
  bool hashed;
  kiln_kv_hash_t hash;
} kv_block_t;

struct kiln_kv_manager {
  int32_t num_blocks, block_size;
  bool prefix_caching;
  kv_block_t *blocks;
  int32_t head, tail, num_free, num_cached;
  int32_t *table; /* [cap] block ids, -1 = empty */
  uint32_t cap_mask;
  uint64_t evictions, lookups, hits;
};

/* ---- free list ---------------------------------------------------------------------------- */

static void fl_remove(kiln_kv_manager_t *m, int32_t b) {
  kv_block_t *k = &m->blocks[b];
  if (k->prev >= 0) m->blocks[k->prev].next = k->next; else m->head = k->next;
  if (k->next >= 0) m->blocks[k->next].prev = k->prev; else m->tail = k->prev;
  k->prev = k->next = -1;
  k->in_free = false;
  m->num_free--;
}

static void fl_push_tail(kiln_kv_manager_t *m, int32_t b) {
  kv_block_t *k = &m->blocks[b];
  k->prev = m->tail;
  k->next = -1;
  if (m->tail >= 0) m->blocks[m->tail].next = b; else m->head = b;
  m->tail = b;
  k->in_free = true;
  m->num_free++;
}

static void fl_push_head(kiln_kv_manager_t *m, int32_t b) {
  kv_block_t *k = &m->blocks[b];
  k->next = m->head;
  k->prev = -1;
  if (m->head >= 0) m->blocks[m->head].prev = b; else m->tail = b;
  m->head = b;
  k->in_free = true;
  m->num_free++;
}

/* ---- hash table --------------------------------------------------------------------------- */

static bool hash_eq(kiln_kv_hash_t a, kiln_kv_hash_t b) { return a.lo == b.lo && a.hi == b.hi; }

/* The slot holding h, or the empty slot where it would go. */
static uint32_t ht_find(const kiln_kv_manager_t *m, kiln_kv_hash_t h) {
  uint32_t i = (uint32_t)h.lo & m->cap_mask;
  while (m->table[i] >= 0 && !hash_eq(m->blocks[m->table[i]].hash, h)) i = (i + 1) & m->cap_mask;
  return i;
}

static void ht_remove(kiln_kv_manager_t *m, int32_t b) {
  uint32_t i = ht_find(m, m->blocks[b].hash);
  if (m->table[i] != b) return; /* not indexed (cannot happen while invariants hold) */
  m->table[i] = -1;
  /* Backward shift: move later entries of the run into the hole when their home allows. */
  uint32_t j = i;
  for (;;) {
    j = (j + 1) & m->cap_mask;
    int32_t e = m->table[j];
    if (e < 0) break;
    uint32_t home = (uint32_t)m->blocks[e].hash.lo & m->cap_mask;
    /* e may move to i iff home is not in the cyclic range (i, j]. */
    bool in_range = i <= j ? (home > i && home <= j) : (home > i || home <= j);
    if (!in_range) {
      m->table[i] = e;
      m->table[j] = -1;
      i = j;
    }
  }
}

static void unhash(kiln_kv_manager_t *m, int32_t b) {
  if (!m->blocks[b].hashed) return;
  ht_remove(m, b);
  m->blocks[b].hashed = false;
  m->num_cached--;
}

/* ---- API ---------------------------------------------------------------------------------- */

kiln_status_t kiln_kv_manager_create(int32_t num_blocks, int32_t block_size, bool prefix_caching,
                                     kiln_kv_manager_t **out) {
  *out = NULL;
  if (num_blocks < 1 || num_blocks > (1 << 30) || block_size < 1 || block_size > 4096)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "KV block manager: %d blocks of %d tokens (want [1, 2^30] blocks of "
                            "[1, 4096] tokens)",
                            num_blocks, block_size);
  kiln_kv_manager_t *m = calloc(1, sizeof(*m));
  uint32_t cap = 1;
  while (cap < 2u * (uint32_t)num_blocks) cap <<= 1;
  if (m) {
    m->blocks = malloc((size_t)num_blocks * sizeof(*m->blocks));
    m->table = malloc((size_t)cap * sizeof(*m->table));
  }
  if (!m || !m->blocks || !m->table) {
    kiln_kv_manager_free(m);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "KV block manager: out of memory for %d blocks",
                            num_blocks);
  }
  m->num_blocks = num_blocks;
  m->block_size = block_size;
  m->prefix_caching = prefix_caching;
  m->cap_mask = cap - 1;
  memset(m->table, 0xff, (size_t)cap * sizeof(*m->table));
  m->head = m->tail = -1;
  for (int32_t b = 0; b < num_blocks; b++) {
    m->blocks[b] = (kv_block_t){.ref = 0, .prev = -1, .next = -1};
    fl_push_tail(m, b);
  }
  *out = m;
  return NULL;
}

void kiln_kv_manager_free(kiln_kv_manager_t *m) {
  if (!m) return;
  free(m->blocks);
  free(m->table);
  free(m);
}

int32_t kiln_kv_block_size(const kiln_kv_manager_t *m) { return m->block_size; }
int32_t kiln_kv_num_blocks(const kiln_kv_manager_t *m) { return m->num_blocks; }
int32_t kiln_kv_num_free(const kiln_kv_manager_t *m) { return m->num_free; }
bool kiln_kv_prefix_caching(const kiln_kv_manager_t *m) { return m->prefix_caching; }

void kiln_kv_stats(const kiln_kv_manager_t *m, kiln_kv_stats_t *out) {
  out->num_blocks = m->num_blocks;
  out->num_free = m->num_free;
  out->num_cached = m->num_cached;
  out->evictions = m->evictions;
  out->lookups = m->lookups;
  out->hits = m->hits;
}

int32_t kiln_kv_alloc(kiln_kv_manager_t *m) {
  int32_t b = m->head;
  if (b < 0) return -1;
  fl_remove(m, b);
  if (m->blocks[b].hashed) {
    unhash(m, b);
    m->evictions++;
  }
  m->blocks[b].ref = 1;
  return b;
}

void kiln_kv_ref(kiln_kv_manager_t *m, int32_t block) { m->blocks[block].ref++; }

void kiln_kv_release(kiln_kv_manager_t *m, int32_t block) {
  kv_block_t *k = &m->blocks[block];
  if (k->ref <= 0) return; /* a double release is a caller bug; kiln_kv_check cannot see it */
  if (--k->ref > 0) return;
  if (k->hashed)
    fl_push_tail(m, block);
  else
    fl_push_head(m, block);
}

int32_t kiln_kv_refcount(const kiln_kv_manager_t *m, int32_t block) { return m->blocks[block].ref; }

kiln_kv_hash_t kiln_kv_hash_block(const kiln_kv_hash_t *parent, const int32_t *tokens,
                                  int32_t block_size, uint64_t extra) {
  XXH3_state_t st;
  XXH3_128bits_reset(&st);
  uint64_t p[3] = {parent ? parent->lo : 0, parent ? parent->hi : 0, extra};
  XXH3_128bits_update(&st, p, sizeof(p));
  XXH3_128bits_update(&st, tokens, (size_t)block_size * sizeof(*tokens));
  XXH128_hash_t h = XXH3_128bits_digest(&st);
  return (kiln_kv_hash_t){h.low64, h.high64};
}

int32_t kiln_kv_peek(const kiln_kv_manager_t *m, kiln_kv_hash_t h) {
  if (!m->prefix_caching) return -1;
  return m->table[ht_find(m, h)];
}

int32_t kiln_kv_lookup(kiln_kv_manager_t *m, kiln_kv_hash_t h) {
  if (!m->prefix_caching) return -1;
  m->lookups++;
  int32_t b = m->table[ht_find(m, h)];
  if (b < 0) return -1;
  m->hits++;
  if (m->blocks[b].in_free) fl_remove(m, b);
  m->blocks[b].ref++;
  return b;
}

bool kiln_kv_commit(kiln_kv_manager_t *m, int32_t block, kiln_kv_hash_t h) {
  kv_block_t *k = &m->blocks[block];
  if (!m->prefix_caching || k->hashed || k->ref <= 0) return false;
  uint32_t i = ht_find(m, h);
  if (m->table[i] >= 0) return false; /* the first copy wins */
  k->hash = h;
  k->hashed = true;
  m->table[i] = block;
  m->num_cached++;
  return true;
}

int32_t kiln_kv_cow(kiln_kv_manager_t *m, int32_t block) {
  int32_t nb = kiln_kv_alloc(m);
  if (nb < 0) return -1;
  kiln_kv_release(m, block);
  return nb;
}

void kiln_kv_reset_cache(kiln_kv_manager_t *m) {
  for (int32_t b = 0; b < m->num_blocks; b++)
    if (m->blocks[b].hashed && m->blocks[b].ref == 0) {
      unhash(m, b);
      /* Unhashed free blocks belong at the head. */
      fl_remove(m, b);
      fl_push_head(m, b);
    }
}

kiln_status_t kiln_kv_check(const kiln_kv_manager_t *m) {
  int32_t n = 0, cached = 0;
  for (int32_t b = m->head, prev = -1; b >= 0; prev = b, b = m->blocks[b].next) {
    if (++n > m->num_blocks)
      return kiln_status_make(KILN_ERR_INTERNAL, "KV: the free list has a cycle");
    if (m->blocks[b].prev != prev)
      return kiln_status_make(KILN_ERR_INTERNAL, "KV: block %d has a broken prev link", b);
    if (m->blocks[b].ref != 0 || !m->blocks[b].in_free)
      return kiln_status_make(KILN_ERR_INTERNAL, "KV: block %d in the free list has ref %d", b,
                              m->blocks[b].ref);
  }
  if (n != m->num_free)
    return kiln_status_make(KILN_ERR_INTERNAL, "KV: %d blocks in the free list, count says %d", n,
                            m->num_free);
  for (int32_t b = 0; b < m->num_blocks; b++) {
    const kv_block_t *k = &m->blocks[b];
    if (k->ref < 0 || (k->ref == 0) != k->in_free)
      return kiln_status_make(KILN_ERR_INTERNAL, "KV: block %d has ref %d but in_free %d", b,
                              k->ref, (int)k->in_free);
    if (k->hashed) {
      cached++;
      if (m->table[ht_find(m, k->hash)] != b)
        return kiln_status_make(KILN_ERR_INTERNAL, "KV: block %d's hash is not indexed", b);
    }
  }
  if (cached != m->num_cached)
    return kiln_status_make(KILN_ERR_INTERNAL, "KV: %d hashed blocks, count says %d", cached,
                            m->num_cached);
  int32_t entries = 0;
  for (uint32_t i = 0; i <= m->cap_mask; i++)
    if (m->table[i] >= 0) {
      entries++;
      if (!m->blocks[m->table[i]].hashed)
        return kiln_status_make(KILN_ERR_INTERNAL, "KV: table entry for unhashed block %d",
                                m->table[i]);
    }
  if (entries != cached)
    return kiln_status_make(KILN_ERR_INTERNAL, "KV: %d table entries for %d hashed blocks",
                            entries, cached);
  return NULL;
}
