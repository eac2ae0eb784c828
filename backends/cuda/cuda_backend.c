/* cuda_backend.c - the CUDA backend's table: probe, devices, buffers, streams, copies, graphs,
 * and the host-side validation of every op before its kernel launcher runs. */
#define _GNU_SOURCE /* dladdr-free, but RTLD_* and strnlen want it on some libcs */
#include <dlfcn.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#define CUDA_STR2(x) #x
#define CUDA_STR(x) CUDA_STR2(x)

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

kiln_hal_error_t *cuda_err_blas(cublasStatus_t s, const char *what) {
  int32_t code = s == CUBLAS_STATUS_ALLOC_FAILED    ? KILN_HAL_ERR_OUT_OF_MEMORY
                 : s == CUBLAS_STATUS_NOT_SUPPORTED ? KILN_HAL_ERR_UNSUPPORTED
                                                    : KILN_HAL_ERR_DEVICE;
  return kiln_hal_error_new(code, "%s: %s: %s", what, cublasLtGetStatusName(s),
                            cublasLtGetStatusString(s));
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

/* Copies a caller's args struct (struct_size = the caller's sizeof) into a zeroed full-size one:
 * members an older caller lacks read as zero. */
static kiln_hal_error_t *args_copy(const char *op, void *dst, size_t dst_size, const void *src) {
  memset(dst, 0, dst_size);
  if (!src) return cuda_err_arg("%s: args is NULL", op);
  uint32_t n;
  memcpy(&n, src, sizeof(n));
  if (n < sizeof(uint32_t)) return cuda_err_arg("%s: args struct_size %u is too small", op, n);
  memcpy(dst, src, n < dst_size ? n : dst_size);
  return NULL;
}

#define ARGS_COPY(op, local, user) args_copy((op), &(local), sizeof(local), (user))

/* ============================================================================================
 * Validation
 * ==========================================================================================*/

static const char *dtype_list(uint32_t dtypes, char *buf, size_t n) {
  buf[0] = 0;
  size_t used = 0;
  for (int d = 0; d < KILN_HAL_DTYPE_COUNT; d++) {
    if (!(dtypes & CUDA_DT(d))) continue;
    int w = snprintf(buf + used, n - used, "%s%s", used ? "|" : "", kiln_hal_dtype_name(d));
    if (w < 0 || (size_t)w >= n - used) break;
    used += (size_t)w;
  }
  return buf;
}

static void shape_str(const kiln_hal_tensor_t *t, char *buf, size_t n) {
  size_t used = 0;
  buf[0] = 0;
  int nd = t->ndim < 0 ? 0 : t->ndim > KILN_HAL_MAX_DIMS ? KILN_HAL_MAX_DIMS : t->ndim;
  used += (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < nd && used < n; i++)
    used += (size_t)snprintf(buf + used, n - used, "%s%lld", i ? "," : "", (long long)t->shape[i]);
  if (used < n) snprintf(buf + used, n - used, "]");
}

kiln_hal_error_t *cuda_check_tensor(kiln_hal_device_t *dev, const char *op, const char *name,
                                    const kiln_hal_tensor_t *t, uint32_t dtypes, int32_t ndim,
                                    bool last_contig) {
  char buf[96];
  if (!t->buffer) return cuda_err_arg("%s: %s is absent", op, name);
  if (t->dtype < 0 || t->dtype >= KILN_HAL_DTYPE_COUNT || !(dtypes & CUDA_DT(t->dtype)))
    return cuda_err_arg("%s: %s has dtype %s, want %s", op, name, kiln_hal_dtype_name(t->dtype),
                        dtype_list(dtypes, buf, sizeof(buf)));
  if (t->ndim < 1 || t->ndim > KILN_HAL_MAX_DIMS)
    return cuda_err_arg("%s: %s has ndim %d, want 1..%d", op, name, t->ndim, KILN_HAL_MAX_DIMS);
  if (ndim && t->ndim != ndim)
    return cuda_err_arg("%s: %s has ndim %d, want %d", op, name, t->ndim, ndim);
  int64_t last = 0;
  bool empty = false;
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0 || t->stride[i] < 0)
      return cuda_err_arg("%s: %s has shape[%d]=%lld stride[%d]=%lld (must be >= 0)", op, name, i,
                          (long long)t->shape[i], i, (long long)t->stride[i]);
    if (t->shape[i] == 0) empty = true;
    int64_t span;
    if (t->shape[i] > 0 && (__builtin_mul_overflow(t->shape[i] - 1, t->stride[i], &span) ||
                            __builtin_add_overflow(last, span, &last)))
      return cuda_err_arg("%s: %s: shape x stride overflows", op, name);
  }
  if (last_contig && t->shape[t->ndim - 1] > 1 && t->stride[t->ndim - 1] != 1)
    return cuda_err_arg("%s: %s: last dimension must be contiguous (stride %lld)", op, name,
                        (long long)t->stride[t->ndim - 1]);
  size_t es = kiln_hal_dtype_size(t->dtype);
  if (t->offset % es)
    return cuda_err_arg("%s: %s: offset %llu is not a multiple of the element size %zu", op, name,
                        (unsigned long long)t->offset, es);
  kiln_hal_buffer_t *b = t->buffer;
  if (!b->pinned && b->device != dev)
    return cuda_err_arg("%s: %s lives in a buffer of device %d, the stream is on device %d", op,
                        name, b->device->index, dev->index);
  if (!empty) {
    uint64_t end;
    if (__builtin_mul_overflow((uint64_t)last + 1, (uint64_t)es, &end) ||
        __builtin_add_overflow(end, t->offset, &end) || end > b->size) {
      shape_str(t, buf, sizeof(buf));
      return cuda_err_arg(
          "%s: %s (shape %s, offset %llu) reaches past the end of its %llu-byte "
          "buffer",
          op, name, buf, (unsigned long long)t->offset, (unsigned long long)b->size);
    }
  }
  return NULL;
}

