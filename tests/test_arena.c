/* test_arena.c - cmocka tests for base/arena: alignment, many small allocations, huge ones,
 * strndup, free and reuse, byte accounting, the limit, size hints and overflow. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "base/arena.h"

static void test_empty_is_valid(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  assert_int_equal(kiln_arena_bytes(&a), 0);
  kiln_arena_free(&a);
  kiln_arena_free(&a); /* twice is fine */
  assert_int_equal(kiln_arena_bytes(&a), 0);
  /* Size 0 still gives a usable (non-NULL) pointer. */
  assert_non_null(kiln_arena_alloc(&a, 0, 1));
  assert_non_null(kiln_arena_alloc(&a, 0, 16));
  kiln_arena_free(&a);
}

static void test_alignment(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  /* Odd sizes between aligned requests: every alignment up to the maximum is honoured, also
   * across chunk boundaries (enough rounds to fill several chunks). */
  for (int round = 0; round < 2000; round++) {
    for (size_t align = 1; align <= KILN_ARENA_MAX_ALIGN; align *= 2) {
      size_t size = (size_t)(round % 13) + 1;
      unsigned char *p = kiln_arena_alloc(&a, size, align);
      assert_non_null(p);
      assert_int_equal((uintptr_t)p % align, 0);
      memset(p, 0xAB, size);
    }
  }
  kiln_arena_free(&a);
}

static void test_many_small(void **state) {
  (void)state;
  enum { N = 200000 };
  kiln_arena_t a = KILN_ARENA_INIT;
  unsigned char **ptrs = malloc(N * sizeof *ptrs);
  assert_non_null(ptrs);
  size_t requested = 0;
  for (size_t i = 0; i < N; i++) {
    size_t size = i % 61 + 1;
    ptrs[i] = kiln_arena_alloc(&a, size, 1);
    assert_non_null(ptrs[i]);
    memset(ptrs[i], (int)(i & 0xFF), size);
    requested += size;
  }
  /* Nothing overlapped: every block still holds its own pattern. */
  for (size_t i = 0; i < N; i++) {
    size_t size = i % 61 + 1;
    for (size_t k = 0; k < size; k++) assert_int_equal(ptrs[i][k], i & 0xFF);
  }
  /* Geometric chunks waste little: at most a quarter of each chunk's tail plus one chunk. */
  size_t held = kiln_arena_bytes(&a);
  assert_true(held >= requested);
  assert_true(held <= requested + requested / 2 + KILN_ARENA_MAX_CHUNK);
  free(ptrs);
  kiln_arena_free(&a);
}

static void test_huge(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  char *before = kiln_arena_alloc(&a, 10, 1);
  assert_non_null(before);
  size_t held = kiln_arena_bytes(&a);
  size_t big = 8 * KILN_ARENA_MAX_CHUNK + 3;
  unsigned char *p = kiln_arena_alloc(&a, big, 16);
  assert_non_null(p);
  assert_int_equal((uintptr_t)p % 16, 0);
  p[0] = 1;
  p[big - 1] = 2;
  /* It got a chunk of its own, and the small chunk keeps filling after it. */
  assert_true(kiln_arena_bytes(&a) >= held + big);
  assert_true(kiln_arena_bytes(&a) <= held + big + 64);
  char *after = kiln_arena_alloc(&a, 10, 1);
  assert_ptr_equal(after, before + 10);
  kiln_arena_free(&a);
}

static void test_strndup(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  static const char src[] = "ab\0cd\0";
  char *d = kiln_arena_strndup(&a, src, 5); /* the embedded NUL is copied, not a stop */
  assert_non_null(d);
  assert_memory_equal(d, "ab\0cd", 5);
  assert_int_equal(d[5], '\0');
  char *e = kiln_arena_strndup(&a, "xyz", 2);
  assert_string_equal(e, "xy");
  char *z = kiln_arena_strndup(&a, NULL, 0);
  assert_non_null(z);
  assert_string_equal(z, "");
  assert_memory_equal(d, "ab\0cd", 6); /* later copies did not touch the first */
  kiln_arena_free(&a);
}

static void test_zalloc(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  /* Dirty memory, freed and handed out again (malloc likely recycles it) comes back zeroed. */
  memset(kiln_arena_alloc(&a, 3000, 1), 0xFF, 3000);
  kiln_arena_free(&a);
  unsigned char *p = kiln_arena_zalloc(&a, 3000, 8);
  assert_non_null(p);
  for (size_t i = 0; i < 3000; i++) assert_int_equal(p[i], 0);
  kiln_arena_free(&a);
}

static void test_free_and_reuse(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < 5000; i++) assert_non_null(kiln_arena_alloc(&a, 100, 8));
    assert_non_null(kiln_arena_alloc(&a, 3 * KILN_ARENA_MAX_CHUNK, 8));
    assert_true(kiln_arena_bytes(&a) > 0);
    kiln_arena_free(&a);
    assert_int_equal(kiln_arena_bytes(&a), 0);
    assert_null(a.head);
  }
  /* After a free the arena starts small again. */
  assert_non_null(kiln_arena_alloc(&a, 1, 1));
  assert_true(kiln_arena_bytes(&a) <= KILN_ARENA_MIN_CHUNK + 64);
  kiln_arena_free(&a);
}

