/* trace.c - the trace backend: wraps another backend and reports per-op counts and times.
 *
 * A third-party plugin in all but location: it includes only the installed SDK headers
 * (<kiln/hal.h>, <kiln/hal_util.h>) and links nothing of libkiln. It is chosen by name
 * ([backend] name = trace) and configured in its own INI section:
 *
 *   [plugin.trace]
 *   backend = auto        the backend to wrap: a name (auto, cpu, cuda, ...) or a path
 *   sync = false          true: stream_sync after every op, so its time is device time
 *   output = stderr       stderr, stdout or a file (reports are appended)
 *   format = text         text, or json (one object per line)
 *   gemm_shapes = 10      GEMM shapes listed by total time (0 = none)
 *
 * Every table member forwards to the wrapped backend's with the handles unchanged (a device,
 * buffer, stream or graph is the wrapped backend's own), timing the call with CLOCK_MONOTONIC.
 * Ops enqueued while their stream captures a graph are counted as captured (they do not run
 * then); each graph remembers how many of each op it holds, so a replay adds them to the
 * "replayed" column while its time goes to graph_replay. shutdown() writes the report; the host
 * shuts the wrapped backend down itself, after this one (reverse order of init).
 *
 * A key of [plugin.trace] that is not one of the above is an error at init naming it, when the
 * host can list the section's keys (ABI 1.1 config_key; an ABI 1.0 host cannot).
 *
 * THREAD-SAFETY: the counters are C11 atomics. The capture, graph and GEMM-shape tables share
 * one spin lock (held for a table look-up only; no pthread dependency). init and shutdown run on
 * the host's one thread, as hal.h says. One configuration per process: a host calls init once
 * while the plugin is initialised, however many registries (engines) open it, and shutdown when
 * the last one is freed (hal.h, LIFETIME), so two engines at once share one wrapped backend,
 * one configuration (the first engine's) and one report. Hosts older than that (ABI 1.0) could
 * call init again while it was live: such a nested init shares the first one, and the report
 * is written at the last shutdown. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, strcasecmp, open_memstream, sched_yield */

#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <kiln/hal.h>
#include <kiln/hal_util.h>

#define TRACE_EXPORT __attribute__((visibility("default")))
#define TRACE_NAME "trace"
#define TRACE_MAX_GEMM_SHAPES 1000

/* ============================================================================================
 * What is counted
 * ==========================================================================================*/

typedef enum trace_op {
  TRACE_GEMM,
  TRACE_EMBEDDING,
  TRACE_RMSNORM,
  TRACE_ROPE,
  TRACE_SILU_MUL,
  TRACE_ADD,
  TRACE_COPY,
  TRACE_KV_WRITE,
  TRACE_ATTENTION,
  TRACE_ARGMAX,
  TRACE_TOPK,
  TRACE_PENALIZE,
  TRACE_SAMPLE,
  TRACE_LAYERNORM,
  TRACE_ACTIVATION,
  TRACE_MASK_LOGITS,
  TRACE_COPY_H2D,
  TRACE_COPY_D2H,
  TRACE_COPY_D2D,
  TRACE_FILL,
  TRACE_BUFFER_ALLOC,
  TRACE_STREAM_SYNC,
  TRACE_GRAPH_BEGIN,
  TRACE_GRAPH_END,
  TRACE_GRAPH_REPLAY,
  TRACE_OP_COUNT
} trace_op_t;

static const char *const trace_op_names[TRACE_OP_COUNT] = {
    "gemm",   "embedding",    "rmsnorm",     "rope",        "silu_mul",  "add",
    "copy",   "kv_write",     "attention",   "argmax",      "topk",      "penalize",
    "sample", "layernorm",    "activation",  "mask_logits", "copy_h2d",  "copy_d2h",  "copy_d2d",
    "fill",   "buffer_alloc", "stream_sync", "graph_begin", "graph_end", "graph_replay",
};

/* Counters of one op. calls + captured is every call the host made. */
typedef struct trace_stat {
  _Atomic uint64_t calls;    /* calls that ran (not captured), failed ones included */
  _Atomic uint64_t errors;   /* calls (run or captured) that returned an error */
  _Atomic uint64_t captured; /* calls made while their stream captured a graph */
  _Atomic uint64_t replayed; /* runs inside graph_replay (timed as part of the replay) */
  _Atomic uint64_t ns_total; /* wall time of the `calls`, ns */
  _Atomic uint64_t ns_max;
  _Atomic uint64_t bytes; /* copies, fill, buffer_alloc: bytes over `calls` */
} trace_stat_t;

/* A stream between graph_begin and graph_end (key = stream), or a graph from graph_end (key =
 * graph): how many of each op it recorded. */
typedef struct trace_rec {
  const void *key;
  uint32_t counts[TRACE_OP_COUNT];
} trace_rec_t;

typedef struct trace_recs {
  trace_rec_t *v;
  size_t n, cap;
} trace_recs_t;

/* One GEMM shape: c[batch, m, n] = a[batch, m, k] @ b[batch, k, n]. */
typedef struct trace_shape {
  int64_t m, n, k, batch;
  int32_t dtype, out_dtype;
  uint64_t calls, ns;
  bool used;
} trace_shape_t;

#define TRACE_SHAPE_SLOTS 2048 /* power of two; filled to 3/4 at most */

typedef enum trace_format { TRACE_TEXT = 0, TRACE_JSON = 1 } trace_format_t;

/* ============================================================================================
 * State. Written by init/shutdown only, except the counters and the locked tables.
 * ==========================================================================================*/

static kiln_hal_backend_t g_inner; /* copy of the wrapped table, zero past its struct_size */
static const kiln_hal_host_t *g_host;
static int g_refs; /* live init()s */
static bool g_sync;
static trace_format_t g_format;
static int g_gemm_top;
static FILE *g_out;
static bool g_out_owned;
static char g_out_name[256];
static char g_want[256];        /* [plugin.trace] backend as given (or "auto") */
static char g_device_name[128]; /* the wrapped backend's device 0 */
static uint64_t g_t_init;

