/* cuda_backend.c - the CUDA backend's table: probe, devices, buffers, streams, copies, graphs,
 * and the host-side validation of every op before its kernel launcher runs. */
#define _GNU_SOURCE /* dladdr-free, but RTLD_* and strnlen want it on some libcs */
#include <dlfcn.h>
#include <pthread.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#define CUDA_STR2(x) #x
#define CUDA_STR(x) CUDA_STR2(x)

/* The build description `kiln info` shows. KILN_GPU_ARCH_LIST comes from CMake. */
#ifndef KILN_GPU_ARCH_LIST
#define KILN_GPU_ARCH_LIST "?"
#endif
#if defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_version.h>
#define CUDA_BUILD_INFO                                                                       \
  "HIP " CUDA_STR(HIP_VERSION_MAJOR) "." CUDA_STR(HIP_VERSION_MINOR) " (libamdhip64; rocBLAS " \
  "loaded at run time, else Kiln's GEMM kernel), archs " KILN_GPU_ARCH_LIST
#else
#include <cublasLt.h> /* for its version only: every cuBLASLt call is in cuda_blas_lt.c */
#define CUDA_BUILD_INFO                                                                \
  "CUDA " CUDA_STR(CUDART_VERSION) " (cudart static, cuBLASLt " CUDA_STR(             \
      CUBLAS_VER_MAJOR) "." CUDA_STR(CUBLAS_VER_MINOR) "), archs " KILN_GPU_ARCH_LIST
#endif

static const kiln_hal_host_t *g_host;

/* ============================================================================================
 * Errors
 * ==========================================================================================*/

kiln_hal_error_t *cuda_err_arg(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_hal_error_t *e = kiln_hal_error_vnew(KILN_HAL_ERR_INVALID_ARGUMENT, fmt, ap);
  va_end(ap);
  return e;
}

kiln_hal_error_t *cuda_err_unsupported(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_hal_error_t *e = kiln_hal_error_vnew(KILN_HAL_ERR_UNSUPPORTED, fmt, ap);
  va_end(ap);
  return e;
}

kiln_hal_error_t *cuda_err_rt(cudaError_t e, const char *what) {
  int32_t code = e == cudaErrorMemoryAllocation ? KILN_HAL_ERR_OUT_OF_MEMORY : KILN_HAL_ERR_DEVICE;
  return kiln_hal_error_new(code, "%s: %s: %s", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* A launcher's result as an error object. */
static kiln_hal_error_t *launch_result(cudaError_t e, const char *op) {
  if (e == cudaSuccess) return NULL;
  return kiln_hal_error_new(
      e == cudaErrorMemoryAllocation ? KILN_HAL_ERR_OUT_OF_MEMORY : KILN_HAL_ERR_DEVICE,
      "%s: kernel launch: %s: %s", op, cudaGetErrorName(e), cudaGetErrorString(e));
}

kiln_hal_error_t *cuda_stream_enter(kiln_hal_stream_t *s) {
  if (!s) return cuda_err_arg("stream is NULL");
  cudaError_t e = cudaSetDevice(s->device->index);
  return e == cudaSuccess ? NULL : cuda_err_rt(e, "cudaSetDevice");
}

#define ARGS_COPY(op, local, user) kiln_hal_args_copy((op), &(local), sizeof(local), (user))

/* ============================================================================================
 * Validation
 * ==========================================================================================*/

static uint64_t buffer_size(void *ctx, kiln_hal_buffer_t *b) {
  (void)ctx;
  return b->size;
}

static kiln_hal_error_t *check_buffer(void *ctx, const char *op, const char *name,
                                      kiln_hal_buffer_t *b) {
  const kiln_hal_device_t *dev = (const kiln_hal_device_t *)ctx;
  if (!b->pinned && b->device != dev)
    return cuda_err_arg("%s: %s lives in a buffer of device %d, the stream is on device %d", op,
                        name, b->device->index, dev->index);
  return NULL;
}

kiln_hal_check_env_t cuda_check_env(kiln_hal_device_t *dev) {
  kiln_hal_check_env_t env = {buffer_size, check_buffer, dev};
  return env;
}

cuda_view_t cuda_view(const kiln_hal_tensor_t *t) {
  cuda_view_t v;
  memset(&v, 0, sizeof(v));
  if (!t->buffer) return v;
  v.ptr = (char *)t->buffer->ptr + t->offset;
  v.dtype = t->dtype;
  v.ndim = t->ndim;
  for (int i = 0; i < t->ndim && i < 4; i++) {
    v.shape[i] = t->shape[i];
    v.stride[i] = t->stride[i];
  }
  return v;
}

/* Returns from the calling op on error. */
#define CHECK(expr)                  \
  do {                               \
    kiln_hal_error_t *err_ = (expr); \
    if (err_) return err_;           \
  } while (0)

/* ============================================================================================
 * Probe, init, devices
 * ==========================================================================================*/

/* ---- what differs between NVIDIA and AMD devices ---------------------------------------- */

#if defined(__HIP_PLATFORM_AMD__)
#define GPU_MAKER "AMD"
#define GPU_API "hip"
/* "gfx90a" out of "gfx90a:sramecc+:xnack-". */
static void device_arch(const struct cudaDeviceProp *p, char *buf, size_t n) {
  snprintf(buf, n, "%.*s", (int)strcspn(p->gcnArchName, ":"), p->gcnArchName);
}
/* Whether this build holds code for arch: hipcc emits code objects only for the listed
 * targets, and a launch on any other fails (hipErrorNoBinaryForGpu) mid-run. */
static bool arch_built(const char *arch) {
  const char *list = KILN_GPU_ARCH_LIST;
  size_t n = strlen(arch);
  for (const char *p = list; *p;) {
    size_t len = strcspn(p, " ;");
    if (len == n && strncmp(p, arch, n) == 0) return true;
    p += len;
    p += strspn(p, " ;");
  }
  return false;
}
/* NULL when the plugin can drive the device, else why not. */
static kiln_hal_error_t *device_refusal(const struct cudaDeviceProp *p, const char *op) {
  char arch[64];
  device_arch(p, arch, sizeof(arch));
  if (arch_built(arch)) return NULL;
  return cuda_err_unsupported("%s: %s is %s; this rocm plugin was built for %s (rebuild with "
                              "-DKILN_ROCM_ARCHS=%s)",
                              op, p->name, arch, KILN_GPU_ARCH_LIST, arch);
}
#else
#define GPU_MAKER "NVIDIA"
#define GPU_API "cuda"
static void device_arch(const struct cudaDeviceProp *p, char *buf, size_t n) {
  snprintf(buf, n, "sm_%d%d", p->major, p->minor);
}
static kiln_hal_error_t *device_refusal(const struct cudaDeviceProp *p, const char *op) {
  if (p->major >= 8) return NULL;
  return cuda_err_unsupported("%s: %s is sm_%d%d; this build needs sm_80 or newer", op, p->name,
                              p->major, p->minor);
}
#endif

static kiln_hal_error_t *cuda_probe(int32_t *out_score) {
  if (!out_score) return cuda_err_arg("probe: out_score is NULL");
  *out_score = 0;
#if !defined(__HIP_PLATFORM_AMD__)
  /* The driver library first: without it the runtime can only say "insufficient driver". The
   * handle is kept (the driver is never unloaded; the runtime opens it again itself). The HIP
   * runtime needs no such check: the plugin links it, so it is loaded if we got this far. */
  dlerror();
  void *h = dlopen(KILN_GPU_DRIVER_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *why = dlerror();
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE, "no " GPU_MAKER " driver: %s",
                              why ? why : KILN_GPU_DRIVER_SONAME ": dlopen failed");
  }
#endif
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    /* HIP 5's error strings repeat the name: print it once then. */
    const char *name = cudaGetErrorName(e), *text = cudaGetErrorString(e);
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE, "%s: %s%s%s", GPU_API "GetDeviceCount", name,
                              strcmp(name, text) ? ": " : "", strcmp(name, text) ? text : "");
  }
  if (n <= 0)
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE,
                              "the " GPU_MAKER " driver is loaded but reports no device");
  /* Usable only if some device is one this build can drive; else say why the first is not. */
  kiln_hal_error_t *why = NULL;
  for (int i = 0; i < n; i++) {
    struct cudaDeviceProp p;
    e = cudaGetDeviceProperties(&p, i);
    kiln_hal_error_t *r = e != cudaSuccess ? cuda_err_rt(e, "probe: cudaGetDeviceProperties")
                                           : device_refusal(&p, "probe");
    if (!r) {
      if (why) why->destroy(why);
      *out_score = 200;
      return NULL;
    }
    if (why)
      r->destroy(r);
    else
      why = r;
  }
  return why;
}

