/* test_collectives.c - conformance of the ABI 1.5 collectives (docs/parallel.md) on every
 * backend with KILN_HAL_CAP_COLLECTIVES that can run several ranks on one device (the cpu
 * backend; $KILN_TEST_BACKENDS restricts the list). Each case runs with 2 and 4 ranks, once as
 * threads of this process and once as forked processes:
 *   all_reduce of fresh random F32/F16/BF16 tensors (one of them over several 1 MiB steps, one
 *   in place, one replayed from a graph) against an fp64 sum of what every rank stored;
 *   all_gather, broadcast from the last rank, a send/recv ring of a multi-chunk message;
 *   mismatched sizes (every rank gets INVALID_ARGUMENT and the communicator stays usable);
 * then a rank that never joins and a rank that exits after joining: the others fail with an
 * error naming it within the configured 1 s timeout. No /dev/shm/kiln-comm-* entry may remain.
 * Forked children use only buffers, copies and collectives (no op that needs the backend's
 * thread pool, whose workers a fork does not copy).
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "hal/loader.h"
#include "hal/ref/ops_ref.h"
#include "kiln/hal_util.h"

static kiln_hal_registry_t *g_registry;
static const kiln_hal_backend_t *g_t;
static kiln_hal_device_t *g_dev;
/* The in-process cases (ranks as threads or forked children sharing one device) need a
 * host-memory backend: NCCL wants one process per GPU, started fresh (a CUDA context does not
 * survive fork), which tools/dev/collectives_gpu.sh runs through main_rank. */
static bool g_in_process;
#define SKIP_UNLESS_IN_PROCESS()                                                              \
  do {                                                                                        \
    if (!g_t) skip();                                                                         \
    if (!g_in_process) {                                                                      \
      printf("test_collectives: %s is not a host-memory backend: its collectives run one "    \
             "process per GPU (tools/dev/collectives_gpu.sh); in-process cases skipped\n",    \
             g_name);                                                                          \
      skip();                                                                                 \
    }                                                                                         \
  } while (0)
static const char *g_name;
static uint64_t g_seed;

/* ---- per-rank context ------------------------------------------------------------------ */

typedef struct rank_ctx {
  int world, rank;
  kiln_hal_comm_id_t id;
  int timeout_ms;
  int (*body)(struct rank_ctx *);
  int failures;
  kiln_hal_stream_t *stream;
  kiln_hal_comm_t *comm;
  char last_error[512];
} rank_ctx_t;

static void rfail(rank_ctx_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rfail(rank_ctx_t *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "[%s rank %d/%d] ", g_name, c->rank, c->world);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  c->failures++;
}

static bool rok(rank_ctx_t *c, kiln_hal_error_t *e, const char *what) {
  if (!e) return true;
  rfail(c, "%s failed: %d: %s", what, (int)e->code, e->message);
  kiln_hal_error_free(e);
  return false;
}

/* The ranks run as threads share one device (g_dev), and the cpu plugin (like hal.h asks of
 * every plugin) refuses buffer_alloc on a device while any of its streams captures a graph: a
 * rank's allocation must not land inside another rank's capture. dev_alloc and the capture in
 * case_all_reduce hold g_dev_mu (the capture records the collective without waiting for the
 * other ranks, so no rank waits for a peer while holding it). Forked ranks have a device each. */
static pthread_mutex_t g_dev_mu = PTHREAD_MUTEX_INITIALIZER;

static kiln_hal_error_t *dev_alloc(uint64_t bytes, uint32_t flags, kiln_hal_buffer_t **out) {
  pthread_mutex_lock(&g_dev_mu);
  kiln_hal_error_t *e = g_t->buffer_alloc(g_dev, bytes, flags, out);
  pthread_mutex_unlock(&g_dev_mu);
  return e;
}

/* Deterministic inputs every rank can recompute: splitmix64 of (seed, tag, rank, i). */
static double value(uint64_t tag, int rank, int64_t i) {
  uint64_t z = g_seed ^ (tag * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)rank << 40) ^ (uint64_t)i;
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (double)(z >> 11) / 9007199254740992.0 * 4.0 - 2.0;
}

