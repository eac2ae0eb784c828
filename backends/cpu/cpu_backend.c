/* cpu_backend.c - the CPU plugin's table: lifecycle, the device, buffers, streams, graphs. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_internal.h"

cpu_pool_t *cpu_g_pool;
static const kiln_hal_host_t *g_host;
static int g_threads;
static char g_build_info[256];

/* ============================================================================================
 * Helpers shared by the ops
 * ==========================================================================================*/

kiln_hal_error_t *cpu_err(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_hal_error_t *e = kiln_hal_error_vnew(KILN_HAL_ERR_INVALID_ARGUMENT, fmt, ap);
  va_end(ap);
  return e;
}

int cpu_num_threads(void) {
  if (cpu_g_pool) return cpu_pool_threads(cpu_g_pool);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

void *cpu_scratch(kiln_hal_stream_t *s, size_t bytes) {
  if (bytes <= s->scratch_size) return s->scratch;
  /* Grow geometrically so a warming-up model settles after a few calls. */
  size_t want = s->scratch_size * 2 > bytes ? s->scratch_size * 2 : bytes;
  want = (want + 4095) & ~(size_t)4095;
  void *p = NULL;
  if (posix_memalign(&p, 64, want) != 0) return NULL;
  free(s->scratch);
  s->scratch = p;
  s->scratch_size = want;
  return p;
}

static uint64_t buffer_size(void *ctx, kiln_hal_buffer_t *b) {
  (void)ctx;
  return b->size;
}

const kiln_hal_check_env_t cpu_check_env = {buffer_size, NULL, NULL};

/* ============================================================================================
 * Lifecycle and device
 * ==========================================================================================*/

static void host_log(int32_t level, const char *msg) {
  if (g_host && KILN_HAL_HAS(g_host, log) && g_host->log) g_host->log(g_host->ctx, level, msg);
}

static void build_info_update(int threads) {
  char th[32];
  if (threads > 0) snprintf(th, sizeof(th), "%d threads", threads);
  else snprintf(th, sizeof(th), "threads: auto");
  snprintf(g_build_info, sizeof(g_build_info), "gcc %s, %s (sgemm), x86-64 kernels: %s, %s",
           __VERSION__, cpu_gemm_blas_name(), cpu_vec_features(), th);
}

/* The host calls init once per process while the plugin stays initialised, however many
 * registries open it, and keeps host valid until shutdown (hal.h, LIFETIME); init may run again
 * after a shutdown, so shutdown puts everything back. A second init while live would be a host
 * bug: refuse it rather than share or leak the pool. */
static kiln_hal_error_t *be_init(const kiln_hal_host_t *host) {
  if (cpu_g_pool)
    return kiln_hal_error_new(KILN_HAL_ERR_INTERNAL,
                              "cpu: init called while already initialised (a host bug)");
  g_host = host;
  cpu_vec_init();
  int threads = 0;
  if (host && KILN_HAL_HAS(host, num_threads) && host->num_threads > 0) threads = host->num_threads;
  if (threads <= 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    threads = n > 0 ? (int)n : 1;
  }
  cpu_g_pool = cpu_pool_create(threads);
  if (!cpu_g_pool) {
    g_host = NULL;
    return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY,
                              "cpu: cannot start a pool of %d threads", threads);
  }
  g_threads = cpu_pool_threads(cpu_g_pool);
  cpu_gemm_init(g_threads);
  build_info_update(g_threads);
  char msg[320];
  snprintf(msg, sizeof(msg), "cpu backend: %s", g_build_info);
  host_log(KILN_HAL_LOG_INFO, msg);
  return NULL;
}

static void be_shutdown(void) {
  cpu_pool_destroy(cpu_g_pool);
  cpu_g_pool = NULL;
  g_host = NULL;
  g_threads = 0;
}

