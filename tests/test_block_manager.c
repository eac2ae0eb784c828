/* test_block_manager.c - the KV block manager (core/kv) and the scheduler (core/sched) on their
 * own, without an engine or a model.
 *
 * Block manager: creation errors, exhaustion, the free list's order (unhashed blocks are reused
 * first, cached ones last and least recently freed first), the prefix cache (commit, lookup,
 * revival of a free cached block, eviction, duplicate hashes, peek, reset), copy-on-write, the
 * hash chain, and a randomized stress run against a model of the manager kept in the test
 * (per-block reference counts, hashes and the exact free list), with kiln_kv_check after every
 * operation. KILN_TEST_SEED repeats a run (default: the time; the seed is printed).
 *
 * Scheduler: prefix reuse at admission (never the whole prompt), chunked prefill sharing steps
 * with decodes, whole-prompt admission without it, preemption by recompute, FCFS and priority
 * order, max_num_seqs with the slots promised to the forks of n > 1 prompts, and the
 * copy-on-write of a fork's shared last block.
 */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "core/kv/block_manager.h"
#include "core/sched/scheduler.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Fails with the status's message (and frees it) when st is not NULL. */
#define ASSERT_OK(expr)                                                   \
  do {                                                                    \
    kiln_status_t st_ = (expr);                                           \
    if (st_) {                                                            \
      char msg_[512];                                                     \
      snprintf(msg_, sizeof(msg_), "%s", kiln_status_message(st_));       \
      kiln_status_free(st_);                                              \
      fail_msg("%s: %s", #expr, msg_);                                    \
    }                                                                     \
  } while (0)

static kiln_kv_hash_t hash_of(uint64_t key) {
  int32_t t[2] = {(int32_t)key, (int32_t)(key >> 32)};
  return kiln_kv_hash_block(NULL, t, 2, 0xabcdefull);
}

static bool hash_eq(kiln_kv_hash_t a, kiln_kv_hash_t b) { return a.lo == b.lo && a.hi == b.hi; }

static kiln_kv_manager_t *make_kv(int32_t nb, int32_t bs, bool prefix) {
  kiln_kv_manager_t *m = NULL;
  ASSERT_OK(kiln_kv_manager_create(nb, bs, prefix, &m));
  assert_non_null(m);
  ASSERT_OK(kiln_kv_check(m));
  return m;
}

static void check_kv(const kiln_kv_manager_t *m) { ASSERT_OK(kiln_kv_check(m)); }

/* ---- block manager ------------------------------------------------------------------------ */

static void test_create_errors(void **state) {
  (void)state;
  static const int32_t bad[][2] = {{0, 16}, {-1, 16}, {(1 << 30) + 1, 16}, {4, 0}, {4, -3},
                                   {4, 4097}, {0, 0}};
  for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
    kiln_kv_manager_t *m = (kiln_kv_manager_t *)&m; /* must be reset to NULL */
    kiln_status_t st = kiln_kv_manager_create(bad[i][0], bad[i][1], true, &m);
    assert_non_null(st);
    assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
    assert_true(kiln_status_message(st)[0] != '\0');
    assert_null(m);
    kiln_status_free(st);
  }
  /* The bounds themselves are fine. */
  kiln_kv_manager_t *m = make_kv(1, 4096, false);
  assert_int_equal(kiln_kv_num_blocks(m), 1);
  assert_int_equal(kiln_kv_block_size(m), 4096);
  assert_int_equal(kiln_kv_num_free(m), 1);
  assert_false(kiln_kv_prefix_caching(m));
  kiln_kv_manager_free(m);
  m = make_kv(3, 1, true);
  assert_true(kiln_kv_prefix_caching(m));
  kiln_kv_stats_t s;
  kiln_kv_stats(m, &s);
  assert_int_equal(s.num_blocks, 3);
  assert_int_equal(s.num_free, 3);
  assert_int_equal(s.num_cached, 0);
  assert_int_equal(s.evictions, 0);
  assert_int_equal(s.lookups, 0);
  assert_int_equal(s.hits, 0);
  kiln_kv_manager_free(m);
  kiln_kv_manager_free(NULL);
}

static void test_alloc_until_exhausted(void **state) {
  (void)state;
  const int32_t NB = 5;
  kiln_kv_manager_t *m = make_kv(NB, 16, true);
  bool seen[5] = {false};
  for (int32_t i = 0; i < NB; i++) {
    int32_t b = kiln_kv_alloc(m);
    assert_true(b >= 0 && b < NB);
    assert_false(seen[b]);
    seen[b] = true;
    assert_int_equal(kiln_kv_refcount(m, b), 1);
    assert_int_equal(kiln_kv_num_free(m), NB - 1 - i);
    check_kv(m);
  }
  assert_int_equal(kiln_kv_alloc(m), -1);
  assert_int_equal(kiln_kv_alloc(m), -1);
  assert_int_equal(kiln_kv_num_free(m), 0);
  check_kv(m);
  /* One back, one out again. */
  kiln_kv_release(m, 3);
  assert_int_equal(kiln_kv_num_free(m), 1);
  assert_int_equal(kiln_kv_alloc(m), 3);
  assert_int_equal(kiln_kv_alloc(m), -1);
  for (int32_t b = 0; b < NB; b++) kiln_kv_release(m, b);
  assert_int_equal(kiln_kv_num_free(m), NB);
  check_kv(m);
  kiln_kv_manager_free(m);
}