static kiln_hal_tensor_t view(kiln_hal_buffer_t *b, uint64_t off, int32_t dtype, int64_t rows,
                              int64_t cols) {
  kiln_hal_tensor_t t;
  memset(&t, 0, sizeof(t));
  t.buffer = b;
  t.offset = off;
  t.dtype = dtype;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.stride[0] = cols;
  t.stride[1] = 1;
  return t;
}

/* Host encodings of n values of a float dtype (rounded as the backend stores them). */
static void encode(int32_t dtype, const double *v, void *out, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (dtype == KILN_HAL_F32) ((float *)out)[i] = (float)v[i];
    else if (dtype == KILN_HAL_F16) ((uint16_t *)out)[i] = kiln_hal_f32_to_f16((float)v[i]);
    else ((uint16_t *)out)[i] = kiln_hal_f32_to_bf16((float)v[i]);
  }
}
static double decode(int32_t dtype, const void *p, int64_t i) {
  if (dtype == KILN_HAL_F32) return ((const float *)p)[i];
  if (dtype == KILN_HAL_F16) return kiln_hal_f16_to_f32(((const uint16_t *)p)[i]);
  return kiln_hal_bf16_to_f32(((const uint16_t *)p)[i]);
}

static kiln_hal_coll_args_t cargs(rank_ctx_t *c, int peer, kiln_hal_tensor_t src,
                                  kiln_hal_tensor_t dst) {
  kiln_hal_coll_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.peer = peer;
  a.comm = c->comm;
  a.src = src;
  a.dst = dst;
  return a;
}

/* One all_reduce of n elements (tag picks the inputs); in_place, or through a graph. */
static void case_all_reduce(rank_ctx_t *c, int32_t dtype, int64_t n, uint64_t tag, bool in_place,
                            bool graph) {
  size_t es = kiln_hal_dtype_size(dtype), bytes = (size_t)n * es;
  double *v = malloc((size_t)n * sizeof(double)), *want = calloc((size_t)n, sizeof(double)),
         *mag = calloc((size_t)n, sizeof(double));
  uint8_t *host = malloc(bytes), *got = malloc(bytes);
  kiln_hal_buffer_t *b = NULL;
  if (!v || !want || !mag || !host || !got) abort();
  /* The reference: the fp64 sum of every rank's stored (rounded) values. */
  for (int r = 0; r < c->world; r++) {
    for (int64_t i = 0; i < n; i++) v[i] = value(tag, r, i);
    encode(dtype, v, host, n);
    for (int64_t i = 0; i < n; i++) {
      double x = decode(dtype, host, i);
      want[i] += x;
      mag[i] += fabs(x);
    }
  }
  for (int64_t i = 0; i < n; i++) v[i] = value(tag, c->rank, i);
  encode(dtype, v, host, n);
  if (!rok(c, dev_alloc(2 * bytes + 256, 0, &b), "buffer_alloc")) goto out;
  uint64_t dst_off = in_place ? 0 : ((bytes + 255) & ~(size_t)255);
  kiln_hal_coll_args_t a = cargs(c, 0, view(b, 0, dtype, n / 8, 8), view(b, dst_off, dtype, n / 8, 8));
  if (!rok(c, g_t->copy_h2d(c->stream, b, 0, host, bytes), "copy_h2d")) goto out;
  if (graph) {
    kiln_hal_graph_t *gr = NULL;
    pthread_mutex_lock(&g_dev_mu);
    kiln_hal_error_t *e0 = g_t->graph_begin(c->stream), *e = NULL, *e2 = NULL;
    if (!e0) {
      e = g_t->all_reduce(c->stream, &a);
      e2 = g_t->graph_end(c->stream, &gr);
    }
    pthread_mutex_unlock(&g_dev_mu);
    if (!rok(c, e0, "graph_begin")) goto out;
    if (!rok(c, e, "all_reduce (capture)") | !rok(c, e2, "graph_end")) goto out;
    /* Replay twice from the same inputs: the second must give the same sums. */
    for (int k = 0; k < 2 && !c->failures; k++) {
      rok(c, g_t->graph_replay(gr, c->stream), "graph_replay");
      if (k == 0) rok(c, g_t->copy_d2h(c->stream, got, b, dst_off, bytes), "copy_d2h");
    }
    g_t->graph_destroy(gr);
  } else {
    rok(c, g_t->all_reduce(c->stream, &a), "all_reduce");
  }
  if (c->failures) goto out;
  if (!rok(c, g_t->copy_d2h(c->stream, got, b, dst_off, bytes), "copy_d2h")) goto out;
  if (!rok(c, g_t->stream_sync(c->stream), "stream_sync")) goto out;
  /* F32: the sum of W terms in F32; F16/BF16: the exact sum rounded once (cpu) or summed in
   * the dtype (NCCL), so up to W roundings of the dtype. */
  double unit = dtype == KILN_HAL_F32 ? 0x1p-24 : dtype == KILN_HAL_F16 ? 0x1p-11 : 0x1p-8;
  double rtol = dtype == KILN_HAL_F32 ? 0 : 2 * unit, mtol = unit * c->world;
  int bad = 0;
  for (int64_t i = 0; i < n; i++) {
    double g = decode(dtype, got, i), d = fabs(g - want[i]);
    if (!(d <= 1e-30 + rtol * fabs(want[i]) + mtol * mag[i])) {
      if (bad++ < 3)
        rfail(c, "all_reduce %s n=%lld%s%s: [%lld] = %.9g, want %.9g", kiln_hal_dtype_name(dtype),
              (long long)n, in_place ? " in place" : "", graph ? " graph" : "", (long long)i, g,
              want[i]);
    }
  }
out:
  g_t->buffer_free(b);
  free(v);
  free(want);
  free(mag);
  free(host);
  free(got);
}

