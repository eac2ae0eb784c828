/* fake_gpu_plugin.c - a backend plugin that claims one GPU at a chosen PCI address, so that
 * `kiln info` can be seen matching a GPU from a vendor library (tests/vendor/fake_*.c) with
 * the plugin that drives it. It runs nothing: every op is unsupported.
 *   FAKE_GPU_NAME   the plugin's name (string), e.g. "rocm"
 *   FAKE_GPU_PCI    the device's pci_bus_id, (domain << 16 | bus << 8 | device)
 *   FAKE_GPU_SCORE  probe score; 0 = rejected, with a reason */
#include <stdlib.h>
#include <string.h>

#include "kiln/hal.h"
#include "kiln/hal_util.h"

#ifndef FAKE_GPU_SCORE
#define FAKE_GPU_SCORE 150
#endif

struct kiln_hal_device {
  int unused;
};
struct kiln_hal_buffer {
  int unused;
};
struct kiln_hal_stream {
  int unused;
};

static struct kiln_hal_device the_device;
static struct kiln_hal_stream the_stream;

static kiln_hal_error_t *unsupported(const char *what) {
  return kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED, "fake " FAKE_GPU_NAME ": %s not implemented",
                            what);
}

static kiln_hal_error_t *gpu_init(const kiln_hal_host_t *host) { return NULL; }
static void gpu_shutdown(void) {}
static kiln_hal_error_t *gpu_probe(int32_t *out_score) {
  *out_score = FAKE_GPU_SCORE;
  if (FAKE_GPU_SCORE == 0)
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE, "fake " FAKE_GPU_NAME " driver: no device");
  return NULL;
}
static kiln_hal_error_t *gpu_device_count(int32_t *out_count) {
  *out_count = 1;
  return NULL;
}
static kiln_hal_error_t *gpu_device_info(int32_t index, kiln_hal_device_info_t *out) {
  if (index != 0) return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT, "no device %d", index);
  uint32_t size = out->struct_size;
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  info.kind = KILN_HAL_DEVICE_GPU;
  strcpy(info.name, "Fake " FAKE_GPU_NAME " GPU");
  strcpy(info.arch, "fake");
  info.total_memory = info.free_memory = 1u << 30;
  info.warp_size = 64;
  info.compute_units = 1;
  info.pci_bus_id = FAKE_GPU_PCI;
  if (size == 0 || size > sizeof(info)) size = sizeof(info);
  memcpy(out, &info, size);
  out->struct_size = size;
  return NULL;
}
static kiln_hal_error_t *gpu_device_open(int32_t index, kiln_hal_device_t **out) {
  *out = index == 0 ? &the_device : NULL;
  return index == 0 ? NULL
                    : kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT, "no device %d", index);
}
static void gpu_device_close(kiln_hal_device_t *d) {}
static kiln_hal_error_t *gpu_device_memory(kiln_hal_device_t *d, uint64_t *f, uint64_t *t) {
  *f = *t = 1u << 30;
  return NULL;
}
static kiln_hal_error_t *gpu_buffer_alloc(kiln_hal_device_t *d, uint64_t size, uint32_t flags,
                                          kiln_hal_buffer_t **out) {
  *out = NULL;
  return unsupported("buffer_alloc");
}
static void gpu_buffer_free(kiln_hal_buffer_t *b) {}
static kiln_hal_error_t *gpu_stream_create(kiln_hal_device_t *d, kiln_hal_stream_t **out) {
  *out = &the_stream;
  return NULL;
}
static void gpu_stream_destroy(kiln_hal_stream_t *s) {}
static kiln_hal_error_t *gpu_stream_sync(kiln_hal_stream_t *s) { return NULL; }
static kiln_hal_error_t *gpu_copy_h2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t off,
                                      const void *src, uint64_t size) {
  return unsupported("copy_h2d");
}
static kiln_hal_error_t *gpu_copy_d2h(kiln_hal_stream_t *s, void *dst, kiln_hal_buffer_t *src,
                                      uint64_t off, uint64_t size) {
  return unsupported("copy_d2h");
}
static kiln_hal_error_t *gpu_copy_d2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t doff,
                                      kiln_hal_buffer_t *src, uint64_t soff, uint64_t size) {
  return unsupported("copy_d2d");
}
static kiln_hal_error_t *gpu_fill(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t off,
                                  uint64_t size, uint8_t value) {
  return unsupported("fill");
}
#define GPU_OP(op, type)                                                   \
  static kiln_hal_error_t *gpu_##op(kiln_hal_stream_t *s, const type *a) { \
    return unsupported(#op);                                               \
  }
GPU_OP(gemm, kiln_hal_gemm_args_t)
GPU_OP(embedding, kiln_hal_embedding_args_t)
GPU_OP(rmsnorm, kiln_hal_rmsnorm_args_t)
GPU_OP(rope, kiln_hal_rope_args_t)
GPU_OP(silu_mul, kiln_hal_silu_mul_args_t)
GPU_OP(add, kiln_hal_add_args_t)
GPU_OP(copy, kiln_hal_copy_args_t)
GPU_OP(kv_write, kiln_hal_kv_write_args_t)
GPU_OP(attention, kiln_hal_attention_args_t)
GPU_OP(argmax, kiln_hal_argmax_args_t)
GPU_OP(topk, kiln_hal_topk_args_t)
GPU_OP(penalize, kiln_hal_penalize_args_t)
GPU_OP(sample, kiln_hal_sample_args_t)
GPU_OP(layernorm, kiln_hal_layernorm_args_t)
GPU_OP(activation, kiln_hal_activation_args_t)
GPU_OP(mask_logits, kiln_hal_mask_args_t)

static const kiln_hal_backend_t gpu_table = {
    .struct_size = sizeof(kiln_hal_backend_t),
    .abi_major = KILN_HAL_ABI_MAJOR,
    .abi_minor = KILN_HAL_ABI_MINOR,
    .name = FAKE_GPU_NAME,
    .build_info = "test double for kiln info's GPU section",
    .init = gpu_init,
    .shutdown = gpu_shutdown,
    .probe = gpu_probe,
    .device_count = gpu_device_count,
    .device_info = gpu_device_info,
    .device_open = gpu_device_open,
    .device_close = gpu_device_close,
    .device_memory = gpu_device_memory,
    .buffer_alloc = gpu_buffer_alloc,
    .buffer_free = gpu_buffer_free,
    .stream_create = gpu_stream_create,
    .stream_destroy = gpu_stream_destroy,
    .stream_sync = gpu_stream_sync,
    .copy_h2d = gpu_copy_h2d,
    .copy_d2h = gpu_copy_d2h,
    .copy_d2d = gpu_copy_d2d,
    .fill = gpu_fill,
    .gemm = gpu_gemm,
    .embedding = gpu_embedding,
    .rmsnorm = gpu_rmsnorm,
    .rope = gpu_rope,
    .silu_mul = gpu_silu_mul,
    .add = gpu_add,
    .copy = gpu_copy,
    .kv_write = gpu_kv_write,
    .attention = gpu_attention,
    .argmax = gpu_argmax,
    .topk = gpu_topk,
    .penalize = gpu_penalize,
    .sample = gpu_sample,
    .layernorm = gpu_layernorm,
    .activation = gpu_activation,
    .mask_logits = gpu_mask_logits,
};

__attribute__((visibility("default"))) const kiln_hal_backend_t *kiln_backend_query(
    uint32_t host_major, uint32_t host_minor);
__attribute__((visibility("default"))) const kiln_hal_backend_t *kiln_backend_query(
    uint32_t host_major, uint32_t host_minor) {
  return &gpu_table;
}