kiln_hal_error_t *cuda_check_shape(const char *op, const char *name, const kiln_hal_tensor_t *t,
                                   int32_t n, const int64_t *want) {
  for (int i = 0; i < n; i++) {
    if (want[i] >= 0 && t->shape[i] != want[i]) {
      char have[96], w[96];
      shape_str(t, have, sizeof(have));
      size_t used = (size_t)snprintf(w, sizeof(w), "[");
      for (int j = 0; j < n && used < sizeof(w); j++) {
        if (want[j] >= 0)
          used += (size_t)snprintf(w + used, sizeof(w) - used, "%s%lld", j ? "," : "",
                                   (long long)want[j]);
        else
          used += (size_t)snprintf(w + used, sizeof(w) - used, "%s*", j ? "," : "");
      }
      if (used < sizeof(w)) snprintf(w + used, sizeof(w) - used, "]");
      return cuda_err_arg("%s: %s has shape %s, want %s", op, name, have, w);
    }
  }
  return NULL;
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

/* Byte range [lo, hi) a view can touch (empty when it has no elements). */
static void view_range(const kiln_hal_tensor_t *t, uint64_t *lo, uint64_t *hi) {
  uint64_t end = kiln_hal_tensor_extent(t);
  *lo = t->offset;
  *hi = end ? end : t->offset;
}

static bool views_overlap(const kiln_hal_tensor_t *a, const kiln_hal_tensor_t *b) {
  if (!a->buffer || a->buffer != b->buffer) return false;
  uint64_t alo, ahi, blo, bhi;
  view_range(a, &alo, &ahi);
  view_range(b, &blo, &bhi);
  return alo < bhi && blo < ahi;
}

/* Validation helpers that return from the calling op on error. */
#define CHECK(expr)                  \
  do {                               \
    kiln_hal_error_t *err_ = (expr); \
    if (err_) return err_;           \
  } while (0)

#define CHECK_SHAPE(op, name, t, ...)                                                         \
  do {                                                                                        \
    const int64_t want_[] = {__VA_ARGS__};                                                    \
    CHECK(cuda_check_shape(op, name, t, (int32_t)(sizeof(want_) / sizeof(want_[0])), want_)); \
  } while (0)

/* ============================================================================================
 * Probe, init, devices
 * ==========================================================================================*/

static kiln_hal_error_t *cuda_probe(int32_t *out_score) {
  if (!out_score) return cuda_err_arg("probe: out_score is NULL");
  *out_score = 0;
  /* The driver library first: without it the runtime can only say "insufficient driver". The
   * handle is kept (libcuda is never unloaded; the runtime opens it again itself). */
  dlerror();
  void *h = dlopen(KILN_GPU_DRIVER_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *why = dlerror();
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE, "no NVIDIA driver: %s",
                              why ? why : KILN_GPU_DRIVER_SONAME ": dlopen failed");
  }
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess)
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE, "cudaGetDeviceCount: %s: %s",
                              cudaGetErrorName(e), cudaGetErrorString(e));
  if (n <= 0)
    return kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE,
                              "the NVIDIA driver is loaded but reports no CUDA device");
  *out_score = 200;
  return NULL;
}