static void case_all_gather(rank_ctx_t *c, bool in_place) {
  const int64_t n = 37, cols = 3;
  int32_t *mine = malloc(n * cols * 4), *got = malloc((size_t)c->world * n * cols * 4);
  kiln_hal_buffer_t *b = NULL;
  for (int64_t i = 0; i < n * cols; i++) mine[i] = (int32_t)(c->rank * 100000 + i);
  size_t all = (size_t)c->world * n * cols * 4;
  if (!rok(c, dev_alloc(all + 512 + n * cols * 4, 0, &b), "buffer_alloc")) goto out;
  uint64_t src_off = in_place ? (uint64_t)c->rank * n * cols * 4 : ((all + 255) & ~(size_t)255);
  rok(c, g_t->fill(c->stream, b, 0, all, 0xEE), "fill");
  rok(c, g_t->copy_h2d(c->stream, b, src_off, mine, n * cols * 4), "copy_h2d");
  kiln_hal_tensor_t src = view(b, src_off, KILN_HAL_I32, n, cols);
  kiln_hal_tensor_t dst = view(b, 0, KILN_HAL_I32, n * c->world, cols);
  kiln_hal_coll_args_t a = cargs(c, 0, src, dst);
  rok(c, g_t->all_gather(c->stream, &a), "all_gather");
  rok(c, g_t->copy_d2h(c->stream, got, b, 0, all), "copy_d2h");
  rok(c, g_t->stream_sync(c->stream), "stream_sync");
  if (c->failures) goto out;
  for (int r = 0; r < c->world; r++)
    for (int64_t i = 0; i < n * cols; i++)
      if (got[r * n * cols + i] != (int32_t)(r * 100000 + i)) {
        rfail(c, "all_gather%s: slice %d element %lld = %d", in_place ? " in place" : "", r,
              (long long)i, got[r * n * cols + i]);
        goto out;
      }
out:
  g_t->buffer_free(b);
  free(mine);
  free(got);
}