static trace_stat_t g_stats[TRACE_OP_COUNT];
static _Atomic uint64_t g_devices_opened;
static _Atomic int g_ncapturing; /* g_captures.n, read without the lock on every op */

static atomic_flag g_lock = ATOMIC_FLAG_INIT;
static trace_recs_t g_captures; /* streams capturing now */
static trace_recs_t g_graphs;   /* live graphs */
static trace_shape_t g_shapes[TRACE_SHAPE_SLOTS];
static size_t g_nshapes;
static uint64_t g_shapes_dropped; /* GEMM calls whose shape found no free slot */

static char g_build_info[256] =
    "per-op counts and times over the backend named by [plugin.trace] backend";

/* ============================================================================================
 * Helpers
 * ==========================================================================================*/

static uint64_t trace_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void trace_lock(void) {
  for (unsigned spins = 0; atomic_flag_test_and_set_explicit(&g_lock, memory_order_acquire);
       spins++)
    if (spins >= 64) sched_yield();
}

static void trace_unlock(void) { atomic_flag_clear_explicit(&g_lock, memory_order_release); }

static void trace_max(_Atomic uint64_t *p, uint64_t v) {
  uint64_t cur = atomic_load_explicit(p, memory_order_relaxed);
  while (v > cur && !atomic_compare_exchange_weak_explicit(p, &cur, v, memory_order_relaxed,
                                                           memory_order_relaxed)) {
  }
}

static void trace_add(_Atomic uint64_t *p, uint64_t v) {
  atomic_fetch_add_explicit(p, v, memory_order_relaxed);
}

static uint64_t trace_load(_Atomic uint64_t *p) {
  return atomic_load_explicit(p, memory_order_relaxed);
}

static void trace_log(int32_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void trace_log(int32_t level, const char *fmt, ...) {
  if (!g_host || !KILN_HAL_HAS(g_host, log) || !g_host->log) return;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  g_host->log(g_host->ctx, level, msg);
}

/* ---- the record tables (lock held) ------------------------------------------------------- */

static long trace_recs_find(const trace_recs_t *r, const void *key) {
  for (size_t i = 0; i < r->n; i++)
    if (r->v[i].key == key) return (long)i;
  return -1;
}

/* Appends a zeroed record for key; NULL when out of memory. */
static trace_rec_t *trace_recs_add(trace_recs_t *r, const void *key) {
  if (r->n == r->cap) {
    size_t cap = r->cap ? r->cap * 2 : 8;
    trace_rec_t *v = realloc(r->v, cap * sizeof(*v));
    if (!v) return NULL;
    r->v = v;
    r->cap = cap;
  }
  trace_rec_t *rec = &r->v[r->n++];
  memset(rec, 0, sizeof(*rec));
  rec->key = key;
  return rec;
}

static void trace_recs_remove(trace_recs_t *r, long i) { r->v[i] = r->v[--r->n]; }

static void trace_recs_free(trace_recs_t *r) {
  free(r->v);
  memset(r, 0, sizeof(*r));
}

/* ---- timing one call ------------------------------------------------------------------- */

typedef struct trace_call {
  trace_op_t op;
  bool captured; /* its stream was capturing a graph */
  uint64_t t0, ns;
} trace_call_t;

/* Starts timing op. capture_stream: the stream whose capture would record this call, or NULL
 * for calls that are never recorded (graph_begin/end, stream_sync, buffer_alloc). */
static void trace_begin(trace_call_t *c, trace_op_t op, const kiln_hal_stream_t *capture_stream) {
  c->op = op;
  c->captured = false;
  c->ns = 0;
  if (capture_stream && atomic_load_explicit(&g_ncapturing, memory_order_acquire) > 0) {
    trace_lock();
    c->captured = trace_recs_find(&g_captures, capture_stream) >= 0;
    trace_unlock();
  }
  c->t0 = trace_now();
}

/* Ends the call: with [plugin.trace] sync, waits for sync_stream first (not while capturing,
 * where a sync is forbidden). Returns err, or the sync's error. */
static kiln_hal_error_t *trace_end(trace_call_t *c, kiln_hal_stream_t *sync_stream,
                                   kiln_hal_error_t *err, uint64_t bytes) {
  trace_stat_t *st = &g_stats[c->op];
  if (c->captured) {
    trace_add(&st->captured, 1);
    if (err) {
      trace_add(&st->errors, 1);
      return err;
    }
    trace_lock();
    long i = trace_recs_find(&g_captures, sync_stream);
    if (i >= 0) g_captures.v[i].counts[c->op]++;
    trace_unlock();
    return err;
  }
  if (!err && g_sync && sync_stream) err = g_inner.stream_sync(sync_stream);
  c->ns = trace_now() - c->t0;
  trace_add(&st->calls, 1);
  trace_add(&st->ns_total, c->ns);
  trace_max(&st->ns_max, c->ns);
  if (bytes) trace_add(&st->bytes, bytes);
  if (err) trace_add(&st->errors, 1);
  return err;
}

/* Adds one timed GEMM to its shape's row. */
static void trace_gemm_shape(const kiln_hal_gemm_args_t *a, uint64_t ns) {
  if (!a || g_gemm_top <= 0) return;
  int32_t nd = a->a.ndim;
  if ((nd != 2 && nd != 3) || a->b.ndim != nd || a->c.ndim != nd) return;
  trace_shape_t key = {0};
  key.m = a->a.shape[nd - 2];
  key.k = a->a.shape[nd - 1];
  key.n = a->b.shape[nd - 1];
  key.batch = nd == 3 ? a->c.shape[0] : 1;
  key.dtype = a->a.dtype;
  key.out_dtype = a->c.dtype;
  uint64_t h = 1469598103934665603u;
  const int64_t parts[6] = {key.m, key.n, key.k, key.batch, key.dtype, key.out_dtype};
  for (int i = 0; i < 6; i++) h = (h ^ (uint64_t)parts[i]) * 1099511628211u;
  trace_lock();
  for (size_t probe = 0; probe < TRACE_SHAPE_SLOTS; probe++) {
    trace_shape_t *s = &g_shapes[(h + probe) & (TRACE_SHAPE_SLOTS - 1)];
    if (!s->used) {
      if (g_nshapes >= (size_t)TRACE_SHAPE_SLOTS / 4 * 3) {
        g_shapes_dropped++;
        break;
      }
      *s = key;
      s->used = true;
      g_nshapes++;
    }
    if (s->m == key.m && s->n == key.n && s->k == key.k && s->batch == key.batch &&
        s->dtype == key.dtype && s->out_dtype == key.out_dtype) {
      s->calls++;
      s->ns += ns;
      break;
    }
  }
  trace_unlock();
}

static bool trace_has_graphs(void) {
  return g_inner.graph_begin && g_inner.graph_end && g_inner.graph_replay && g_inner.graph_destroy;
}

static kiln_hal_error_t *trace_no_graphs(const char *what) {
  return kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED,
                            "%s: the backend under trace (%s) has no graphs", what,
                            g_inner.name ? g_inner.name : "?");
}

