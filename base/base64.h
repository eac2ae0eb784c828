/* base64.h - standard base64 (RFC 4648), for data URLs (server/, tools/). */
#ifndef KILN_BASE_BASE64_H
#define KILN_BASE_BASE64_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/strbuf.h"

/* Decodes standard base64 ("=" padding optional at the end; no whitespace) into *out
 * (malloc'ed, owned by the caller). Returns false with the offset of the first bad character in
 * *bad_at (or the length, for a bad ending), or with *bad_at -1 when out of memory. */
bool kiln_base64_decode(const char *s, size_t len, unsigned char **out, size_t *out_len,
                        int64_t *bad_at);

/* Appends the standard base64 of n bytes (with "=" padding) to out; false when out of memory
 * (the buffer's own flag, kiln_strbuf_ok). */
bool kiln_base64_encode(const void *data, size_t n, kiln_strbuf_t *out);

#endif /* KILN_BASE_BASE64_H */