static void case_broadcast(rank_ctx_t *c) {
  const int64_t n = 3000; /* bf16, 6000 bytes */
  int root = c->world - 1;
  uint16_t *h = malloc(n * 2), *got = malloc(n * 2);
  kiln_hal_buffer_t *b = NULL;
  for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)(c->rank * 7 + i);
  if (!rok(c, dev_alloc(n * 2, 0, &b), "buffer_alloc")) goto out;
  rok(c, g_t->copy_h2d(c->stream, b, 0, h, n * 2), "copy_h2d");
  kiln_hal_coll_args_t a = cargs(c, root, view(b, 0, KILN_HAL_BF16, n / 10, 10),
                                 view(b, 0, KILN_HAL_BF16, n / 10, 10));
  a.src.buffer = NULL; /* ignored */
  rok(c, g_t->broadcast(c->stream, &a), "broadcast");
  rok(c, g_t->copy_d2h(c->stream, got, b, 0, n * 2), "copy_d2h");
  rok(c, g_t->stream_sync(c->stream), "stream_sync");
  if (c->failures) goto out;
  for (int64_t i = 0; i < n; i++)
    if (got[i] != (uint16_t)(root * 7 + i)) {
      rfail(c, "broadcast: [%lld] = %u, want %u", (long long)i, got[i], (unsigned)(root * 7 + i));
      break;
    }
out:
  g_t->buffer_free(b);
  free(h);
  free(got);
}

/* A ring: rank r sends to r+1 and receives from r-1; even ranks send first. */
static void case_ring(rank_ctx_t *c) {
  const int64_t n = 50000; /* f32: 200000 bytes, several 64 KiB chunks */
  float *h = malloc(n * 4), *got = malloc(n * 4);
  kiln_hal_buffer_t *b = NULL;
  int next = (c->rank + 1) % c->world, prev = (c->rank + c->world - 1) % c->world;
  for (int64_t i = 0; i < n; i++) h[i] = (float)value(99, c->rank, i);
  if (!rok(c, dev_alloc(2 * n * 4, 0, &b), "buffer_alloc")) goto out;
  rok(c, g_t->copy_h2d(c->stream, b, 0, h, n * 4), "copy_h2d");
  kiln_hal_coll_args_t s = cargs(c, next, view(b, 0, KILN_HAL_F32, n / 50, 50), view(b, 0, 0, 0, 0));
  s.dst.buffer = NULL;
  kiln_hal_coll_args_t r = cargs(c, prev, view(b, 0, 0, 0, 0), view(b, n * 4, KILN_HAL_F32, n / 50, 50));
  r.src.buffer = NULL;
  for (int k = 0; k < 2; k++) {
    bool do_send = (k == 0) == (c->rank % 2 == 0);
    if (do_send) rok(c, g_t->send(c->stream, &s), "send");
    else rok(c, g_t->recv(c->stream, &r), "recv");
  }
  rok(c, g_t->copy_d2h(c->stream, got, b, n * 4, n * 4), "copy_d2h");
  rok(c, g_t->stream_sync(c->stream), "stream_sync");
  if (c->failures) goto out;
  for (int64_t i = 0; i < n; i++)
    if (got[i] != (float)value(99, prev, i)) {
      rfail(c, "recv from %d: [%lld] = %g, want %g", prev, (long long)i, got[i], value(99, prev, i));
      break;
    }
out:
  g_t->buffer_free(b);
  free(h);
  free(got);
}

static void expect_invalid(rank_ctx_t *c, kiln_hal_error_t *e, const char *what, const char *needle) {
  if (!e) {
    rfail(c, "%s: succeeded, want INVALID_ARGUMENT", what);
    return;
  }
  if (e->code != KILN_HAL_ERR_INVALID_ARGUMENT || !strstr(e->message, needle))
    rfail(c, "%s: got %d: %s; want INVALID_ARGUMENT mentioning \"%s\"", what, (int)e->code,
          e->message, needle);
  kiln_hal_error_free(e);
}