static kiln_hal_error_t *cuda_init(const kiln_hal_host_t *host) {
  g_host = host;
  if (host && KILN_HAL_HAS(host, log) && host->log) {
    char line[700];
    snprintf(line, sizeof(line), "gemm library: %s", cuda_blas_describe());
    host->log(host->ctx, KILN_HAL_LOG_INFO, line);
  }
  return NULL;
}

static void cuda_shutdown(void) { g_host = NULL; }

static kiln_hal_error_t *cuda_device_count(int32_t *out_count) {
  if (!out_count) return cuda_err_arg("device_count: out_count is NULL");
  *out_count = 0;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cuda_err_rt(e, "device_count: cudaGetDeviceCount");
  *out_count = n;
  return NULL;
}

static kiln_hal_error_t *check_index(const char *op, int32_t index) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cuda_err_rt(e, "cudaGetDeviceCount");
  if (index < 0 || index >= n)
    return cuda_err_arg("%s: device index %d out of range (%d devices)", op, index, n);
  return NULL;
}

/* The quantized formats gemm_quant takes (cuda_qgemv.cu): every GGUF block format, the
 * INT4_G / INT8_G group formats and, on CUDA, FP8_E4M3; KILN_HAL_CAP_QUANT of each is set in
 * device_info, so the loader keeps FP8 checkpoints FP8 on this backend (decode reads 1 byte a
 * weight; M > 8 runs the CUDA-core tiled kernel, see cuda_qgemv.cu). The ROCm build of this
 * file does not claim FP8 (its kernel has not run on an AMD GPU): FP8 is widened at load there. */
static bool qfmt_supported(int32_t fmt) {
#if defined(__HIP_PLATFORM_AMD__)
  const bool fp8 = false;
#else
  const bool fp8 = fmt == KILN_HAL_QFMT_FP8_E4M3;
#endif
  return (fmt >= KILN_HAL_QFMT_Q4_0 && fmt < KILN_HAL_QFMT_COUNT) ||
         fmt == KILN_HAL_QFMT_INT4_G || fmt == KILN_HAL_QFMT_INT8_G || fp8;
}

static uint64_t quant_caps(void) {
  uint64_t caps = 0;
  for (int32_t f = 0; f < KILN_HAL_QFMT_GROUP_END; f++)
    if (qfmt_supported(f)) caps |= KILN_HAL_CAP_QUANT(f);
  return caps;
}

static kiln_hal_error_t *cuda_device_info(int32_t index, kiln_hal_device_info_t *out_info) {
  if (!out_info) return cuda_err_arg("device_info: out_info is NULL");
  uint32_t caller_size = out_info->struct_size;
  CHECK(check_index("device_info", index));
  kiln_hal_device_info_t info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  struct cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, index);
  if (e != cudaSuccess) return cuda_err_rt(e, "device_info: cudaGetDeviceProperties");
  int prev = 0;
  size_t free_b = 0, total_b = 0;
  (void)cudaGetDevice(&prev);
  e = cudaSetDevice(index);
  if (e == cudaSuccess) e = cudaMemGetInfo(&free_b, &total_b);
  (void)cudaSetDevice(prev);
  if (e != cudaSuccess) return cuda_err_rt(e, "device_info: cudaMemGetInfo");
  info.kind = KILN_HAL_DEVICE_GPU;
  snprintf(info.name, sizeof(info.name), "%.127s", p.name);
  device_arch(&p, info.arch, sizeof(info.arch));
  info.total_memory = total_b;
  info.free_memory = free_b;
  info.caps = KILN_HAL_CAP_F16 | KILN_HAL_CAP_GRAPHS | KILN_HAL_CAP_DEVICE_SAMPLING;
#if defined(__HIP_PLATFORM_AMD__)
  info.caps |= KILN_HAL_CAP_BF16; /* converted in registers: any gfx9+ target */
#else
  if (p.major >= 8) info.caps |= KILN_HAL_CAP_BF16 | KILN_HAL_CAP_TF32;
#endif
  if (cuda_nccl_available()) info.caps |= KILN_HAL_CAP_COLLECTIVES;
  info.caps |= quant_caps(); /* gemm_quant (cuda_qgemv.cu) */
  if (qfmt_supported(KILN_HAL_QFMT_FP8_E4M3)) info.caps |= KILN_HAL_CAP_FP8_XQUANT;
  /* The FP8 KV cache (ABI 1.7): codes cast and decoded in integer steps, so every architecture
   * (sm_80 and gfx targets without FP8 conversions included) takes it. */
  info.caps |= KILN_HAL_CAP_KV_FP8;
  info.warp_size = p.warpSize;
  info.compute_units = p.multiProcessorCount;
  info.pci_bus_id =
      ((uint32_t)p.pciDomainID << 16) | ((uint32_t)p.pciBusID << 8) | (uint32_t)p.pciDeviceID;
  /* Write only what the caller's struct holds (an older host passes a smaller one). */
  if (caller_size == 0 || caller_size > sizeof(info)) caller_size = sizeof(info);
  memcpy(out_info, &info, caller_size);
  out_info->struct_size = caller_size;
  return NULL;
}

static kiln_hal_error_t *cuda_device_open(int32_t index, kiln_hal_device_t **out_device) {
  if (!out_device) return cuda_err_arg("device_open: out_device is NULL");
  *out_device = NULL;
  CHECK(check_index("device_open", index));
  struct cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, index);
  if (e != cudaSuccess) return cuda_err_rt(e, "device_open: cudaGetDeviceProperties");
  CHECK(device_refusal(&p, "device_open"));
  e = cudaSetDevice(index);
  if (e == cudaSuccess) e = cudaFree(NULL); /* creates the primary context now, not mid-op */
  if (e != cudaSuccess) return cuda_err_rt(e, "device_open: creating the context");
  kiln_hal_device_t *d = calloc(1, sizeof(*d));
  if (!d) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "device_open: out of host memory");
  d->index = index;
  d->warp_size = p.warpSize;
  d->sm_count = p.multiProcessorCount;
  d->cc = p.major * 10 + p.minor;
#if defined(__HIP_PLATFORM_AMD__)
  d->smem_optin = (int64_t)p.sharedMemPerBlock; /* LDS per workgroup: no opt-in step on AMD */
