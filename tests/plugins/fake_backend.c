/* fake_backend.c - purpose-built plugins for the loader tests, one source compiled with
 * different FAKE_* definitions into each misbehaving (or well-behaved) variant:
 *   FAKE_NAME        the name the table reports (string)
 *   FAKE_MAJOR       the ABI major it claims (default: the host's)
 *   FAKE_MINOR       the ABI minor it claims; > host minor makes the table carry extra members
 *   FAKE_SCORE       probe score (0 = "no device", with a message)
 *   FAKE_SHORT       the table stops before the graph members (an older, shorter table);
 *                    the members past struct_size hold poison the host must never call
 *   FAKE_NULL_ROPE   a required member is NULL
 *   FAKE_FAIL_GEMM   gemm returns an injected device error
 *   FAKE_NO_ENTRY    the entry symbol is not exported
 *   FAKE_NEEDS_DEP   links a library that the test keeps off the search path
 *   FAKE_WRAP_CPU    a fake GPU that works: init() loads the cpu backend through
 *                    host->load_backend() and every device, buffer, stream, copy, op and graph
 *                    member forwards to it (handles are the cpu backend's own), so a model runs
 *                    through this plugin exactly as on cpu (tests/test_plugin_folders.sh)
 *   FAKE_COUNT_INIT  appends its life cycle ("<name> init|shutdown|touch ...") to the file named
 *                    by [plugin.<name>] counts_file (read at init, kept until shutdown), and
 *                    device_count ("touch") uses the host pointer and strings kept since init
 *                    (tests/test_registry_nesting.c). FAKE_MINOR=0 then reads the host through
 *                    ABI 1.0's kiln_hal_host_t, as a plugin built against 1.0 does.
 * Otherwise buffers are malloc'ed host memory; ops other than gemm/fill/copies answer
 * UNSUPPORTED. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln/hal_util.h"

#ifdef FAKE_WRAP_CPU
/* The fake device members below stay compiled (one source for every variant) but the wrapper's
 * table does not use them. */
#pragma GCC diagnostic ignored "-Wunused-function"
#endif

#ifndef FAKE_MAJOR
#define FAKE_MAJOR KILN_HAL_ABI_MAJOR
#endif
#ifndef FAKE_MINOR
#if FAKE_MAJOR == KILN_HAL_ABI_MAJOR
#define FAKE_MINOR KILN_HAL_ABI_MINOR
#else
#define FAKE_MINOR 0 /* a plugin of another major: that major's first minor ("ABI 2.0") */
#endif
#endif
#ifndef FAKE_SCORE
#define FAKE_SCORE 150
#endif

#define EXPORT __attribute__((visibility("default")))

struct kiln_hal_buffer {
  size_t size;
  unsigned char *data;
};
struct kiln_hal_device {
  int unused;
};
struct kiln_hal_stream {
  int unused;
};

static struct kiln_hal_device fake_device;
static int fake_initialised;

#ifdef FAKE_NEEDS_DEP
int kiln_test_missing_dep(void); /* in a library kept off the search path */
#endif

#ifdef FAKE_WRAP_CPU
/* The wrapped cpu backend; set by init(), owned (and shut down) by the host. */
static const kiln_hal_backend_t *wrapped;
static kiln_hal_error_t *wrap_load(const kiln_hal_host_t *host);
#endif

#ifdef FAKE_COUNT_INIT
#if FAKE_MINOR == 0
/* kiln_hal_host_t as ABI 1.0 had it (up to num_threads): what a plugin built against 1.0 reads. */
typedef struct fake_host {
  uint32_t struct_size;
  void *ctx;
  void (*log)(void *ctx, int32_t level, const char *message);
  const char *(*config_get)(void *ctx, const char *key);
  const struct kiln_hal_backend *(*load_backend)(void *ctx, const char *name_or_path,
                                                 kiln_hal_error_t **out_error);
  int32_t num_threads;
} fake_host_t;
#else
typedef kiln_hal_host_t fake_host_t;
#endif
static const fake_host_t *count_host; /* kept from init to shutdown, as hal.h allows */
static const char *count_file;        /* [plugin.<name>] counts_file, kept likewise */
static const char *count_greeting;    /* [plugin.<name>] greeting, kept likewise */
static int count_inits, count_shutdowns;

/* Appends "<name> <event> inits=N shutdowns=N <detail>" to count_file. */
static void count_event(const char *event, const char *detail) {
  if (!count_file) return;
  FILE *f = fopen(count_file, "a");
  if (!f) return;
  fprintf(f, "%s %s inits=%d shutdowns=%d %s\n", FAKE_NAME, event, count_inits, count_shutdowns,
          detail ? detail : "");
  fclose(f);
}