/* Rank 1 reduces one row more than the others: every rank is told, and all stay in step. */
static void case_mismatch(rank_ctx_t *c) {
  kiln_hal_buffer_t *b = NULL;
  if (!rok(c, dev_alloc(4096, 0, &b), "buffer_alloc")) return;
  rok(c, g_t->fill(c->stream, b, 0, 4096, 0), "fill");
  int64_t rows = c->rank == 1 ? 9 : 8;
  kiln_hal_coll_args_t a = cargs(c, 0, view(b, 0, KILN_HAL_F32, rows, 16), view(b, 0, KILN_HAL_F32, rows, 16));
  expect_invalid(c, g_t->all_reduce(c->stream, &a), "mismatched all_reduce", "do not match");
  /* send/recv of different sizes: both sides fail. */
  if (c->rank < 2) {
    kiln_hal_coll_args_t p = cargs(c, 1 - c->rank, view(b, 0, KILN_HAL_F32, rows, 16),
                                   view(b, 0, KILN_HAL_F32, rows, 16));
    if (c->rank == 0) expect_invalid(c, g_t->send(c->stream, &p), "mismatched send", "different size");
    else expect_invalid(c, g_t->recv(c->stream, &p), "mismatched recv", "wants");
  }
  /* Bad arguments are refused before any rank waits. */
  kiln_hal_coll_args_t bad = cargs(c, c->world, view(b, 0, KILN_HAL_F32, 8, 16), view(b, 0, KILN_HAL_F32, 8, 16));
  expect_invalid(c, g_t->broadcast(c->stream, &bad), "broadcast root out of range", "peer");
  bad = cargs(c, 0, view(b, 0, KILN_HAL_I32, 8, 16), view(b, 0, KILN_HAL_I32, 8, 16));
  expect_invalid(c, g_t->all_reduce(c->stream, &bad), "all_reduce of i32", "dtype");
  bad = cargs(c, 0, view(b, 0, KILN_HAL_F32, 8, 16), view(b, 0, KILN_HAL_F32, 8, 16));
  bad.dst.shape[0] = 7;
  expect_invalid(c, g_t->all_gather(c->stream, &bad), "all_gather dst too small", "world_size");
  g_t->buffer_free(b);
  /* Still in step. */
  case_all_reduce(c, KILN_HAL_F32, 64, 7, false, false);
}

static int body_all(rank_ctx_t *c) {
  for (int d = 0; d < 3; d++) {
    int32_t dt = d == 0 ? KILN_HAL_F32 : d == 1 ? KILN_HAL_F16 : KILN_HAL_BF16;
    case_all_reduce(c, dt, 1000, 10 + (uint64_t)d, false, false);
    case_all_reduce(c, dt, 800, 20 + (uint64_t)d, true, false);
  }
  case_all_reduce(c, KILN_HAL_F32, 300000, 30, false, false); /* 1.2 MB: two steps */
  case_all_reduce(c, KILN_HAL_BF16, 600000, 31, true, false); /* 1.2 MB: two steps */
  case_all_reduce(c, KILN_HAL_F16, 256, 32, false, true);
  case_all_gather(c, false);
  case_all_gather(c, true);
  case_broadcast(c);
  if (c->world > 1) {
    case_ring(c);
    /* NCCL/RCCL do not check sizes across ranks (a mismatch is undefined there). */
    if (strcmp(g_name, "cpu") == 0) case_mismatch(c);
  }
  return c->failures;
}

/* ---- running ranks ----------------------------------------------------------------------- */

static int rank_run(rank_ctx_t *c) {
  if (!rok(c, g_t->stream_create(g_dev, &c->stream), "stream_create")) return c->failures;
  kiln_hal_comm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.world_size = c->world;
  a.rank = c->rank;
  a.timeout_ms = c->timeout_ms;
  a.id = c->id;
  kiln_hal_error_t *e = g_t->comm_create(g_dev, &a, &c->comm);
  if (e) {
    snprintf(c->last_error, sizeof(c->last_error), "%s", e->message);
    if (c->body) rfail(c, "comm_create: %s", e->message);
    kiln_hal_error_free(e);
  } else if (c->body) {
    c->body(c);
  }
  g_t->comm_destroy(c->comm);
  g_t->stream_destroy(c->stream);
  return c->failures;
}

static void *thread_main(void *p) {
  rank_run(p);
  return NULL;
}

