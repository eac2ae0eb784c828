/* oom_alloc.c - the --wrap'ed allocation functions behind oom_alloc.h. */
#define _GNU_SOURCE /* the prototypes of strdup, strndup, posix_memalign */
#include "oom_alloc.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* The real functions, reached through the linker's --wrap renaming. */
void *__real_malloc(size_t size);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t size);
char *__real_strdup(const char *s);
char *__real_strndup(const char *s, size_t n);
int __real_posix_memalign(void **out, size_t align, size_t size);
void *__real_aligned_alloc(size_t align, size_t size);

/* The wrappers: defined here, called by every object linked with --wrap=<name>. */
void *__wrap_malloc(size_t size);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t size);
char *__wrap_strdup(const char *s);
char *__wrap_strndup(const char *s, size_t n);
int __wrap_posix_memalign(void **out, size_t align, size_t size);
void *__wrap_aligned_alloc(size_t align, size_t size);

static bool oom_armed;
static bool oom_sticky;
static long oom_pass;     /* allocations still let through before the failing one */
static long oom_count;    /* allocations attempted since arming */
static long oom_failures; /* allocations failed since arming */

void oom_alloc_arm(long pass, bool sticky) {
  oom_armed = pass >= 0;
  oom_sticky = sticky;
  oom_pass = pass;
  oom_count = 0;
  oom_failures = 0;
}

long oom_alloc_disarm(void) {
  oom_armed = false;
  return oom_count;
}

long oom_alloc_failures(void) { return oom_failures; }

/* True when this allocation is to fail. */
static bool oom_fail_now(void) {
  oom_count++;
  if (!oom_armed) return false;
  if (oom_pass > 0) {
    oom_pass--;
    return false;
  }
  if (!oom_sticky) oom_armed = false;
  oom_failures++;
  errno = ENOMEM;
  return true;
}

void *__wrap_malloc(size_t size) { return oom_fail_now() ? NULL : __real_malloc(size); }

void *__wrap_calloc(size_t n, size_t size) {
  return oom_fail_now() ? NULL : __real_calloc(n, size);
}

/* A failed realloc leaves the old block alone, as the real one does. */
void *__wrap_realloc(void *p, size_t size) {
  return oom_fail_now() ? NULL : __real_realloc(p, size);
}

char *__wrap_strdup(const char *s) { return oom_fail_now() ? NULL : __real_strdup(s); }

char *__wrap_strndup(const char *s, size_t n) {
  return oom_fail_now() ? NULL : __real_strndup(s, n);
}

int __wrap_posix_memalign(void **out, size_t align, size_t size) {
  return oom_fail_now() ? ENOMEM : __real_posix_memalign(out, align, size);
}

void *__wrap_aligned_alloc(size_t align, size_t size) {
  return oom_fail_now() ? NULL : __real_aligned_alloc(align, size);
}