static const char *count_config(const char *key) {
  const fake_host_t *h = count_host;
  return h && KILN_HAL_HAS(h, config_get) && h->config_get ? h->config_get(h->ctx, key) : NULL;
}

static void count_init(const kiln_hal_host_t *host) {
  int nested = count_host != NULL; /* init while initialised: the host broke hal.h's LIFETIME */
  count_host = (const fake_host_t *)host;
  count_inits++;
  count_file = count_config("counts_file");
  count_greeting = count_config("greeting");
  char detail[64];
  snprintf(detail, sizeof(detail), "host_size=%u%s", host ? (unsigned)host->struct_size : 0u,
           nested ? " NESTED" : "");
  count_event("init", detail);
}

static void count_shutdown(void) {
  count_shutdowns++;
  count_event("shutdown", count_host ? "" : "NOT-INITIALISED");
  count_host = NULL;
  count_file = count_greeting = NULL;
}

/* Uses what init kept: the host (log, config_get, config_key) and the strings it returned. */
static void count_touch(void) {
  const fake_host_t *h = count_host;
  if (!h) return;
  if (KILN_HAL_HAS(h, log) && h->log)
    h->log(h->ctx, KILN_HAL_LOG_INFO, "fake " FAKE_NAME " touched");
  const char *g = count_config("greeting");
  char keys[256] = "";
#if FAKE_MINOR >= 1
  if (KILN_HAL_HAS(h, config_key) && h->config_key) {
    for (int32_t i = 0; i < 64; i++) {
      const char *k = h->config_key(h->ctx, i);
      if (!k) break;
      snprintf(keys + strlen(keys), sizeof(keys) - strlen(keys), "%s%s", i ? "," : "", k);
    }
  } else {
    snprintf(keys, sizeof(keys), "(no config_key)");
  }
#else
  snprintf(keys, sizeof(keys), "(ABI 1.0: no config_key)");
#endif
  char detail[512];
  snprintf(detail, sizeof(detail), "greeting=%s kept=%s keys=%s", g ? g : "(unset)",
           count_greeting ? count_greeting : "(unset)", keys);
  count_event("touch", detail);
}
#endif

static kiln_hal_error_t *fake_init(const kiln_hal_host_t *host) {
#ifdef FAKE_NEEDS_DEP
  if (kiln_test_missing_dep() != 42) return kiln_hal_error_new(KILN_HAL_ERR_INTERNAL, "bad dep");
#endif
#ifdef FAKE_WRAP_CPU
  kiln_hal_error_t *werr = wrap_load(host);
  if (werr) return werr;
#endif
  if (host && KILN_HAL_HAS(host, log) && host->log)
    host->log(host->ctx, KILN_HAL_LOG_DEBUG, "fake backend " FAKE_NAME " initialised");
  fake_initialised = 1;
#ifdef FAKE_COUNT_INIT
  count_init(host);
#endif
  return NULL;
}
static void fake_shutdown(void) {
  fake_initialised = 0;
#ifdef FAKE_COUNT_INIT
  count_shutdown();
#endif
#ifdef FAKE_WRAP_CPU
  wrapped = NULL; /* the host shuts the cpu backend down after this one */
#endif
}

static kiln_hal_error_t *fake_probe(int32_t *out_score) {
  *out_score = FAKE_SCORE;
  if (FAKE_SCORE == 0)
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE, "no FakeGPU adapter present on this bus");
  return NULL;
}

static kiln_hal_error_t *fake_device_count(int32_t *out_count) {
#ifdef FAKE_COUNT_INIT
  count_touch();
#endif
  *out_count = 1;
  return NULL;
}

static kiln_hal_error_t *fake_device_info(int32_t index, kiln_hal_device_info_t *out) {
  if (index != 0) return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT, "no device %d", index);
  memset(out, 0, sizeof(*out));
  out->struct_size = sizeof(*out);
  out->kind = FAKE_SCORE >= 100 ? KILN_HAL_DEVICE_GPU : KILN_HAL_DEVICE_CPU;
  strcpy(out->name, "Fake " FAKE_NAME " device");
  strcpy(out->arch, "fake");
  out->total_memory = out->free_memory = 1u << 30;
  out->caps = KILN_HAL_CAP_HOST_MEMORY;
  out->warp_size = 32;
  out->compute_units = 1;
  return NULL;
}

