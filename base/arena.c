/* arena.c - a bump allocator over a list of malloc'ed chunks (see arena.h). */
#include "arena.h"

#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct kiln_arena_chunk {
  kiln_arena_chunk_t *next;
  size_t cap, used;
  _Alignas(KILN_ARENA_MAX_ALIGN) unsigned char data[]; /* cap bytes; used of them handed out */
};

#define CHUNK_HDR (offsetof(kiln_arena_chunk_t, data))

_Static_assert(CHUNK_HDR % KILN_ARENA_MAX_ALIGN == 0, "chunk data must be maximally aligned");
_Static_assert(KILN_ARENA_MIN_CHUNK <= KILN_ARENA_MAX_CHUNK, "chunk sizes");

/* The slow path: the head cannot hold size bytes, so a new chunk is made; its data is aligned to
 * KILN_ARENA_MAX_ALIGN, which satisfies any alignment one may ask for.
 *
 * A request bigger than a quarter of the next regular chunk gets a chunk of exactly its size,
 * linked behind the head, so the space left in the head is not wasted. Every new chunk doubles
 * the next regular size (up to KILN_ARENA_MAX_CHUNK): an arena that keeps asking for memory soon
 * gets chunks big enough that the slow path is rare, while a small one stays small (a size set
 * by kiln_arena_expect() beyond KILN_ARENA_MAX_CHUNK is kept as it is). Near the limit a
 * regular chunk shrinks to what the limit leaves, so the whole limit is usable. */
static void *arena_alloc_slow(kiln_arena_t *a, size_t size) {
  if (size > (size_t)PTRDIFF_MAX - CHUNK_HDR) return NULL; /* no object may be that big */
  size_t next = a->next_size ? a->next_size : KILN_ARENA_MIN_CHUNK;
  bool dedicated = size > next / 4;
  size_t cap = dedicated ? size : next;
  if (a->limit) {
    size_t room = a->limit > a->bytes ? a->limit - a->bytes : 0;
    if (room < CHUNK_HDR || size > room - CHUNK_HDR) {
      a->limit_hit = true;
      return NULL;
    }
    if (cap > room - CHUNK_HDR) cap = room - CHUNK_HDR;
  }
  kiln_arena_chunk_t *c = malloc(CHUNK_HDR + cap);
  if (!c) return NULL;
  c->cap = cap;
  c->used = size;
  a->bytes += CHUNK_HDR + cap;
  if (next < KILN_ARENA_MAX_CHUNK)
    a->next_size = next >= KILN_ARENA_MAX_CHUNK / 2 ? KILN_ARENA_MAX_CHUNK : next * 2;
  if (dedicated && a->head) {
    c->next = a->head->next;
    a->head->next = c;
  } else {
    c->next = a->head;
    a->head = c;
  }
  return c->data;
}

void *kiln_arena_alloc(kiln_arena_t *a, size_t size, size_t align) {
  assert(align && align <= KILN_ARENA_MAX_ALIGN && (align & (align - 1)) == 0);
  kiln_arena_chunk_t *h = a->head;
  if (h) {
    /* used <= cap, and cap is far below SIZE_MAX, so neither line can wrap. */
    size_t off = (h->used + align - 1) & ~(align - 1);
    if (off <= h->cap && size <= h->cap - off) {
      h->used = off + size;
      return h->data + off;
    }
  }
  return arena_alloc_slow(a, size);
}

void *kiln_arena_zalloc(kiln_arena_t *a, size_t size, size_t align) {
  void *p = kiln_arena_alloc(a, size, align);
  if (p && size) memset(p, 0, size);
  return p;
}

char *kiln_arena_strndup(kiln_arena_t *a, const char *s, size_t n) {
  if (n == SIZE_MAX) return NULL;
  char *d = kiln_arena_alloc(a, n + 1, 1);
  if (!d) return NULL;
  if (n) memcpy(d, s, n);
  d[n] = '\0';
  return d;
}

void kiln_arena_expect(kiln_arena_t *a, size_t bytes) {
  if (bytes < KILN_ARENA_MIN_CHUNK) bytes = KILN_ARENA_MIN_CHUNK;
  if (bytes > KILN_ARENA_MAX_EXPECT) bytes = KILN_ARENA_MAX_EXPECT;
  if (bytes > a->next_size) a->next_size = bytes;
}

size_t kiln_arena_bytes(const kiln_arena_t *a) { return a->bytes; }

void kiln_arena_free(kiln_arena_t *a) {
  kiln_arena_chunk_t *c = a->head;
  while (c) {
    kiln_arena_chunk_t *next = c->next;
    free(c);
    c = next;
  }
  a->head = NULL;
  a->next_size = 0;
  a->bytes = 0;
  a->limit_hit = false;
}
