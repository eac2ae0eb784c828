/* cuda_nccl.c - the GPU backends' collectives (ABI 1.5, docs/parallel.md) on NCCL (CUDA) or
 * RCCL (ROCm, the same API), loaded with dlopen the first time the plugin is asked about them:
 * the plugin loads and serves one GPU without the library, and KILN_HAL_CAP_COLLECTIVES says
 * whether it was found. The few declarations below are written from NCCL's documented C API
 * (nccl.h is not included, so the ROCm build needs no RCCL headers either).
 *
 * Every call is enqueued on the stream's cudaStream_t, so it is ordered with the stream's other
 * work and captured into graphs like a kernel (NCCL 2.9+/RCCL support capture). NCCL checks
 * neither sizes nor roots across ranks and has no per-call timeout: a mismatch is undefined and
 * a missing peer blocks the stream (docs/parallel.md: what the host must guarantee, and the
 * watchdog planned on top of ncclCommAbort).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#if defined(__HIP_PLATFORM_AMD__)
#define KILN_NCCL_SONAME "librccl.so.1"
#define KILN_NCCL_NAME "RCCL"
#else
#define KILN_NCCL_SONAME "libnccl.so.2"
#define KILN_NCCL_NAME "NCCL"
#endif

/* ---- NCCL's C API, as documented (types and the values of the enums used) --------------- */
typedef struct kiln_nccl_comm *kiln_ncclComm_t;
typedef struct {
  char internal[128]; /* NCCL_UNIQUE_ID_BYTES */
} kiln_ncclUniqueId;
typedef int kiln_ncclResult_t; /* ncclSuccess = 0 */
enum {
  KILN_NCCL_INT32 = 2,
  KILN_NCCL_INT64 = 4,
  KILN_NCCL_UINT8 = 1,
  KILN_NCCL_FLOAT16 = 6,
  KILN_NCCL_FLOAT32 = 7,
  KILN_NCCL_BFLOAT16 = 9,
  KILN_NCCL_SUM = 0,
};

typedef struct nccl_api {
  kiln_ncclResult_t (*GetVersion)(int *);
  const char *(*GetErrorString)(kiln_ncclResult_t);
  kiln_ncclResult_t (*GetUniqueId)(kiln_ncclUniqueId *);
  kiln_ncclResult_t (*CommInitRank)(kiln_ncclComm_t *, int, kiln_ncclUniqueId, int);
  kiln_ncclResult_t (*CommDestroy)(kiln_ncclComm_t);
  kiln_ncclResult_t (*AllReduce)(const void *, void *, size_t, int, int, kiln_ncclComm_t,
                                 cudaStream_t);
  kiln_ncclResult_t (*AllGather)(const void *, void *, size_t, int, kiln_ncclComm_t,
                                 cudaStream_t);
  kiln_ncclResult_t (*Broadcast)(const void *, void *, size_t, int, int, kiln_ncclComm_t,
                                 cudaStream_t);
  kiln_ncclResult_t (*Send)(const void *, size_t, int, int, kiln_ncclComm_t, cudaStream_t);
  kiln_ncclResult_t (*Recv)(void *, size_t, int, int, kiln_ncclComm_t, cudaStream_t);
} nccl_api_t;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static nccl_api_t g_nccl;
static bool g_have;
static char g_why[256];
static char g_desc[64];