static kiln_hal_error_t *cuda_init(const kiln_hal_host_t *host) {
  g_host = host;
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
  snprintf(info.arch, sizeof(info.arch), "sm_%d%d", p.major, p.minor);
  info.total_memory = total_b;
  info.free_memory = free_b;
  info.caps = KILN_HAL_CAP_F16 | KILN_HAL_CAP_GRAPHS | KILN_HAL_CAP_DEVICE_SAMPLING;
  if (p.major >= 8) info.caps |= KILN_HAL_CAP_BF16 | KILN_HAL_CAP_TF32;
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
  if (p.major < 8)
    return cuda_err_unsupported("device_open: %s is sm_%d%d; this build needs sm_80 or newer",
                                p.name, p.major, p.minor);
  e = cudaSetDevice(index);
  if (e == cudaSuccess) e = cudaFree(NULL); /* creates the primary context now, not mid-op */
  if (e != cudaSuccess) return cuda_err_rt(e, "device_open: creating the context");
  kiln_hal_device_t *d = calloc(1, sizeof(*d));
  if (!d) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "device_open: out of host memory");
  d->index = index;
  d->warp_size = p.warpSize;
  d->sm_count = p.multiProcessorCount;
  d->smem_optin = (int64_t)p.sharedMemPerBlockOptin;
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
  cublasStatus_t bs = cublasLtCreate(&s->lt);
  if (bs != CUBLAS_STATUS_SUCCESS) {
    s->lt = NULL;
    err = cuda_err_blas(bs, "stream_create: cublasLtCreate");
    goto fail;
  }
  s->workspace_size = CUDA_GEMM_WORKSPACE_BYTES;
  e = cudaMalloc(&s->workspace, s->workspace_size);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    s->workspace = NULL;
    err = cuda_err_rt(e, "stream_create: cudaMalloc(cuBLASLt workspace)");
    goto fail;
  }
  e = cudaMalloc((void **)&s->stage, CUDA_GEMM_STAGE_BYTES);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    s->stage = NULL;
    err = cuda_err_rt(e, "stream_create: cudaMalloc(gemm staging)");
    goto fail;
  }
  *out_stream = s;
  return NULL;
fail:
  if (s->workspace) (void)cudaFree(s->workspace);
  if (s->lt) cublasLtDestroy(s->lt);
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
  cuda_gemm_plans_release(s);
  if (s->lt) cublasLtDestroy(s->lt);
  (void)cudaStreamDestroy(s->stream);
  if (s->workspace) (void)cudaFree(s->workspace);
  if (s->stage) (void)cudaFree(s->stage);
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