static void test_bytes_accounting(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  assert_non_null(kiln_arena_alloc(&a, 1, 1));
  size_t first = kiln_arena_bytes(&a);
  assert_true(first >= KILN_ARENA_MIN_CHUNK && first <= KILN_ARENA_MIN_CHUNK + 64);
  /* Allocations inside the chunk cost nothing more; bytes never shrink; chunk sizes double. */
  assert_non_null(kiln_arena_alloc(&a, 100, 1));
  assert_int_equal(kiln_arena_bytes(&a), first);
  size_t last = first, chunks = 1;
  for (int i = 0; i < 20000; i++) {
    assert_non_null(kiln_arena_alloc(&a, 512, 8));
    size_t now = kiln_arena_bytes(&a);
    assert_true(now >= last);
    if (now != last) {
      chunks++;
      assert_true(now - last <= KILN_ARENA_MAX_CHUNK + 64); /* regular chunks stop at the cap */
    }
    last = now;
  }
  /* 10 MB in chunks that double from 4 KiB to 1 MiB: a handful, not thousands. */
  assert_true(chunks < 30);
  kiln_arena_free(&a);
}

static void test_limit(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  a.limit = 100000;
  size_t got = 0;
  while (kiln_arena_alloc(&a, 1000, 8)) got += 1000;
  assert_true(a.limit_hit);
  assert_true(kiln_arena_bytes(&a) <= a.limit);
  /* Near the limit chunks shrink to what is left, so nearly all of it is usable. */
  assert_true(got >= 90000);
  /* A request beyond the limit fails at once, whatever its size. */
  a.limit_hit = false;
  assert_null(kiln_arena_alloc(&a, SIZE_MAX / 4, 1));
  assert_true(a.limit_hit);
  /* free keeps the limit and clears the flag. */
  kiln_arena_free(&a);
  assert_false(a.limit_hit);
  assert_int_equal(a.limit, 100000);
  assert_null(kiln_arena_alloc(&a, 200000, 1));
  assert_true(a.limit_hit);
  assert_int_equal(kiln_arena_bytes(&a), 0);
  kiln_arena_free(&a);
}

static void test_expect(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  kiln_arena_expect(&a, 3 << 20);
  assert_non_null(kiln_arena_alloc(&a, 1, 1));
  size_t held = kiln_arena_bytes(&a);
  assert_true(held >= (3u << 20) && held <= (3u << 20) + 64);
  /* The whole expected size is served from that one chunk. */
  for (int i = 0; i < 3000; i++) assert_non_null(kiln_arena_alloc(&a, 1000, 8));
  assert_int_equal(kiln_arena_bytes(&a), held);
  kiln_arena_free(&a);
  /* Absurd hints are clamped (and the limit still applies). */
  kiln_arena_expect(&a, SIZE_MAX);
  assert_non_null(kiln_arena_alloc(&a, 1, 1));
  assert_true(kiln_arena_bytes(&a) <= KILN_ARENA_MAX_EXPECT + 64);
  kiln_arena_free(&a);
  a.limit = 1 << 20;
  kiln_arena_expect(&a, 8 << 20);
  assert_non_null(kiln_arena_alloc(&a, 1, 1));
  assert_true(kiln_arena_bytes(&a) <= a.limit);
  kiln_arena_free(&a);
}

static void test_overflow(void **state) {
  (void)state;
  kiln_arena_t a = KILN_ARENA_INIT;
  /* On an empty arena and on one with a partly filled head: sizes that cannot exist fail
   * without touching the arena (no wrapped size reaches malloc). */
  for (int round = 0; round < 2; round++) {
    size_t held = kiln_arena_bytes(&a);
    assert_null(kiln_arena_alloc(&a, SIZE_MAX, 1));
    assert_null(kiln_arena_alloc(&a, SIZE_MAX, 16));
    assert_null(kiln_arena_alloc(&a, SIZE_MAX - 15, 16));
    assert_null(kiln_arena_alloc(&a, SIZE_MAX - 40, 1)); /* would wrap with a chunk header */
    assert_null(kiln_arena_alloc(&a, (size_t)PTRDIFF_MAX, 1));
    assert_null(kiln_arena_zalloc(&a, SIZE_MAX, 8));
    assert_null(kiln_arena_strndup(&a, "x", SIZE_MAX));
    assert_false(a.limit_hit);
    assert_int_equal(kiln_arena_bytes(&a), held);
    char *p = kiln_arena_alloc(&a, 3, 1); /* still usable */
    assert_non_null(p);
    memcpy(p, "ok", 3);
  }
  kiln_arena_free(&a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_empty_is_valid), cmocka_unit_test(test_alignment),
      cmocka_unit_test(test_many_small),     cmocka_unit_test(test_huge),
      cmocka_unit_test(test_strndup),        cmocka_unit_test(test_zalloc),
      cmocka_unit_test(test_free_and_reuse), cmocka_unit_test(test_bytes_accounting),
      cmocka_unit_test(test_limit),          cmocka_unit_test(test_expect),
      cmocka_unit_test(test_overflow),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