static bool shm_exists(const kiln_hal_comm_id_t *id) {
  char path[200];
  snprintf(path, sizeof(path), "/dev/shm%s", (const char *)id->bytes);
  return access(path, F_OK) == 0;
}

/* Runs body on `world` ranks as threads or forked processes; returns the failures. */
static int run_world(int world, bool fork_ranks, int (*body)(rank_ctx_t *)) {
  rank_ctx_t ctx[8];
  kiln_hal_comm_id_t id;
  kiln_hal_error_t *e = g_t->comm_get_unique_id(&id);
  assert_null(e);
  int failures = 0;
  for (int r = 0; r < world; r++) {
    memset(&ctx[r], 0, sizeof(ctx[r]));
    ctx[r].world = world;
    ctx[r].rank = r;
    ctx[r].id = id;
    ctx[r].timeout_ms = 20000;
    ctx[r].body = body;
  }
  if (fork_ranks) {
    pid_t pids[8];
    fflush(NULL);
    for (int r = 0; r < world; r++) {
      pids[r] = fork();
      assert_true(pids[r] >= 0);
      if (pids[r] == 0) _exit(rank_run(&ctx[r]) ? 1 : 0);
    }
    for (int r = 0; r < world; r++) {
      int st = 0;
      waitpid(pids[r], &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "[%s] forked rank %d of %d failed (status %d)\n", g_name, r, world, st);
        failures++;
      }
    }
  } else {
    pthread_t th[8];
    for (int r = 0; r < world; r++) assert_int_equal(pthread_create(&th[r], NULL, thread_main, &ctx[r]), 0);
    for (int r = 0; r < world; r++) {
      pthread_join(th[r], NULL);
      failures += ctx[r].failures;
    }
  }
  if (shm_exists(&id)) {
    fprintf(stderr, "[%s] /dev/shm%s left behind\n", g_name, (const char *)id.bytes);
    failures++;
  }
  return failures;
}

static void test_collectives_threads(void **state) {
  (void)state;
  SKIP_UNLESS_IN_PROCESS();
  assert_int_equal(run_world(2, false, body_all), 0);
  assert_int_equal(run_world(4, false, body_all), 0);
}

static void test_collectives_processes(void **state) {
  (void)state;
  SKIP_UNLESS_IN_PROCESS();
  assert_int_equal(run_world(2, true, body_all), 0);
  assert_int_equal(run_world(4, true, body_all), 0);
}