static kiln_hal_error_t *fake_device_open(int32_t index, kiln_hal_device_t **out) {
  *out = NULL;
  if (index != 0) return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT, "no device %d", index);
  *out = &fake_device;
  return NULL;
}
static void fake_device_close(kiln_hal_device_t *d) { (void)d; }

static kiln_hal_error_t *fake_device_memory(kiln_hal_device_t *d, uint64_t *f, uint64_t *t) {
  *f = *t = 1u << 30;
  return NULL;
}

static kiln_hal_error_t *fake_buffer_alloc(kiln_hal_device_t *d, uint64_t size, uint32_t flags,
                                           kiln_hal_buffer_t **out) {
  *out = NULL;
  kiln_hal_buffer_t *b = calloc(1, sizeof(*b));
  if (!b) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "fake: out of memory");
  b->size = size;
  b->data = malloc(size ? size : 1);
  if (!b->data) {
    free(b);
    return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "fake: out of memory");
  }
  *out = b;
  return NULL;
}
static void fake_buffer_free(kiln_hal_buffer_t *b) {
  if (!b) return;
  free(b->data);
  free(b);
}
static void *fake_buffer_host_ptr(kiln_hal_buffer_t *b) { return b->data; }

static struct kiln_hal_stream fake_stream;
static kiln_hal_error_t *fake_stream_create(kiln_hal_device_t *d, kiln_hal_stream_t **out) {
  *out = &fake_stream;
  return NULL;
}
static void fake_stream_destroy(kiln_hal_stream_t *s) { (void)s; }
static kiln_hal_error_t *fake_stream_sync(kiln_hal_stream_t *s) { return NULL; }

static kiln_hal_error_t *fake_range(kiln_hal_buffer_t *b, uint64_t off, uint64_t size) {
  if (off > b->size || size > b->size - off)
    return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT, "fake: range past buffer end");
  return NULL;
}
static kiln_hal_error_t *fake_copy_h2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t off,
                                       const void *src, uint64_t size) {
  kiln_hal_error_t *e = fake_range(dst, off, size);
  if (!e) memcpy(dst->data + off, src, size);
  return e;
}
static kiln_hal_error_t *fake_copy_d2h(kiln_hal_stream_t *s, void *dst, kiln_hal_buffer_t *src,
                                       uint64_t off, uint64_t size) {
  kiln_hal_error_t *e = fake_range(src, off, size);
  if (!e) memcpy(dst, src->data + off, size);
  return e;
}
static kiln_hal_error_t *fake_copy_d2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t doff,
                                       kiln_hal_buffer_t *src, uint64_t soff, uint64_t size) {
  kiln_hal_error_t *e = fake_range(dst, doff, size);
  if (!e) e = fake_range(src, soff, size);
  if (!e) memmove(dst->data + doff, src->data + soff, size);
  return e;
}
static kiln_hal_error_t *fake_fill(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t off,
                                   uint64_t size, uint8_t value) {
  kiln_hal_error_t *e = fake_range(dst, off, size);
  if (!e) memset(dst->data + off, value, size);
  return e;
}

static kiln_hal_error_t *fake_gemm(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *a) {
#ifdef FAKE_FAIL_GEMM
  return kiln_hal_error_new(KILN_HAL_ERR_DEVICE, "injected failure: fake device lost in gemm");
#else
  return kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED, "fake: gemm not implemented");
#endif
}

#define FAKE_UNSUPPORTED(op, type)                                                   \
  __attribute__((unused)) static kiln_hal_error_t *fake_##op(kiln_hal_stream_t *s, const type *a) {          \
    return kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED, "fake: " #op " not implemented"); \
  }
FAKE_UNSUPPORTED(embedding, kiln_hal_embedding_args_t)
FAKE_UNSUPPORTED(rmsnorm, kiln_hal_rmsnorm_args_t)
FAKE_UNSUPPORTED(rope, kiln_hal_rope_args_t)
FAKE_UNSUPPORTED(silu_mul, kiln_hal_silu_mul_args_t)
FAKE_UNSUPPORTED(add, kiln_hal_add_args_t)
FAKE_UNSUPPORTED(copy, kiln_hal_copy_args_t)
FAKE_UNSUPPORTED(kv_write, kiln_hal_kv_write_args_t)
FAKE_UNSUPPORTED(attention, kiln_hal_attention_args_t)
FAKE_UNSUPPORTED(argmax, kiln_hal_argmax_args_t)
FAKE_UNSUPPORTED(topk, kiln_hal_topk_args_t)
FAKE_UNSUPPORTED(penalize, kiln_hal_penalize_args_t)
FAKE_UNSUPPORTED(sample, kiln_hal_sample_args_t)
FAKE_UNSUPPORTED(layernorm, kiln_hal_layernorm_args_t)
FAKE_UNSUPPORTED(activation, kiln_hal_activation_args_t)
FAKE_UNSUPPORTED(mask_logits, kiln_hal_mask_args_t)

