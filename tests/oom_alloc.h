/* oom_alloc.h - a heap that fails on demand, for out-of-memory tests (SQLite's and libuv's
 * habit): the test executable is linked with -Wl,--wrap=malloc,... so that every allocation
 * made by the Kiln objects compiled into it goes through the counting wrappers in oom_alloc.c.
 *
 * Armed with oom_alloc_arm(n, sticky), the wrappers let n allocations through and fail the
 * next one (returning NULL, as an exhausted heap would); with sticky set, every allocation
 * after it fails too. Disarmed (the default), they only pass through.
 *
 * Only the objects linked into the executable are wrapped: allocations inside shared libraries
 * (libc's own fopen/realpath/newlocale, inih, PCRE2, utf8proc, dlopen, cmocka) are not counted
 * and never fail. Not thread-safe: arm, run one operation on one thread, disarm.
 */
#ifndef KILN_TESTS_OOM_ALLOC_H
#define KILN_TESTS_OOM_ALLOC_H

#include <stdbool.h>

/* Lets the next `pass` allocations through and fails the one after (and, when sticky, all
 * later ones) until oom_alloc_disarm(). A negative pass never fails: it only counts. */
void oom_alloc_arm(long pass, bool sticky);

/* Stops failing. Returns the number of allocations attempted since oom_alloc_arm() (failed ones
 * included). */
long oom_alloc_disarm(void);

/* Number of allocations that were made to fail since the last oom_alloc_arm(). */
long oom_alloc_failures(void);

#endif /* KILN_TESTS_OOM_ALLOC_H */
