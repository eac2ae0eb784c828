/* status.c - heap-allocated error values with messages (see status.h). */
#include "status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kiln_status {
  kiln_status_code_t code;
  int is_static; /* the OOM fallback: never freed */
  char *message;
};

static struct kiln_status status_oom = {KILN_ERR_OUT_OF_MEMORY, 1,
                                        "out of memory while reporting an error"};

kiln_status_t kiln_status_makev(kiln_status_code_t code, const char *fmt, va_list ap) {
  if (code == KILN_OK) code = KILN_ERR_INTERNAL; /* an error with code 0 is a caller bug */
  struct kiln_status *st = malloc(sizeof(*st));
  if (!st) return &status_oom;
  va_list ap2;
  va_copy(ap2, ap);
  int n = vsnprintf(NULL, 0, fmt, ap2);
  va_end(ap2);
  if (n < 0) n = 0;
  st->message = malloc((size_t)n + 1);
  if (!st->message) {
    free(st);
    return &status_oom;
  }
  vsnprintf(st->message, (size_t)n + 1, fmt, ap);
  st->code = code;
  st->is_static = 0;
  return st;
}

kiln_status_t kiln_status_make(kiln_status_code_t code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_status_t st = kiln_status_makev(code, fmt, ap);
  va_end(ap);
  return st;
}

kiln_status_t kiln_status_annotate(kiln_status_t st, const char *fmt, ...) {
  if (!st || st->is_static) return st;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) return st;
  size_t old = strlen(st->message);
  char *msg = malloc((size_t)n + 2 + old + 1);
  if (!msg) return st; /* keep the original message rather than lose it */
  va_start(ap, fmt);
  vsnprintf(msg, (size_t)n + 1, fmt, ap);
  va_end(ap);
  memcpy(msg + n, ": ", 2);
  memcpy(msg + n + 2, st->message, old + 1);
  free(st->message);
  st->message = msg;
  return st;
}

kiln_status_code_t kiln_status_code(const kiln_status_t st) { return st ? st->code : KILN_OK; }

const char *kiln_status_message(const kiln_status_t st) { return st ? st->message : "ok"; }

const char *kiln_status_code_name(kiln_status_code_t code) {
  switch (code) {
    case KILN_OK: return "OK";
    case KILN_ERR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case KILN_ERR_NOT_FOUND: return "NOT_FOUND";
    case KILN_ERR_OUT_OF_MEMORY: return "OUT_OF_MEMORY";
    case KILN_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case KILN_ERR_IO: return "IO";
    case KILN_ERR_INCOMPATIBLE: return "INCOMPATIBLE";
    case KILN_ERR_DEVICE: return "DEVICE";
    case KILN_ERR_INTERNAL: return "INTERNAL";
    case KILN_ERR_UNAVAILABLE: return "UNAVAILABLE";
  }
  return "UNKNOWN";
}

void kiln_status_free(kiln_status_t st) {
  if (!st || st->is_static) return;
  free(st->message);
  free(st);
}