#else
  d->smem_optin = (int64_t)p.sharedMemPerBlockOptin;
#endif
  atomic_init(&d->capturing, 0);
  *out_device = d;
  return NULL;
}

static void cuda_device_close(kiln_hal_device_t *device) { free(device); }

static kiln_hal_error_t *cuda_device_memory(kiln_hal_device_t *device, uint64_t *out_free,
                                            uint64_t *out_total) {
  if (!device || !out_free || !out_total) return cuda_err_arg("device_memory: NULL argument");
  *out_free = *out_total = 0;
  size_t f = 0, t = 0;
  cudaError_t e = cudaSetDevice(device->index);
  if (e == cudaSuccess) e = cudaMemGetInfo(&f, &t);
  if (e != cudaSuccess) return cuda_err_rt(e, "device_memory: cudaMemGetInfo");
  *out_free = f;
  *out_total = t;
  return NULL;
}

/* ============================================================================================
 * Buffers
 * ==========================================================================================*/

static kiln_hal_error_t *cuda_buffer_alloc(kiln_hal_device_t *device, uint64_t size, uint32_t flags,
                                           kiln_hal_buffer_t **out_buffer) {
  if (!out_buffer) return cuda_err_arg("buffer_alloc: out_buffer is NULL");
  *out_buffer = NULL;
  if (!device) return cuda_err_arg("buffer_alloc: device is NULL");
  if (flags & ~(uint32_t)KILN_HAL_BUFFER_HOST_PINNED)
    return cuda_err_arg("buffer_alloc: unknown flags 0x%x", flags);
  if (atomic_load(&device->capturing) > 0)
    return cuda_err_arg("buffer_alloc: not allowed while a stream of this device captures a graph");
  kiln_hal_buffer_t *b = calloc(1, sizeof(*b));
  if (!b) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "buffer_alloc: out of host memory");
  b->device = device;
  b->size = size;
  b->pinned = (flags & KILN_HAL_BUFFER_HOST_PINNED) != 0;
  if (size > 0) {
    cudaError_t e = cudaSetDevice(device->index);
    if (e == cudaSuccess) e = b->pinned ? cudaMallocHost(&b->ptr, size) : cudaMalloc(&b->ptr, size);
    if (e != cudaSuccess) {
      (void)cudaGetLastError(); /* an allocation failure is not sticky: clear it */
      free(b);
      char what[96];
      snprintf(what, sizeof(what), "buffer_alloc: %s(%llu bytes)",
               (flags & KILN_HAL_BUFFER_HOST_PINNED) ? "cudaMallocHost" : "cudaMalloc",
               (unsigned long long)size);
      return cuda_err_rt(e, what);
    }
  }
  *out_buffer = b;
  return NULL;
}

static void cuda_buffer_free(kiln_hal_buffer_t *buffer) {
  if (!buffer) return;
  if (buffer->ptr) {
    (void)cudaSetDevice(buffer->device->index);
    if (buffer->pinned)
      (void)cudaFreeHost(buffer->ptr);
    else
      (void)cudaFree(buffer->ptr);
  }
  free(buffer->gidx_ok);
  free(buffer);
}

static void *cuda_buffer_host_ptr(kiln_hal_buffer_t *buffer) {
  return buffer && buffer->pinned ? buffer->ptr : NULL;
}

/* ============================================================================================
 * Streams
 * ==========================================================================================*/

static kiln_hal_error_t *cuda_stream_create(kiln_hal_device_t *device,
                                            kiln_hal_stream_t **out_stream) {
  if (!out_stream) return cuda_err_arg("stream_create: out_stream is NULL");
  *out_stream = NULL;
  if (!device) return cuda_err_arg("stream_create: device is NULL");
  if (atomic_load(&device->capturing) > 0)
    return cuda_err_arg(
        "stream_create: not allowed while a stream of this device captures a graph");
  kiln_hal_error_t *err = NULL;
  kiln_hal_stream_t *s = calloc(1, sizeof(*s));
  if (!s)
    return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "stream_create: out of host memory");
  s->device = device;
  cudaError_t e = cudaSetDevice(device->index);
  if (e != cudaSuccess) {
    err = cuda_err_rt(e, "stream_create: cudaSetDevice");
    goto fail;
  }
  e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    s->stream = NULL;
    err = cuda_err_rt(e, "stream_create: cudaStreamCreateWithFlags");
    goto fail;
  }
  if ((err = cuda_blas_create(s, &s->blas))) goto fail;
  e = cudaMalloc((void **)&s->stage, CUDA_GEMM_STAGE_BYTES);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    s->stage = NULL;
    err = cuda_err_rt(e, "stream_create: cudaMalloc(gemm staging)");
    goto fail;
  }
  e = cudaMalloc(&s->attn_scratch, CUDA_ATTN_SCRATCH_BYTES);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    s->attn_scratch = NULL;
    err = cuda_err_rt(e, "stream_create: cudaMalloc(attention scratch)");
    goto fail;
  }
  *out_stream = s;
  return NULL;
fail:
  if (s->stage) (void)cudaFree(s->stage);
  cuda_blas_destroy(s->blas);
  if (s->stream) (void)cudaStreamDestroy(s->stream);
  free(s);
  return err;
}

static void cuda_stream_destroy(kiln_hal_stream_t *s) {
  if (!s) return;
  (void)cudaSetDevice(s->device->index);
  if (s->capturing) {
    cudaGraph_t g = NULL;
    if (cudaStreamEndCapture(s->stream, &g) == cudaSuccess && g) (void)cudaGraphDestroy(g);
    (void)cudaGetLastError();
    s->capturing = false;
    atomic_fetch_sub(&s->device->capturing, 1);
  }
  (void)cudaStreamSynchronize(s->stream);
  cuda_blas_destroy(s->blas);
  (void)cudaStreamDestroy(s->stream);
  if (s->stage) (void)cudaFree(s->stage);
  if (s->attn_scratch) (void)cudaFree(s->attn_scratch);
  free(s);
}

/* INVALID_ARGUMENT when the stream is capturing a graph (host synchronisation is not allowed). */
static kiln_hal_error_t *refuse_in_capture(kiln_hal_stream_t *s, const char *op) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(s->stream, &st);
  if (e != cudaSuccess) return cuda_err_rt(e, op);
  if (s->capturing || st != cudaStreamCaptureStatusNone)
    return cuda_err_arg("%s: not allowed while the stream captures a graph", op);
  return NULL;
}

static kiln_hal_error_t *cuda_stream_sync(kiln_hal_stream_t *s) {
  CHECK(cuda_stream_enter(s));
  CHECK(refuse_in_capture(s, "stream_sync"));
  cudaError_t e = cudaStreamSynchronize(s->stream);
  if (e != cudaSuccess)
    return cuda_err_rt(e, "stream_sync: cudaStreamSynchronize (work enqueued earlier failed)");
  e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_err_rt(e, "stream_sync: an earlier asynchronous error");
  return NULL;
}

/* ============================================================================================
 * Copies and fill
 * ==========================================================================================*/

static kiln_hal_error_t *check_range(const char *op, const char *name, kiln_hal_buffer_t *b,
                                     uint64_t offset, uint64_t size) {
  if (!b) return cuda_err_arg("%s: %s buffer is NULL", op, name);
  uint64_t end;
  if (__builtin_add_overflow(offset, size, &end) || end > b->size)
    return cuda_err_arg("%s: %s range [%llu, +%llu) is outside its %llu-byte buffer", op, name,
                        (unsigned long long)offset, (unsigned long long)size,
                        (unsigned long long)b->size);
  return NULL;
}