/* ============================================================================================
 * Configuration: [plugin.trace]
 * ==========================================================================================*/

static const char *trace_config(const kiln_hal_host_t *host, const char *key) {
  if (!host || !KILN_HAL_HAS(host, config_get) || !host->config_get) return NULL;
  return host->config_get(host->ctx, key);
}

static int trace_parse_bool(const char *s) {
  static const char *const yes[] = {"true", "yes", "on", "1"};
  static const char *const no[] = {"false", "no", "off", "0"};
  for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
    if (strcasecmp(s, yes[i]) == 0) return 1;
    if (strcasecmp(s, no[i]) == 0) return 0;
  }
  return -1;
}

typedef struct trace_settings {
  const char *backend;
  bool sync;
  trace_format_t format;
  int gemm_top;
  FILE *out;
  bool out_owned;
  const char *out_name;
} trace_settings_t;

/* The keys of [plugin.trace], in the order the error message lists them. */
static const char *const trace_keys[] = {"backend", "sync", "output", "format", "gemm_shapes"};
#define TRACE_NKEYS (sizeof(trace_keys) / sizeof(trace_keys[0]))

/* A key of [plugin.trace] that trace does not know (a typo: `synk = true`) is an error naming
 * it. Needs a host that lists the section's keys (ABI 1.1 config_key); an ABI 1.0 host cannot,
 * and then unknown keys go unnoticed (the report's second line shows the settings in effect). */
static kiln_hal_error_t *trace_check_keys(const kiln_hal_host_t *host) {
  if (!host || !KILN_HAL_HAS(host, config_key) || !host->config_key) return NULL;
  for (int32_t i = 0; i < INT32_MAX; i++) {
    const char *key = host->config_key(host->ctx, i);
    if (!key) break;
    bool known = false;
    for (size_t k = 0; k < TRACE_NKEYS && !known; k++) known = strcmp(key, trace_keys[k]) == 0;
    if (known) continue;
    char valid[128] = "";
    for (size_t k = 0; k < TRACE_NKEYS; k++)
      snprintf(valid + strlen(valid), sizeof(valid) - strlen(valid), "%s%s", k ? ", " : "",
               trace_keys[k]);
    return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                              "[plugin.trace] unknown key '%s': valid keys are %s", key, valid);
  }
  return NULL;
}

/* Reads and checks every key; opens the output. On error nothing is left open. */
static kiln_hal_error_t *trace_settings_read(const kiln_hal_host_t *host, trace_settings_t *s) {
  memset(s, 0, sizeof(*s));
  kiln_hal_error_t *kerr = trace_check_keys(host);
  if (kerr) return kerr;
  const char *v = trace_config(host, "backend");
  s->backend = v ? v : "auto";
  if (!*s->backend)
    return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                              "[plugin.trace] backend is empty: name the backend to wrap (auto, "
                              "cpu, cuda, ...) or give the path of its plugin");
  if ((v = trace_config(host, "sync"))) {
    int b = trace_parse_bool(v);
    if (b < 0)
      return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                                "[plugin.trace] sync = '%s' is not a boolean: use true/false, "
                                "yes/no, on/off or 1/0",
                                v);
    s->sync = b == 1;
  }
  s->format = TRACE_TEXT;
  if ((v = trace_config(host, "format"))) {
    if (strcasecmp(v, "text") == 0)
      s->format = TRACE_TEXT;
    else if (strcasecmp(v, "json") == 0)
      s->format = TRACE_JSON;
    else
      return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                                "[plugin.trace] format = '%s': use text or json", v);
  }
  s->gemm_top = 10;
  if ((v = trace_config(host, "gemm_shapes"))) {
    char *end = NULL;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (!*v || *end || errno || n < 0 || n > TRACE_MAX_GEMM_SHAPES)
      return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                                "[plugin.trace] gemm_shapes = '%s': want an integer in [0, %d] "
                                "(0 = no GEMM shape table)",
                                v, TRACE_MAX_GEMM_SHAPES);
    s->gemm_top = (int)n;
  }
  v = trace_config(host, "output");
  if (!v || strcmp(v, "stderr") == 0) {
    s->out = stderr;
    s->out_name = "stderr";
  } else if (strcmp(v, "stdout") == 0) {
    s->out = stdout;
    s->out_name = "stdout";
  } else if (!*v) {
    return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                              "[plugin.trace] output is empty: use stderr, stdout or a file path");
  } else {
    s->out = fopen(v, "a");
    if (!s->out)
      return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                                "[plugin.trace] output = '%s': cannot open it for appending: %s", v,
                                strerror(errno));
    s->out_owned = true;
    s->out_name = v;
  }
  return NULL;
}

/* ============================================================================================
 * The report
 * ==========================================================================================*/

static void trace_json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\')
      fprintf(f, "\\%c", ch);
    else if (ch < 0x20)
      fprintf(f, "\\u%04x", ch);
    else
      fputc(ch, f);
  }
  fputc('"', f);
}

static const char *trace_bytes(char *buf, size_t n, uint64_t b) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    u++;
  }
  if (u == 0)
    snprintf(buf, n, "%" PRIu64 " B", b);
  else
    snprintf(buf, n, "%.1f %s", v, units[u]);
  return buf;
}