static void test_release_order_lru(void **state) {
  (void)state;
  const int32_t NB = 8;
  kiln_kv_manager_t *m = make_kv(NB, 4, true);
  for (int32_t i = 0; i < NB; i++) assert_int_equal(kiln_kv_alloc(m), i); /* a fresh pool: 0.. */
  kiln_kv_hash_t h0 = hash_of(100), h1 = hash_of(101), h2 = hash_of(102);
  assert_true(kiln_kv_commit(m, 0, h0));
  assert_true(kiln_kv_commit(m, 1, h1));
  assert_true(kiln_kv_commit(m, 2, h2));
  /* Freed: cached 1, raw 5, cached 0, raw 6, cached 2. Free list: 6 5 | 1 0 2. */
  kiln_kv_release(m, 1);
  kiln_kv_release(m, 5);
  kiln_kv_release(m, 0);
  kiln_kv_release(m, 6);
  kiln_kv_release(m, 2);
  check_kv(m);
  kiln_kv_stats_t s;
  kiln_kv_stats(m, &s);
  assert_int_equal(s.num_free, 5);
  assert_int_equal(s.num_cached, 3);
  /* The raw blocks first, most recently freed first. */
  assert_int_equal(kiln_kv_alloc(m), 6);
  assert_int_equal(kiln_kv_alloc(m), 5);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.evictions, 0);
  assert_int_equal(s.num_cached, 3);
  /* Then the cached ones, least recently freed first, each an eviction. */
  assert_int_equal(kiln_kv_peek(m, h1), 1);
  assert_int_equal(kiln_kv_alloc(m), 1);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.evictions, 1);
  assert_int_equal(s.num_cached, 2);
  assert_int_equal(kiln_kv_peek(m, h1), -1);
  assert_int_equal(kiln_kv_peek(m, h0), 0);
  assert_int_equal(kiln_kv_peek(m, h2), 2);
  assert_int_equal(kiln_kv_alloc(m), 0);
  assert_int_equal(kiln_kv_alloc(m), 2);
  assert_int_equal(kiln_kv_alloc(m), -1);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.evictions, 3);
  assert_int_equal(s.num_cached, 0);
  assert_int_equal(kiln_kv_lookup(m, h0), -1);
  check_kv(m);
  /* A lookup hit in the middle of the cached part leaves the others in order. */
  for (int32_t b = 0; b < 4; b++) assert_true(kiln_kv_commit(m, b, hash_of(200 + (uint64_t)b)));
  for (int32_t b = 0; b < 4; b++) kiln_kv_release(m, b); /* free list: 0 1 2 3 */
  assert_int_equal(kiln_kv_lookup(m, hash_of(201)), 1);
  kiln_kv_release(m, 1); /* to the tail: 0 2 3 1 */
  assert_int_equal(kiln_kv_alloc(m), 0);
  assert_int_equal(kiln_kv_alloc(m), 2);
  assert_int_equal(kiln_kv_alloc(m), 3);
  assert_int_equal(kiln_kv_alloc(m), 1);
  check_kv(m);
  for (int32_t b = 0; b < NB; b++) kiln_kv_release(m, b);
  kiln_kv_manager_free(m);
}

static void test_commit_lookup(void **state) {
  (void)state;
  kiln_kv_manager_t *m = make_kv(4, 4, true);
  int32_t a = kiln_kv_alloc(m), b = kiln_kv_alloc(m);
  kiln_kv_hash_t h = hash_of(7), other = hash_of(8);
  assert_true(kiln_kv_commit(m, a, h));
  assert_false(kiln_kv_commit(m, a, other)); /* already hashed */
  kiln_kv_stats_t s;
  kiln_kv_stats(m, &s);
  assert_int_equal(s.num_cached, 1);
  /* A hit on an in-use block: one more reference. */
  assert_int_equal(kiln_kv_lookup(m, h), a);
  assert_int_equal(kiln_kv_refcount(m, a), 2);
  assert_int_equal(kiln_kv_lookup(m, other), -1);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.lookups, 2);
  assert_int_equal(s.hits, 1);
  assert_int_equal(s.num_free, 2);
  check_kv(m);
  /* The last release keeps it findable; a lookup revives it out of the free list. */
  kiln_kv_release(m, a);
  kiln_kv_release(m, a);
  assert_int_equal(kiln_kv_refcount(m, a), 0);
  assert_int_equal(kiln_kv_num_free(m), 3);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.num_cached, 1);
  check_kv(m);
  assert_int_equal(kiln_kv_lookup(m, h), a);
  assert_int_equal(kiln_kv_refcount(m, a), 1);
  assert_int_equal(kiln_kv_num_free(m), 2);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.lookups, 3);
  assert_int_equal(s.hits, 2);
  assert_int_equal(s.evictions, 0);
  check_kv(m);
  /* The revived block is not handed out by alloc. */
  int32_t c = kiln_kv_alloc(m), d = kiln_kv_alloc(m);
  assert_true(c != a && d != a && c != b && d != b && c != d);
  assert_int_equal(kiln_kv_alloc(m), -1);
  /* Commit of a free block does nothing. */
  kiln_kv_release(m, d);
  assert_false(kiln_kv_commit(m, d, other));
  assert_int_equal(kiln_kv_peek(m, other), -1);
  kiln_kv_release(m, a);
  kiln_kv_release(m, b);
  kiln_kv_release(m, c);
  check_kv(m);
  kiln_kv_manager_free(m);
}

static void test_alloc_evicts(void **state) {
  (void)state;
  kiln_kv_manager_t *m = make_kv(1, 8, true);
  int32_t a = kiln_kv_alloc(m);
  kiln_kv_hash_t h = hash_of(1);
  assert_true(kiln_kv_commit(m, a, h));
  kiln_kv_release(m, a);
  assert_int_equal(kiln_kv_peek(m, h), a);
  assert_int_equal(kiln_kv_alloc(m), a); /* the only block: the cached one goes */
  kiln_kv_stats_t s;
  kiln_kv_stats(m, &s);
  assert_int_equal(s.evictions, 1);
  assert_int_equal(s.num_cached, 0);
  assert_int_equal(kiln_kv_lookup(m, h), -1);
  assert_int_equal(kiln_kv_refcount(m, a), 1);
  /* The hash can be committed anew (by this block). */
  assert_true(kiln_kv_commit(m, a, h));
  kiln_kv_release(m, a);
  assert_int_equal(kiln_kv_lookup(m, h), a);
  kiln_kv_release(m, a);
  check_kv(m);
  kiln_kv_manager_free(m);
}

static void test_commit_duplicate(void **state) {
  (void)state;
  kiln_kv_manager_t *m = make_kv(4, 4, true);
  int32_t a = kiln_kv_alloc(m), b = kiln_kv_alloc(m), c = kiln_kv_alloc(m);
  kiln_kv_hash_t h = hash_of(42);
  assert_true(kiln_kv_commit(m, a, h));
  assert_false(kiln_kv_commit(m, b, h)); /* the first copy wins */
  kiln_kv_stats_t s;
  kiln_kv_stats(m, &s);
  assert_int_equal(s.num_cached, 1);
  assert_int_equal(kiln_kv_peek(m, h), a);
  check_kv(m);
  /* b stayed unhashed: freed, it goes to the head (reused before anything else). */
  kiln_kv_release(m, a);
  kiln_kv_release(m, b);
  assert_int_equal(kiln_kv_alloc(m), b);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.evictions, 0);
  /* b can take another hash. */
  assert_true(kiln_kv_commit(m, b, hash_of(43)));
  assert_int_equal(kiln_kv_peek(m, h), a);
  kiln_kv_release(m, b);
  kiln_kv_release(m, c);
  check_kv(m);
  kiln_kv_manager_free(m);
}