static kiln_hal_error_t *cuda_embedding(kiln_hal_stream_t *s,
                                        const kiln_hal_embedding_args_t *user) {
  const char *op = "embedding";
  kiln_hal_embedding_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  CHECK(cuda_check_tensor(d, op, "table", &a.table, CUDA_DT_FLOAT, 2, true));
  CHECK(cuda_check_tensor(d, op, "ids", &a.ids, CUDA_DT(KILN_HAL_I32), 1, true));
  CHECK(cuda_check_tensor(d, op, "out", &a.out, CUDA_DT(a.table.dtype), 2, true));
  CHECK_SHAPE(op, "out", &a.out, a.ids.shape[0], a.table.shape[1]);
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
  CHECK(cuda_check_tensor(d, op, "x", &a.x, CUDA_DT_FLOAT, 2, true));
  uint32_t dt = CUDA_DT(a.x.dtype);
  int64_t T = a.x.shape[0], H = a.x.shape[1];
  CHECK(cuda_check_tensor(d, op, "weight", &a.weight, dt, 1, true));
  CHECK_SHAPE(op, "weight", &a.weight, H);
  CHECK(cuda_check_tensor(d, op, "out", &a.out, dt, 2, true));
  CHECK_SHAPE(op, "out", &a.out, T, H);
  if (a.residual.buffer) {
    CHECK(cuda_check_tensor(d, op, "residual", &a.residual, dt, 2, true));
    CHECK_SHAPE(op, "residual", &a.residual, T, H);
    if (views_overlap(&a.out, &a.residual))
      return cuda_err_arg("rmsnorm: out must not alias residual");
  }
  if (!isfinite(a.eps) || a.eps < 0) return cuda_err_arg("rmsnorm: eps %g must be >= 0", a.eps);
  if (T == 0 || H == 0) return NULL;
  return launch_result(
      cuda_launch_rmsnorm(s->stream, d->warp_size, cuda_view(&a.x), cuda_view(&a.residual),
                          cuda_view(&a.weight), cuda_view(&a.out), a.eps, a.weight_offset),
      op);
}

static kiln_hal_error_t *cuda_rope(kiln_hal_stream_t *s, const kiln_hal_rope_args_t *user) {
  const char *op = "rope";
  kiln_hal_rope_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  if (a.style != KILN_HAL_ROPE_NEOX && a.style != KILN_HAL_ROPE_INTERLEAVED)
    return cuda_err_arg("rope: unknown style %d", a.style);
  CHECK(cuda_check_tensor(d, op, "positions", &a.positions, CUDA_DT(KILN_HAL_I32), 1, true));
  CHECK(cuda_check_tensor(d, op, "cos_sin", &a.cos_sin, CUDA_DT(KILN_HAL_F32), 2, true));
  int64_t T = a.positions.shape[0], R = a.cos_sin.shape[1];
  if (R % 2)
    return cuda_err_arg("rope: rotary dim (cos_sin.shape[1]) %lld must be even", (long long)R);
  const kiln_hal_tensor_t *xs[2] = {&a.q, &a.k};
  const char *names[2] = {"q", "k"};
  for (int i = 0; i < 2; i++) {
    if (!xs[i]->buffer) continue;
    CHECK(cuda_check_tensor(d, op, names[i], xs[i], CUDA_DT_FLOAT, 3, true));
    CHECK_SHAPE(op, names[i], xs[i], T, -1, -1);
    if (i == 1 && a.q.buffer && a.k.shape[2] != a.q.shape[2])
      return cuda_err_arg("rope: k head dim %lld differs from q's %lld", (long long)a.k.shape[2],
                          (long long)a.q.shape[2]);
    if (R > xs[i]->shape[2])
      return cuda_err_arg("rope: rotary dim %lld exceeds %s's head dim %lld", (long long)R,
                          names[i], (long long)xs[i]->shape[2]);
  }
  if (T == 0 || R == 0) return NULL;
  for (int i = 0; i < 2; i++) {
    if (!xs[i]->buffer || kiln_hal_tensor_numel(xs[i]) == 0) continue;
    CHECK(launch_result(cuda_launch_rope(s->stream, cuda_view(xs[i]), cuda_view(&a.positions),
                                         cuda_view(&a.cos_sin), a.style),
                        op));
  }
  return NULL;
}