static kiln_hal_error_t *be_probe(int32_t *out_score) {
  if (!out_score) return cpu_err("probe: out_score is NULL");
  *out_score = 10;
  return NULL;
}

static kiln_hal_error_t *be_device_count(int32_t *out_count) {
  if (!out_count) return cpu_err("device_count: out_count is NULL");
  *out_count = 1;
  return NULL;
}

/* MemTotal and MemAvailable from /proc/meminfo, in bytes (0 when unreadable). */
static void read_meminfo(uint64_t *total, uint64_t *avail) {
  *total = 0;
  *avail = 0;
  FILE *f = fopen("/proc/meminfo", "r");
  if (!f) return;
  char line[256];
  while (fgets(line, sizeof(line), f)) {
    unsigned long long kb;
    if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) *total = (uint64_t)kb * 1024;
    else if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) *avail = (uint64_t)kb * 1024;
  }
  fclose(f);
}

static kiln_hal_error_t *be_device_info(int32_t index, kiln_hal_device_info_t *out) {
  if (!out) return cpu_err("device_info: out_info is NULL");
  if (index != 0) return cpu_err("device_info: device %d does not exist (the cpu has 1)", (int)index);
  cpu_vec_init();
  int threads = cpu_num_threads();
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  info.kind = KILN_HAL_DEVICE_CPU;
#if defined(__x86_64__)
  snprintf(info.name, sizeof(info.name), "x86_64 CPU (%d threads)", threads);
  snprintf(info.arch, sizeof(info.arch), "x86_64 %s", cpu_vec_features());
#else
  snprintf(info.name, sizeof(info.name), "CPU (%d threads)", threads);
  snprintf(info.arch, sizeof(info.arch), "generic");
#endif
  read_meminfo(&info.total_memory, &info.free_memory);
  info.caps = KILN_HAL_CAP_F16 | KILN_HAL_CAP_BF16 | KILN_HAL_CAP_GRAPHS |
              KILN_HAL_CAP_HOST_MEMORY | KILN_HAL_CAP_DEVICE_SAMPLING |
              KILN_HAL_CAP_MIXED_BATCH_GRAPHS | KILN_HAL_CAP_COLLECTIVES;
  for (int32_t f = KILN_HAL_QFMT_Q4_0; f < KILN_HAL_QFMT_COUNT; f++)
    info.caps |= KILN_HAL_CAP_QUANT(f);
  info.caps |= KILN_HAL_CAP_QUANT(KILN_HAL_QFMT_INT4_G) | KILN_HAL_CAP_QUANT(KILN_HAL_QFMT_INT8_G) |
               KILN_HAL_CAP_QUANT(KILN_HAL_QFMT_FP8_E4M3) | KILN_HAL_CAP_FP8_XQUANT |
               KILN_HAL_CAP_KV_FP8;
  info.warp_size = 1;
  info.compute_units = threads;
  info.pci_bus_id = 0;
  /* Honour the caller's struct_size: an older host has a smaller struct. */
  uint32_t n = out->struct_size && out->struct_size < sizeof(info) ? out->struct_size
                                                                   : (uint32_t)sizeof(info);
  memcpy(out, &info, n);
  out->struct_size = n;
  return NULL;
}

static kiln_hal_error_t *be_device_open(int32_t index, kiln_hal_device_t **out_device) {
  if (!out_device) return cpu_err("device_open: out_device is NULL");
  *out_device = NULL;
  if (index != 0) return cpu_err("device_open: device %d does not exist (the cpu has 1)", (int)index);
  kiln_hal_device_t *d = calloc(1, sizeof(*d));
  if (!d) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "device_open: out of memory");
  d->index = index;
  atomic_init(&d->capturing, 0);
  atomic_init(&d->refusals, 0u);
  *out_device = d;
  return NULL;
}

static void be_device_close(kiln_hal_device_t *device) { free(device); }

