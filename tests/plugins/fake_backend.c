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
 * Buffers are malloc'ed host memory; ops other than gemm/fill/copies answer UNSUPPORTED. */
#include <stdlib.h>
#include <string.h>

#include "kiln/hal_util.h"

#ifndef FAKE_MAJOR
#define FAKE_MAJOR KILN_HAL_ABI_MAJOR
#endif
#ifndef FAKE_MINOR
#define FAKE_MINOR KILN_HAL_ABI_MINOR
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

static kiln_hal_error_t *fake_init(const kiln_hal_host_t *host) {
#ifdef FAKE_NEEDS_DEP
  if (kiln_test_missing_dep() != 42) return kiln_hal_error_new(KILN_HAL_ERR_INTERNAL, "bad dep");
#endif
  if (host && KILN_HAL_HAS(host, log) && host->log)
    host->log(host->ctx, KILN_HAL_LOG_DEBUG, "fake backend " FAKE_NAME " initialised");
  fake_initialised = 1;
  return NULL;
}
static void fake_shutdown(void) { fake_initialised = 0; }

static kiln_hal_error_t *fake_probe(int32_t *out_score) {
  *out_score = FAKE_SCORE;
  if (FAKE_SCORE == 0)
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE, "no FakeGPU adapter present on this bus");
  return NULL;
}

static kiln_hal_error_t *fake_device_count(int32_t *out_count) {
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

/* Poison for members past a short table's struct_size: calling it is a host bug. */
__attribute__((unused)) static kiln_hal_error_t *fake_poison_begin(kiln_hal_stream_t *s) { abort(); }

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
            .device_count = fake_device_count,
            .device_info = fake_device_info,
            .device_open = fake_device_open,
            .device_close = fake_device_close,
            .device_memory = fake_device_memory,
            .buffer_alloc = fake_buffer_alloc,
            .buffer_free = fake_buffer_free,
            .buffer_host_ptr = fake_buffer_host_ptr,
            .stream_create = fake_stream_create,
            .stream_destroy = fake_stream_destroy,
            .stream_sync = fake_stream_sync,
            .copy_h2d = fake_copy_h2d,
            .copy_d2h = fake_copy_d2h,
            .copy_d2d = fake_copy_d2d,
            .fill = fake_fill,
            .gemm = fake_gemm,
            .embedding = fake_embedding,
            .rmsnorm = fake_rmsnorm,
#ifndef FAKE_NULL_ROPE
            .rope = fake_rope,
#endif
            .silu_mul = fake_silu_mul,
            .add = fake_add,
            .copy = fake_copy,
            .kv_write = fake_kv_write,
            .attention = fake_attention,
            .argmax = fake_argmax,
            .topk = fake_topk,
            .penalize = fake_penalize,
            .sample = fake_sample,
#ifdef FAKE_SHORT
            .graph_begin = fake_poison_begin,
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
