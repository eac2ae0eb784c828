/* arena.h - a bump allocator: many small allocations, freed all at once.
 *
 * An arena hands out memory from a list of malloc'ed chunks. Regular chunks start at
 * KILN_ARENA_MIN_CHUNK and double up to KILN_ARENA_MAX_CHUNK, so a small arena stays small and a
 * big one costs few mallocs; a request too big to share a chunk gets a chunk of its own. Nothing
 * is freed until kiln_arena_free().
 *
 * Ownership: the arena owns every chunk; pointers it returns are borrowed and die with the next
 * kiln_arena_free(). The kiln_arena_t itself is the caller's (usually embedded in a struct).
 * Zero-initialised (KILN_ARENA_INIT) is an empty, valid arena with no limit.
 *
 * Limit: set `limit` to a byte count to make the arena refuse (NULL, with limit_hit set) any
 * chunk that would take kiln_arena_bytes() past it; this bounds what untrusted input (a chat
 * template) can make us allocate, counted before malloc is asked.
 *
 * Failure: allocations return NULL when malloc fails, when the limit would be passed, or when
 * size plus alignment would overflow (or exceed PTRDIFF_MAX); the arena is unchanged then.
 *
 * Thread-safety: none; an arena belongs to one thread at a time.
 */
#ifndef KILN_CORE_ARENA_H
#define KILN_CORE_ARENA_H

#include <stdbool.h>
#include <stddef.h>

#define KILN_ARENA_MIN_CHUNK ((size_t)4 << 10) /* the first regular chunk */
#define KILN_ARENA_MAX_CHUNK ((size_t)1 << 20) /* regular chunks stop doubling here */
#define KILN_ARENA_MAX_ALIGN ((size_t)16)      /* the largest alignment one may ask for */
#define KILN_ARENA_MAX_EXPECT \
  ((size_t)64 << 20) /* the largest chunk kiln_arena_expect() asks for */

typedef struct kiln_arena_chunk kiln_arena_chunk_t;

typedef struct kiln_arena {
  kiln_arena_chunk_t *head; /* the regular chunk being filled; dedicated chunks sit behind it */
  size_t next_size;         /* size of the next regular chunk; 0 = KILN_ARENA_MIN_CHUNK */
  size_t bytes;             /* bytes taken from malloc, chunk headers included */
  size_t limit;             /* 0 = none; else bytes may never pass it */
  bool limit_hit;           /* an allocation failed because of limit (not malloc) */
} kiln_arena_t;

#define KILN_ARENA_INIT \
  { NULL, 0, 0, 0, false }

/* Returns size bytes aligned to align (a power of two <= KILN_ARENA_MAX_ALIGN; anything else is
 * a programmer bug and asserts). size 0 gives a valid non-NULL pointer. NULL on out-of-memory,
 * on the limit (limit_hit is set) or when size is too large to represent. */
void *kiln_arena_alloc(kiln_arena_t *a, size_t size, size_t align);

/* kiln_arena_alloc, with the memory zeroed. */
void *kiln_arena_zalloc(kiln_arena_t *a, size_t size, size_t align);

/* Copies s[0..n) (which may contain NULs) and appends a NUL; NULL on failure as above. s may be
 * NULL when n is 0. */
char *kiln_arena_strndup(kiln_arena_t *a, const char *s, size_t n);

/* Tells the arena that about bytes will be allocated: regular chunks from now on are at least
 * that big (clamped to [KILN_ARENA_MIN_CHUNK, KILN_ARENA_MAX_EXPECT]), so a big document lives
 * in a few chunks. Worth it for sizes known up front (a parser knows its input): a few large
 * mallocs are measurably faster than many 1 MiB ones, and the untouched pages of a large malloc
 * cost nothing. Never fails; the limit still applies. */
void kiln_arena_expect(kiln_arena_t *a, size_t bytes);

/* Bytes the arena holds from malloc (chunk headers and unused tails included): what a memory
 * limit should count. */
size_t kiln_arena_bytes(const kiln_arena_t *a);

/* Frees every chunk. The arena is empty and reusable afterwards; limit is kept, limit_hit is
 * cleared. Freeing twice is harmless. */
void kiln_arena_free(kiln_arena_t *a);

#endif /* KILN_CORE_ARENA_H */