static kiln_hal_error_t *be_device_memory(kiln_hal_device_t *device, uint64_t *out_free,
                                          uint64_t *out_total) {
  if (!device) return cpu_err("device_memory: device is NULL");
  uint64_t total, avail;
  read_meminfo(&total, &avail);
  if (out_free) *out_free = avail;
  if (out_total) *out_total = total;
  return NULL;
}

/* ============================================================================================
 * Buffers
 * ==========================================================================================*/

static kiln_hal_error_t *be_buffer_alloc(kiln_hal_device_t *device, uint64_t size, uint32_t flags,
                                         kiln_hal_buffer_t **out_buffer) {
  if (!out_buffer) return cpu_err("buffer_alloc: out_buffer is NULL");
  *out_buffer = NULL;
  if (!device) return cpu_err("buffer_alloc: device is NULL");
  /* hal.h forbids allocation during a capture (a GPU graph could not keep the address): refuse
   * it here too, so that a host that allocates while capturing fails on the CPU in CI, not
   * only on a GPU. The refusal ends the device's captures (graph_end fails). */
  if (atomic_load(&device->capturing) > 0) {
    atomic_fetch_add(&device->refusals, 1u);
    return cpu_err(
        "buffer_alloc: not allowed while a stream of this device captures a graph "
        "(capture invalidated)");
  }
  kiln_hal_buffer_t *b = NULL;
  void *data = NULL;
  /* Round up so that the allocation is a whole number of alignment units; 0 still gets one. */
  if (size > UINT64_MAX - CPU_BUFFER_ALIGN || size > (uint64_t)SIZE_MAX - CPU_BUFFER_ALIGN)
    goto oom;
  size_t bytes = (size_t)((size + CPU_BUFFER_ALIGN - 1) & ~(uint64_t)(CPU_BUFFER_ALIGN - 1));
  if (bytes == 0) bytes = CPU_BUFFER_ALIGN;
  b = calloc(1, sizeof(*b));
  if (!b || posix_memalign(&data, CPU_BUFFER_ALIGN, bytes) != 0) goto oom;
  b->data = data;
  b->size = size;
  *out_buffer = b;
  return NULL;

oom:
  free(b);
  return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY,
                            "buffer_alloc: cannot allocate %llu bytes of host memory",
                            (unsigned long long)size);
}

static void be_buffer_free(kiln_hal_buffer_t *buffer) {
  if (!buffer) return;
  free(buffer->data);
  free(buffer);
}

static void *be_buffer_host_ptr(kiln_hal_buffer_t *buffer) { return buffer ? buffer->data : NULL; }

/* ============================================================================================
 * Streams, raw copies and graph capture
 * ==========================================================================================*/

static kiln_hal_error_t *be_stream_create(kiln_hal_device_t *device, kiln_hal_stream_t **out) {
  if (!out) return cpu_err("stream_create: out_stream is NULL");
  *out = NULL;
  if (!device) return cpu_err("stream_create: device is NULL");
  kiln_hal_stream_t *s = calloc(1, sizeof(*s));
  if (!s) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "stream_create: out of memory");
  s->device = device;
  *out = s;
  return NULL;
}

static void be_stream_destroy(kiln_hal_stream_t *s) {
  if (!s) return;
  if (s->capturing) atomic_fetch_sub(&s->device->capturing, 1);
  free(s->rec);
  free(s->scratch);
  free(s);
}

/* Capture refuses host synchronisation: the call fails and so will graph_end. */
static kiln_hal_error_t *refuse_in_capture(kiln_hal_stream_t *s, const char *what) {
  s->capture_failed = true;
  return cpu_err("%s: not allowed while the stream is capturing a graph (capture invalidated)",
                 what);
}

static kiln_hal_error_t *be_stream_sync(kiln_hal_stream_t *s) {
  if (!s) return cpu_err("stream_sync: stream is NULL");
  if (s->capturing) return refuse_in_capture(s, "stream_sync");
  return NULL;
}