static kiln_hal_error_t *check_device(kiln_hal_stream_t *s, const char *op, kiln_hal_buffer_t *b) {
  if (!b->pinned && b->device != s->device)
    return cuda_err_arg("%s: buffer of device %d used on a stream of device %d", op,
                        b->device->index, s->device->index);
  return NULL;
}

static kiln_hal_error_t *cuda_copy_h2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst,
                                       uint64_t dst_offset, const void *src, uint64_t size) {
  CHECK(cuda_stream_enter(s));
  CHECK(refuse_in_capture(s, "copy_h2d"));
  CHECK(check_range("copy_h2d", "dst", dst, dst_offset, size));
  CHECK(check_device(s, "copy_h2d", dst));
  if (size == 0) return NULL;
  if (!src) return cuda_err_arg("copy_h2d: src is NULL");
  cudaError_t e =
      cudaMemcpyAsync((char *)dst->ptr + dst_offset, src, size, cudaMemcpyDefault, s->stream);
  return e == cudaSuccess ? NULL : cuda_err_rt(e, "copy_h2d: cudaMemcpyAsync");
}

static kiln_hal_error_t *cuda_copy_d2h(kiln_hal_stream_t *s, void *dst, kiln_hal_buffer_t *src,
                                       uint64_t src_offset, uint64_t size) {
  CHECK(cuda_stream_enter(s));
  CHECK(refuse_in_capture(s, "copy_d2h"));
  CHECK(check_range("copy_d2h", "src", src, src_offset, size));
  CHECK(check_device(s, "copy_d2h", src));
  if (size == 0) return NULL;
  if (!dst) return cuda_err_arg("copy_d2h: dst is NULL");
  cudaError_t e =
      cudaMemcpyAsync(dst, (const char *)src->ptr + src_offset, size, cudaMemcpyDefault, s->stream);
  return e == cudaSuccess ? NULL : cuda_err_rt(e, "copy_d2h: cudaMemcpyAsync");
}

static kiln_hal_error_t *cuda_copy_d2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst,
                                       uint64_t dst_offset, kiln_hal_buffer_t *src,
                                       uint64_t src_offset, uint64_t size) {
  CHECK(cuda_stream_enter(s));
  CHECK(check_range("copy_d2d", "dst", dst, dst_offset, size));
  CHECK(check_range("copy_d2d", "src", src, src_offset, size));
  CHECK(check_device(s, "copy_d2d", dst));
  CHECK(check_device(s, "copy_d2d", src));
  if (size == 0) return NULL;
  cudaError_t e =
      cudaMemcpyAsync((char *)dst->ptr + dst_offset, (const char *)src->ptr + src_offset, size,
                      cudaMemcpyDefault, s->stream);
  return e == cudaSuccess ? NULL : cuda_err_rt(e, "copy_d2d: cudaMemcpyAsync");
}

static kiln_hal_error_t *cuda_fill(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t offset,
                                   uint64_t size, uint8_t value) {
  CHECK(cuda_stream_enter(s));
  CHECK(check_range("fill", "dst", dst, offset, size));
  CHECK(check_device(s, "fill", dst));
  if (size == 0) return NULL;
  cudaError_t e = cudaMemsetAsync((char *)dst->ptr + offset, value, size, s->stream);
  return e == cudaSuccess ? NULL : cuda_err_rt(e, "fill: cudaMemsetAsync");
}

/* ============================================================================================
 * Ops: validate on the host, then launch.
 * ==========================================================================================*/

static kiln_hal_error_t *cuda_gemm_op(kiln_hal_stream_t *s, const kiln_hal_gemm_args_t *user) {
  kiln_hal_gemm_args_t a;
  CHECK(ARGS_COPY("gemm", a, user));
  CHECK(cuda_stream_enter(s));
  return cuda_gemm(s, &a);
}

/* KILN_CUDA_QGEMM=tiled, read once: every gemm_quant on the tiled kernel, also at M <= 8 (to
 * test it against the decode GEMV). */
static bool qgemm_tiled_forced(void) {
  static atomic_int state; /* 0 = not read yet, 1 = no, 2 = yes */
  int v = atomic_load_explicit(&state, memory_order_relaxed);
  if (v == 0) {
    const char *m = getenv("KILN_CUDA_QGEMM");
    v = (m && strcmp(m, "tiled") == 0) ? 2 : 1;
    atomic_store_explicit(&state, v, memory_order_relaxed);
  }
  return v == 2;
}

/* KILN_CUDA_FP8_GEMV=split|nosplit, read once: the FP8 GEMV's K split forced on or off (for
 * the benchmarks and the conformance suite, which run both), else chosen per shape. */
static int32_t fp8_gemv_ks_forced(void) {
  static atomic_int state; /* 0 = not read yet, else 1 + the value */
  int v = atomic_load_explicit(&state, memory_order_relaxed);
  if (v == 0) {
    const char *m = getenv("KILN_CUDA_FP8_GEMV");
    v = 1 + (!m ? 0 : strcmp(m, "nosplit") == 0 ? 1 : strcmp(m, "split") == 0 ? 2 : 0);
    atomic_store_explicit(&state, v, memory_order_relaxed);
  }
  return v - 1;
}

/* KILN_CUDA_FP8_LT_MIN_M=n (1..1024), read once: the smallest M for which gemm_quant with
 * x_quant = FP8_TOKEN takes cuBLASLt's FP8 GEMM instead of the FP8 GEMV on the codes (default
 * CUDA_FP8_LT_MIN_M; the benchmarks time both sides of the threshold with it). */
static int64_t fp8_lt_min_m(void) {
  static atomic_int state; /* 0 = not read yet, else the value */
  int v = atomic_load_explicit(&state, memory_order_relaxed);
  if (v == 0) {
    const char *m = getenv("KILN_CUDA_FP8_LT_MIN_M");
    char *end = NULL;
    long n = m ? strtol(m, &end, 10) : 0;
    v = (m && end != m && *end == 0 && n >= 1 && n <= 1024) ? (int)n : CUDA_FP8_LT_MIN_M;
    atomic_store_explicit(&state, v, memory_order_relaxed);
  }
  return v;
}

/* ---- gemm_quant's g_idx check ---------------------------------------------------------- *
 * hal.h: a g_idx entry outside [0, G) is INVALID_ARGUMENT. The entries live in device memory,
 * so checking them costs a copy to the host and a synchronisation: gemm_quant does it the
 * first time it sees a (buffer, offset, K, G) and remembers the ones that passed on the buffer
 * (freed with it), so a model's act-order weights are read back once, at their first call,
 * and never again. Under graph capture (no synchronisation allowed) an unchecked g_idx is not
 * read back; the kernels still read nothing out of bounds for a bad entry (they make that
 * weight NaN), and the host checks g_idx at load anyway. A g_idx rewritten in place after its
 * check is not checked again (weights are not rewritten). */
static pthread_mutex_t g_gidx_lock = PTHREAD_MUTEX_INITIALIZER;