/* A snapshot of one op's counters, for sorting. */
typedef struct trace_row {
  trace_op_t op;
  uint64_t calls, errors, captured, replayed, ns_total, ns_max, bytes;
} trace_row_t;

static int trace_row_cmp(const void *pa, const void *pb) {
  const trace_row_t *a = pa, *b = pb;
  if (a->ns_total != b->ns_total) return a->ns_total > b->ns_total ? -1 : 1;
  if (a->calls != b->calls) return a->calls > b->calls ? -1 : 1;
  return (int)a->op - (int)b->op;
}

static int trace_shape_cmp(const void *pa, const void *pb) {
  const trace_shape_t *a = pa, *b = pb;
  if (a->ns != b->ns) return a->ns > b->ns ? -1 : 1;
  if (a->calls != b->calls) return a->calls > b->calls ? -1 : 1;
  return 0;
}

static double trace_gflops(const trace_shape_t *s) {
  if (!s->ns) return 0.0;
  double flop = 2.0 * (double)s->m * (double)s->n * (double)s->k * (double)s->batch;
  return flop * (double)s->calls / (double)s->ns;
}

static void trace_report_write(FILE *f) {
  trace_row_t rows[TRACE_OP_COUNT];
  int nrows = 0;
  uint64_t all_ns = 0, all_calls = 0, all_errors = 0, all_captured = 0, all_replayed = 0;
  for (int i = 0; i < TRACE_OP_COUNT; i++) {
    trace_stat_t *st = &g_stats[i];
    trace_row_t r = {(trace_op_t)i,
                     trace_load(&st->calls),
                     trace_load(&st->errors),
                     trace_load(&st->captured),
                     trace_load(&st->replayed),
                     trace_load(&st->ns_total),
                     trace_load(&st->ns_max),
                     trace_load(&st->bytes)};
    if (!r.calls && !r.captured && !r.replayed && !r.errors) continue;
    rows[nrows++] = r;
    all_ns += r.ns_total;
    all_calls += r.calls;
    all_errors += r.errors;
    all_captured += r.captured;
    all_replayed += r.replayed;
  }
  qsort(rows, (size_t)nrows, sizeof(rows[0]), trace_row_cmp);

  /* The GEMM shapes, biggest total first (the table is only read here: no lock needed once
   * every handle is released, but take it anyway: it costs nothing). */
  trace_lock();
  size_t nshapes = 0;
  trace_shape_t *shapes = g_nshapes ? malloc(g_nshapes * sizeof(*shapes)) : NULL;
  for (size_t i = 0; shapes && i < TRACE_SHAPE_SLOTS; i++)
    if (g_shapes[i].used) shapes[nshapes++] = g_shapes[i];
  uint64_t dropped = g_shapes_dropped;
  trace_unlock();
  if (nshapes) qsort(shapes, nshapes, sizeof(*shapes), trace_shape_cmp);
  uint64_t gemm_ns = trace_load(&g_stats[TRACE_GEMM].ns_total);
  size_t show = nshapes < (size_t)g_gemm_top ? nshapes : (size_t)g_gemm_top;

  double wall_s = (double)(trace_now() - g_t_init) * 1e-9;
  const char *inner = g_inner.name ? g_inner.name : "?";
  if (g_format == TRACE_JSON) {
    fprintf(f, "{\"report\":\"kiln-trace\",\"pid\":%ld,\"backend\":", (long)getpid());
    trace_json_string(f, inner);
    fprintf(f, ",\"requested\":");
    trace_json_string(f, g_want);
    fprintf(f, ",\"output\":");
    trace_json_string(f, g_out_name);
    fprintf(f, ",\"device\":");
    trace_json_string(f, g_device_name);
    fprintf(f, ",\"sync\":%s,\"times\":\"%s\",\"wall_s\":%.6f,\"gemm_shapes_top\":%d,\"ops\":[",
            g_sync ? "true" : "false", g_sync ? "completion" : "enqueue", wall_s, g_gemm_top);
    for (int i = 0; i < nrows; i++) {
      const trace_row_t *r = &rows[i];
      fprintf(f,
              "%s{\"op\":\"%s\",\"calls\":%" PRIu64 ",\"errors\":%" PRIu64 ",\"captured\":%" PRIu64
              ",\"replayed\":%" PRIu64 ",\"total_ns\":%" PRIu64 ",\"mean_ns\":%" PRIu64
              ",\"max_ns\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"share\":%.6f}",
              i ? "," : "", trace_op_names[r->op], r->calls, r->errors, r->captured, r->replayed,
              r->ns_total, r->calls ? r->ns_total / r->calls : 0, r->ns_max, r->bytes,
              all_ns ? (double)r->ns_total / (double)all_ns : 0.0);
    }
    fprintf(f, "],\"gemm_shapes\":[");
    for (size_t i = 0; i < show; i++) {
      const trace_shape_t *s = &shapes[i];
      fprintf(f,
              "%s{\"m\":%" PRId64 ",\"n\":%" PRId64 ",\"k\":%" PRId64 ",\"batch\":%" PRId64
              ",\"dtype\":\"%s\",\"out_dtype\":\"%s\",\"calls\":%" PRIu64 ",\"total_ns\":%" PRIu64
              ",\"mean_ns\":%" PRIu64 ",\"gflops\":%.3f,\"share_of_gemm\":%.6f}",
              i ? "," : "", s->m, s->n, s->k, s->batch, kiln_hal_dtype_name(s->dtype),
              kiln_hal_dtype_name(s->out_dtype), s->calls, s->ns, s->calls ? s->ns / s->calls : 0,
              trace_gflops(s), gemm_ns ? (double)s->ns / (double)gemm_ns : 0.0);
    }
    fprintf(f, "],\"gemm_shapes_seen\":%zu,\"gemm_calls_unshaped\":%" PRIu64 "}\n", nshapes,
            dropped);
    free(shapes);
    return;
  }

  fprintf(f, "== kiln trace (pid %ld): backend %s", (long)getpid(), inner);
  fprintf(f, ", device 0: %s; %.3f s from init to shutdown\n",
          g_device_name[0] ? g_device_name : "?", wall_s);
  fprintf(
      f,
      "   [plugin.trace] backend = %s, sync = %s, output = %s, format = text, gemm_shapes = %d\n",
      g_want, g_sync ? "true" : "false", g_out_name, g_gemm_top);
  if (g_sync)
    fprintf(
        f,
        "   sync = true: every op is followed by stream_sync on its stream, so its time is the\n"
        "   time to completion (device time plus the call); the run is slower than untraced.\n");
  else
    fprintf(f,
            "   sync = false: times are enqueue times, the host's wall time per call. An\n"
            "   asynchronous backend (a GPU) returns before the work runs and its time shows up\n"
            "   in stream_sync; set [plugin.trace] sync = true for per-op device times.\n");
  fprintf(f, "%-13s %9s %7s %9s %9s %12s %7s %11s %11s %12s\n", "op", "calls", "errors", "captured",
          "replayed", "total ms", "share", "mean us", "max us", "bytes");
  for (int i = 0; i < nrows; i++) {
    const trace_row_t *r = &rows[i];
    char mean[32] = "-", mx[32] = "-", bytes[32] = "";
    if (r->calls) {
      snprintf(mean, sizeof(mean), "%.3f", (double)r->ns_total / (double)r->calls * 1e-3);
      snprintf(mx, sizeof(mx), "%.3f", (double)r->ns_max * 1e-3);
    }
    if (r->bytes) trace_bytes(bytes, sizeof(bytes), r->bytes);
    fprintf(f, "%-13s %9" PRIu64 " %7" PRIu64 " %9" PRIu64 " %9" PRIu64 " %12.3f %6.1f%% %11s %11s",
            trace_op_names[r->op], r->calls, r->errors, r->captured, r->replayed,
            (double)r->ns_total * 1e-6, all_ns ? 100.0 * (double)r->ns_total / (double)all_ns : 0.0,
            mean, mx);
    if (bytes[0]) fprintf(f, " %12s", bytes);
    fputc('\n', f);
  }
  fprintf(f, "%-13s %9" PRIu64 " %7" PRIu64 " %9" PRIu64 " %9" PRIu64 " %12.3f %6.1f%%\n", "total",
          all_calls, all_errors, all_captured, all_replayed, (double)all_ns * 1e-6,
          all_ns ? 100.0 : 0.0);
  if (all_captured || all_replayed)
    fprintf(f,
            "   captured: calls recorded into a graph (not run then); replayed: runs inside\n"
            "   graph_replay, whose time includes them.\n");
  if (show) {
    fprintf(f, "gemm by shape (calls that ran), top %zu of %zu by total time%s:\n", show, nshapes,
            dropped ? " (some calls not classified: too many shapes)" : "");
    fprintf(f, "%8s %8s %8s %6s %-9s %9s %12s %7s %11s %9s\n", "M", "N", "K", "batch", "dtype",
            "calls", "total ms", "share", "mean us", "GFLOP/s");
    for (size_t i = 0; i < show; i++) {
      const trace_shape_t *s = &shapes[i];
      char dt[24];
      if (s->dtype == s->out_dtype)
        snprintf(dt, sizeof(dt), "%s", kiln_hal_dtype_name(s->dtype));
      else
        snprintf(dt, sizeof(dt), "%s>%s", kiln_hal_dtype_name(s->dtype),
                 kiln_hal_dtype_name(s->out_dtype));
      fprintf(f,
              "%8" PRId64 " %8" PRId64 " %8" PRId64 " %6" PRId64 " %-9s %9" PRIu64
              " %12.3f %6.1f%% %11.3f %9.2f\n",
              s->m, s->n, s->k, s->batch, dt, s->calls, (double)s->ns * 1e-6,
              gemm_ns ? 100.0 * (double)s->ns / (double)gemm_ns : 0.0,
              s->calls ? (double)s->ns / (double)s->calls * 1e-3 : 0.0, trace_gflops(s));
    }
  }
  free(shapes);
}