static void nccl_load(void) {
  dlerror();
  void *h = dlopen(KILN_NCCL_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *why = dlerror();
    snprintf(g_why, sizeof(g_why), "%s", why ? why : KILN_NCCL_SONAME ": dlopen failed");
    return;
  }
  struct {
    const char *name;
    void **slot;
  } syms[] = {
      {"ncclGetVersion", (void **)&g_nccl.GetVersion},
      {"ncclGetErrorString", (void **)&g_nccl.GetErrorString},
      {"ncclGetUniqueId", (void **)&g_nccl.GetUniqueId},
      {"ncclCommInitRank", (void **)&g_nccl.CommInitRank},
      {"ncclCommDestroy", (void **)&g_nccl.CommDestroy},
      {"ncclAllReduce", (void **)&g_nccl.AllReduce},
      {"ncclAllGather", (void **)&g_nccl.AllGather},
      {"ncclBroadcast", (void **)&g_nccl.Broadcast},
      {"ncclSend", (void **)&g_nccl.Send},
      {"ncclRecv", (void **)&g_nccl.Recv},
  };
  for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
    void *p = dlsym(h, syms[i].name);
    if (!p) {
      snprintf(g_why, sizeof(g_why), KILN_NCCL_SONAME " has no %s (too old?)", syms[i].name);
      return; /* the handle stays open: plugins are never unloaded either */
    }
    memcpy(syms[i].slot, &p, sizeof(p));
  }
  int v = 0;
  if (g_nccl.GetVersion(&v) != 0) v = 0;
  /* NCCL_VERSION_CODE: major*10000 + minor*100 + patch from 2.9 on. */
  snprintf(g_desc, sizeof(g_desc), KILN_NCCL_NAME " %d.%d.%d (" KILN_NCCL_SONAME ")", v / 10000,
           (v / 100) % 100, v % 100);
  g_have = true;
}

bool cuda_nccl_available(void) {
  pthread_once(&g_once, nccl_load);
  return g_have;
}

const char *cuda_nccl_describe(void) {
  pthread_once(&g_once, nccl_load);
  return g_have ? g_desc : "no " KILN_NCCL_NAME;
}

static kiln_hal_error_t *nccl_missing(const char *op) {
  return cuda_err_unsupported("%s: collectives need " KILN_NCCL_NAME ": %s", op, g_why);
}

static kiln_hal_error_t *nccl_err(kiln_ncclResult_t r, const char *what) {
  return kiln_hal_error_new(KILN_HAL_ERR_DEVICE, "%s: " KILN_NCCL_NAME " error %d: %s", what, r,
                            g_nccl.GetErrorString ? g_nccl.GetErrorString(r) : "?");
}

struct kiln_hal_comm {
  kiln_ncclComm_t comm;
  kiln_hal_device_t *device;
  int32_t world, rank;
};

kiln_hal_error_t *cuda_comm_get_unique_id(kiln_hal_comm_id_t *out) {
  if (!out) return cuda_err_arg("comm_get_unique_id: out_id is NULL");
  memset(out, 0, sizeof(*out));
  if (!cuda_nccl_available()) return nccl_missing("comm_get_unique_id");
  kiln_ncclUniqueId id;
  kiln_ncclResult_t r = g_nccl.GetUniqueId(&id);
  if (r) return nccl_err(r, "ncclGetUniqueId");
  memcpy(out->bytes, id.internal, sizeof(id.internal));
  return NULL;
}

kiln_hal_error_t *cuda_comm_create(kiln_hal_device_t *device, const kiln_hal_comm_args_t *args,
                                   kiln_hal_comm_t **out) {
  if (!out) return cuda_err_arg("comm_create: out_comm is NULL");
  *out = NULL;
  if (!device) return cuda_err_arg("comm_create: device is NULL");
  kiln_hal_comm_args_t a;
  kiln_hal_error_t *e = kiln_hal_args_copy("comm_create", &a, sizeof(a), args);
  if (e) return e;
  if (a.world_size < 1 || a.world_size > KILN_HAL_COMM_MAX_RANKS)
    return cuda_err_arg("comm_create: world_size %d is outside 1..%d", (int)a.world_size,
                        KILN_HAL_COMM_MAX_RANKS);
  if (a.rank < 0 || a.rank >= a.world_size)
    return cuda_err_arg("comm_create: rank %d is outside 0..%d", (int)a.rank,
                        (int)a.world_size - 1);
  if (a.timeout_ms < 0) return cuda_err_arg("comm_create: timeout_ms %d is negative", (int)a.timeout_ms);
  if (!cuda_nccl_available()) return nccl_missing("comm_create");
  cudaError_t ce = cudaSetDevice(device->index);
  if (ce != cudaSuccess) return cuda_err_rt(ce, "comm_create: cudaSetDevice");
  kiln_hal_comm_t *c = calloc(1, sizeof(*c));
  if (!c) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "comm_create: out of memory");
  kiln_ncclUniqueId id;
  memcpy(id.internal, a.id.bytes, sizeof(id.internal));
  kiln_ncclResult_t r = g_nccl.CommInitRank(&c->comm, a.world_size, id, a.rank);
  if (r) {
    free(c);
    return nccl_err(r, "comm_create: ncclCommInitRank");
  }
  c->device = device;
  c->world = a.world_size;
  c->rank = a.rank;
  *out = c;
  return NULL;
}

