/* base64.h - standard base64 (RFC 4648) decoding, for data URLs (server/, tools/). */
#ifndef KILN_BASE_BASE64_H
#define KILN_BASE_BASE64_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Decodes standard base64 ("=" padding optional at the end; no whitespace) into *out
 * (malloc'ed, owned by the caller). Returns false with the offset of the first bad character in
 * *bad_at (or the length, for a bad ending), or with *bad_at -1 when out of memory. */
bool kiln_base64_decode(const char *s, size_t len, unsigned char **out, size_t *out_len,
                        int64_t *bad_at);

#endif /* KILN_BASE_BASE64_H */