static double elapsed_s(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

/* World 3, rank 2 never comes: ranks 0 and 1 fail in about 1 s naming rank 2. */
static void test_collectives_never_joins(void **state) {
  (void)state;
  SKIP_UNLESS_IN_PROCESS();
  kiln_hal_comm_id_t id;
  assert_null(g_t->comm_get_unique_id(&id));
  rank_ctx_t ctx[2];
  pthread_t th[2];
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int r = 0; r < 2; r++) {
    memset(&ctx[r], 0, sizeof(ctx[r]));
    ctx[r] = (rank_ctx_t){.world = 3, .rank = r, .id = id, .timeout_ms = 1000};
    assert_int_equal(pthread_create(&th[r], NULL, thread_main, &ctx[r]), 0);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  double dt = elapsed_s(&t0);
  for (int r = 0; r < 2; r++) {
    printf("rank %d: %s\n", r, ctx[r].last_error);
    assert_non_null(strstr(ctx[r].last_error, "timed out"));
    assert_non_null(strstr(ctx[r].last_error, "rank(s) 2"));
  }
  assert_true(dt >= 0.9 && dt < 5.0);
  assert_false(shm_exists(&id));
}

/* A forked rank 1 exits right after joining: rank 0's all_reduce fails naming rank 1. */
static int body_wait_for_dead(rank_ctx_t *c) {
  if (c->rank == 1) return 0; /* "crashes": leaves without calling the collective */
  kiln_hal_buffer_t *b = NULL;
  if (!rok(c, dev_alloc(256, 0, &b), "buffer_alloc")) return c->failures;
  rok(c, g_t->fill(c->stream, b, 0, 256, 0), "fill");
  kiln_hal_coll_args_t a = cargs(c, 0, view(b, 0, KILN_HAL_F32, 4, 16), view(b, 0, KILN_HAL_F32, 4, 16));
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  kiln_hal_error_t *e = g_t->all_reduce(c->stream, &a);
  double dt = elapsed_s(&t0);
  if (!e || e->code != KILN_HAL_ERR_DEVICE || !strstr(e->message, "rank(s) 1"))
    rfail(c, "all_reduce with a dead peer: %s", e ? e->message : "succeeded");
  else
    printf("rank 0 after %.2f s: %s\n", dt, e->message);
  if (dt < 0.9 || dt > 5.0) rfail(c, "the timeout took %.2f s, want about 1 s", dt);
  kiln_hal_error_free(e);
  /* A broken communicator fails at once. */
  e = g_t->all_reduce(c->stream, &a);
  if (!e || !strstr(e->message, "broken")) rfail(c, "second all_reduce: %s", e ? e->message : "succeeded");
  kiln_hal_error_free(e);
  g_t->buffer_free(b);
  return c->failures;
}

static void test_collectives_dead_peer(void **state) {
  (void)state;
  SKIP_UNLESS_IN_PROCESS();
  kiln_hal_comm_id_t id;
  assert_null(g_t->comm_get_unique_id(&id));
  rank_ctx_t ctx[2];
  pid_t pids[2];
  fflush(NULL);
  for (int r = 0; r < 2; r++) {
    ctx[r] = (rank_ctx_t){.world = 2, .rank = r, .id = id, .timeout_ms = 1000, .body = body_wait_for_dead};
    pids[r] = fork();
    assert_true(pids[r] >= 0);
    if (pids[r] == 0) _exit(rank_run(&ctx[r]) ? 1 : 0);
  }
  for (int r = 0; r < 2; r++) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
  }
  assert_false(shm_exists(&id));
}

/* Bad comm_create arguments: clear errors, no segment. */
static void test_collectives_bad_create(void **state) {
  (void)state;
  SKIP_UNLESS_IN_PROCESS();
  kiln_hal_comm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.world_size = 2;
  a.rank = 2;
  assert_null(g_t->comm_get_unique_id(&a.id));
  kiln_hal_comm_t *c = (kiln_hal_comm_t *)&a;
  kiln_hal_error_t *e = g_t->comm_create(g_dev, &a, &c);
  assert_non_null(e);
  assert_null(c);
  assert_int_equal(e->code, KILN_HAL_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(e->message, "rank 2"));
  kiln_hal_error_free(e);
  a.rank = 0;
  a.world_size = 0;
  e = g_t->comm_create(g_dev, &a, &c);
  assert_non_null(e);
  assert_non_null(strstr(e->message, "world_size"));
  kiln_hal_error_free(e);
  a.world_size = 1;
  memset(a.id.bytes, 0, sizeof(a.id.bytes));
  memcpy(a.id.bytes, "nonsense", 8);
  e = g_t->comm_create(g_dev, &a, &c);
  assert_non_null(e);
  assert_non_null(strstr(e->message, "id"));
  kiln_hal_error_free(e);
  /* world_size 1 works and every collective is a copy. */
  assert_int_equal(run_world(1, false, body_all), 0);
}

static int setup_device(int index);

static int setup(void **state) {
  (void)state;
  return setup_device(0);
}