/* Poison for members past a short table's struct_size: calling it is a host bug. */
__attribute__((unused)) static kiln_hal_error_t *fake_poison_begin(kiln_hal_stream_t *s) { abort(); }

#ifdef FAKE_WRAP_CPU
/* ---- FAKE_WRAP_CPU: every member below forwards to the cpu backend --------------------------- */

static kiln_hal_error_t *wrap_load(const kiln_hal_host_t *host) {
  if (!host || !KILN_HAL_HAS(host, load_backend) || !host->load_backend)
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE,
                              FAKE_NAME ": this host cannot load the cpu backend it wraps");
  kiln_hal_error_t *err = NULL;
  wrapped = host->load_backend(host->ctx, "cpu", &err);
  if (!wrapped)
    return err ? err : kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE, FAKE_NAME ": no cpu backend");
  kiln_hal_error_free(err);
  if (KILN_HAL_HAS(host, log) && host->log)
    host->log(host->ctx, KILN_HAL_LOG_INFO,
              "fake GPU " FAKE_NAME ": every op runs on the cpu backend it wraps");
  return NULL;
}

static kiln_hal_error_t *wrap_device_count(int32_t *out_count) {
#ifdef FAKE_COUNT_INIT
  count_touch();
#endif
  if (!wrapped) return kiln_hal_error_new(KILN_HAL_ERR_INTERNAL, FAKE_NAME ": not initialised");
  return wrapped->device_count(out_count);
}

/* The cpu device, shown as a GPU named for this plugin (without graphs if cpu has none). */
static kiln_hal_error_t *wrap_device_info(int32_t index, kiln_hal_device_info_t *out) {
  if (!wrapped) return kiln_hal_error_new(KILN_HAL_ERR_INTERNAL, FAKE_NAME ": not initialised");
  kiln_hal_error_t *err = wrapped->device_info(index, out);
  if (err) return err;
  if (KILN_HAL_HAS(out, name)) {
    char inner[sizeof(out->name)];
    memcpy(inner, out->name, sizeof(inner));
    inner[sizeof(inner) - 1] = '\0';
    snprintf(out->name, sizeof(out->name), "Fake " FAKE_NAME " GPU (cpu inside: %.80s)", inner);
  }
  if (KILN_HAL_HAS(out, kind)) out->kind = KILN_HAL_DEVICE_GPU;
  if (KILN_HAL_HAS(out, caps) && !wrapped->graph_begin)
    out->caps &= ~(uint64_t)(KILN_HAL_CAP_GRAPHS | KILN_HAL_CAP_MIXED_BATCH_GRAPHS);
  /* The wrapper does not forward the collectives (ABI 1.5). */
  if (KILN_HAL_HAS(out, caps)) out->caps &= ~(uint64_t)KILN_HAL_CAP_COLLECTIVES;
  return NULL;
}

