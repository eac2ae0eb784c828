/* strbuf.h - a growable byte buffer that is always NUL-terminated.
 *
 * Zero-initialised (KILN_STRBUF_INIT) is an empty, valid buffer. Appends return false on
 * out-of-memory and leave the buffer unchanged, so a caller may batch appends and check once
 * with kiln_strbuf_ok(). Not thread-safe.
 */
#ifndef KILN_CORE_STRBUF_H
#define KILN_CORE_STRBUF_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

typedef struct kiln_strbuf {
  char *data;   /* NUL-terminated when cap > 0; NULL when nothing was ever appended */
  size_t len;   /* bytes used, excluding the NUL */
  size_t cap;   /* bytes allocated */
  bool failed;  /* an append ran out of memory */
} kiln_strbuf_t;

#define KILN_STRBUF_INIT {NULL, 0, 0, false}

/* Makes room for extra more bytes (plus the NUL) so the next appends cannot fail. Sizes beyond
 * PTRDIFF_MAX fail (and set the failure flag) without calling malloc. */
bool kiln_strbuf_reserve(kiln_strbuf_t *b, size_t extra);
bool kiln_strbuf_append(kiln_strbuf_t *b, const void *data, size_t n);
bool kiln_strbuf_append_str(kiln_strbuf_t *b, const char *s);
bool kiln_strbuf_append_char(kiln_strbuf_t *b, char c);
bool kiln_strbuf_printf(kiln_strbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool kiln_strbuf_vprintf(kiln_strbuf_t *b, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));
/* Appends the UTF-8 encoding of code point cp (must be <= 0x10FFFF and not a surrogate; one
 * that is not is written as U+FFFD, so the buffer never holds invalid UTF-8 from this call). */
bool kiln_strbuf_append_utf8(kiln_strbuf_t *b, unsigned cp);
/* "" when empty; borrowed. */
const char *kiln_strbuf_cstr(const kiln_strbuf_t *b);
/* True when no append failed since init/reset. */
bool kiln_strbuf_ok(const kiln_strbuf_t *b);
/* Keeps the allocation, empties the content, clears the failure flag. */
void kiln_strbuf_reset(kiln_strbuf_t *b);
/* Hands the allocation to the caller, who frees it (never NULL unless out of memory: an empty
 * buffer yields a malloc'ed ""); the buffer becomes empty with its failure flag cleared, so check
 * kiln_strbuf_ok() first. out_len may be NULL. */
char *kiln_strbuf_detach(kiln_strbuf_t *b, size_t *out_len);
/* Frees the allocation and leaves an empty, reusable buffer (freeing twice is harmless). */
void kiln_strbuf_free(kiln_strbuf_t *b);

/* A printf into a new malloc'ed string; NULL on out-of-memory or a formatting error. */
char *kiln_strprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif /* KILN_CORE_STRBUF_H */