void cuda_comm_destroy(kiln_hal_comm_t *c) {
  if (!c) return;
  if (c->comm) g_nccl.CommDestroy(c->comm);
  free(c);
}

static int nccl_dtype(int32_t d) {
  switch (d) {
    case KILN_HAL_F32: return KILN_NCCL_FLOAT32;
    case KILN_HAL_F16: return KILN_NCCL_FLOAT16;
    case KILN_HAL_BF16: return KILN_NCCL_BFLOAT16;
    case KILN_HAL_I32: return KILN_NCCL_INT32;
    case KILN_HAL_I64: return KILN_NCCL_INT64;
    default: return KILN_NCCL_UINT8;
  }
}

static bool dense(const kiln_hal_tensor_t *t) {
  int64_t want = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] > 1 && t->stride[i] != want) return false;
    want *= t->shape[i];
  }
  return true;
}

static size_t numel(const kiln_hal_tensor_t *t) {
  size_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
  return n;
}

static kiln_hal_error_t *check_dense(kiln_hal_device_t *dev, const char *op, const char *name,
                                     const kiln_hal_tensor_t *t, uint32_t dtypes) {
  kiln_hal_check_env_t env = cuda_check_env(dev);
  kiln_hal_error_t *e = kiln_hal_check_tensor(&env, op, name, t, dtypes, 0, true);
  if (e) return e;
  if (!dense(t)) return cuda_err_arg("%s: %s must be dense (row-major without padding)", op, name);
  return NULL;
}

#define CUDA_NCCL_CHECK(expr)        \
  do {                               \
    kiln_hal_error_t *err_ = (expr); \
    if (err_) return err_;           \
  } while (0)

enum { COLL_ALL_REDUCE = 1, COLL_ALL_GATHER, COLL_BROADCAST, COLL_SEND, COLL_RECV };