static kiln_hal_error_t *wrap_device_open(int32_t index, kiln_hal_device_t **out) {
  if (!wrapped) {
    *out = NULL;
    return kiln_hal_error_new(KILN_HAL_ERR_INTERNAL, FAKE_NAME ": not initialised");
  }
  return wrapped->device_open(index, out);
}
static void wrap_device_close(kiln_hal_device_t *d) { wrapped->device_close(d); }
static kiln_hal_error_t *wrap_device_memory(kiln_hal_device_t *d, uint64_t *f, uint64_t *t) {
  return wrapped->device_memory(d, f, t);
}
static kiln_hal_error_t *wrap_buffer_alloc(kiln_hal_device_t *d, uint64_t size, uint32_t flags,
                                           kiln_hal_buffer_t **out) {
  return wrapped->buffer_alloc(d, size, flags, out);
}
static void wrap_buffer_free(kiln_hal_buffer_t *b) { wrapped->buffer_free(b); }
static void *wrap_buffer_host_ptr(kiln_hal_buffer_t *b) {
  return wrapped->buffer_host_ptr ? wrapped->buffer_host_ptr(b) : NULL;
}
static kiln_hal_error_t *wrap_stream_create(kiln_hal_device_t *d, kiln_hal_stream_t **out) {
  return wrapped->stream_create(d, out);
}
static void wrap_stream_destroy(kiln_hal_stream_t *s) { wrapped->stream_destroy(s); }
static kiln_hal_error_t *wrap_stream_sync(kiln_hal_stream_t *s) { return wrapped->stream_sync(s); }
static kiln_hal_error_t *wrap_copy_h2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t off,
                                       const void *src, uint64_t size) {
  return wrapped->copy_h2d(s, dst, off, src, size);
}
static kiln_hal_error_t *wrap_copy_d2h(kiln_hal_stream_t *s, void *dst, kiln_hal_buffer_t *src,
                                       uint64_t off, uint64_t size) {
  return wrapped->copy_d2h(s, dst, src, off, size);
}
static kiln_hal_error_t *wrap_copy_d2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t doff,
                                       kiln_hal_buffer_t *src, uint64_t soff, uint64_t size) {
  return wrapped->copy_d2d(s, dst, doff, src, soff, size);
}
static kiln_hal_error_t *wrap_fill(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t off,
                                   uint64_t size, uint8_t value) {
  return wrapped->fill(s, dst, off, size, value);
}

#define WRAP_OP(op, type)                                                   \
  static kiln_hal_error_t *wrap_##op(kiln_hal_stream_t *s, const type *a) { \
    return wrapped->op(s, a);                                               \
  }
WRAP_OP(gemm, kiln_hal_gemm_args_t)
WRAP_OP(embedding, kiln_hal_embedding_args_t)
WRAP_OP(rmsnorm, kiln_hal_rmsnorm_args_t)
WRAP_OP(rope, kiln_hal_rope_args_t)
WRAP_OP(silu_mul, kiln_hal_silu_mul_args_t)
WRAP_OP(add, kiln_hal_add_args_t)
WRAP_OP(copy, kiln_hal_copy_args_t)
WRAP_OP(kv_write, kiln_hal_kv_write_args_t)
WRAP_OP(attention, kiln_hal_attention_args_t)
WRAP_OP(argmax, kiln_hal_argmax_args_t)
WRAP_OP(topk, kiln_hal_topk_args_t)
WRAP_OP(penalize, kiln_hal_penalize_args_t)
WRAP_OP(sample, kiln_hal_sample_args_t)
/* ABI 1.2's optional ops: forwarded when the cpu backend has them. */
#define WRAP_OPTIONAL_OP(op, type)                                          \
  static kiln_hal_error_t *wrap_##op(kiln_hal_stream_t *s, const type *a) { \
    if (!wrapped->op)                                                       \
      return kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED,                   \
                                FAKE_NAME ": the wrapped cpu lacks " #op);  \
    return wrapped->op(s, a);                                               \
  }
WRAP_OPTIONAL_OP(layernorm, kiln_hal_layernorm_args_t)
WRAP_OPTIONAL_OP(activation, kiln_hal_activation_args_t)
WRAP_OPTIONAL_OP(mask_logits, kiln_hal_mask_args_t)

/* Graphs: forwarded when the cpu backend has them (device_info hides CAP_GRAPHS otherwise). */
static kiln_hal_error_t *wrap_no_graphs(void) {
  return kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED, FAKE_NAME ": the wrapped cpu has no graphs");
}
static kiln_hal_error_t *wrap_graph_begin(kiln_hal_stream_t *s) {
  return wrapped->graph_begin ? wrapped->graph_begin(s) : wrap_no_graphs();
}
static kiln_hal_error_t *wrap_graph_end(kiln_hal_stream_t *s, kiln_hal_graph_t **out) {
  if (!wrapped->graph_end) {
    *out = NULL;
    return wrap_no_graphs();
  }
  return wrapped->graph_end(s, out);
}
static kiln_hal_error_t *wrap_graph_replay(kiln_hal_graph_t *g, kiln_hal_stream_t *s) {
  return wrapped->graph_replay ? wrapped->graph_replay(g, s) : wrap_no_graphs();
}
static void wrap_graph_destroy(kiln_hal_graph_t *g) {
  if (wrapped->graph_destroy) wrapped->graph_destroy(g);
}
#define FAKE_IMPL(m) wrap_##m
#else
#define FAKE_IMPL(m) fake_##m
#endif

/* A newer minor: the 1.0 table followed by members this host does not know. */
typedef struct fake_table {
  kiln_hal_backend_t base;
  void (*future_member)(void);
  uint64_t future_flags;
} fake_table_t;