/* The index of the first entry of b's list with offset >= off. Caller holds the lock. */
static int64_t gidx_lower(const kiln_hal_buffer_t *b, uint64_t off) {
  int64_t lo = 0, hi = b->gidx_len;
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    if (b->gidx_ok[mid].offset < off)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static bool gidx_known(kiln_hal_buffer_t *b, uint64_t off, int64_t k, int64_t groups) {
  bool found = false;
  pthread_mutex_lock(&g_gidx_lock);
  for (int64_t i = gidx_lower(b, off); i < b->gidx_len && b->gidx_ok[i].offset == off; i++)
    if (b->gidx_ok[i].k == k && b->gidx_ok[i].groups == groups) found = true;
  pthread_mutex_unlock(&g_gidx_lock);
  return found;
}

/* Remembers a checked g_idx (best effort: out of memory only forgets it). */
static void gidx_remember(kiln_hal_buffer_t *b, uint64_t off, int64_t k, int64_t groups) {
  pthread_mutex_lock(&g_gidx_lock);
  if (b->gidx_len == b->gidx_cap) {
    int64_t cap = b->gidx_cap ? 2 * b->gidx_cap : 8;
    cuda_gidx_ok_t *n = realloc(b->gidx_ok, (size_t)cap * sizeof(*n));
    if (!n) {
      pthread_mutex_unlock(&g_gidx_lock);
      return;
    }
    b->gidx_ok = n;
    b->gidx_cap = cap;
  }
  int64_t i = gidx_lower(b, off);
  memmove(b->gidx_ok + i + 1, b->gidx_ok + i, (size_t)(b->gidx_len - i) * sizeof(*b->gidx_ok));
  b->gidx_ok[i] = (cuda_gidx_ok_t){off, k, groups};
  b->gidx_len++;
  pthread_mutex_unlock(&g_gidx_lock);
}

/* INVALID_ARGUMENT when an entry of w's g_idx lies outside [0, G) (see above). */
static kiln_hal_error_t *check_gidx(kiln_hal_stream_t *s, const kiln_hal_qweight_t *w) {
  kiln_hal_buffer_t *b = w->g_idx.buffer;
  const int64_t K = w->k, G = w->scales.shape[1];
  if (gidx_known(b, w->g_idx.offset, K, G)) return NULL;
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(s->stream, &st);
  if (e != cudaSuccess) return cuda_err_rt(e, "gemm_quant: cudaStreamIsCapturing");
  if (s->capturing || st != cudaStreamCaptureStatusNone) return NULL; /* the kernels are safe */
  int32_t *h = malloc((size_t)K * sizeof(*h));
  if (!h) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "gemm_quant: out of host memory");
  e = cudaMemcpyAsync(h, (const char *)b->ptr + w->g_idx.offset, (size_t)K * sizeof(*h),
                      cudaMemcpyDefault, s->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s->stream);
  if (e != cudaSuccess) {
    free(h);
    return cuda_err_rt(e, "gemm_quant: reading w.g_idx back");
  }
  for (int64_t k = 0; k < K; k++)
    if (h[k] < 0 || h[k] >= G) {
      kiln_hal_error_t *err =
          cuda_err_arg("gemm_quant: w.g_idx[%lld] = %d lies outside the %lld groups",
                       (long long)k, (int)h[k], (long long)G);
      free(h);
      return err;
    }
  free(h);
  gidx_remember(b, w->g_idx.offset, K, G);
  return NULL;
}

/* ---- gemm_quant with x_quant = FP8_TOKEN (ABI 1.6, W8A8) --------------------------------- *
 * x is quantized per row into the stream's staging buffer (CUDA_GEMM_STAGE_BYTES, free during
 * gemm_quant), M in chunks of the rows that fit, then per chunk either
 *  - cuBLASLt's FP8 GEMM (sm_89+, M >= CUDA_FP8_LT_MIN_M, one scale per weight row as a
 *    contiguous vector): e4m3 x e4m3 on the matrix units, the weight scales on D's rows and
 *    the token scales on its columns (outer-vector scaling), the bias in the epilogue, one
 *    rounding to y; or, where cuBLASLt has no algorithm for the call (alignment, the bias),
 *  - the codes' values as f16 (exact) through the GEMV / tiled kernel, each sum times s_m
 *    before the bias and the rounding (qgemm_w_t.xsc).
 * Two launches a chunk; no allocation, so it captures into graphs. */
static kiln_hal_error_t *gemm_quant_xq(kiln_hal_stream_t *s, const kiln_hal_gemm_quant_args_t *a,
                                       cuda_qgemm_params_t *p) {
  const char *op = "gemm_quant";
  const int64_t M = p->M, K = p->K, N = p->N;
  const int64_t kpad = (K + 15) / 16 * 16;
  const size_t ysz = kiln_hal_dtype_size(p->dtype_y);
  bool lt = s->blas && s->device->cc >= 89 && M >= fp8_lt_min_m() && p->G == 1 &&
            !p->force_tiled && (N == 1 || a->w.scales.stride[0] == 1);
#if defined(__HIP_PLATFORM_AMD__)
  lt = false;
#endif
  size_t esz = lt ? 1 : 2;
  int64_t rows = (int64_t)((CUDA_GEMM_STAGE_BYTES - 512) / ((size_t)kpad * esz + 4));
  if (rows < 1)
    return cuda_err_unsupported("gemm_quant: x_quant with K = %lld needs more than the %u MiB "
                                "staging buffer per row",
                                (long long)K, CUDA_GEMM_STAGE_BYTES >> 20);
  char *stage = (char *)s->stage;
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t r = M - m0 < rows ? M - m0 : rows;
    const size_t xsz = kiln_hal_dtype_size(p->dtype_x);
    const char *xc = (const char *)p->x + (size_t)(m0 * p->ldx) * xsz;
    char *yc = (char *)p->y + (size_t)(m0 * p->ldy) * ysz;
    float *sc = (float *)(stage + (((size_t)rows * (size_t)kpad * esz + 255) & ~(size_t)255));
    /* the GEMV / tiled kernel take y in x's dtype or f32: bf16 code values for a bf16 y */
    const int32_t xdt = p->dtype_y == KILN_HAL_BF16 ? KILN_HAL_BF16 : KILN_HAL_F16;
    const int mode = esz == 1 ? CUDA_XQ_FP8 : xdt == KILN_HAL_BF16 ? CUDA_XQ_BF16 : CUDA_XQ_F16;
    cudaError_t ce = cuda_launch_fp8_xquant(s->stream, xc, p->dtype_x, p->ldx, (int32_t)r,
                                            (int32_t)K, stage, kpad, mode, sc);
    if (ce != cudaSuccess) return launch_result(ce, op);
    if (lt) {
      cuda_blas_call_t c;
      memset(&c, 0, sizeof(c));
      c.dtype_ab = CUDA_BLAS_FP8_E4M3;
      c.dtype_c = p->dtype_y;
      c.trans_a = true; /* A' = W: stored K x N column-major, i.e. [N, K] row-major */
      c.trans_b = false;
      c.m = N, c.n = r, c.k = K;
      c.a = p->w, c.lda = p->row_stride;
      c.b = stage, c.ldb = kpad;
      c.d = yc, c.ldd = p->ldy;
      c.batch = 1;
      c.alpha = 1.0f, c.beta = 0.0f;
      c.bias = p->bias;
      c.bias_required = true;
      c.scale_a = (const float *)p->scales;
      c.scale_b = sc;
      bool bias_done = false;
      kiln_hal_error_t *e = cuda_blas_matmul(s, &c, &bias_done);
      if (!e) continue;
      if (e->code != KILN_HAL_ERR_UNSUPPORTED) return e;
      kiln_hal_error_free(e); /* no algorithm for this call: f16 codes from here on */
      lt = false;
      esz = 2;
      rows = (int64_t)((CUDA_GEMM_STAGE_BYTES - 512) / ((size_t)kpad * esz + 4));
      m0 -= rows; /* this chunk again (the loop adds rows back), at the f16 chunk size */
      continue;
    }
    cuda_qgemm_params_t q = *p;
    q.x = stage;
    q.ldx = kpad;
    q.dtype_x = xdt;
    q.y = yc;
    q.M = (int32_t)r;
    q.xscale = sc;
    CHECK(launch_result(cuda_launch_qgemm(s->stream, s->device->warp_size, &q), op));
  }
  return NULL;
}