static kiln_hal_error_t *cuda_silu_mul(kiln_hal_stream_t *s, const kiln_hal_silu_mul_args_t *user) {
  const char *op = "silu_mul";
  kiln_hal_silu_mul_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  if (a.act < KILN_HAL_ACT_SILU || a.act > KILN_HAL_ACT_GELU)
    return cuda_err_arg("silu_mul: unknown activation %d", a.act);
  CHECK(cuda_check_tensor(d, op, "x", &a.x, CUDA_DT_FLOAT, 2, true));
  CHECK(cuda_check_tensor(d, op, "out", &a.out, CUDA_DT(a.x.dtype), 2, true));
  CHECK_SHAPE(op, "out", &a.out, a.x.shape[0], -1);
  if (a.x.shape[1] != 2 * a.out.shape[1])
    return cuda_err_arg("silu_mul: x has %lld columns, want 2 x out's %lld",
                        (long long)a.x.shape[1], (long long)a.out.shape[1]);
  if (kiln_hal_tensor_numel(&a.out) == 0) return NULL;
  return launch_result(cuda_launch_silu_mul(s->stream, cuda_view(&a.x), cuda_view(&a.out), a.act),
                       op);
}

static kiln_hal_error_t *cuda_add(kiln_hal_stream_t *s, const kiln_hal_add_args_t *user) {
  const char *op = "add";
  kiln_hal_add_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  CHECK(cuda_check_tensor(d, op, "a", &a.a, CUDA_DT_FLOAT, 2, true));
  uint32_t dt = CUDA_DT(a.a.dtype);
  CHECK(cuda_check_tensor(d, op, "b", &a.b, dt, 2, true));
  CHECK(cuda_check_tensor(d, op, "out", &a.out, dt, 2, true));
  CHECK_SHAPE(op, "b", &a.b, a.a.shape[0], a.a.shape[1]);
  CHECK_SHAPE(op, "out", &a.out, a.a.shape[0], a.a.shape[1]);
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
  const uint32_t all =
      CUDA_DT_FLOAT | CUDA_DT(KILN_HAL_I32) | CUDA_DT(KILN_HAL_I64) | CUDA_DT(KILN_HAL_U8);
  CHECK(cuda_check_tensor(d, op, "src", &a.src, all, 0, false));
  bool sf = (CUDA_DT_FLOAT & CUDA_DT(a.src.dtype)) != 0;
  CHECK(cuda_check_tensor(d, op, "dst", &a.dst, sf ? CUDA_DT_FLOAT : CUDA_DT(a.src.dtype),
                          a.src.ndim, false));
  for (int i = 0; i < a.src.ndim; i++)
    if (a.src.shape[i] != a.dst.shape[i])
      return cuda_err_arg("copy: src and dst shapes differ in dim %d (%lld vs %lld)", i,
                          (long long)a.src.shape[i], (long long)a.dst.shape[i]);
  if (kiln_hal_tensor_numel(&a.src) == 0) return NULL;
  return launch_result(cuda_launch_copy(s->stream, cuda_view(&a.src), cuda_view(&a.dst)), op);
}

static kiln_hal_error_t *cuda_kv_write(kiln_hal_stream_t *s, const kiln_hal_kv_write_args_t *user) {
  const char *op = "kv_write";
  kiln_hal_kv_write_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  CHECK(cuda_check_tensor(d, op, "k", &a.k, CUDA_DT_FLOAT, 3, true));
  uint32_t dt = CUDA_DT(a.k.dtype);
  int64_t T = a.k.shape[0], NKV = a.k.shape[1], D = a.k.shape[2];
  CHECK(cuda_check_tensor(d, op, "v", &a.v, dt, 3, true));
  CHECK_SHAPE(op, "v", &a.v, T, NKV, D);
  CHECK(cuda_check_tensor(d, op, "k_cache", &a.k_cache, dt, 4, true));
  CHECK_SHAPE(op, "k_cache", &a.k_cache, -1, NKV, -1, D);
  CHECK(cuda_check_tensor(d, op, "v_cache", &a.v_cache, dt, 4, true));
  CHECK_SHAPE(op, "v_cache", &a.v_cache, a.k_cache.shape[0], NKV, a.k_cache.shape[2], D);
  if (!kiln_hal_tensor_is_contiguous(&a.k_cache) || !kiln_hal_tensor_is_contiguous(&a.v_cache))
    return cuda_err_arg("kv_write: k_cache and v_cache must be dense");
  CHECK(cuda_check_tensor(d, op, "slot_mapping", &a.slot_mapping, CUDA_DT(KILN_HAL_I32), 1, true));
  CHECK_SHAPE(op, "slot_mapping", &a.slot_mapping, T);
  if (T == 0 || NKV == 0 || D == 0 || kiln_hal_tensor_numel(&a.k_cache) == 0) return NULL;
  return launch_result(
      cuda_launch_kv_write(s->stream, cuda_view(&a.k), cuda_view(&a.v), cuda_view(&a.k_cache),
                           cuda_view(&a.v_cache), cuda_view(&a.slot_mapping)),
      op);
}