/* Writes the report in one piece (so that reports of processes sharing a file do not mix). */
static void trace_report(void) {
  char *buf = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&buf, &len);
  if (mem) {
    trace_report_write(mem);
    if (fclose(mem) == 0 && buf) fwrite(buf, 1, len, g_out);
    free(buf);
  } else {
    trace_report_write(g_out);
  }
  fflush(g_out);
}

/* ============================================================================================
 * Lifecycle
 * ==========================================================================================*/

static kiln_hal_error_t *tr_init(const kiln_hal_host_t *host) {
  if (g_refs > 0) { /* nested init from an ABI 1.0 host (see THREAD-SAFETY): share the first */
    g_refs++;
    return NULL;
  }
  trace_settings_t s;
  kiln_hal_error_t *err = trace_settings_read(host, &s);
  if (err) return err;
  if (!host || !KILN_HAL_HAS(host, load_backend) || !host->load_backend) {
    err = kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED,
                             "this host does not offer load_backend(): it cannot load the "
                             "backend that trace wraps");
    goto fail;
  }
  kiln_hal_error_t *lerr = NULL;
  const kiln_hal_backend_t *t = host->load_backend(host->ctx, s.backend, &lerr);
  if (!t) {
    err = kiln_hal_error_new(lerr ? lerr->code : KILN_HAL_ERR_NO_DEVICE,
                             "[plugin.trace] backend = %s: %s", s.backend,
                             lerr && lerr->message ? lerr->message : "cannot be loaded");
    kiln_hal_error_free(lerr);
    goto fail;
  }
  kiln_hal_error_free(lerr);
  /* The host checked the wrapped table (ABI, required members); copy it so that nothing here
   * depends on the host's copy staying where it is. Members past its struct_size stay NULL. */
  size_t n = t->struct_size < sizeof(g_inner) ? t->struct_size : sizeof(g_inner);
  if (n < offsetof(kiln_hal_backend_t, sample) + sizeof(t->sample)) {
    err = kiln_hal_error_new(KILN_HAL_ERR_INTERNAL,
                             "[plugin.trace] backend = %s: its table (%u bytes) lacks the 1.0 "
                             "ops",
                             s.backend, t->struct_size);
    goto fail;
  }
  memset(&g_inner, 0, sizeof(g_inner));
  memcpy(&g_inner, t, n);
  g_inner.struct_size = (uint32_t)n;

  g_host = host;
  g_sync = s.sync;
  g_format = s.format;
  g_gemm_top = s.gemm_top;
  g_out = s.out;
  g_out_owned = s.out_owned;
  snprintf(g_out_name, sizeof(g_out_name), "%s", s.out_name);
  snprintf(g_want, sizeof(g_want), "%s", s.backend);
  g_device_name[0] = '\0';
  kiln_hal_device_info_t di;
  memset(&di, 0, sizeof(di));
  di.struct_size = sizeof(di);
  kiln_hal_error_t *derr = g_inner.device_info(0, &di);
  if (derr)
    kiln_hal_error_free(derr);
  else
    snprintf(g_device_name, sizeof(g_device_name), "%s", di.name);
  snprintf(g_build_info, sizeof(g_build_info), "trace over %s%s%s", g_inner.name,
           g_inner.build_info && *g_inner.build_info ? " | " : "",
           g_inner.build_info ? g_inner.build_info : "");
  g_t_init = trace_now();
  g_refs = 1;
  trace_log(KILN_HAL_LOG_INFO,
            "tracing %s (backend = %s), sync = %s, report to %s as %s, gemm_shapes = %d",
            g_inner.name, g_want, g_sync ? "true" : "false", g_out_name,
            g_format == TRACE_JSON ? "json" : "text", g_gemm_top);
  return NULL;