static void test_cow(void **state) {
  (void)state;
  kiln_kv_manager_t *m = make_kv(3, 4, true);
  int32_t a = kiln_kv_alloc(m);
  kiln_kv_ref(m, a);
  kiln_kv_ref(m, a);
  assert_int_equal(kiln_kv_refcount(m, a), 3);
  int32_t n1 = kiln_kv_cow(m, a);
  assert_true(n1 >= 0 && n1 != a);
  assert_int_equal(kiln_kv_refcount(m, n1), 1);
  assert_int_equal(kiln_kv_refcount(m, a), 2);
  assert_int_equal(kiln_kv_num_free(m), 1);
  check_kv(m);
  int32_t n2 = kiln_kv_cow(m, a);
  assert_true(n2 >= 0 && n2 != a && n2 != n1);
  assert_int_equal(kiln_kv_refcount(m, a), 1);
  assert_int_equal(kiln_kv_num_free(m), 0);
  /* Pool empty: -1 and nothing changes. */
  kiln_kv_ref(m, a);
  assert_int_equal(kiln_kv_cow(m, a), -1);
  assert_int_equal(kiln_kv_refcount(m, a), 2);
  assert_int_equal(kiln_kv_refcount(m, n1), 1);
  assert_int_equal(kiln_kv_refcount(m, n2), 1);
  assert_int_equal(kiln_kv_num_free(m), 0);
  check_kv(m);
  kiln_kv_release(m, a);
  kiln_kv_release(m, a);
  kiln_kv_release(m, n1);
  kiln_kv_release(m, n2);
  assert_int_equal(kiln_kv_num_free(m), 3);
  check_kv(m);
  kiln_kv_manager_free(m);
}

static void test_peek(void **state) {
  (void)state;
  kiln_kv_manager_t *m = make_kv(2, 4, true);
  int32_t a = kiln_kv_alloc(m);
  kiln_kv_hash_t h = hash_of(5);
  assert_int_equal(kiln_kv_peek(m, h), -1);
  assert_true(kiln_kv_commit(m, a, h));
  assert_int_equal(kiln_kv_peek(m, h), a);
  assert_int_equal(kiln_kv_peek(m, h), a);
  assert_int_equal(kiln_kv_refcount(m, a), 1);
  kiln_kv_release(m, a);
  assert_int_equal(kiln_kv_peek(m, h), a); /* free and cached: still free after a peek */
  assert_int_equal(kiln_kv_refcount(m, a), 0);
  assert_int_equal(kiln_kv_num_free(m), 2);
  kiln_kv_stats_t s;
  kiln_kv_stats(m, &s);
  assert_int_equal(s.lookups, 0);
  assert_int_equal(s.hits, 0);
  check_kv(m);
  kiln_kv_manager_free(m);
}

static void test_prefix_caching_off(void **state) {
  (void)state;
  kiln_kv_manager_t *m = make_kv(2, 4, false);
  int32_t a = kiln_kv_alloc(m), b = kiln_kv_alloc(m);
  kiln_kv_hash_t h = hash_of(9);
  assert_false(kiln_kv_commit(m, a, h));
  assert_int_equal(kiln_kv_lookup(m, h), -1);
  assert_int_equal(kiln_kv_peek(m, h), -1);
  assert_int_equal(kiln_kv_refcount(m, a), 1);
  kiln_kv_stats_t s;
  kiln_kv_stats(m, &s);
  assert_int_equal(s.num_cached, 0);
  assert_int_equal(s.hits, 0);
  /* Everything freed goes to the head: the last freed is the next taken. */
  kiln_kv_release(m, a);
  kiln_kv_release(m, b);
  assert_int_equal(kiln_kv_alloc(m), b);
  assert_int_equal(kiln_kv_alloc(m), a);
  kiln_kv_release(m, a);
  kiln_kv_release(m, b);
  check_kv(m);
  kiln_kv_manager_free(m);
}

static void test_hash_chain(void **state) {
  (void)state;
  int32_t t[4] = {11, 22, 33, 44};
  kiln_kv_hash_t h = kiln_kv_hash_block(NULL, t, 4, 0);
  assert_true(hash_eq(h, kiln_kv_hash_block(NULL, t, 4, 0))); /* deterministic */
  kiln_kv_hash_t zero = {0, 0};
  assert_true(hash_eq(h, kiln_kv_hash_block(&zero, t, 4, 0))); /* no parent = zero parent */
  /* The parent, every token, the token count and the extra key all matter. */
  kiln_kv_hash_t p = hash_of(1), p2 = hash_of(2);
  kiln_kv_hash_t hp = kiln_kv_hash_block(&p, t, 4, 0);
  assert_false(hash_eq(h, hp));
  assert_false(hash_eq(hp, kiln_kv_hash_block(&p2, t, 4, 0)));
  for (int32_t i = 0; i < 4; i++) {
    int32_t u[4];
    memcpy(u, t, sizeof(u));
    u[i]++;
    assert_false(hash_eq(h, kiln_kv_hash_block(NULL, u, 4, 0)));
    assert_false(hash_eq(hp, kiln_kv_hash_block(&p, u, 4, 0)));
  }
  assert_false(hash_eq(h, kiln_kv_hash_block(NULL, t, 3, 0)));
  assert_false(hash_eq(h, kiln_kv_hash_block(NULL, t, 4, 1)));
  assert_false(hash_eq(hp, kiln_kv_hash_block(&p, t, 4, 0x5a17)));
  /* A chain names the whole prefix: the same second block after different first blocks. */
  int32_t u[4] = {11, 22, 33, 45};
  kiln_kv_hash_t c1 = kiln_kv_hash_block(NULL, t, 4, 0), d1 = kiln_kv_hash_block(NULL, u, 4, 0);
  int32_t second[4] = {1, 2, 3, 4};
  assert_false(hash_eq(kiln_kv_hash_block(&c1, second, 4, 0), kiln_kv_hash_block(&d1, second, 4, 0)));
}

static void test_reset_cache(void **state) {
  (void)state;
  kiln_kv_manager_t *m = make_kv(6, 4, true);
  int32_t b[6];
  for (int32_t i = 0; i < 6; i++) b[i] = kiln_kv_alloc(m);
  for (int32_t i = 0; i < 4; i++) assert_true(kiln_kv_commit(m, b[i], hash_of((uint64_t)i)));
  /* b0, b1: free and cached; b2: in use and cached; b3: free and cached; b4: free raw. */
  kiln_kv_release(m, b[0]);
  kiln_kv_release(m, b[1]);
  kiln_kv_release(m, b[3]);
  kiln_kv_release(m, b[4]);
  kiln_kv_reset_cache(m);
  check_kv(m);
  kiln_kv_stats_t s;
  kiln_kv_stats(m, &s);
  assert_int_equal(s.num_cached, 1); /* the in-use block keeps its hash */
  assert_int_equal(s.num_free, 4);
  assert_int_equal(kiln_kv_peek(m, hash_of(0)), -1);
  assert_int_equal(kiln_kv_peek(m, hash_of(1)), -1);
  assert_int_equal(kiln_kv_peek(m, hash_of(3)), -1);
  assert_int_equal(kiln_kv_peek(m, hash_of(2)), b[2]);
  assert_int_equal(kiln_kv_refcount(m, b[2]), 1);
  /* The reset blocks are plain free blocks now: taking all four evicts nothing. */
  for (int32_t i = 0; i < 4; i++) assert_true(kiln_kv_alloc(m) >= 0);
  assert_int_equal(kiln_kv_alloc(m), -1);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.evictions, 0);
  for (int32_t i = 0; i < 6; i++) kiln_kv_release(m, i);
  assert_int_equal(kiln_kv_num_free(m), 6);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.num_cached, 1); /* b2 freed with its hash */
  kiln_kv_reset_cache(m);
  kiln_kv_stats(m, &s);
  assert_int_equal(s.num_cached, 0);
  check_kv(m);
  kiln_kv_manager_free(m);
}