/* Checks [offset, offset + size) against a buffer. */
static kiln_hal_error_t *check_range(const char *op, const char *name, const kiln_hal_buffer_t *b,
                                     uint64_t offset, uint64_t size) {
  if (!b) return cpu_err("%s: %s buffer is NULL", op, name);
  if (offset > b->size || size > b->size - offset)
    return cpu_err("%s: %s range [%llu, +%llu) exceeds the buffer of %llu bytes", op, name,
                   (unsigned long long)offset, (unsigned long long)size,
                   (unsigned long long)b->size);
  return NULL;
}

static kiln_hal_error_t *be_copy_h2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst,
                                     uint64_t dst_offset, const void *src, uint64_t size) {
  if (!s) return cpu_err("copy_h2d: stream is NULL");
  if (s->capturing) return refuse_in_capture(s, "copy_h2d");
  kiln_hal_error_t *e = check_range("copy_h2d", "dst", dst, dst_offset, size);
  if (e) return e;
  if (size && !src) return cpu_err("copy_h2d: src is NULL");
  if (size) memmove((char *)dst->data + dst_offset, src, (size_t)size);
  return NULL;
}

static kiln_hal_error_t *be_copy_d2h(kiln_hal_stream_t *s, void *dst, kiln_hal_buffer_t *src,
                                     uint64_t src_offset, uint64_t size) {
  if (!s) return cpu_err("copy_d2h: stream is NULL");
  if (s->capturing) return refuse_in_capture(s, "copy_d2h");
  kiln_hal_error_t *e = check_range("copy_d2h", "src", src, src_offset, size);
  if (e) return e;
  if (size && !dst) return cpu_err("copy_d2h: dst is NULL");
  if (size) memmove(dst, (const char *)src->data + src_offset, (size_t)size);
  return NULL;
}

/* fill and copy_d2d: validated at capture and again when run. */
static kiln_hal_error_t *run_raw(cpu_op_kind_t kind, const cpu_raw_copy_t *r, bool dry_run) {
  const char *op = kind == CPU_OP_FILL ? "fill" : "copy_d2d";
  kiln_hal_error_t *e = check_range(op, "dst", r->dst, r->dst_offset, r->size);
  if (!e && kind == CPU_OP_COPY_D2D) e = check_range(op, "src", r->src, r->src_offset, r->size);
  if (e || dry_run || r->size == 0) return e;
  char *d = (char *)r->dst->data + r->dst_offset;
  if (kind == CPU_OP_FILL) memset(d, r->value, (size_t)r->size);
  else memmove(d, (const char *)r->src->data + r->src_offset, (size_t)r->size);
  return NULL;
}

static kiln_hal_error_t *run_op(kiln_hal_stream_t *s, const cpu_op_t *op, bool dry_run) {
  switch (op->kind) {
    case CPU_OP_FILL:
    case CPU_OP_COPY_D2D: return run_raw(op->kind, &op->u.raw, dry_run);
    case CPU_OP_GEMM: return cpu_gemm(s, &op->u.gemm, dry_run);
    case CPU_OP_EMBEDDING: return cpu_embedding(s, &op->u.embedding, dry_run);
    case CPU_OP_RMSNORM: return cpu_rmsnorm(s, &op->u.rmsnorm, dry_run);
    case CPU_OP_ROPE: return cpu_rope(s, &op->u.rope, dry_run);
    case CPU_OP_SILU_MUL: return cpu_silu_mul(s, &op->u.silu_mul, dry_run);
    case CPU_OP_ADD: return cpu_add(s, &op->u.add, dry_run);
    case CPU_OP_COPY: return cpu_copy(s, &op->u.copy, dry_run);
    case CPU_OP_KV_WRITE: return cpu_kv_write(s, &op->u.kv_write, dry_run);
    case CPU_OP_ATTENTION: return cpu_attention(s, &op->u.attention, dry_run);
    case CPU_OP_ARGMAX: return cpu_argmax(s, &op->u.argmax, dry_run);
    case CPU_OP_TOPK: return cpu_topk(s, &op->u.topk, dry_run);
    case CPU_OP_PENALIZE: return cpu_penalize(s, &op->u.penalize, dry_run);
    case CPU_OP_SAMPLE: return cpu_sample(s, &op->u.sample, dry_run);
    case CPU_OP_LAYERNORM: return cpu_layernorm(s, &op->u.layernorm, dry_run);
    case CPU_OP_ACTIVATION: return cpu_activation(s, &op->u.activation, dry_run);
    case CPU_OP_MASK_LOGITS: return cpu_mask_logits(s, &op->u.mask_logits, dry_run);
    case CPU_OP_GEMM_QUANT: return cpu_gemm_quant(s, &op->u.gemm_quant, dry_run);
    case CPU_OP_COLL: return cpu_coll_run(s, op->u.coll.op, &op->u.coll.args, dry_run);
  }
  return kiln_hal_error_new(KILN_HAL_ERR_INTERNAL, "cpu: unknown recorded op %d", (int)op->kind);
}