fail:
  if (s.out_owned) fclose(s.out);
  return err;
}

static void tr_shutdown(void) {
  if (g_refs == 0) return;
  if (--g_refs > 0) return;
  /* No report when no device was opened (`kiln info` starts plugins to list devices). No host
   * log either: under an ABI 1.0 host that nested inits, the host of the first init may be gone
   * by now (an ABI 1.1 host keeps it valid until shutdown returns). */
  if (trace_load(&g_devices_opened) > 0) trace_report();
  if (g_out_owned)
    fclose(g_out);
  else if (g_out)
    fflush(g_out);
  g_out = NULL;
  g_out_owned = false;
  /* Back to the state before init, so that a later init (another engine) starts afresh. */
  for (int i = 0; i < TRACE_OP_COUNT; i++) {
    trace_stat_t *st = &g_stats[i];
    atomic_store(&st->calls, 0);
    atomic_store(&st->errors, 0);
    atomic_store(&st->captured, 0);
    atomic_store(&st->replayed, 0);
    atomic_store(&st->ns_total, 0);
    atomic_store(&st->ns_max, 0);
    atomic_store(&st->bytes, 0);
  }
  atomic_store(&g_devices_opened, 0);
  atomic_store(&g_ncapturing, 0);
  trace_lock();
  trace_recs_free(&g_captures);
  trace_recs_free(&g_graphs);
  memset(g_shapes, 0, sizeof(g_shapes));
  g_nshapes = 0;
  g_shapes_dropped = 0;
  trace_unlock();
  memset(&g_inner, 0, sizeof(g_inner));
  g_host = NULL;
}

/* CPU-class and as low as it goes: `backend = auto` (which takes only scores of 100 and more,
 * then cpu by name) never picks trace; it is used by name or path. Needs nothing to probe. */
static kiln_hal_error_t *tr_probe(int32_t *out_score) {
  if (!out_score)
    return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT, "probe: out_score is NULL");
  *out_score = 1;
  return NULL;
}

/* ============================================================================================
 * Devices, buffers, streams: forwarded
 * ==========================================================================================*/

static kiln_hal_error_t *tr_device_count(int32_t *out_count) {
  return g_inner.device_count(out_count);
}

/* The wrapped backend's info, without the capabilities of optional members it lacks. */
static kiln_hal_error_t *tr_device_info(int32_t index, kiln_hal_device_info_t *out_info) {
  kiln_hal_error_t *err = g_inner.device_info(index, out_info);
  if (!err && out_info && KILN_HAL_HAS(out_info, caps)) {
    if (!trace_has_graphs())
      out_info->caps &= ~(uint64_t)(KILN_HAL_CAP_GRAPHS | KILN_HAL_CAP_MIXED_BATCH_GRAPHS);
    if (!g_inner.buffer_host_ptr) out_info->caps &= ~(uint64_t)KILN_HAL_CAP_HOST_MEMORY;
#ifdef KILN_HAL_CAP_COLLECTIVES
    /* The collectives (ABI 1.5) are not traced or forwarded yet. */
    out_info->caps &= ~(uint64_t)KILN_HAL_CAP_COLLECTIVES;
#endif
  }
  return err;
}

static kiln_hal_error_t *tr_device_open(int32_t index, kiln_hal_device_t **out_device) {
  kiln_hal_error_t *err = g_inner.device_open(index, out_device);
  if (!err) trace_add(&g_devices_opened, 1);
  return err;
}

static void tr_device_close(kiln_hal_device_t *device) { g_inner.device_close(device); }

static kiln_hal_error_t *tr_device_memory(kiln_hal_device_t *device, uint64_t *out_free,
                                          uint64_t *out_total) {
  return g_inner.device_memory(device, out_free, out_total);
}

static kiln_hal_error_t *tr_buffer_alloc(kiln_hal_device_t *device, uint64_t size, uint32_t flags,
                                         kiln_hal_buffer_t **out_buffer) {
  trace_call_t c;
  trace_begin(&c, TRACE_BUFFER_ALLOC, NULL);
  kiln_hal_error_t *err = g_inner.buffer_alloc(device, size, flags, out_buffer);
  return trace_end(&c, NULL, err, size);
}

static void tr_buffer_free(kiln_hal_buffer_t *buffer) { g_inner.buffer_free(buffer); }

static void *tr_buffer_host_ptr(kiln_hal_buffer_t *buffer) {
  return g_inner.buffer_host_ptr ? g_inner.buffer_host_ptr(buffer) : NULL;
}

static kiln_hal_error_t *tr_stream_create(kiln_hal_device_t *device,
                                          kiln_hal_stream_t **out_stream) {
  return g_inner.stream_create(device, out_stream);
}

