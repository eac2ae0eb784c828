/* base64.c - standard base64 decoding (see base64.h). */
#include "base/base64.h"

#include <stdint.h>
#include <stdlib.h>

bool kiln_base64_decode(const char *s, size_t len, unsigned char **out, size_t *out_len,
                        int64_t *bad_at) {
  *out = NULL;
  *out_len = 0;
  *bad_at = -1;
  size_t n = len;
  while (n > 0 && s[n - 1] == '=' && len - n < 2) n--; /* padding */
  if (n % 4 == 1) {
    *bad_at = (int64_t)len;
    return false;
  }
  unsigned char *o = malloc(n / 4 * 3 + 3);
  if (!o) return false;
  uint32_t acc = 0;
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    int v = c >= 'A' && c <= 'Z'   ? c - 'A'
            : c >= 'a' && c <= 'z' ? c - 'a' + 26
            : c >= '0' && c <= '9' ? c - '0' + 52
            : c == '+'             ? 62
            : c == '/'             ? 63
                                   : -1;
    if (v < 0) {
      free(o);
      *bad_at = (int64_t)i;
      return false;
    }
    acc = acc << 6 | (uint32_t)v;
    if (i % 4 == 3) {
      o[k++] = (unsigned char)(acc >> 16);
      o[k++] = (unsigned char)(acc >> 8);
      o[k++] = (unsigned char)acc;
      acc = 0;
    }
  }
  if (n % 4 == 2) {
    o[k++] = (unsigned char)(acc >> 4);
  } else if (n % 4 == 3) {
    o[k++] = (unsigned char)(acc >> 10);
    o[k++] = (unsigned char)(acc >> 2);
  }
  *out = o;
  *out_len = k;
  return true;
}

bool kiln_base64_encode(const void *data, size_t n, kiln_strbuf_t *out) {
  static const char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const unsigned char *p = data;
  for (size_t k = 0; k < n; k += 3) {
    const uint32_t v = (uint32_t)p[k] << 16 | (k + 1 < n ? (uint32_t)p[k + 1] << 8 : 0) |
                       (k + 2 < n ? (uint32_t)p[k + 2] : 0);
    const char q[4] = {abc[v >> 18], abc[(v >> 12) & 63], k + 1 < n ? abc[(v >> 6) & 63] : '=',
                       k + 2 < n ? abc[v & 63] : '='};
    kiln_strbuf_append(out, q, 4);
  }
  return kiln_strbuf_ok(out);
}