static void fake_future(void) { abort(); }

static const fake_table_t fake_table = {
    .base =
        {
#if FAKE_MINOR > KILN_HAL_ABI_MINOR
            .struct_size = sizeof(fake_table_t),
#elif defined(FAKE_SHORT)
            .struct_size = offsetof(kiln_hal_backend_t, graph_begin),
#elif FAKE_MAJOR == KILN_HAL_ABI_MAJOR && FAKE_MINOR < 2
            /* A 1.0 or 1.1 plugin: its table ends before 1.2's ops. */
            .struct_size = offsetof(kiln_hal_backend_t, layernorm),
#elif FAKE_MAJOR == KILN_HAL_ABI_MAJOR && FAKE_MINOR < 3
            /* A 1.2 plugin: its table ends before 1.3's mask_logits. */
            .struct_size = offsetof(kiln_hal_backend_t, mask_logits),
#else
            .struct_size = sizeof(kiln_hal_backend_t),
#endif
            .abi_major = FAKE_MAJOR,
            .abi_minor = FAKE_MINOR,
            .name = FAKE_NAME,
            .build_info = "loader test plugin (" FAKE_NAME ")",
            .init = fake_init,
            .shutdown = fake_shutdown,
            .probe = fake_probe,
            .device_count = FAKE_IMPL(device_count),
            .device_info = FAKE_IMPL(device_info),
            .device_open = FAKE_IMPL(device_open),
            .device_close = FAKE_IMPL(device_close),
            .device_memory = FAKE_IMPL(device_memory),
            .buffer_alloc = FAKE_IMPL(buffer_alloc),
            .buffer_free = FAKE_IMPL(buffer_free),
            .buffer_host_ptr = FAKE_IMPL(buffer_host_ptr),
            .stream_create = FAKE_IMPL(stream_create),
            .stream_destroy = FAKE_IMPL(stream_destroy),
            .stream_sync = FAKE_IMPL(stream_sync),
            .copy_h2d = FAKE_IMPL(copy_h2d),
            .copy_d2h = FAKE_IMPL(copy_d2h),
            .copy_d2d = FAKE_IMPL(copy_d2d),
            .fill = FAKE_IMPL(fill),
            .gemm = FAKE_IMPL(gemm),
            .embedding = FAKE_IMPL(embedding),
            .rmsnorm = FAKE_IMPL(rmsnorm),
#ifndef FAKE_NULL_ROPE
            .rope = FAKE_IMPL(rope),
#endif
            .silu_mul = FAKE_IMPL(silu_mul),
            .add = FAKE_IMPL(add),
            .copy = FAKE_IMPL(copy),
            .kv_write = FAKE_IMPL(kv_write),
            .attention = FAKE_IMPL(attention),
            .argmax = FAKE_IMPL(argmax),
            .topk = FAKE_IMPL(topk),
            .penalize = FAKE_IMPL(penalize),
            .sample = FAKE_IMPL(sample),
#ifdef FAKE_SHORT
            .graph_begin = fake_poison_begin,
#elif defined(FAKE_WRAP_CPU)
            .graph_begin = wrap_graph_begin,
            .graph_end = wrap_graph_end,
            .graph_replay = wrap_graph_replay,
            .graph_destroy = wrap_graph_destroy,
#endif
#if !(FAKE_MAJOR == KILN_HAL_ABI_MAJOR && FAKE_MINOR < 2)
            .layernorm = FAKE_IMPL(layernorm),
            .activation = FAKE_IMPL(activation),
#endif
#if !(FAKE_MAJOR == KILN_HAL_ABI_MAJOR && FAKE_MINOR < 3)
            .mask_logits = FAKE_IMPL(mask_logits),
#endif
        },
    .future_member = fake_future,
    .future_flags = ~0ull,
};

#ifndef FAKE_NO_ENTRY
EXPORT const kiln_hal_backend_t *kiln_backend_query(uint32_t host_major, uint32_t host_minor);
EXPORT const kiln_hal_backend_t *kiln_backend_query(uint32_t host_major, uint32_t host_minor) {
  (void)host_major;
  (void)host_minor;
  return &fake_table.base;
}
#else
EXPORT const kiln_hal_backend_t *kiln_backend_query_misspelt(uint32_t a, uint32_t b);
EXPORT const kiln_hal_backend_t *kiln_backend_query_misspelt(uint32_t a, uint32_t b) {
  return &fake_table.base;
}
#endif