static void tr_stream_destroy(kiln_hal_stream_t *stream) {
  trace_lock();
  long i = trace_recs_find(&g_captures, stream);
  if (i >= 0) {
    trace_recs_remove(&g_captures, i);
    atomic_fetch_sub(&g_ncapturing, 1);
  }
  trace_unlock();
  g_inner.stream_destroy(stream);
}

static kiln_hal_error_t *tr_stream_sync(kiln_hal_stream_t *stream) {
  trace_call_t c;
  trace_begin(&c, TRACE_STREAM_SYNC, NULL);
  kiln_hal_error_t *err = g_inner.stream_sync(stream);
  return trace_end(&c, NULL, err, 0);
}

/* ============================================================================================
 * Copies and ops: timed
 * ==========================================================================================*/

static kiln_hal_error_t *tr_copy_h2d(kiln_hal_stream_t *stream, kiln_hal_buffer_t *dst,
                                     uint64_t dst_offset, const void *src, uint64_t size) {
  trace_call_t c;
  trace_begin(&c, TRACE_COPY_H2D, stream);
  kiln_hal_error_t *err = g_inner.copy_h2d(stream, dst, dst_offset, src, size);
  return trace_end(&c, stream, err, size);
}

static kiln_hal_error_t *tr_copy_d2h(kiln_hal_stream_t *stream, void *dst, kiln_hal_buffer_t *src,
                                     uint64_t src_offset, uint64_t size) {
  trace_call_t c;
  trace_begin(&c, TRACE_COPY_D2H, stream);
  kiln_hal_error_t *err = g_inner.copy_d2h(stream, dst, src, src_offset, size);
  return trace_end(&c, stream, err, size);
}

static kiln_hal_error_t *tr_copy_d2d(kiln_hal_stream_t *stream, kiln_hal_buffer_t *dst,
                                     uint64_t dst_offset, kiln_hal_buffer_t *src,
                                     uint64_t src_offset, uint64_t size) {
  trace_call_t c;
  trace_begin(&c, TRACE_COPY_D2D, stream);
  kiln_hal_error_t *err = g_inner.copy_d2d(stream, dst, dst_offset, src, src_offset, size);
  return trace_end(&c, stream, err, size);
}

static kiln_hal_error_t *tr_fill(kiln_hal_stream_t *stream, kiln_hal_buffer_t *dst, uint64_t offset,
                                 uint64_t size, uint8_t value) {
  trace_call_t c;
  trace_begin(&c, TRACE_FILL, stream);
  kiln_hal_error_t *err = g_inner.fill(stream, dst, offset, size, value);
  return trace_end(&c, stream, err, size);
}

static kiln_hal_error_t *tr_gemm(kiln_hal_stream_t *stream, const kiln_hal_gemm_args_t *args) {
  trace_call_t c;
  trace_begin(&c, TRACE_GEMM, stream);
  kiln_hal_error_t *err = g_inner.gemm(stream, args);
  err = trace_end(&c, stream, err, 0);
  if (!err && !c.captured) trace_gemm_shape(args, c.ns);
  return err;
}

#define TRACE_OP_WRAPPER(name, OP, args_t)                                            \
  static kiln_hal_error_t *tr_##name(kiln_hal_stream_t *stream, const args_t *args) { \
    trace_call_t c;                                                                   \
    trace_begin(&c, OP, stream);                                                      \
    kiln_hal_error_t *err = g_inner.name(stream, args);                               \
    return trace_end(&c, stream, err, 0);                                             \
  }

TRACE_OP_WRAPPER(embedding, TRACE_EMBEDDING, kiln_hal_embedding_args_t)
TRACE_OP_WRAPPER(rmsnorm, TRACE_RMSNORM, kiln_hal_rmsnorm_args_t)
TRACE_OP_WRAPPER(rope, TRACE_ROPE, kiln_hal_rope_args_t)
TRACE_OP_WRAPPER(silu_mul, TRACE_SILU_MUL, kiln_hal_silu_mul_args_t)
TRACE_OP_WRAPPER(add, TRACE_ADD, kiln_hal_add_args_t)
TRACE_OP_WRAPPER(copy, TRACE_COPY, kiln_hal_copy_args_t)
TRACE_OP_WRAPPER(kv_write, TRACE_KV_WRITE, kiln_hal_kv_write_args_t)
TRACE_OP_WRAPPER(attention, TRACE_ATTENTION, kiln_hal_attention_args_t)
TRACE_OP_WRAPPER(argmax, TRACE_ARGMAX, kiln_hal_argmax_args_t)
TRACE_OP_WRAPPER(topk, TRACE_TOPK, kiln_hal_topk_args_t)
TRACE_OP_WRAPPER(penalize, TRACE_PENALIZE, kiln_hal_penalize_args_t)
TRACE_OP_WRAPPER(sample, TRACE_SAMPLE, kiln_hal_sample_args_t)

/* The ABI 1.2 and 1.3 ops are optional, but the table is fixed before the wrapped backend is known:
 * a backend under trace that lacks one (a 1.1 plugin) answers UNSUPPORTED at the call. */
static const char *trace_inner_name(void) { return g_inner.name ? g_inner.name : "?"; }

#define TRACE_OPTIONAL_OP_WRAPPER(op, OP, args_t)                                      \
  static kiln_hal_error_t *tr_##op(kiln_hal_stream_t *stream, const args_t *args) {    \
    trace_call_t c;                                                                    \
    trace_begin(&c, OP, stream);                                                       \
    kiln_hal_error_t *err =                                                            \
        g_inner.op ? g_inner.op(stream, args)                                          \
                   : kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED,                      \
                                        #op ": the backend under trace (%s) lacks it", \
                                        trace_inner_name());                           \
    return trace_end(&c, stream, err, 0);                                              \
  }
TRACE_OPTIONAL_OP_WRAPPER(layernorm, TRACE_LAYERNORM, kiln_hal_layernorm_args_t)
TRACE_OPTIONAL_OP_WRAPPER(activation, TRACE_ACTIVATION, kiln_hal_activation_args_t)
TRACE_OPTIONAL_OP_WRAPPER(mask_logits, TRACE_MASK_LOGITS, kiln_hal_mask_args_t)