/* ---- randomized stress against a model ---------------------------------------------------- */

static uint64_t g_seed, g_rng;

static uint64_t rng_u64(void) {
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static int32_t rng_int(int32_t n) { return (int32_t)(rng_u64() % (uint64_t)n); }

static int group_setup(void **state) {
  (void)state;
  const char *env = getenv("KILN_TEST_SEED");
  g_seed = env && env[0] ? strtoull(env, NULL, 10) : (uint64_t)time(NULL);
  printf("test_block_manager: seed %llu (set KILN_TEST_SEED=%llu to reproduce)\n",
         (unsigned long long)g_seed, (unsigned long long)g_seed);
  fflush(stdout);
  return 0;
}

#define MAX_NB 24
#define NUM_KEYS 40

/* The manager as the header describes it. */
typedef struct model {
  int32_t nb;
  bool prefix;
  int32_t ref[MAX_NB];
  int32_t key[MAX_NB]; /* hash key held, or -1 */
  int32_t free_list[MAX_NB];
  int32_t num_free;
  uint64_t evictions, lookups, hits;
} model_t;

static void model_remove(model_t *md, int32_t b) {
  for (int32_t i = 0; i < md->num_free; i++)
    if (md->free_list[i] == b) {
      memmove(md->free_list + i, md->free_list + i + 1,
              (size_t)(md->num_free - i - 1) * sizeof(int32_t));
      md->num_free--;
      return;
    }
  fail_msg("model: block %d is not in the free list", b);
}

static void model_push_head(model_t *md, int32_t b) {
  memmove(md->free_list + 1, md->free_list, (size_t)md->num_free * sizeof(int32_t));
  md->free_list[0] = b;
  md->num_free++;
}

static void model_push_tail(model_t *md, int32_t b) { md->free_list[md->num_free++] = b; }

static int32_t model_alloc(model_t *md) {
  if (!md->num_free) return -1;
  int32_t b = md->free_list[0];
  model_remove(md, b);
  if (md->key[b] >= 0) {
    md->key[b] = -1;
    md->evictions++;
  }
  md->ref[b] = 1;
  return b;
}

static void model_release(model_t *md, int32_t b) {
  if (--md->ref[b] > 0) return;
  if (md->key[b] >= 0)
    model_push_tail(md, b);
  else
    model_push_head(md, b);
}

static int32_t model_find(const model_t *md, int32_t key) {
  if (!md->prefix) return -1;
  for (int32_t b = 0; b < md->nb; b++)
    if (md->key[b] == key) return b;
  return -1;
}

/* A random in-use block (with ref >= min_ref), or -1. */
static int32_t model_pick_used(const model_t *md, int32_t min_ref) {
  int32_t cand[MAX_NB], n = 0;
  for (int32_t b = 0; b < md->nb; b++)
    if (md->ref[b] >= min_ref && md->ref[b] > 0) cand[n++] = b;
  return n ? cand[rng_int(n)] : -1;
}

static void model_compare(const model_t *md, const kiln_kv_manager_t *m, long op, const char *what) {
  kiln_status_t st = kiln_kv_check(m);
  if (st) {
    char msg[512];
    snprintf(msg, sizeof(msg), "%s", kiln_status_message(st));
    kiln_status_free(st);
    fail_msg("seed %llu, op %ld (%s): %s", (unsigned long long)g_seed, op, what, msg);
  }
  kiln_kv_stats_t s;
  kiln_kv_stats(m, &s);
  int32_t cached = 0;
  for (int32_t b = 0; b < md->nb; b++) {
    cached += md->key[b] >= 0;
    if (kiln_kv_refcount(m, b) != md->ref[b])
      fail_msg("seed %llu, op %ld (%s): block %d has ref %d, model %d", (unsigned long long)g_seed,
               op, what, b, kiln_kv_refcount(m, b), md->ref[b]);
  }
  if (s.num_free != md->num_free || s.num_cached != cached || s.evictions != md->evictions ||
      s.lookups != md->lookups || s.hits != md->hits || kiln_kv_num_free(m) != md->num_free)
    fail_msg("seed %llu, op %ld (%s): stats free %d cached %d evictions %llu lookups %llu hits "
             "%llu; model %d %d %llu %llu %llu",
             (unsigned long long)g_seed, op, what, s.num_free, s.num_cached,
             (unsigned long long)s.evictions, (unsigned long long)s.lookups,
             (unsigned long long)s.hits, md->num_free, cached, (unsigned long long)md->evictions,
             (unsigned long long)md->lookups, (unsigned long long)md->hits);
}

static void stress_round(int32_t nb, bool prefix, long ops, kiln_kv_hash_t *keys) {
  kiln_kv_manager_t *m = make_kv(nb, 16, prefix);
  model_t md;
  memset(&md, 0, sizeof(md));
  md.nb = nb;
  md.prefix = prefix;
  for (int32_t b = 0; b < nb; b++) {
    md.key[b] = -1;
    md.free_list[b] = b;
  }
  md.num_free = nb;
  for (long op = 0; op < ops; op++) {
    int32_t r = rng_int(100);
    const char *what;
    if (r < 22) {
      what = "alloc";
      int32_t want = model_alloc(&md);
      int32_t got = kiln_kv_alloc(m);
      if (got != want)
        fail_msg("seed %llu, op %ld: alloc gave %d, model %d", (unsigned long long)g_seed, op, got,
                 want);
    } else if (r < 30) {
      what = "ref";
      int32_t b = model_pick_used(&md, 1);
      if (b < 0) continue;
      md.ref[b]++;
      kiln_kv_ref(m, b);
    } else if (r < 55) {
      what = "release";
      int32_t b = model_pick_used(&md, 1);
      if (b < 0) continue;
      model_release(&md, b);
      kiln_kv_release(m, b);
    } else if (r < 70) {
      what = "commit";
      int32_t b = model_pick_used(&md, 1);
      if (b < 0) continue;
      int32_t k = rng_int(NUM_KEYS);
      bool want = prefix && md.key[b] < 0 && model_find(&md, k) < 0;
      if (want) md.key[b] = k;
      bool got = kiln_kv_commit(m, b, keys[k]);
      if (got != want)
        fail_msg("seed %llu, op %ld: commit(%d, key %d) gave %d, model %d",
                 (unsigned long long)g_seed, op, b, k, (int)got, (int)want);
    } else if (r < 85) {
      what = "lookup";
      int32_t k = rng_int(NUM_KEYS);
      int32_t want = model_find(&md, k);
      if (prefix) {
        md.lookups++;
        if (want >= 0) {
          md.hits++;
          if (md.ref[want] == 0) model_remove(&md, want);
          md.ref[want]++;
        }
      }
      int32_t got = kiln_kv_lookup(m, keys[k]);
      if (got != want)
        fail_msg("seed %llu, op %ld: lookup(key %d) gave %d, model %d", (unsigned long long)g_seed,
                 op, k, got, want);
    } else if (r < 90) {
      what = "peek";
      int32_t k = rng_int(NUM_KEYS);
      int32_t want = model_find(&md, k), got = kiln_kv_peek(m, keys[k]);
      if (got != want)
        fail_msg("seed %llu, op %ld: peek(key %d) gave %d, model %d", (unsigned long long)g_seed,
                 op, k, got, want);
    } else if (r < 99) {
      what = "cow";
      /* Mostly shared blocks (the real use); sometimes a sole owner's. */
      int32_t b = model_pick_used(&md, rng_int(4) ? 2 : 1);
      if (b < 0) continue;
      int32_t want = model_alloc(&md);
      if (want >= 0) model_release(&md, b);
      int32_t got = kiln_kv_cow(m, b);
      if (got != want)
        fail_msg("seed %llu, op %ld: cow(%d) gave %d, model %d", (unsigned long long)g_seed, op, b,
                 got, want);
    } else {
      what = "reset_cache";
      for (int32_t b = 0; b < nb; b++)
        if (md.key[b] >= 0 && md.ref[b] == 0) {
          md.key[b] = -1;
          model_remove(&md, b);
          model_push_head(&md, b);
        }
      kiln_kv_reset_cache(m);
    }
    model_compare(&md, m, op, what);
  }
  /* Let go of everything: all free, all refcounts zero. */
  for (int32_t b = 0; b < nb; b++)
    while (md.ref[b] > 0) {
      model_release(&md, b);
      kiln_kv_release(m, b);
    }
  model_compare(&md, m, ops, "release all");
  assert_int_equal(kiln_kv_num_free(m), nb);
  /* Allocation order once more: raw blocks, then cached ones in LRU order. */
  for (int32_t i = 0; i < nb; i++) assert_int_equal(kiln_kv_alloc(m), model_alloc(&md));
  model_compare(&md, m, ops, "alloc all");
  kiln_kv_manager_free(m);
}

static void test_stress(void **state) {
  (void)state;
  g_rng = g_seed;
  kiln_kv_hash_t keys[NUM_KEYS];
  for (int32_t k = 0; k < NUM_KEYS; k++) keys[k] = hash_of(1000 + (uint64_t)k);
  /* Keys sharing their low bits, so that the hash table's probe runs and the backward-shift
   * deletion are exercised (home slot = lo & mask): keys 0..9 all go home to slot 5. */
  for (int32_t k = 0; k < 10; k++) keys[k].lo = ((uint64_t)k << 40) | 5u;
  long total = 0;
  for (int32_t round = 0; round < 48; round++) {
    int32_t nb = round < 4 ? round + 1 : 1 + rng_int(MAX_NB);
    bool prefix = round % 6 != 5;
    long ops = 2500;
    stress_round(nb, prefix, ops, keys);
    total += ops;
  }
  printf("test_block_manager: stress %ld operations, seed %llu\n", total,
         (unsigned long long)g_seed);
}

/* ---- scheduler ---------------------------------------------------------------------------- */

typedef struct sched_fixture {
  kiln_kv_manager_t *kv;
  kiln_scheduler_t *s;
} sched_fixture_t;

static sched_fixture_t make_sched(int32_t nb, int32_t bs, bool prefix, int32_t max_seqs,
                                  int32_t max_tokens, bool chunked, bool priority) {
  sched_fixture_t f;
  f.kv = make_kv(nb, bs, prefix);
  kiln_sched_options_t o = {.max_num_seqs = max_seqs,
                            .max_num_batched_tokens = max_tokens,
                            .chunked_prefill = chunked,
                            .priority_policy = priority,
                            .cache_salt = 0};
  ASSERT_OK(kiln_scheduler_create(f.kv, &o, &f.s));
  return f;
}

/* Every sequence must already be finished (and freed). */
static void free_sched(sched_fixture_t *f) {
  assert_int_equal(kiln_scheduler_num_running(f->s), 0);
  assert_int_equal(kiln_scheduler_num_waiting(f->s), 0);
  assert_int_equal(kiln_kv_num_free(f->kv), kiln_kv_num_blocks(f->kv));
  for (int32_t b = 0; b < kiln_kv_num_blocks(f->kv); b++)
    assert_int_equal(kiln_kv_refcount(f->kv, b), 0);
  check_kv(f->kv);
  kiln_scheduler_free(f->s);
  kiln_kv_manager_free(f->kv);
}

/* A fresh sequence of tokens base, base + 1, ... (n of them) as its prompt. */
static void make_seq(kiln_seq_t *q, const int32_t *tokens, int32_t n, uint64_t arrival) {
  memset(q, 0, sizeof(*q));
  for (int32_t i = 0; i < n; i++) ASSERT_OK(kiln_seq_append(q, tokens[i]));
  q->num_prompt = n;
  q->owner = q;
  q->arrival = arrival;
}

static void seq_range(kiln_seq_t *q, int32_t base, int32_t n, uint64_t arrival) {
  int32_t t[256];
  assert_true(n <= 256);
  for (int32_t i = 0; i < n; i++) t[i] = base + i;
  make_seq(q, t, n, arrival);
}

static kiln_sched_step_t *schedule(sched_fixture_t *f) {
  kiln_sched_step_t *step = NULL;
  ASSERT_OK(kiln_scheduler_schedule(f->s, &step));
  assert_non_null(step);
  check_kv(f->kv);
  int32_t sum = 0;
  for (int32_t i = 0; i < step->num_items; i++) sum += step->items[i].count;
  assert_int_equal(sum, step->num_tokens);
  return step;
}

/* The item of q in the step, or NULL. */
static const kiln_sched_item_t *item_of(const kiln_sched_step_t *step, const kiln_seq_t *q) {
  for (int32_t i = 0; i < step->num_items; i++)
    if (step->items[i].seq == q) return &step->items[i];
  return NULL;
}

/* The forward "ran": mark computed, then append a token to every sequence that sampled. */
static void complete(sched_fixture_t *f, const kiln_sched_step_t *step, int32_t token) {
  kiln_scheduler_update_computed(f->s, step);
  check_kv(f->kv);
  for (int32_t i = 0; i < step->num_items; i++)
    if (step->items[i].sample) ASSERT_OK(kiln_seq_append(step->items[i].seq, token));
}

static void end_seq(sched_fixture_t *f, kiln_seq_t *q) {
  kiln_scheduler_finish(f->s, q);
  assert_int_equal(q->state, KILN_SEQ_FINISHED);
  assert_int_equal(q->num_blocks, 0);
  kiln_seq_free(q);
  check_kv(f->kv);
}

static void test_sched_prefix_hit(void **state) {
  (void)state;
  const int32_t BS = 4;
  sched_fixture_t f = make_sched(32, BS, true, 8, 64, true, false);
  kiln_seq_t a, b, c, d;
  seq_range(&a, 100, 10, 0); /* 2 full blocks + 2 tokens */
  kiln_scheduler_add(f.s, &a);
  kiln_sched_step_t *st = schedule(&f);
  assert_int_equal(st->num_items, 1);
  assert_int_equal(st->items[0].start, 0);
  assert_int_equal(st->items[0].count, 10);
  assert_true(st->items[0].sample);
  assert_int_equal(a.num_cached, 0);
  assert_int_equal(a.num_blocks, 3);
  complete(&f, st, 7);
  assert_int_equal(a.num_computed, 10);
  assert_int_equal(a.num_committed, 2);
  kiln_kv_stats_t ks;
  kiln_kv_stats(f.kv, &ks);
  assert_int_equal(ks.num_cached, 2);
  int32_t a0 = a.blocks[0], a1 = a.blocks[1];
  end_seq(&f, &a);

  /* b shares a's two full blocks then differs: it computes only its last 3 tokens. */
  int32_t tb[11];
  for (int32_t i = 0; i < 11; i++) tb[i] = i < 8 ? 100 + i : 500 + i;
  make_seq(&b, tb, 11, 1);
  kiln_scheduler_add(f.s, &b);
  st = schedule(&f);
  assert_int_equal(st->num_items, 1);
  assert_int_equal(st->items[0].start, 8);
  assert_int_equal(st->items[0].count, 3);
  assert_int_equal(b.num_cached, 8);
  assert_int_equal(b.num_computed, 8);
  assert_int_equal(b.blocks[0], a0);
  assert_int_equal(b.blocks[1], a1);
  complete(&f, st, 7);
  assert_int_equal(b.num_computed, 11);

  /* c's prompt is exactly a's two full blocks: only the first is taken, because the last
   * token must be computed to produce logits. It shares that block with b (ref 2). */
  seq_range(&c, 100, 8, 2);
  kiln_scheduler_add(f.s, &c);
  st = schedule(&f);
  const kiln_sched_item_t *ic = item_of(st, &c);
  assert_non_null(ic);
  assert_int_equal(ic->start, 4);
  assert_int_equal(ic->count, 4);
  assert_int_equal(c.num_cached, 4);
  assert_int_equal(c.blocks[0], a0);
  assert_int_equal(kiln_kv_refcount(f.kv, a0), 2);
  assert_true(c.blocks[1] != a1); /* a1 is b's; c computes its own second block */
  complete(&f, st, 7);

  /* A one-token prompt always computes its token. */
  seq_range(&d, 100, 1, 3);
  kiln_scheduler_add(f.s, &d);
  st = schedule(&f);
  const kiln_sched_item_t *id = item_of(st, &d);
  assert_non_null(id);
  assert_int_equal(id->start, 0);
  assert_int_equal(id->count, 1);
  assert_int_equal(d.num_cached, 0);
  complete(&f, st, 7);

  uint64_t queries, hits;
  kiln_scheduler_prefix_stats(f.s, &queries, &hits);
  assert_int_equal(queries, 10 + 11 + 8 + 1);
  assert_int_equal(hits, 8 + 4);
  end_seq(&f, &b);
  end_seq(&f, &c);
  end_seq(&f, &d);
  free_sched(&f);
}

static void test_sched_no_prefix_cache_flag(void **state) {
  (void)state;
  /* A sequence asking for prompt logprobs (no_prefix_cache) computes its whole prompt. */
  sched_fixture_t f = make_sched(16, 4, true, 4, 64, true, false);
  kiln_seq_t a, b;
  seq_range(&a, 1, 9, 0);
  kiln_scheduler_add(f.s, &a);
  kiln_sched_step_t *st = schedule(&f);
  complete(&f, st, 3);
  seq_range(&b, 1, 9, 1);
  b.no_prefix_cache = true;
  kiln_scheduler_add(f.s, &b);
  st = schedule(&f);
  const kiln_sched_item_t *ib = item_of(st, &b);
  assert_non_null(ib);
  assert_int_equal(ib->start, 0);
  assert_int_equal(ib->count, 9);
  assert_int_equal(b.num_cached, 0);
  complete(&f, st, 3);
  end_seq(&f, &a);
  end_seq(&f, &b);
  free_sched(&f);
}

static void test_sched_chunked_prefill(void **state) {
  (void)state;
  const int32_t BUDGET = 8;
  sched_fixture_t f = make_sched(32, 4, false, 4, BUDGET, true, false);
  kiln_seq_t d, l;
  seq_range(&d, 1, 3, 0);
  kiln_scheduler_add(f.s, &d);
  kiln_sched_step_t *st = schedule(&f);
  assert_int_equal(st->num_items, 1);
  assert_int_equal(st->items[0].count, 3);
  complete(&f, st, 9); /* d now decodes */
  seq_range(&l, 50, 20, 1);
  kiln_scheduler_add(f.s, &l);
  /* Steps: d decodes 1 token each time, l takes the rest of the budget. */
  int32_t want_start[] = {0, 7, 14}, want_count[] = {7, 7, 6};
  for (int32_t k = 0; k < 3; k++) {
    st = schedule(&f);
    assert_true(st->num_tokens <= BUDGET);
    assert_int_equal(st->num_items, 2);
    assert_ptr_equal(st->items[0].seq, &d); /* running first */
    assert_int_equal(st->items[0].count, 1);
    assert_true(st->items[0].sample);
    assert_ptr_equal(st->items[1].seq, &l);
    assert_int_equal(st->items[1].start, want_start[k]);
    assert_int_equal(st->items[1].count, want_count[k]);
    assert_int_equal(st->items[1].sample, k == 2); /* samples when the prompt is done */
    assert_int_equal(l.state, KILN_SEQ_RUNNING);
    complete(&f, st, 9);
  }
  assert_int_equal(l.num_computed, 20);
  assert_int_equal(l.num_tokens, 21);
  st = schedule(&f);
  assert_int_equal(st->num_items, 2);
  assert_int_equal(st->num_tokens, 2);
  complete(&f, st, 9);
  end_seq(&f, &d);
  end_seq(&f, &l);
  free_sched(&f);
}

static void test_sched_no_chunking(void **state) {
  (void)state;
  const int32_t BUDGET = 8;
  sched_fixture_t f = make_sched(32, 4, true, 4, BUDGET, false, false);
  kiln_seq_t d, l;
  seq_range(&d, 1, 3, 0);
  kiln_scheduler_add(f.s, &d);
  kiln_sched_step_t *st = schedule(&f);
  complete(&f, st, 9);
  seq_range(&l, 50, BUDGET, 1); /* fits an empty step only */
  kiln_scheduler_add(f.s, &l);
  for (int32_t k = 0; k < 3; k++) {
    st = schedule(&f);
    assert_int_equal(st->num_items, 1);
    assert_ptr_equal(st->items[0].seq, &d);
    assert_int_equal(l.state, KILN_SEQ_WAITING);
    assert_int_equal(l.num_blocks, 0);
    assert_int_equal(l.num_computed, 0);
    complete(&f, st, 9);
  }
  end_seq(&f, &d);
  st = schedule(&f);
  assert_int_equal(st->num_items, 1);
  assert_ptr_equal(st->items[0].seq, &l);
  assert_int_equal(st->items[0].start, 0);
  assert_int_equal(st->items[0].count, BUDGET);
  assert_true(st->items[0].sample);
  complete(&f, st, 9);
  end_seq(&f, &l);
  free_sched(&f);
}

static void test_sched_preemption(void **state) {
  (void)state;
  const int32_t BS = 4;
  for (int32_t self = 0; self < 2; self++) {
    /* 4 blocks. a and b take two each. Then one of them crosses into a third block. */
    sched_fixture_t f = make_sched(4, BS, true, 4, 64, true, false);
    kiln_seq_t a, b;
    seq_range(&a, 10, self ? 6 : 7, 0);
    seq_range(&b, 40, self ? 7 : 6, 1);
    kiln_scheduler_add(f.s, &a);
    kiln_scheduler_add(f.s, &b);
    kiln_sched_step_t *st = schedule(&f);
    assert_int_equal(st->num_items, 2);
    assert_int_equal(kiln_kv_num_free(f.kv), 0);
    complete(&f, st, 5); /* a: 8 or 7 tokens, b: 7 or 8 */
    st = schedule(&f);    /* token 7 fits block 1 for both */
    assert_int_equal(st->num_items, 2);
    assert_int_equal(st->num_preempted, 0);
    complete(&f, st, 5); /* a: 9 or 8 tokens: one of them needs a third block */
    st = schedule(&f);
    /* b is the most recently admitted: it goes, whether a asked (self = 0) or b itself. */
    assert_int_equal(st->num_preempted, 1);
    assert_int_equal(kiln_scheduler_num_preemptions(f.s), 1);
    assert_int_equal(st->num_items, 1);
    assert_ptr_equal(st->items[0].seq, &a);
    assert_int_equal(st->items[0].count, 1);
    assert_int_equal(b.state, KILN_SEQ_WAITING);
    assert_int_equal(b.num_blocks, 0);
    assert_int_equal(b.num_computed, 0);
    assert_int_equal(b.num_tokens, self ? 9 : 8); /* generated tokens kept */
    assert_ptr_equal(kiln_scheduler_waiting_head(f.s), &b);
    assert_int_equal(kiln_scheduler_num_running(f.s), 1);
    assert_int_equal(kiln_scheduler_num_waiting(f.s), 1);
    assert_int_equal(a.num_blocks, self ? 2 : 3);
    complete(&f, st, 5);
    /* A later arrival queues behind the preempted b (it resumes first). */
    kiln_seq_t c;
    seq_range(&c, 80, 2, 2);
    kiln_scheduler_add(f.s, &c);
    assert_ptr_equal(kiln_scheduler_waiting_head(f.s), &b);
    assert_ptr_equal(b.next, &c);
    /* When a ends, b is admitted again: its full blocks were cached (one with self = 0, two
     * with self = 1), so only the tail is recomputed (its generated tokens included). */
    end_seq(&f, &a);
    st = schedule(&f);
    const kiln_sched_item_t *ib = item_of(st, &b);
    assert_non_null(ib);
    assert_int_equal(ib->start, self ? 8 : 4);
    assert_int_equal(ib->start + ib->count, b.num_tokens);
    assert_true(ib->sample);
    assert_int_equal(b.num_cached, 0); /* counted at the first admission only */
    complete(&f, st, 5);
    end_seq(&f, &b);
    if (c.state != KILN_SEQ_RUNNING) {
      st = schedule(&f);
      complete(&f, st, 5);
    }
    end_seq(&f, &c);
    free_sched(&f);
  }
}

static void test_sched_order(void **state) {
  (void)state;
  static const int32_t prio[] = {5, 1, 3, 1, 0};
  for (int32_t policy = 0; policy < 2; policy++) {
    sched_fixture_t f = make_sched(64, 4, false, 1, 64, true, policy == 1);
    kiln_seq_t q[5];
    for (int32_t i = 0; i < 5; i++) {
      seq_range(&q[i], 10 * i + 1, 3, (uint64_t)i);
      q[i].priority = prio[i];
      kiln_scheduler_add(f.s, &q[i]);
    }
    /* FCFS: arrival order. Priority: lower first, then arrival: 4, 1, 3, 2, 0. */
    static const int32_t fcfs[] = {0, 1, 2, 3, 4}, by_prio[] = {4, 1, 3, 2, 0};
    const int32_t *want = policy ? by_prio : fcfs;
    int32_t k = 0;
    for (kiln_seq_t *w = kiln_scheduler_waiting_head(f.s); w; w = w->next, k++)
      assert_ptr_equal(w, &q[want[k]]);
    assert_int_equal(k, 5);
    /* One slot: they run one at a time in that order. */
    for (k = 0; k < 5; k++) {
      kiln_sched_step_t *st = schedule(&f);
      assert_int_equal(st->num_items, 1);
      assert_ptr_equal(st->items[0].seq, &q[want[k]]);
      complete(&f, st, 2);
      end_seq(&f, &q[want[k]]);
    }
    free_sched(&f);
  }
}

static void test_sched_max_num_seqs(void **state) {
  (void)state;
  const int32_t BS = 4;
  sched_fixture_t f = make_sched(64, BS, true, 4, 256, true, false);
  /* a asks for n = 3: it takes 3 slots at admission; b fits the 4th, c waits. */
  kiln_seq_t a, b, c, kids[2];
  seq_range(&a, 1, 6, 0);
  a.fork_n = 3;
  seq_range(&b, 30, 3, 1);
  seq_range(&c, 60, 3, 2);
  kiln_scheduler_add(f.s, &a);
  kiln_scheduler_add(f.s, &b);
  kiln_scheduler_add(f.s, &c);
  kiln_sched_step_t *st = schedule(&f);
  assert_int_equal(st->num_items, 2);
  assert_ptr_equal(st->items[0].seq, &a);
  assert_ptr_equal(st->items[1].seq, &b);
  assert_int_equal(c.state, KILN_SEQ_WAITING);
  kiln_scheduler_update_computed(f.s, st);
  /* a's prompt is computed: fork it as the engine does (children right after it). */
  kiln_seq_t *after = &a;
  for (int32_t i = 0; i < 2; i++) {
    ASSERT_OK(kiln_scheduler_fork(f.s, &a, &kids[i]));
    kids[i].index = i + 1;
    kiln_scheduler_add_running_after(f.s, after, &kids[i]);
    after = &kids[i];
  }
  kiln_scheduler_fork_done(f.s, &a, 2);
  assert_int_equal(a.fork_n, 0);
  assert_int_equal(kiln_scheduler_num_running(f.s), 4);
  /* The children share a's blocks: the full one and the partly filled one. */
  assert_int_equal(kiln_kv_refcount(f.kv, a.blocks[0]), 3);
  assert_int_equal(kiln_kv_refcount(f.kv, a.blocks[1]), 3);
  assert_ptr_equal(a.next, &kids[0]);
  assert_ptr_equal(kids[0].next, &kids[1]);
  for (int32_t i = 0; i < 2; i++) assert_int_equal(kids[i].num_tokens, a.num_tokens);
  ASSERT_OK(kiln_seq_append(&a, 91));
  ASSERT_OK(kiln_seq_append(&kids[0], 92));
  ASSERT_OK(kiln_seq_append(&kids[1], 93));
  ASSERT_OK(kiln_seq_append(&b, 94));
  /* Decodes: a and kids[0] write into the shared last block and get copies; kids[1], by then
   * its only user, writes in place. Still no room for c. */
  int32_t shared = a.blocks[1];
  st = schedule(&f);
  assert_int_equal(st->num_items, 4);
  assert_int_equal(st->num_cow, 2);
  assert_int_equal(st->cow_src[0], shared);
  assert_int_equal(st->cow_src[1], shared);
  assert_int_equal(st->cow_dst[0], a.blocks[1]);
  assert_int_equal(st->cow_dst[1], kids[0].blocks[1]);
  assert_int_equal(kids[1].blocks[1], shared);
  assert_int_equal(kiln_kv_refcount(f.kv, shared), 1);
  assert_int_equal(kiln_kv_refcount(f.kv, a.blocks[0]), 3); /* full: never copied */
  assert_int_equal(c.state, KILN_SEQ_WAITING);
  complete(&f, st, 4);
  /* One child ends: c takes its slot. */
  end_seq(&f, &kids[1]);
  st = schedule(&f);
  assert_int_equal(st->num_items, 4);
  assert_non_null(item_of(st, &c));
  complete(&f, st, 4);
  end_seq(&f, &a);
  end_seq(&f, &kids[0]);
  end_seq(&f, &b);
  end_seq(&f, &c);
  free_sched(&f);
}

static void test_sched_fork_slots_returned(void **state) {
  (void)state;
  /* max_num_seqs 3: a (n = 3) fills them. Its fork makes only one child (out of memory, say);
   * fork_done gives the other promised slot back, so b is admitted. */
  sched_fixture_t f = make_sched(32, 4, false, 3, 64, true, false);
  kiln_seq_t a, b, kid;
  seq_range(&a, 1, 5, 0);
  a.fork_n = 3;
  seq_range(&b, 20, 2, 1);
  kiln_scheduler_add(f.s, &a);
  kiln_scheduler_add(f.s, &b);
  kiln_sched_step_t *st = schedule(&f);
  assert_int_equal(st->num_items, 1);
  assert_int_equal(b.state, KILN_SEQ_WAITING);
  kiln_scheduler_update_computed(f.s, st);
  ASSERT_OK(kiln_scheduler_fork(f.s, &a, &kid));
  kid.index = 1;
  kiln_scheduler_add_running_after(f.s, &a, &kid);
  kiln_scheduler_fork_done(f.s, &a, 1);
  ASSERT_OK(kiln_seq_append(&a, 3));
  ASSERT_OK(kiln_seq_append(&kid, 4));
  st = schedule(&f);
  assert_int_equal(st->num_items, 3);
  assert_non_null(item_of(st, &b));
  complete(&f, st, 1);
  end_seq(&f, &a);
  end_seq(&f, &kid);
  end_seq(&f, &b);
  /* A preempted or finished unforked n > 1 prompt gives its promised slots back too. */
  seq_range(&a, 1, 5, 3);
  a.fork_n = 3;
  seq_range(&b, 20, 2, 4);
  kiln_scheduler_add(f.s, &a);
  kiln_scheduler_add(f.s, &b);
  st = schedule(&f);
  assert_int_equal(st->num_items, 1);
  end_seq(&f, &a); /* cancelled before its fork */
  st = schedule(&f);
  assert_int_equal(st->num_items, 1);
  assert_ptr_equal(st->items[0].seq, &b);
  complete(&f, st, 1);
  end_seq(&f, &b);
  free_sched(&f);
}

static void test_sched_waiting_finish(void **state) {
  (void)state;
  /* Finishing a waiting sequence (cancel before admission) unlinks it. */
  sched_fixture_t f = make_sched(8, 4, true, 1, 64, true, false);
  kiln_seq_t a, b, c;
  seq_range(&a, 1, 3, 0);
  seq_range(&b, 1, 3, 1);
  seq_range(&c, 1, 3, 2);
  kiln_scheduler_add(f.s, &a);
  kiln_scheduler_add(f.s, &b);
  kiln_scheduler_add(f.s, &c);
  end_seq(&f, &b);
  assert_int_equal(kiln_scheduler_num_waiting(f.s), 2);
  assert_ptr_equal(kiln_scheduler_waiting_head(f.s)->next, &c);
  end_seq(&f, &a);
  end_seq(&f, &c);
  kiln_sched_step_t *st = schedule(&f);
  assert_int_equal(st->num_items, 0);
  int64_t alloc = -1, used = -1;
  kiln_scheduler_slot_usage(f.s, &alloc, &used);
  assert_int_equal(alloc, 0);
  assert_int_equal(used, 0);
  free_sched(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_create_errors),
      cmocka_unit_test(test_alloc_until_exhausted),
      cmocka_unit_test(test_release_order_lru),
      cmocka_unit_test(test_commit_lookup),
      cmocka_unit_test(test_alloc_evicts),
      cmocka_unit_test(test_commit_duplicate),
      cmocka_unit_test(test_cow),
      cmocka_unit_test(test_peek),
      cmocka_unit_test(test_prefix_caching_off),
      cmocka_unit_test(test_hash_chain),
      cmocka_unit_test(test_reset_cache),
      cmocka_unit_test(test_stress),
      cmocka_unit_test(test_sched_prefix_hit),
      cmocka_unit_test(test_sched_no_prefix_cache_flag),
      cmocka_unit_test(test_sched_chunked_prefill),
      cmocka_unit_test(test_sched_no_chunking),
      cmocka_unit_test(test_sched_preemption),
      cmocka_unit_test(test_sched_order),
      cmocka_unit_test(test_sched_max_num_seqs),
      cmocka_unit_test(test_sched_fork_slots_returned),
      cmocka_unit_test(test_sched_waiting_finish),
  };
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