static kiln_hal_error_t *cuda_attention(kiln_hal_stream_t *s,
                                        const kiln_hal_attention_args_t *user) {
  const char *op = "attention";
  kiln_hal_attention_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  CHECK(cuda_check_tensor(d, op, "q", &a.q, CUDA_DT_FLOAT, 3, true));
  uint32_t dt = CUDA_DT(a.q.dtype);
  int64_t T = a.q.shape[0], NH = a.q.shape[1], D = a.q.shape[2];
  CHECK(cuda_check_tensor(d, op, "out", &a.out, dt, 3, true));
  CHECK_SHAPE(op, "out", &a.out, T, NH, D);
  CHECK(cuda_check_tensor(d, op, "k_cache", &a.k_cache, dt, 4, true));
  CHECK_SHAPE(op, "k_cache", &a.k_cache, -1, -1, -1, D);
  int64_t NB = a.k_cache.shape[0], NKV = a.k_cache.shape[1], BS = a.k_cache.shape[2];
  CHECK(cuda_check_tensor(d, op, "v_cache", &a.v_cache, dt, 4, true));
  CHECK_SHAPE(op, "v_cache", &a.v_cache, NB, NKV, BS, D);
  if (!kiln_hal_tensor_is_contiguous(&a.k_cache) || !kiln_hal_tensor_is_contiguous(&a.v_cache))
    return cuda_err_arg("attention: k_cache and v_cache must be dense");
  if (NKV <= 0 || NH % NKV)
    return cuda_err_arg("attention: %lld query heads are not a multiple of %lld kv heads",
                        (long long)NH, (long long)NKV);
  if (BS <= 0) return cuda_err_arg("attention: block size must be > 0");
  if (a.num_seqs < 0) return cuda_err_arg("attention: num_seqs %d < 0", a.num_seqs);
  int64_t S = a.num_seqs;
  CHECK(cuda_check_tensor(d, op, "block_table", &a.block_table, CUDA_DT(KILN_HAL_I32), 2, true));
  CHECK_SHAPE(op, "block_table", &a.block_table, S, -1);
  CHECK(cuda_check_tensor(d, op, "seq_lens", &a.seq_lens, CUDA_DT(KILN_HAL_I32), 1, true));
  CHECK_SHAPE(op, "seq_lens", &a.seq_lens, S);
  CHECK(cuda_check_tensor(d, op, "query_start_loc", &a.query_start_loc, CUDA_DT(KILN_HAL_I32), 1,
                          true));
  CHECK_SHAPE(op, "query_start_loc", &a.query_start_loc, S + 1);
  if (a.max_query_len < 0 || a.max_seq_len < 0)
    return cuda_err_arg("attention: max_query_len %d / max_seq_len %d must be >= 0",
                        a.max_query_len, a.max_seq_len);
  if (a.sliding_window < 0)
    return cuda_err_arg("attention: sliding_window %d must be >= 0", a.sliding_window);
  if (!isfinite(a.scale)) return cuda_err_arg("attention: scale is not finite");
  if (!isfinite(a.softcap) || a.softcap < 0)
    return cuda_err_arg("attention: softcap %g must be >= 0", a.softcap);
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
  p.num_blocks = (int32_t)NB;
  p.num_kv_heads = (int32_t)NKV;
  p.block_size = (int32_t)BS;
  p.max_blocks = (int32_t)a.block_table.shape[1];
  p.scale = a.scale;
  p.softcap = a.softcap;
  p.sliding_window = a.sliding_window;
  p.causal = a.causal;
  return launch_result(cuda_launch_attention(s->stream, d->warp_size, &p), op);
}

