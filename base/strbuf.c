/* strbuf.c - a growable, always NUL-terminated byte buffer (see strbuf.h). */
#include "strbuf.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Grows the allocation so that extra more bytes plus the NUL fit. Capacity doubles so that n
 * appends cost O(n) in total. On failure the buffer is untouched except for the failure flag.
 * Sizes above PTRDIFF_MAX fail without asking malloc (no object may be that big). */
bool kiln_strbuf_reserve(kiln_strbuf_t *b, size_t extra) {
  if (b->len > PTRDIFF_MAX - 1 || extra > PTRDIFF_MAX - 1 - b->len) {
    b->failed = true;
    return false;
  }
  size_t need = b->len + extra + 1;
  if (need <= b->cap) return true;
  size_t cap = b->cap ? b->cap : 16;
  while (cap < need) cap = cap > PTRDIFF_MAX / 2 ? need : cap * 2;
  char *p = realloc(b->data, cap);
  if (!p) {
    b->failed = true;
    return false;
  }
  if (!b->data) p[0] = '\0';
  b->data = p;
  b->cap = cap;
  return true;
}

bool kiln_strbuf_append(kiln_strbuf_t *b, const void *data, size_t n) {
  if (!kiln_strbuf_reserve(b, n)) return false;
  if (n) memcpy(b->data + b->len, data, n);
  b->len += n;
  b->data[b->len] = '\0';
  return true;
}

bool kiln_strbuf_append_str(kiln_strbuf_t *b, const char *s) {
  return kiln_strbuf_append(b, s, strlen(s));
}

bool kiln_strbuf_append_char(kiln_strbuf_t *b, char c) {
  if (b->len + 1 >= b->cap && !kiln_strbuf_reserve(b, 1)) return false;
  b->data[b->len++] = c;
  b->data[b->len] = '\0';
  return true;
}

bool kiln_strbuf_vprintf(kiln_strbuf_t *b, const char *fmt, va_list ap) {
  /* First try the room already there; most calls fit and format once. */
  va_list ap2;
  va_copy(ap2, ap);
  char *dst = b->data ? b->data + b->len : NULL;
  size_t room = b->data ? b->cap - b->len : 0;
  int n = vsnprintf(dst, room, fmt, ap2);
  va_end(ap2);
  if (n < 0) { /* an encoding error: nothing sensible to append */
    if (b->data) b->data[b->len] = '\0';
    b->failed = true;
    return false;
  }
  if ((size_t)n < room) {
    b->len += (size_t)n;
    return true;
  }
  if (b->data) b->data[b->len] = '\0'; /* undo the truncated attempt */
  if (!kiln_strbuf_reserve(b, (size_t)n)) return false;
  vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
  b->len += (size_t)n;
  return true;
}

bool kiln_strbuf_printf(kiln_strbuf_t *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  bool ok = kiln_strbuf_vprintf(b, fmt, ap);
  va_end(ap);
  return ok;
}

bool kiln_strbuf_append_utf8(kiln_strbuf_t *b, unsigned cp) {
  char u[4];
  size_t n;
  if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 0xFFFD;
  if (cp < 0x80) {
    u[0] = (char)cp;
    n = 1;
  } else if (cp < 0x800) {
    u[0] = (char)(0xC0 | (cp >> 6));
    u[1] = (char)(0x80 | (cp & 0x3F));
    n = 2;
  } else if (cp < 0x10000) {
    u[0] = (char)(0xE0 | (cp >> 12));
    u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    u[2] = (char)(0x80 | (cp & 0x3F));
    n = 3;
  } else {
    u[0] = (char)(0xF0 | (cp >> 18));
    u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    u[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    u[3] = (char)(0x80 | (cp & 0x3F));
    n = 4;
  }
  return kiln_strbuf_append(b, u, n);
}

const char *kiln_strbuf_cstr(const kiln_strbuf_t *b) { return b->data ? b->data : ""; }

bool kiln_strbuf_ok(const kiln_strbuf_t *b) { return !b->failed; }

void kiln_strbuf_reset(kiln_strbuf_t *b) {
  b->len = 0;
  if (b->data) b->data[0] = '\0';
  b->failed = false;
}

char *kiln_strbuf_detach(kiln_strbuf_t *b, size_t *out_len) {
  char *p = b->data;
  size_t len = b->len;
  if (!p) {
    p = malloc(1);
    if (p) p[0] = '\0';
    len = 0;
  }
  b->data = NULL;
  b->len = 0;
  b->cap = 0;
  b->failed = false;
  if (out_len) *out_len = p ? len : 0;
  return p;
}

void kiln_strbuf_free(kiln_strbuf_t *b) {
  free(b->data);
  b->data = NULL;
  b->len = 0;
  b->cap = 0;
  b->failed = false;
}

char *kiln_strprintf(const char *fmt, ...) {
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  va_list ap;
  va_start(ap, fmt);
  bool ok = kiln_strbuf_vprintf(&b, fmt, ap);
  va_end(ap);
  if (!ok) {
    kiln_strbuf_free(&b);
    return NULL;
  }
  return kiln_strbuf_detach(&b, NULL);
}