static int setup_device(int index) {
  const char *s = getenv("KILN_TEST_SEED");
  if (!g_seed) g_seed = s && *s ? strtoull(s, NULL, 0) : (uint64_t)time(NULL);
  printf("test_collectives: seed %llu (KILN_TEST_SEED to repeat)\n", (unsigned long long)g_seed);
  kiln_hal_registry_options_t opts;
  memset(&opts, 0, sizeof(opts));
  kiln_status_t st = kiln_hal_registry_create(&opts, &g_registry);
  if (st) {
    kiln_status_free(st);
    return -1;
  }
  const char *want = getenv("KILN_TEST_BACKENDS");
  const char *name = want && *want ? want : "cpu";
  const kiln_hal_plugin_t *p = NULL;
  st = kiln_hal_registry_open(g_registry, name, &p);
  if (st) {
    printf("test_collectives: backend %s: %s\n", name, kiln_status_message(st));
    kiln_status_free(st);
    return -1;
  }
  g_name = p->name;
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  if (p->table.device_info(0, &info) || !(info.caps & KILN_HAL_CAP_COLLECTIVES) ||
      !p->table.comm_create) {
    printf("test_collectives: backend %s has no collectives: skipped\n", name);
    return 0;
  }
  g_in_process = (info.caps & KILN_HAL_CAP_HOST_MEMORY) != 0;
  int32_t count = 1;
  if (p->table.device_count(&count) == NULL && count > 0) index %= count;
  kiln_hal_error_t *e = p->table.device_open(index, &g_dev);
  if (e) {
    printf("test_collectives: device 0: %s\n", e->message);
    kiln_hal_error_free(e);
    return -1;
  }
  g_t = &p->table;
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (g_dev) g_t->device_close(g_dev);
  kiln_hal_registry_free(g_registry);
  return 0;
}

/* One rank of a multi-process run (tools/dev/collectives_gpu.sh): KILN_COLL_RANK and
 * KILN_COLL_WORLD say who this is, KILN_COLL_ID_FILE where rank 0 leaves the unique id. Each
 * rank opens device (rank mod device count) and runs every case once. This is how a GPU
 * backend is tested: NCCL needs one process per GPU, started fresh (a CUDA context does not
 * survive fork). */
static int main_rank(int rank, int world, const char *id_file) {
  if (setup_device(rank) != 0 || !g_t) {
    fprintf(stderr, "test_collectives: rank %d: no backend with collectives\n", rank);
    return 2;
  }
  rank_ctx_t c;
  memset(&c, 0, sizeof(c));
  c.world = world;
  c.rank = rank;
  c.timeout_ms = 60000;
  c.body = body_all;
  if (rank == 0) {
    kiln_hal_error_t *e = g_t->comm_get_unique_id(&c.id);
    if (e) {
      fprintf(stderr, "comm_get_unique_id: %s\n", e->message);
      kiln_hal_error_free(e);
      return 1;
    }
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", id_file);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(c.id.bytes, 1, sizeof(c.id.bytes), f) != sizeof(c.id.bytes) || fclose(f) ||
        rename(tmp, id_file)) {
      fprintf(stderr, "cannot write %s\n", id_file);
      return 1;
    }
  } else {
    for (int i = 0;; i++) {
      FILE *f = fopen(id_file, "rb");
      size_t got = f ? fread(c.id.bytes, 1, sizeof(c.id.bytes), f) : 0;
      if (f) fclose(f);
      if (got == sizeof(c.id.bytes)) break;
      if (i > 600) {
        fprintf(stderr, "rank %d: no id in %s after 60 s\n", rank, id_file);
        return 1;
      }
      struct timespec ts = {0, 100000000};
      nanosleep(&ts, NULL);
    }
  }
  int failures = rank_run(&c);
  printf("test_collectives: %s rank %d of %d: %s\n", g_name, rank, world,
         failures ? "FAILED" : "passed");
  teardown(NULL);
  return failures ? 1 : 0;
}

int main(void) {
  const char *rank = getenv("KILN_COLL_RANK"), *world = getenv("KILN_COLL_WORLD"),
             *id_file = getenv("KILN_COLL_ID_FILE");
  if (rank && world && id_file) {
    const char *s = getenv("KILN_TEST_SEED");
    g_seed = s && *s ? strtoull(s, NULL, 0) : 1;
    return main_rank(atoi(rank), atoi(world), id_file);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_collectives_bad_create),
      cmocka_unit_test(test_collectives_threads),
      cmocka_unit_test(test_collectives_processes),
      cmocka_unit_test(test_collectives_never_joins),
      cmocka_unit_test(test_collectives_dead_peer),
  };
  return cmocka_run_group_tests_name("collectives", tests, setup, teardown);
}