/* logits: [S, V] F32 with a contiguous last dim; V > 0 unless S == 0. */
static kiln_hal_error_t *check_logits(kiln_hal_device_t *d, const char *op,
                                      const kiln_hal_tensor_t *t) {
  CHECK(cuda_check_tensor(d, op, "logits", t, CUDA_DT(KILN_HAL_F32), 2, true));
  if (t->shape[0] > 0 && t->shape[1] == 0) return cuda_err_arg("%s: logits have V == 0", op);
  if (t->shape[1] > INT32_MAX) return cuda_err_unsupported("%s: V beyond int32", op);
  return NULL;
}

/* An optional [S] tensor of the given dtype. */
static kiln_hal_error_t *check_opt_vec(kiln_hal_device_t *d, const char *op, const char *name,
                                       const kiln_hal_tensor_t *t, int32_t dtype, int64_t n) {
  if (!t->buffer) return NULL;
  CHECK(cuda_check_tensor(d, op, name, t, CUDA_DT(dtype), 1, true));
  CHECK_SHAPE(op, name, t, n);
  return NULL;
}

static kiln_hal_error_t *cuda_argmax(kiln_hal_stream_t *s, const kiln_hal_argmax_args_t *user) {
  const char *op = "argmax";
  kiln_hal_argmax_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  CHECK(check_logits(d, op, &a.logits));
  int64_t S = a.logits.shape[0];
  CHECK(cuda_check_tensor(d, op, "out_ids", &a.out_ids, CUDA_DT(KILN_HAL_I32), 1, true));
  CHECK_SHAPE(op, "out_ids", &a.out_ids, S);
  CHECK(check_opt_vec(d, op, "out_logprob", &a.out_logprob, KILN_HAL_F32, S));
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
  CHECK(check_logits(d, op, &a.logits));
  int64_t S = a.logits.shape[0], V = a.logits.shape[1];
  CHECK(cuda_check_tensor(d, op, "out_values", &a.out_values, CUDA_DT(KILN_HAL_F32), 2, true));
  int64_t k = a.out_values.shape[1];
  CHECK_SHAPE(op, "out_values", &a.out_values, S, k);
  CHECK(cuda_check_tensor(d, op, "out_ids", &a.out_ids, CUDA_DT(KILN_HAL_I32), 2, true));
  CHECK_SHAPE(op, "out_ids", &a.out_ids, S, k);
  if (k > V) return cuda_err_arg("topk: k %lld > V %lld", (long long)k, (long long)V);
  CHECK(check_opt_vec(d, op, "out_lse", &a.out_lse, KILN_HAL_F32, S));
  if (S == 0 || (k == 0 && !a.out_lse.buffer)) return NULL;
  return launch_result(
      cuda_launch_topk(s->stream, d->warp_size, cuda_view(&a.logits), cuda_view(&a.out_values),
                       cuda_view(&a.out_ids), cuda_view(&a.out_lse)),
      op);
}

/* A flattened token list: ids [N] I32 + offsets [S + 1] I32 (+ values [N] F32 for the bias). */
static kiln_hal_error_t *check_list(kiln_hal_device_t *d, const char *op, const char *ids_name,
                                    const kiln_hal_tensor_t *ids, const char *off_name,
                                    const kiln_hal_tensor_t *off, int64_t S) {
  if (!ids->buffer && !off->buffer) return NULL;
  if (!ids->buffer || !off->buffer)
    return cuda_err_arg("%s: %s and %s must both be present or both absent", op, ids_name,
                        off_name);
  CHECK(cuda_check_tensor(d, op, ids_name, ids, CUDA_DT(KILN_HAL_I32), 1, true));
  CHECK(cuda_check_tensor(d, op, off_name, off, CUDA_DT(KILN_HAL_I32), 1, true));
  CHECK_SHAPE(op, off_name, off, S + 1);
  if (ids->shape[0] > INT32_MAX) return cuda_err_unsupported("%s: %s beyond int32", op, ids_name);
  return NULL;
}