/* gemm_quant (ABI 1.4): hal_check.h's rules and the g_idx check above, then one launch
 * (cuda_qgemv.cu). */
static kiln_hal_error_t *cuda_gemm_quant(kiln_hal_stream_t *s,
                                         const kiln_hal_gemm_quant_args_t *user) {
  const char *op = "gemm_quant";
  kiln_hal_gemm_quant_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_check_env_t env = cuda_check_env(s->device);
  CHECK(kiln_hal_check_gemm_quant(&env, &a));
  if (!qfmt_supported(a.w.format))
    return cuda_err_unsupported("gemm_quant: format %s (%d) is not implemented on this backend",
                                kiln_hal_qfmt_name(a.w.format), (int)a.w.format);
  const int64_t M = a.x.shape[0], K = a.x.shape[1], N = a.w.n;
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
    return cuda_err_unsupported("gemm_quant: M = %lld, N = %lld, K = %lld beyond int32",
                                (long long)M, (long long)N, (long long)K);
  if (M == 0 || N == 0) return NULL;
  cuda_qgemm_params_t p;
  memset(&p, 0, sizeof(p));
  p.x = cuda_view(&a.x).ptr;
  p.ldx = a.x.stride[0];
  p.dtype_x = a.x.dtype;
  p.y = cuda_view(&a.y).ptr;
  p.ldy = a.y.stride[0];
  p.dtype_y = a.y.dtype;
  p.bias = cuda_view(&a.bias).ptr;
  p.w = (const char *)a.w.buffer->ptr + a.w.offset;
  p.row_stride = a.w.row_stride;
  p.format = a.w.format;
  p.M = (int32_t)M;
  p.N = (int32_t)N;
  p.K = (int32_t)K;
  if (kiln_hal_qfmt_is_group(a.w.format)) {
    p.scales = cuda_view(&a.w.scales).ptr;
    p.lds = a.w.scales.stride[0];
    p.zeros = cuda_view(&a.w.zeros).ptr;
    p.ldz = a.w.zeros.buffer ? a.w.zeros.stride[0] : 0;
    if (a.w.g_idx.buffer) CHECK(check_gidx(s, &a.w));
    p.g_idx = (const int32_t *)cuda_view(&a.w.g_idx).ptr; /* contiguous (hal_check.h) */
    p.group_size = a.w.group_size;
    if (a.w.scales.shape[1] > INT32_MAX)
      return cuda_err_unsupported("gemm_quant: w.scales has more than INT32_MAX groups");
    p.G = (int32_t)a.w.scales.shape[1];
  }
  p.force_tiled = qgemm_tiled_forced();
  p.fp8_ks = fp8_gemv_ks_forced();
  if (a.x_quant == KILN_HAL_XQUANT_FP8_TOKEN) return gemm_quant_xq(s, &a, &p);
  return launch_result(cuda_launch_qgemm(s->stream, s->device->warp_size, &p), op);
}

static kiln_hal_error_t *cuda_embedding(kiln_hal_stream_t *s,
                                        const kiln_hal_embedding_args_t *user) {
  const char *op = "embedding";
  kiln_hal_embedding_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_embedding(&env, &a));
  if (kiln_hal_tensor_numel(&a.out) == 0) return NULL;
  return launch_result(
      cuda_launch_embedding(s->stream, cuda_view(&a.table), cuda_view(&a.ids), cuda_view(&a.out)),
      op);
}

static kiln_hal_error_t *cuda_rmsnorm(kiln_hal_stream_t *s, const kiln_hal_rmsnorm_args_t *user) {
  const char *op = "rmsnorm";
  kiln_hal_rmsnorm_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_rmsnorm(&env, &a));
  int64_t T = a.x.shape[0], H = a.x.shape[1];
  if (T == 0 || H == 0) return NULL;
  return launch_result(
      cuda_launch_rmsnorm(s->stream, d->warp_size, cuda_view(&a.x), cuda_view(&a.residual),
                          cuda_view(&a.weight), cuda_view(&a.out), a.eps, a.weight_offset),
      op);
}

static kiln_hal_error_t *cuda_layernorm(kiln_hal_stream_t *s,
                                        const kiln_hal_layernorm_args_t *user) {
  const char *op = "layernorm";
  kiln_hal_layernorm_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_layernorm(&env, &a));
  int64_t T = a.x.shape[0], H = a.x.shape[1];
  if (T == 0 || H == 0) return NULL;
  return launch_result(
      cuda_launch_layernorm(s->stream, d->warp_size, cuda_view(&a.x), cuda_view(&a.residual),
                            cuda_view(&a.weight), cuda_view(&a.bias), cuda_view(&a.out), a.eps),
      op);
}

static kiln_hal_error_t *cuda_rope(kiln_hal_stream_t *s, const kiln_hal_rope_args_t *user) {
  const char *op = "rope";
  kiln_hal_rope_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_rope(&env, &a));
  int64_t T = a.positions.shape[0], R = a.cos_sin.shape[1];
  if (T == 0 || R == 0) return NULL;
  const bool has_q = a.q.buffer && kiln_hal_tensor_numel(&a.q) > 0;
  const bool has_k = a.k.buffer && kiln_hal_tensor_numel(&a.k) > 0;
  if (!has_q && !has_k) return NULL;
  /* q and k in one launch (k alone when q is absent) */
  const kiln_hal_tensor_t *first = has_q ? &a.q : &a.k;
  return launch_result(cuda_launch_rope(s->stream, cuda_view(first), cuda_view(&a.k),
                                        has_q && has_k, cuda_view(&a.positions),
                                        cuda_view(&a.cos_sin), a.style),
                       op);
}

static kiln_hal_error_t *cuda_silu_mul(kiln_hal_stream_t *s, const kiln_hal_silu_mul_args_t *user) {
  const char *op = "silu_mul";
  kiln_hal_silu_mul_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_silu_mul(&env, &a));
  if (kiln_hal_tensor_numel(&a.out) == 0) return NULL;
  return launch_result(cuda_launch_silu_mul(s->stream, cuda_view(&a.x), cuda_view(&a.out), a.act),
                       op);
}

static kiln_hal_error_t *cuda_activation(kiln_hal_stream_t *s,
                                         const kiln_hal_activation_args_t *user) {
  const char *op = "activation";
  kiln_hal_activation_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_activation(&env, &a));
  if (kiln_hal_tensor_numel(&a.out) == 0) return NULL;
  return launch_result(cuda_launch_activation(s->stream, cuda_view(&a.x), cuda_view(&a.out), a.act),
                       op);
}

static kiln_hal_error_t *cuda_add(kiln_hal_stream_t *s, const kiln_hal_add_args_t *user) {
  const char *op = "add";
  kiln_hal_add_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_add(&env, &a));
  if (kiln_hal_tensor_numel(&a.out) == 0) return NULL;
  return launch_result(
      cuda_launch_add(s->stream, cuda_view(&a.a), cuda_view(&a.b), cuda_view(&a.out)), op);
}