/* ============================================================================================
 * Graphs: present in the table always, UNSUPPORTED when the wrapped backend has none (its
 * devices then lack CAP_GRAPHS, so a host never asks).
 * ==========================================================================================*/

static kiln_hal_error_t *tr_graph_begin(kiln_hal_stream_t *stream) {
  trace_call_t c;
  trace_begin(&c, TRACE_GRAPH_BEGIN, NULL);
  if (!trace_has_graphs()) return trace_end(&c, NULL, trace_no_graphs("graph_begin"), 0);
  /* Record the capture before it starts: the stream is this thread's until graph_begin
   * returns, so no op can see the record early. */
  trace_lock();
  bool tracked = trace_recs_find(&g_captures, stream) < 0 && trace_recs_add(&g_captures, stream);
  if (tracked) atomic_fetch_add(&g_ncapturing, 1);
  trace_unlock();
  kiln_hal_error_t *err = g_inner.graph_begin(stream);
  if (err && tracked) {
    trace_lock();
    long i = trace_recs_find(&g_captures, stream);
    if (i >= 0) {
      trace_recs_remove(&g_captures, i);
      atomic_fetch_sub(&g_ncapturing, 1);
    }
    trace_unlock();
  }
  return trace_end(&c, NULL, err, 0);
}

static kiln_hal_error_t *tr_graph_end(kiln_hal_stream_t *stream, kiln_hal_graph_t **out_graph) {
  trace_call_t c;
  trace_begin(&c, TRACE_GRAPH_END, NULL);
  if (!trace_has_graphs()) {
    if (out_graph) *out_graph = NULL;
    return trace_end(&c, NULL, trace_no_graphs("graph_end"), 0);
  }
  kiln_hal_error_t *err = g_inner.graph_end(stream, out_graph);
  /* The capture is over whatever the result (hal.h: a failed capture runs eagerly again). */
  trace_lock();
  long i = trace_recs_find(&g_captures, stream);
  if (i >= 0) {
    trace_rec_t cap = g_captures.v[i];
    trace_recs_remove(&g_captures, i);
    atomic_fetch_sub(&g_ncapturing, 1);
    trace_rec_t *g = !err && out_graph && *out_graph ? trace_recs_add(&g_graphs, *out_graph) : NULL;
    if (g) memcpy(g->counts, cap.counts, sizeof(g->counts)); /* OOM: replays count no ops */
  }
  trace_unlock();
  return trace_end(&c, NULL, err, 0);
}

static kiln_hal_error_t *tr_graph_replay(kiln_hal_graph_t *graph, kiln_hal_stream_t *stream) {
  trace_call_t c;
  trace_begin(&c, TRACE_GRAPH_REPLAY, stream);
  if (!trace_has_graphs()) return trace_end(&c, stream, trace_no_graphs("graph_replay"), 0);
  kiln_hal_error_t *err = g_inner.graph_replay(graph, stream);
  if (!err && !c.captured) {
    uint32_t counts[TRACE_OP_COUNT];
    bool found = false;
    trace_lock();
    long i = trace_recs_find(&g_graphs, graph);
    if (i >= 0) {
      memcpy(counts, g_graphs.v[i].counts, sizeof(counts));
      found = true;
    }
    trace_unlock();
    for (int op = 0; found && op < TRACE_OP_COUNT; op++)
      if (counts[op]) trace_add(&g_stats[op].replayed, counts[op]);
  }
  return trace_end(&c, stream, err, 0);
}

static void tr_graph_destroy(kiln_hal_graph_t *graph) {
  if (!trace_has_graphs()) return;
  trace_lock();
  long i = trace_recs_find(&g_graphs, graph);
  if (i >= 0) trace_recs_remove(&g_graphs, i);
  trace_unlock();
  g_inner.graph_destroy(graph);
}

/* ============================================================================================
 * The table
 * ==========================================================================================*/

static const kiln_hal_backend_t g_table = {
    .struct_size = sizeof(kiln_hal_backend_t),
    .abi_major = KILN_HAL_ABI_MAJOR,
    .abi_minor = KILN_HAL_ABI_MINOR,
    .name = TRACE_NAME,
    .build_info = g_build_info,
    .init = tr_init,
    .shutdown = tr_shutdown,
    .probe = tr_probe,
    .device_count = tr_device_count,
    .device_info = tr_device_info,
    .device_open = tr_device_open,
    .device_close = tr_device_close,
    .device_memory = tr_device_memory,
    .buffer_alloc = tr_buffer_alloc,
    .buffer_free = tr_buffer_free,
    .buffer_host_ptr = tr_buffer_host_ptr,
    .stream_create = tr_stream_create,
    .stream_destroy = tr_stream_destroy,
    .stream_sync = tr_stream_sync,
    .copy_h2d = tr_copy_h2d,
    .copy_d2h = tr_copy_d2h,
    .copy_d2d = tr_copy_d2d,
    .fill = tr_fill,
    .gemm = tr_gemm,
    .embedding = tr_embedding,
    .rmsnorm = tr_rmsnorm,
    .rope = tr_rope,
    .silu_mul = tr_silu_mul,
    .add = tr_add,
    .copy = tr_copy,
    .kv_write = tr_kv_write,
    .attention = tr_attention,
    .argmax = tr_argmax,
    .topk = tr_topk,
    .penalize = tr_penalize,
    .sample = tr_sample,
    .graph_begin = tr_graph_begin,
    .graph_end = tr_graph_end,
    .graph_replay = tr_graph_replay,
    .graph_destroy = tr_graph_destroy,
    .layernorm = tr_layernorm,
    .mask_logits = tr_mask_logits,
    .activation = tr_activation,
};

TRACE_EXPORT const kiln_hal_backend_t *kiln_backend_query(uint32_t host_major, uint32_t host_minor);

/* Returns the table whatever the host's version: the host refuses a major mismatch itself and
 * says why ("plugin ABI 1.0, host ABI 2.0"). */
TRACE_EXPORT const kiln_hal_backend_t *kiln_backend_query(uint32_t host_major,
                                                          uint32_t host_minor) {
  (void)host_major;
  (void)host_minor;
  return &g_table;
}