/* Runs an op now, or validates and records it while capturing. */
static kiln_hal_error_t *submit(kiln_hal_stream_t *s, const cpu_op_t *op) {
  if (!s->capturing) return run_op(s, op, false);
  kiln_hal_error_t *e = run_op(s, op, true);
  if (e) {
    s->capture_failed = true;
    return e;
  }
  if (s->rec_len == s->rec_cap) {
    size_t cap = s->rec_cap ? s->rec_cap * 2 : 64;
    cpu_op_t *r = realloc(s->rec, cap * sizeof(*r));
    if (!r) {
      s->capture_failed = true;
      return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "graph capture: out of memory");
    }
    s->rec = r;
    s->rec_cap = cap;
  }
  s->rec[s->rec_len++] = *op;
  return NULL;
}

static kiln_hal_error_t *be_copy_d2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst,
                                     uint64_t dst_offset, kiln_hal_buffer_t *src,
                                     uint64_t src_offset, uint64_t size) {
  if (!s) return cpu_err("copy_d2d: stream is NULL");
  cpu_op_t op;
  memset(&op, 0, sizeof(op));
  op.kind = CPU_OP_COPY_D2D;
  op.u.raw = (cpu_raw_copy_t){dst, src, dst_offset, src_offset, size, 0};
  return submit(s, &op);
}

static kiln_hal_error_t *be_fill(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t offset,
                                 uint64_t size, uint8_t value) {
  if (!s) return cpu_err("fill: stream is NULL");
  cpu_op_t op;
  memset(&op, 0, sizeof(op));
  op.kind = CPU_OP_FILL;
  op.u.raw = (cpu_raw_copy_t){dst, NULL, offset, 0, size, value};
  return submit(s, &op);
}