static kiln_hal_error_t *coll(kiln_hal_stream_t *s, int op, const char *n,
                              const kiln_hal_coll_args_t *args) {
  if (!s) return cuda_err_arg("%s: stream is NULL", n);
  kiln_hal_coll_args_t a;
  kiln_hal_error_t *e = kiln_hal_args_copy(n, &a, sizeof(a), args);
  if (e) return e;
  kiln_hal_comm_t *c = a.comm;
  if (!c) return cuda_err_arg("%s: comm is NULL", n);
  if (c->device != s->device) return cuda_err_arg("%s: comm and stream are on different devices", n);
  switch (op) {
    case COLL_ALL_REDUCE:
      CUDA_NCCL_CHECK(check_dense(s->device, n, "src", &a.src, KILN_HAL_DT_FLOAT));
      CUDA_NCCL_CHECK(check_dense(s->device, n, "dst", &a.dst, KILN_HAL_DT_FLOAT));
      if (a.src.dtype != a.dst.dtype) return cuda_err_arg("%s: src and dst dtypes differ", n);
      CUDA_NCCL_CHECK(kiln_hal_check_same_shape(n, "src", &a.src, "dst", &a.dst));
      if (kiln_hal_tensor_overlap(&a.src, &a.dst) && a.src.offset != a.dst.offset)
        return cuda_err_arg("%s: src and dst overlap without being the same tensor", n);
      break;
    case COLL_ALL_GATHER: {
      CUDA_NCCL_CHECK(check_dense(s->device, n, "src", &a.src, KILN_HAL_DT_ANY));
      CUDA_NCCL_CHECK(check_dense(s->device, n, "dst", &a.dst, KILN_HAL_DT_ANY));
      if (a.src.dtype != a.dst.dtype) return cuda_err_arg("%s: src and dst dtypes differ", n);
      bool ok = a.src.ndim == a.dst.ndim && a.dst.shape[0] == a.src.shape[0] * c->world;
      for (int i = 1; ok && i < a.src.ndim; i++) ok = a.src.shape[i] == a.dst.shape[i];
      if (!ok)
        return cuda_err_arg("%s: dst must be src's shape with dimension 0 times world_size %d",
                            n, c->world);
      break;
    }
    case COLL_BROADCAST:
    case COLL_RECV: CUDA_NCCL_CHECK(check_dense(s->device, n, "dst", &a.dst, KILN_HAL_DT_ANY)); break;
    case COLL_SEND: CUDA_NCCL_CHECK(check_dense(s->device, n, "src", &a.src, KILN_HAL_DT_ANY)); break;
  }
  if (op >= COLL_BROADCAST) {
    if (a.peer < 0 || a.peer >= c->world)
      return cuda_err_arg("%s: peer %d is outside 0..%d", n, (int)a.peer, c->world - 1);
    if (op != COLL_BROADCAST && a.peer == c->rank)
      return cuda_err_arg("%s: peer %d is this rank", n, (int)a.peer);
  }
  CUDA_NCCL_CHECK(cuda_stream_enter(s));
  cuda_view_t src = cuda_view(&a.src), dst = cuda_view(&a.dst);
  kiln_ncclResult_t r = 0;
  switch (op) {
    case COLL_ALL_REDUCE:
      r = g_nccl.AllReduce(src.ptr, dst.ptr, numel(&a.src), nccl_dtype(a.src.dtype), KILN_NCCL_SUM,
                           c->comm, s->stream);
      break;
    case COLL_ALL_GATHER:
      r = g_nccl.AllGather(src.ptr, dst.ptr, numel(&a.src), nccl_dtype(a.src.dtype), c->comm,
                           s->stream);
      break;
    case COLL_BROADCAST:
      r = g_nccl.Broadcast(dst.ptr, dst.ptr, numel(&a.dst), nccl_dtype(a.dst.dtype), a.peer,
                           c->comm, s->stream);
      break;
    case COLL_SEND:
      r = g_nccl.Send(src.ptr, numel(&a.src), nccl_dtype(a.src.dtype), a.peer, c->comm, s->stream);
      break;
    case COLL_RECV:
      r = g_nccl.Recv(dst.ptr, numel(&a.dst), nccl_dtype(a.dst.dtype), a.peer, c->comm, s->stream);
      break;
  }
  return r ? nccl_err(r, n) : NULL;
}

kiln_hal_error_t *cuda_all_reduce(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a) {
  return coll(s, COLL_ALL_REDUCE, "all_reduce", a);
}
kiln_hal_error_t *cuda_all_gather(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a) {
  return coll(s, COLL_ALL_GATHER, "all_gather", a);
}
kiln_hal_error_t *cuda_broadcast(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a) {
  return coll(s, COLL_BROADCAST, "broadcast", a);
}
kiln_hal_error_t *cuda_send(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a) {
  return coll(s, COLL_SEND, "send", a);
}
kiln_hal_error_t *cuda_recv(kiln_hal_stream_t *s, const kiln_hal_coll_args_t *a) {
  return coll(s, COLL_RECV, "recv", a);
}