static kiln_hal_error_t *cuda_penalize(kiln_hal_stream_t *s, const kiln_hal_penalize_args_t *user) {
  const char *op = "penalize";
  kiln_hal_penalize_args_t a;
  CHECK(ARGS_COPY(op, a, user));
  CHECK(cuda_stream_enter(s));
  kiln_hal_device_t *d = s->device;
  CHECK(check_logits(d, op, &a.logits));
  int64_t S = a.logits.shape[0], V = a.logits.shape[1];
  CHECK(check_list(d, op, "prompt_ids", &a.prompt_ids, "prompt_offsets", &a.prompt_offsets, S));
  CHECK(check_list(d, op, "output_ids", &a.output_ids, "output_offsets", &a.output_offsets, S));
  CHECK(check_opt_vec(d, op, "repetition", &a.repetition, KILN_HAL_F32, S));
  CHECK(check_opt_vec(d, op, "frequency", &a.frequency, KILN_HAL_F32, S));
  CHECK(check_opt_vec(d, op, "presence", &a.presence, KILN_HAL_F32, S));
  if (a.bias_ids.buffer || a.bias_values.buffer || a.bias_offsets.buffer) {
    if (!a.bias_ids.buffer || !a.bias_values.buffer || !a.bias_offsets.buffer)
      return cuda_err_arg(
          "penalize: bias_ids, bias_values and bias_offsets must all be present "
          "or all absent");
    CHECK(check_list(d, op, "bias_ids", &a.bias_ids, "bias_offsets", &a.bias_offsets, S));
    CHECK(cuda_check_tensor(d, op, "bias_values", &a.bias_values, CUDA_DT(KILN_HAL_F32), 1, true));
    CHECK_SHAPE(op, "bias_values", &a.bias_values, a.bias_ids.shape[0]);
  }
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
  CHECK(check_logits(d, op, &a.logits));
  int64_t S = a.logits.shape[0];
  CHECK(cuda_check_tensor(d, op, "temperature", &a.temperature, CUDA_DT(KILN_HAL_F32), 1, true));
  CHECK_SHAPE(op, "temperature", &a.temperature, S);
  CHECK(cuda_check_tensor(d, op, "uniform", &a.uniform, CUDA_DT(KILN_HAL_F32), 1, true));
  CHECK_SHAPE(op, "uniform", &a.uniform, S);
  /* top_k, top_p, min_p: absent means "off" for that filter. */
  CHECK(check_opt_vec(d, op, "top_k", &a.top_k, KILN_HAL_I32, S));
  CHECK(check_opt_vec(d, op, "top_p", &a.top_p, KILN_HAL_F32, S));
  CHECK(check_opt_vec(d, op, "min_p", &a.min_p, KILN_HAL_F32, S));
  CHECK(cuda_check_tensor(d, op, "out_ids", &a.out_ids, CUDA_DT(KILN_HAL_I32), 1, true));
  CHECK_SHAPE(op, "out_ids", &a.out_ids, S);
  CHECK(check_opt_vec(d, op, "out_logprob", &a.out_logprob, KILN_HAL_F32, S));
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

#ifndef KILN_CUDA_ARCH_LIST
#define KILN_CUDA_ARCH_LIST "?"
#endif

static const kiln_hal_backend_t g_table = {
    .struct_size = sizeof(kiln_hal_backend_t),
    .abi_major = KILN_HAL_ABI_MAJOR,
    .abi_minor = KILN_HAL_ABI_MINOR,
    .name = "cuda",
    .build_info =
        KILN_GPU_VENDOR " " CUDA_STR(CUDART_VERSION) " (cudart static, cuBLASLt " CUDA_STR(
            CUBLAS_VER_MAJOR) "." CUDA_STR(CUBLAS_VER_MINOR) "), archs " KILN_CUDA_ARCH_LIST,
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
    .sample = cuda_sample,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_replay = cuda_graph_replay,
    .graph_destroy = cuda_graph_destroy,
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