/* One entry point per op: copy the caller's args (whatever its struct_size) and submit. */
#define CPU_OP_ENTRY(name, KIND, type)                                                  \
  static kiln_hal_error_t *be_##name(kiln_hal_stream_t *s, const type *args) {          \
    if (!s) return cpu_err(#name ": stream is NULL");                                   \
    cpu_op_t op;                                                                        \
    op.kind = KIND;                                                                     \
    kiln_hal_error_t *e = kiln_hal_args_copy(#name, &op.u.name, sizeof(op.u.name), args); \
    return e ? e : submit(s, &op);                                                      \
  }

CPU_OP_ENTRY(gemm, CPU_OP_GEMM, kiln_hal_gemm_args_t)
CPU_OP_ENTRY(embedding, CPU_OP_EMBEDDING, kiln_hal_embedding_args_t)
CPU_OP_ENTRY(rmsnorm, CPU_OP_RMSNORM, kiln_hal_rmsnorm_args_t)
CPU_OP_ENTRY(rope, CPU_OP_ROPE, kiln_hal_rope_args_t)
CPU_OP_ENTRY(silu_mul, CPU_OP_SILU_MUL, kiln_hal_silu_mul_args_t)
CPU_OP_ENTRY(add, CPU_OP_ADD, kiln_hal_add_args_t)
CPU_OP_ENTRY(copy, CPU_OP_COPY, kiln_hal_copy_args_t)
CPU_OP_ENTRY(kv_write, CPU_OP_KV_WRITE, kiln_hal_kv_write_args_t)
CPU_OP_ENTRY(attention, CPU_OP_ATTENTION, kiln_hal_attention_args_t)
CPU_OP_ENTRY(argmax, CPU_OP_ARGMAX, kiln_hal_argmax_args_t)
CPU_OP_ENTRY(topk, CPU_OP_TOPK, kiln_hal_topk_args_t)
CPU_OP_ENTRY(penalize, CPU_OP_PENALIZE, kiln_hal_penalize_args_t)
CPU_OP_ENTRY(sample, CPU_OP_SAMPLE, kiln_hal_sample_args_t)
CPU_OP_ENTRY(layernorm, CPU_OP_LAYERNORM, kiln_hal_layernorm_args_t)
CPU_OP_ENTRY(activation, CPU_OP_ACTIVATION, kiln_hal_activation_args_t)
CPU_OP_ENTRY(mask_logits, CPU_OP_MASK_LOGITS, kiln_hal_mask_args_t)
CPU_OP_ENTRY(gemm_quant, CPU_OP_GEMM_QUANT, kiln_hal_gemm_quant_args_t)

/* The collectives (ABI 1.5): recorded in graphs like any op; a replay runs them again, so
 * every rank must replay its graph (and issue its other collectives) in the same order. */
#define CPU_COLL_ENTRY(name, OPNUM)                                                       \
  static kiln_hal_error_t *be_##name(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *args) { \
    if (!s) return cpu_err(#name ": stream is NULL");                                     \
    cpu_op_t op;                                                                          \
    memset(&op, 0, sizeof(op));                                                           \
    op.kind = CPU_OP_COLL;                                                                \
    op.u.coll.op = OPNUM;                                                                 \
    kiln_hal_error_t *e =                                                                 \
        kiln_hal_args_copy(#name, &op.u.coll.args, sizeof(op.u.coll.args), args);         \
    return e ? e : submit(s, &op);                                                        \
  }

CPU_COLL_ENTRY(all_reduce, 1)
CPU_COLL_ENTRY(all_gather, 2)
CPU_COLL_ENTRY(broadcast, 3)
CPU_COLL_ENTRY(send, 4)
CPU_COLL_ENTRY(recv, 5)

static kiln_hal_error_t *be_graph_begin(kiln_hal_stream_t *s) {
  if (!s) return cpu_err("graph_begin: stream is NULL");
  if (s->capturing) return cpu_err("graph_begin: the stream is already capturing");
  s->capturing = true;
  s->capture_failed = false;
  s->rec_len = 0;
  s->refusals_at_begin = atomic_load(&s->device->refusals);
  atomic_fetch_add(&s->device->capturing, 1);
  return NULL;
}

static kiln_hal_error_t *be_graph_end(kiln_hal_stream_t *s, kiln_hal_graph_t **out_graph) {
  if (!out_graph) return cpu_err("graph_end: out_graph is NULL");
  *out_graph = NULL;
  if (!s) return cpu_err("graph_end: stream is NULL");
  if (!s->capturing) return cpu_err("graph_end: the stream is not capturing");
  s->capturing = false;
  atomic_fetch_sub(&s->device->capturing, 1);
  if (atomic_load(&s->device->refusals) != s->refusals_at_begin) s->capture_failed = true;
  if (s->capture_failed) {
    s->rec_len = 0;
    return cpu_err("graph_end: the capture was invalidated by a failed or forbidden call");
  }
  kiln_hal_graph_t *g = calloc(1, sizeof(*g));
  if (!g) goto oom;
  if (s->rec_len) {
    g->ops = malloc(s->rec_len * sizeof(cpu_op_t));
    if (!g->ops) goto oom;
    memcpy(g->ops, s->rec, s->rec_len * sizeof(cpu_op_t));
  }
  g->len = s->rec_len;
  s->rec_len = 0;
  *out_graph = g;
  return NULL;

oom:
  free(g);
  s->rec_len = 0;
  return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "graph_end: out of memory");
}

static kiln_hal_error_t *be_graph_replay(kiln_hal_graph_t *g, kiln_hal_stream_t *s) {
  if (!g) return cpu_err("graph_replay: graph is NULL");
  if (!s) return cpu_err("graph_replay: stream is NULL");
  if (s->capturing) return refuse_in_capture(s, "graph_replay");
  for (size_t i = 0; i < g->len; i++) {
    kiln_hal_error_t *e = run_op(s, &g->ops[i], false);
    if (e) return e;
  }
  return NULL;
}

static void be_graph_destroy(kiln_hal_graph_t *g) {
  if (!g) return;
  free(g->ops);
  free(g);
}

/* ============================================================================================
 * The table
 * ==========================================================================================*/

static const kiln_hal_backend_t g_table = {
    .struct_size = sizeof(kiln_hal_backend_t),
    .abi_major = KILN_HAL_ABI_MAJOR,
    .abi_minor = KILN_HAL_ABI_MINOR,
    .name = "cpu",
    .build_info = g_build_info,
    .init = be_init,
    .shutdown = be_shutdown,
    .probe = be_probe,
    .device_count = be_device_count,
    .device_info = be_device_info,
    .device_open = be_device_open,
    .device_close = be_device_close,
    .device_memory = be_device_memory,
    .buffer_alloc = be_buffer_alloc,
    .buffer_free = be_buffer_free,
    .buffer_host_ptr = be_buffer_host_ptr,
    .stream_create = be_stream_create,
    .stream_destroy = be_stream_destroy,
    .stream_sync = be_stream_sync,
    .copy_h2d = be_copy_h2d,
    .copy_d2h = be_copy_d2h,
    .copy_d2d = be_copy_d2d,
    .fill = be_fill,
    .gemm = be_gemm,
    .embedding = be_embedding,
    .rmsnorm = be_rmsnorm,
    .rope = be_rope,
    .silu_mul = be_silu_mul,
    .add = be_add,
    .copy = be_copy,
    .kv_write = be_kv_write,
    .attention = be_attention,
    .argmax = be_argmax,
    .topk = be_topk,
    .penalize = be_penalize,
    .sample = be_sample,
    .graph_begin = be_graph_begin,
    .graph_end = be_graph_end,
    .graph_replay = be_graph_replay,
    .graph_destroy = be_graph_destroy,
    .layernorm = be_layernorm,
    .activation = be_activation,
    .mask_logits = be_mask_logits,
    .gemm_quant = be_gemm_quant,
    .comm_get_unique_id = cpu_comm_get_unique_id,
    .comm_create = cpu_comm_create,
    .comm_destroy = cpu_comm_destroy,
    .all_reduce = be_all_reduce,
    .all_gather = be_all_gather,
    .broadcast = be_broadcast,
    .send = be_send,
    .recv = be_recv,
};

__attribute__((visibility("default"))) const kiln_hal_backend_t *kiln_backend_query(
    uint32_t host_major, uint32_t host_minor);

/* Returns the table whatever the host's version: the host refuses a major mismatch itself. */
const kiln_hal_backend_t *kiln_backend_query(uint32_t host_major, uint32_t host_minor) {
  (void)host_major;
  (void)host_minor;
  if (!g_build_info[0]) {
    cpu_vec_init();
    build_info_update(g_threads);
  }
  return &g_table;
}