static kiln_hal_error_t *cuda_copy(kiln_hal_stream_t *s, const kiln_hal_copy_args_t *user) {
  const char *op = "copy";
  kiln_hal_copy_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_copy(&env, &a));
  if (kiln_hal_tensor_numel(&a.src) == 0) return NULL;
  return launch_result(cuda_launch_copy(s->stream, cuda_view(&a.src), cuda_view(&a.dst)), op);
}

static kiln_hal_error_t *cuda_kv_write(kiln_hal_stream_t *s, const kiln_hal_kv_write_args_t *user) {
  const char *op = "kv_write";
  kiln_hal_kv_write_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_kv_write(&env, &a));
  int64_t T = a.k.shape[0], NKV = a.k.shape[1], D = a.k.shape[2];
  if (T == 0 || NKV == 0 || D == 0 || kiln_hal_tensor_numel(&a.k_cache) == 0) return NULL;
  const bool fp8 = a.kv_format == KILN_HAL_KV_FP8_E4M3;
  return launch_result(
      cuda_launch_kv_write(s->stream, cuda_view(&a.k), cuda_view(&a.v), cuda_view(&a.k_cache),
                           cuda_view(&a.v_cache), cuda_view(&a.slot_mapping), fp8, a.k_scale,
                           a.v_scale),
      op);
}

static kiln_hal_error_t *cuda_attention(kiln_hal_stream_t *s,
                                        const kiln_hal_attention_args_t *user) {
  const char *op = "attention";
  kiln_hal_attention_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_attention(&env, &a));
  int64_t T = a.q.shape[0], NH = a.q.shape[1], D = a.q.shape[2];
  int64_t NB = a.k_cache.shape[0], NKV = a.k_cache.shape[1], BS = a.k_cache.shape[2];
  int64_t S = a.num_seqs;
  if (D > 256)
    return cuda_err_unsupported("attention: head dim %lld > 256 is not implemented", (long long)D);
  if (NB > INT32_MAX || BS > INT32_MAX || a.block_table.shape[1] > INT32_MAX || NKV > INT32_MAX)
    return cuda_err_unsupported("attention: cache dimensions beyond int32");
  if (S == 0 || T == 0 || NH == 0 || a.max_query_len == 0) return NULL;
  if (D == 0) return NULL;
  cuda_attention_params_t p;
  memset(&p, 0, sizeof(p));
  p.q = cuda_view(&a.q);
  p.out = cuda_view(&a.out);
  p.k_cache = cuda_view(&a.k_cache).ptr;
  p.v_cache = cuda_view(&a.v_cache).ptr;
  p.block_table = (const int32_t *)cuda_view(&a.block_table).ptr;
  p.seq_lens = (const int32_t *)cuda_view(&a.seq_lens).ptr;
  p.qsl = (const int32_t *)cuda_view(&a.query_start_loc).ptr;
  p.bt_stride = a.block_table.stride[0];
  p.seq_lens_stride = a.seq_lens.stride[0];
  p.qsl_stride = a.query_start_loc.stride[0];
  p.num_seqs = (int32_t)S;
  p.max_query_len = a.max_query_len;
  p.max_seq_len = a.max_seq_len;
  p.num_blocks = (int32_t)NB;
  p.num_kv_heads = (int32_t)NKV;
  p.block_size = (int32_t)BS;
  p.max_blocks = (int32_t)a.block_table.shape[1];
  p.kv_fp8 = a.kv_format == KILN_HAL_KV_FP8_E4M3;
  p.scale = p.kv_fp8 ? a.scale * a.k_scale : a.scale; /* k_scale folded into the scores */
  p.v_scale = p.kv_fp8 ? a.v_scale : 1.0f;
  p.softcap = a.softcap;
  p.sliding_window = a.sliding_window;
  p.causal = a.causal;
  p.sm_count = d->sm_count;
  p.smem_optin = d->smem_optin;
  p.scratch = s->attn_scratch;
  p.scratch_bytes = CUDA_ATTN_SCRATCH_BYTES;
  return launch_result(cuda_launch_attention(s->stream, d->warp_size, &p), op);
}

/* This backend's limit on logits (hal_check.h checked the rest): V fits in int32. */
static kiln_hal_error_t *check_vocab(const char *op, const kiln_hal_tensor_t *t) {
  if (t->shape[1] > INT32_MAX) return cuda_err_unsupported("%s: V beyond int32", op);
  return NULL;
}

static kiln_hal_error_t *cuda_argmax(kiln_hal_stream_t *s, const kiln_hal_argmax_args_t *user) {
  const char *op = "argmax";
  kiln_hal_argmax_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_argmax(&env, &a));
  CHECK(check_vocab(op, &a.logits));
  int64_t S = a.logits.shape[0];
  if (S == 0) return NULL;
  return launch_result(cuda_launch_argmax(s->stream, d->warp_size, cuda_view(&a.logits),
                                          cuda_view(&a.out_ids), cuda_view(&a.out_logprob)),
                       op);
}

static kiln_hal_error_t *cuda_topk(kiln_hal_stream_t *s, const kiln_hal_topk_args_t *user) {
  const char *op = "topk";
  kiln_hal_topk_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_topk(&env, &a));
  CHECK(check_vocab(op, &a.logits));
  int64_t S = a.logits.shape[0], k = a.out_values.shape[1];
  if (S == 0 || (k == 0 && !a.out_lse.buffer)) return NULL;
  return launch_result(
      cuda_launch_topk(s->stream, d->warp_size, cuda_view(&a.logits), cuda_view(&a.out_values),
                       cuda_view(&a.out_ids), cuda_view(&a.out_lse)),
      op);
}

static kiln_hal_error_t *cuda_mask_logits(kiln_hal_stream_t *s, const kiln_hal_mask_args_t *user) {
  const char *op = "mask_logits";
  kiln_hal_mask_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_mask_logits(&env, &a));
  CHECK(check_vocab(op, &a.logits));
  if (a.logits.shape[0] > 65535) return cuda_err_unsupported("mask_logits: more than 65535 rows");
  if (a.logits.shape[0] == 0) return NULL;
  return launch_result(cuda_launch_mask_logits(s->stream, cuda_view(&a.logits), cuda_view(&a.mask),
                                               cuda_view(&a.rows)),
                       op);
}

/* This backend's limit on a token list (hal_check.h checked the rest): its length fits in
 * int32. */
static kiln_hal_error_t *check_list_len(const char *ids_name, const kiln_hal_tensor_t *ids) {
  if (ids->buffer && ids->shape[0] > INT32_MAX)
    return cuda_err_unsupported("penalize: %s beyond int32", ids_name);
  return NULL;
}

static kiln_hal_error_t *cuda_penalize(kiln_hal_stream_t *s, const kiln_hal_penalize_args_t *user) {
  const char *op = "penalize";
  kiln_hal_penalize_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_penalize(&env, &a));
  CHECK(check_vocab(op, &a.logits));
  CHECK(check_list_len("prompt_ids", &a.prompt_ids));
  CHECK(check_list_len("output_ids", &a.output_ids));
  CHECK(check_list_len("bias_ids", &a.bias_ids));
  int64_t S = a.logits.shape[0], V = a.logits.shape[1];
  if (S == 0) return NULL;
  if (cuda_penalize_smem_bytes(V) > d->smem_optin)
    return cuda_err_unsupported(
        "penalize: V %lld needs %lld bytes of shared memory, the device "
        "has %lld",
        (long long)V, (long long)cuda_penalize_smem_bytes(V), (long long)d->smem_optin);
  cuda_penalize_params_t p;
  p.logits = cuda_view(&a.logits);
  p.prompt_ids = cuda_view(&a.prompt_ids);
  p.prompt_offsets = cuda_view(&a.prompt_offsets);
  p.output_ids = cuda_view(&a.output_ids);
  p.output_offsets = cuda_view(&a.output_offsets);
  p.repetition = cuda_view(&a.repetition);
  p.frequency = cuda_view(&a.frequency);
  p.presence = cuda_view(&a.presence);
  p.bias_ids = cuda_view(&a.bias_ids);
  p.bias_values = cuda_view(&a.bias_values);
  p.bias_offsets = cuda_view(&a.bias_offsets);
  return launch_result(cuda_launch_penalize(s->stream, d->warp_size, &p, d->smem_optin), op);
}

static kiln_hal_error_t *cuda_sample(kiln_hal_stream_t *s, const kiln_hal_sample_args_t *user) {
  const char *op = "sample";
  kiln_hal_sample_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  kiln_hal_check_env_t env = cuda_check_env(d);
  CHECK(kiln_hal_check_sample(&env, &a));
  CHECK(check_vocab(op, &a.logits));
  int64_t S = a.logits.shape[0];
  if (S == 0) return NULL;
  cuda_sample_params_t p;
  p.logits = cuda_view(&a.logits);
  p.temperature = cuda_view(&a.temperature);
  p.top_k = cuda_view(&a.top_k);
  p.top_p = cuda_view(&a.top_p);
  p.min_p = cuda_view(&a.min_p);
  p.uniform = cuda_view(&a.uniform);
  p.out_ids = cuda_view(&a.out_ids);
  p.out_logprob = cuda_view(&a.out_logprob);
  return launch_result(cuda_launch_sample(s->stream, d->warp_size, &p), op);
}

/* ============================================================================================
 * Graphs: stream capture. ThreadLocal mode: other threads may keep allocating meanwhile.
 * ==========================================================================================*/

static kiln_hal_error_t *cuda_graph_begin(kiln_hal_stream_t *s) {
  CHECK(cuda_stream_enter(s));
  if (s->capturing) return cuda_err_arg("graph_begin: the stream is already capturing");
  cudaError_t e = cudaStreamBeginCapture(s->stream, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) return cuda_err_rt(e, "graph_begin: cudaStreamBeginCapture");
  s->capturing = true;
  atomic_fetch_add(&s->device->capturing, 1);
  return NULL;
}

static kiln_hal_error_t *cuda_graph_end(kiln_hal_stream_t *s, kiln_hal_graph_t **out_graph) {
  if (!out_graph) return cuda_err_arg("graph_end: out_graph is NULL");
  *out_graph = NULL;
  CHECK(cuda_stream_enter(s));
  if (!s->capturing) return cuda_err_arg("graph_end: the stream is not capturing");
  cudaGraph_t g = NULL;
  cudaError_t e = cudaStreamEndCapture(s->stream, &g);
  s->capturing = false;
  atomic_fetch_sub(&s->device->capturing, 1);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (g) (void)cudaGraphDestroy(g);
    return cuda_err_rt(e, "graph_end: cudaStreamEndCapture (an op during capture failed?)");
  }
  cudaGraphExec_t x = NULL;
  e = kiln_graph_instantiate(&x, g);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaGraphDestroy(g);
    return cuda_err_rt(e, "graph_end: cudaGraphInstantiate");
  }
  kiln_hal_graph_t *graph = calloc(1, sizeof(*graph));
  if (!graph) {
    (void)cudaGraphExecDestroy(x);
    (void)cudaGraphDestroy(g);
    return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "graph_end: out of host memory");
  }
  graph->device = s->device;
  graph->graph = g;
  graph->exec = x;
  *out_graph = graph;
  return NULL;
}

static kiln_hal_error_t *cuda_graph_replay(kiln_hal_graph_t *graph, kiln_hal_stream_t *s) {
  if (!graph) return cuda_err_arg("graph_replay: graph is NULL");
  CHECK(cuda_stream_enter(s));
  if (graph->device != s->device)
    return cuda_err_arg("graph_replay: graph of device %d replayed on a stream of device %d",
                        graph->device->index, s->device->index);
  cudaError_t e = cudaGraphLaunch(graph->exec, s->stream);
  return e == cudaSuccess ? NULL : cuda_err_rt(e, "graph_replay: cudaGraphLaunch");
}

static void cuda_graph_destroy(kiln_hal_graph_t *graph) {
  if (!graph) return;
  (void)cudaSetDevice(graph->device->index);
  (void)cudaGraphExecDestroy(graph->exec);
  (void)cudaGraphDestroy(graph->graph);
  free(graph);
}

/* ============================================================================================
 * The table
 * ==========================================================================================*/

static const kiln_hal_backend_t g_table = {
    .struct_size = sizeof(kiln_hal_backend_t),
    .abi_major = KILN_HAL_ABI_MAJOR,
    .abi_minor = KILN_HAL_ABI_MINOR,
    .name = KILN_GPU_PLUGIN_NAME,
    .build_info = CUDA_BUILD_INFO,
    .init = cuda_init,
    .shutdown = cuda_shutdown,
    .probe = cuda_probe,
    .device_count = cuda_device_count,
    .device_info = cuda_device_info,
    .device_open = cuda_device_open,
    .device_close = cuda_device_close,
    .device_memory = cuda_device_memory,
    .buffer_alloc = cuda_buffer_alloc,
    .buffer_free = cuda_buffer_free,
    .buffer_host_ptr = cuda_buffer_host_ptr,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_sync = cuda_stream_sync,
    .copy_h2d = cuda_copy_h2d,
    .copy_d2h = cuda_copy_d2h,
    .copy_d2d = cuda_copy_d2d,
    .fill = cuda_fill,
    .gemm = cuda_gemm_op,
    .embedding = cuda_embedding,
    .rmsnorm = cuda_rmsnorm,
    .rope = cuda_rope,
    .silu_mul = cuda_silu_mul,
    .add = cuda_add,
    .copy = cuda_copy,
    .kv_write = cuda_kv_write,
    .attention = cuda_attention,
    .argmax = cuda_argmax,
    .topk = cuda_topk,
    .penalize = cuda_penalize,
    .mask_logits = cuda_mask_logits,
    .sample = cuda_sample,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_replay = cuda_graph_replay,
    .graph_destroy = cuda_graph_destroy,
    .layernorm = cuda_layernorm,
    .activation = cuda_activation,
    .gemm_quant = cuda_gemm_quant, /* 1.4 */
    /* 1.5: collectives on NCCL/RCCL (cuda_nccl.c); without the library they return
     * UNSUPPORTED and device_info leaves KILN_HAL_CAP_COLLECTIVES clear. */
    .comm_get_unique_id = cuda_comm_get_unique_id,
    .comm_create = cuda_comm_create,
    .comm_destroy = cuda_comm_destroy,
    .all_reduce = cuda_all_reduce,
    .all_gather = cuda_all_gather,
    .broadcast = cuda_broadcast,
    .send = cuda_send,
    .recv = cuda_recv,
};

__attribute__((visibility("default"))) const kiln_hal_backend_t *kiln_backend_query(
    uint32_t host_major, uint32_t host_minor);

/* The plugin's one exported symbol. Returns the table whatever the host's version (the host
 * refuses a different major with a clear message). */
__attribute__((visibility("default"))) const kiln_hal_backend_t *kiln_backend_query(
    uint32_t host_major, uint32_t host_minor) {
  (void)host_major;
  (void)host_minor;
  return &g_table;
}
