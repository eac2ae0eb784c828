/* gpus.c - lists the GPUs the NVIDIA, AMD and Intel driver libraries see, through dlopen only.
 *
 * Each vendor library is dlopen'ed by name and its entry points are looked up with dlsym; the
 * prototypes, constants and structs are declared here by hand, checked against the vendors'
 * headers (cuda.h 13.0, HIP 5.2's hip_runtime_api.h, Level Zero 1.8's ze_api.h; when
 * <level_zero/ze_api.h> is on the include path the Level Zero declarations are checked at
 * compile time too). Only entry points whose signatures are stable across releases are used:
 * HIP's hipDeviceProp_t changed layout between ROCm 5 and 6, so it is never read.
 *
 * The libraries are never dlclose'd: CUDA, HIP and Level Zero start threads and register
 * atexit handlers on init, which crash at exit once their code is unmapped; the CUDA plugin
 * also shares the same handle (dlopen of one soname returns one mapping).
 */
#define _GNU_SOURCE
#include "hal/gpus.h"

#include <dirent.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

/* Appends a formatted piece to the NUL-terminated string in buf[n] (truncating). */
static void gpu_append(char *buf, size_t n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void gpu_append(char *buf, size_t n, const char *fmt, ...) {
  size_t len = strnlen(buf, n);
  if (len + 1 >= n) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + len, n - len, fmt, ap);
  va_end(ap);
}

/* A table of entry points: name, where its address goes (a function pointer member of a
 * vendor struct), and whether the scan can go on without it. */
typedef struct gpu_sym {
  const char *name;
  size_t offset;
  int required;
} gpu_sym_t;

/* Looks every symbol of syms[n] up in h into the struct at fns (function pointers have the
 * representation of void * on every POSIX system). Missing required ones are listed in
 * d->error (the state becomes FAILED), missing optional ones in d->missing. Returns 0 when a
 * required one is missing. */
static int gpu_lookup(void *h, const gpu_sym_t *syms, size_t n, void *fns, kiln_gpu_driver_t *d) {
  int ok = 1;
  for (size_t i = 0; i < n; i++) {
    void *p = dlsym(h, syms[i].name);
    memcpy((char *)fns + syms[i].offset, &p, sizeof(p));
    if (p) continue;
    if (syms[i].required) {
      if (ok) snprintf(d->error, sizeof(d->error), "%s lacks ", d->library);
      gpu_append(d->error, sizeof(d->error), "%s%s", ok ? "" : ", ", syms[i].name);
      ok = 0;
    } else {
      gpu_append(d->missing, sizeof(d->missing), "%s%s", d->missing[0] ? ", " : "", syms[i].name);
    }
  }
  if (!ok) {
    gpu_append(d->error, sizeof(d->error), " (a driver older than Kiln supports?)");
    d->state = KILN_GPU_DRIVER_FAILED;
  }
  return ok;
}

/* True when dlerror() text err says that name itself was not found (as opposed to found but
 * broken, or a dependency of it missing, whose message names the dependency). */
static int gpu_not_found(const char *name, const char *err) {
  size_t n = strlen(name);
  return strncmp(err, name, n) == 0 &&
         strncmp(err + n, ": cannot open shared object file", 32) == 0;
}

/* dlopens the first of names[] that loads. Fills d->library, d->state (MISSING or UNLOADABLE
 * when none loads) and d->error. Returns the handle or NULL. */
static void *gpu_open(const char *const *names, kiln_gpu_driver_t *d) {
  int broken = 0;
  for (size_t i = 0; names[i]; i++) {
    dlerror();
    void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (h) {
      snprintf(d->library, sizeof(d->library), "%s", names[i]);
      d->error[0] = '\0';
      return h;
    }
    const char *why = dlerror();
    if (!why) why = "dlopen failed";
    if (!gpu_not_found(names[i], why)) {
      /* Found but unusable: say so, whatever the later names do. */
      if (!broken) {
        snprintf(d->library, sizeof(d->library), "%s", names[i]);
        snprintf(d->error, sizeof(d->error), "%s", why);
      }
      broken = 1;
    }
    if (!broken) {
      gpu_append(d->library, sizeof(d->library), "%s%s", i ? ", " : "", names[i]);
      snprintf(d->error, sizeof(d->error), "%s", why);
    }
  }
  d->state = broken ? KILN_GPU_DRIVER_UNLOADABLE : KILN_GPU_DRIVER_MISSING;
  return NULL;
}

/* Room for a driver's device list. Returns 0 on out-of-memory. */
static int gpu_alloc_devices(kiln_gpu_driver_t *d, size_t n) {
  d->device_count = 0;
  if (n == 0) return 1;
  d->devices = calloc(n, sizeof(*d->devices));
  return d->devices != NULL;
}

/* ============================================================================================
 * NVIDIA: the CUDA driver API (cuda.h)
 * ==========================================================================================*/

typedef int cu_result_t; /* CUresult, an enum: CUDA_SUCCESS = 0 */
typedef int cu_device_t; /* CUdevice */
enum {
  CU_ATTR_PCI_BUS_ID = 33,    /* CU_DEVICE_ATTRIBUTE_PCI_BUS_ID */
  CU_ATTR_PCI_DEVICE_ID = 34, /* CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID */
  CU_ATTR_PCI_DOMAIN_ID = 50, /* CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID */
  CU_ATTR_CC_MAJOR = 75,      /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
  CU_ATTR_CC_MINOR = 76,      /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR */
};

typedef struct cu_fns {
  cu_result_t (*cuInit)(unsigned int flags);
  cu_result_t (*cuDeviceGetCount)(int *count);
  cu_result_t (*cuDeviceGet)(cu_device_t *device, int ordinal);
  cu_result_t (*cuDeviceGetName)(char *name, int len, cu_device_t dev);
  cu_result_t (*cuDeviceTotalMem_v2)(size_t *bytes, cu_device_t dev);
  cu_result_t (*cuDriverGetVersion)(int *version);
  cu_result_t (*cuDeviceGetAttribute)(int *value, int attrib, cu_device_t dev);
  cu_result_t (*cuGetErrorName)(cu_result_t error, const char **str);
  cu_result_t (*cuGetErrorString)(cu_result_t error, const char **str);
} cu_fns_t;

static const gpu_sym_t cu_syms[] = {
#define SYM(m, req) \
  { #m, offsetof(cu_fns_t, m), req }
    SYM(cuInit, 1),
    SYM(cuDeviceGetCount, 1),
    SYM(cuDeviceGet, 1),
    SYM(cuDeviceGetName, 1),
    SYM(cuDeviceTotalMem_v2, 1),
    SYM(cuDriverGetVersion, 0),
    SYM(cuDeviceGetAttribute, 0),
    SYM(cuGetErrorName, 0),
    SYM(cuGetErrorString, 0),
#undef SYM
};

/* "call: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected" into buf. */
static void cu_error(const cu_fns_t *f, char *buf, size_t n, const char *call, cu_result_t r) {
  const char *name = NULL, *str = NULL;
  if (f->cuGetErrorName && f->cuGetErrorName(r, &name) != 0) name = NULL;
  if (f->cuGetErrorString && f->cuGetErrorString(r, &str) != 0) str = NULL;
  if (name && str)
    snprintf(buf, n, "%s: %s: %s", call, name, str);
  else if (name || str)
    snprintf(buf, n, "%s: %s", call, name ? name : str);
  else
    snprintf(buf, n, "%s: CUresult %d", call, r);
}

/* Returns 0 on out-of-memory. */
static int gpu_scan_nvidia(void *h, kiln_gpu_driver_t *d) {
  cu_fns_t f;
  if (!gpu_lookup(h, cu_syms, sizeof(cu_syms) / sizeof(cu_syms[0]), &f, d)) return 1;
  int v = 0;
  if (f.cuDriverGetVersion && f.cuDriverGetVersion(&v) == 0 && v > 0)
    snprintf(d->version, sizeof(d->version), "driver %d.%d", v / 1000, (v % 1000) / 10);
  cu_result_t r = f.cuInit(0);
  int n = 0;
  if (r != 0) {
    cu_error(&f, d->error, sizeof(d->error), "cuInit", r);
  } else if ((r = f.cuDeviceGetCount(&n)) != 0) {
    cu_error(&f, d->error, sizeof(d->error), "cuDeviceGetCount", r);
  }
  if (r != 0) {
    d->state = KILN_GPU_DRIVER_FAILED;
    return 1;
  }
  if (n < 0) n = 0;
  if (!gpu_alloc_devices(d, (size_t)n)) return 0;
  for (int i = 0; i < n; i++) {
    kiln_gpu_device_t *g = &d->devices[d->device_count++];
    cu_device_t dev = 0;
    size_t bytes = 0;
    if ((r = f.cuDeviceGet(&dev, i)) != 0) {
      cu_error(&f, g->error, sizeof(g->error), "cuDeviceGet", r);
      continue;
    }
    if ((r = f.cuDeviceGetName(g->name, (int)sizeof(g->name), dev)) != 0) {
      g->name[0] = '\0';
      cu_error(&f, g->error, sizeof(g->error), "cuDeviceGetName", r);
    }
    g->name[sizeof(g->name) - 1] = '\0';
    if ((r = f.cuDeviceTotalMem_v2(&bytes, dev)) == 0)
      g->total_memory = bytes;
    else if (!g->error[0])
      cu_error(&f, g->error, sizeof(g->error), "cuDeviceTotalMem_v2", r);
    if (!f.cuDeviceGetAttribute) continue;
    int major = 0, minor = 0, bus = 0, slot = 0, domain = 0;
    if (f.cuDeviceGetAttribute(&major, CU_ATTR_CC_MAJOR, dev) == 0 &&
        f.cuDeviceGetAttribute(&minor, CU_ATTR_CC_MINOR, dev) == 0 && major > 0)
      snprintf(g->arch, sizeof(g->arch), "sm_%d%d", major, minor);
    if (f.cuDeviceGetAttribute(&bus, CU_ATTR_PCI_BUS_ID, dev) == 0 &&
        f.cuDeviceGetAttribute(&slot, CU_ATTR_PCI_DEVICE_ID, dev) == 0 &&
        f.cuDeviceGetAttribute(&domain, CU_ATTR_PCI_DOMAIN_ID, dev) == 0)
      g->pci_bus_id =
          ((uint32_t)domain << 16) | (((uint32_t)bus & 0xff) << 8) | ((uint32_t)slot & 0xff);
  }
  d->state = KILN_GPU_DRIVER_OK;
  return 1;
}

/* ============================================================================================
 * AMD: the HIP runtime (hip_runtime_api.h). hipDevice_t is an int; hipError_t an enum.
 * ==========================================================================================*/

typedef int hip_error_t;

typedef struct hip_fns {
  hip_error_t (*hipGetDeviceCount)(int *count);
  hip_error_t (*hipDeviceGet)(int *device, int ordinal);
  hip_error_t (*hipDeviceGetName)(char *name, int len, int device);
  hip_error_t (*hipDeviceTotalMem)(size_t *bytes, int device);
  hip_error_t (*hipRuntimeGetVersion)(int *version);
  hip_error_t (*hipDeviceGetPCIBusId)(char *bus_id, int len, int device);
  const char *(*hipGetErrorName)(hip_error_t error);
  const char *(*hipGetErrorString)(hip_error_t error);
} hip_fns_t;

static const gpu_sym_t hip_syms[] = {
#define SYM(m, req) \
  { #m, offsetof(hip_fns_t, m), req }
    SYM(hipGetDeviceCount, 1), SYM(hipDeviceGet, 1),         SYM(hipDeviceGetName, 1),
    SYM(hipDeviceTotalMem, 1), SYM(hipRuntimeGetVersion, 0), SYM(hipDeviceGetPCIBusId, 0),
    SYM(hipGetErrorName, 0),   SYM(hipGetErrorString, 0),
#undef SYM
};

/* "call: hipErrorNoDevice: no ROCm-capable device is detected" into buf (HIP 5 returns the
 * name from both functions; it is then given once). */
static void hip_error(const hip_fns_t *f, char *buf, size_t n, const char *call, hip_error_t r) {
  const char *name = f->hipGetErrorName ? f->hipGetErrorName(r) : NULL;
  const char *str = f->hipGetErrorString ? f->hipGetErrorString(r) : NULL;
  if (name && str && strcmp(name, str) != 0)
    snprintf(buf, n, "%s: %s: %s", call, name, str);
  else if (name || str)
    snprintf(buf, n, "%s: %s", call, name ? name : str);
  else
    snprintf(buf, n, "%s: hipError_t %d", call, r);
}

/* The arch ("gfx942") of the KFD topology node at PCI address pci, from its properties file:
 * "gfx_target_version 90402" (major * 10000 + minor * 100 + stepping, the last two printed
 * in hex in the name), "domain 0", "location_id 49408" (bus << 8 | device << 3 | function;
 * newer kernels put a partition number in bits 31:28). Best effort: out stays "" when the
 * directory or a matching node is missing. */
static void hip_kfd_arch(const char *dir, uint32_t pci, char *out, size_t n) {
  out[0] = '\0';
  DIR *dp = opendir(dir);
  if (!dp) return;
  struct dirent *de;
  while (!out[0] && (de = readdir(dp))) {
    if (de->d_name[0] < '0' || de->d_name[0] > '9') continue;
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s/properties", dir, de->d_name);
    FILE *fp = fopen(path, "r");
    if (!fp) continue;
    unsigned long long gfx = 0, domain = ~0ull, loc = ~0ull;
    char line[256];
    while (fgets(line, sizeof(line), fp)) {
      char key[64];
      unsigned long long v;
      if (sscanf(line, "%63s %llu", key, &v) != 2) continue;
      if (strcmp(key, "gfx_target_version") == 0)
        gfx = v;
      else if (strcmp(key, "domain") == 0)
        domain = v;
      else if (strcmp(key, "location_id") == 0)
        loc = v;
    }
    fclose(fp);
    if (gfx == 0 || domain == ~0ull || loc == ~0ull) continue; /* a CPU node, or partial */
    if (domain != (pci >> 16) || ((loc >> 8) & 0xff) != ((pci >> 8) & 0xff) ||
        ((loc >> 3) & 0x1f) != (pci & 0xff))
      continue;
    snprintf(out, n, "gfx%llu%llx%llx", gfx / 10000, (gfx / 100) % 100, gfx % 100);
  }
  closedir(dp);
}

static int gpu_scan_amd(void *h, kiln_gpu_driver_t *d, const char *kfd_dir) {
  hip_fns_t f;
  if (!gpu_lookup(h, hip_syms, sizeof(hip_syms) / sizeof(hip_syms[0]), &f, d)) return 1;
  int v = 0;
  if (f.hipRuntimeGetVersion && f.hipRuntimeGetVersion(&v) == 0 && v > 0)
    snprintf(d->version, sizeof(d->version), "HIP %d.%d.%d", v / 10000000, (v / 100000) % 100,
             v % 100000);
  int n = 0;
  hip_error_t r = f.hipGetDeviceCount(&n);
  if (r != 0) {
    hip_error(&f, d->error, sizeof(d->error), "hipGetDeviceCount", r);
    d->state = KILN_GPU_DRIVER_FAILED;
    return 1;
  }
  if (n < 0) n = 0;
  if (!gpu_alloc_devices(d, (size_t)n)) return 0;
  for (int i = 0; i < n; i++) {
    kiln_gpu_device_t *g = &d->devices[d->device_count++];
    int dev = 0;
    size_t bytes = 0;
    if ((r = f.hipDeviceGet(&dev, i)) != 0) {
      hip_error(&f, g->error, sizeof(g->error), "hipDeviceGet", r);
      continue;
    }
    if ((r = f.hipDeviceGetName(g->name, (int)sizeof(g->name), dev)) != 0) {
      g->name[0] = '\0';
      hip_error(&f, g->error, sizeof(g->error), "hipDeviceGetName", r);
    }
    g->name[sizeof(g->name) - 1] = '\0';
    if ((r = f.hipDeviceTotalMem(&bytes, dev)) == 0)
      g->total_memory = bytes;
    else if (!g->error[0])
      hip_error(&f, g->error, sizeof(g->error), "hipDeviceTotalMem", r);
    /* "dddd:bb:dd.f", in hex. */
    char bus_id[32] = {0};
    unsigned domain, bus, slot, fn;
    if (f.hipDeviceGetPCIBusId && f.hipDeviceGetPCIBusId(bus_id, (int)sizeof(bus_id) - 1, i) == 0 &&
        sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &slot, &fn) == 4) {
      g->pci_bus_id = (domain << 16) | ((bus & 0xff) << 8) | (slot & 0xff);
      hip_kfd_arch(kfd_dir, g->pci_bus_id, g->arch, sizeof(g->arch));
    }
  }
  d->state = KILN_GPU_DRIVER_OK;
  return 1;
}

/* ============================================================================================
 * Intel: the Level Zero loader (ze_api.h). Enums there are 32-bit (each has a FORCE_UINT32
 * member); structs start with a 32-bit stype and a pNext pointer.
 * ==========================================================================================*/

typedef uint32_t gz_result_t;
typedef struct gz_driver *gz_driver_t;
typedef struct gz_device *gz_device_t;

enum {
  GZ_SUCCESS = 0,                   /* ZE_RESULT_SUCCESS */
  GZ_INIT_GPU_ONLY = 1,             /* ZE_INIT_FLAG_GPU_ONLY */
  GZ_DEVICE_TYPE_GPU = 1,           /* ZE_DEVICE_TYPE_GPU */
  GZ_STYPE_DEVICE_PROPS = 0x3,      /* ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES */
  GZ_STYPE_MEMORY_PROPS = 0x7,      /* ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES */
  GZ_STYPE_PCI_EXT_PROPS = 0x10008, /* ZE_STRUCTURE_TYPE_PCI_EXT_PROPERTIES */
};

typedef struct gz_device_props { /* ze_device_properties_t (1.0 layout, extended by pNext) */
  uint32_t stype;
  void *pNext;
  uint32_t type;
  uint32_t vendorId, deviceId, flags, subdeviceId, coreClockRate;
  uint64_t maxMemAllocSize;
  uint32_t maxHardwareContexts, maxCommandQueuePriority, numThreadsPerEU, physicalEUSimdWidth;
  uint32_t numEUsPerSubslice, numSubslicesPerSlice, numSlices;
  uint64_t timerResolution;
  uint32_t timestampValidBits, kernelTimestampValidBits;
  uint8_t uuid[16];
  char name[256];
} gz_device_props_t;

typedef struct gz_memory_props { /* ze_device_memory_properties_t */
  uint32_t stype;
  void *pNext;
  uint32_t flags, maxClockRate, maxBusWidth;
  uint64_t totalSize;
  char name[256];
} gz_memory_props_t;

typedef struct gz_pci_props { /* ze_pci_ext_properties_t */
  uint32_t stype;
  void *pNext;
  uint32_t domain, bus, device, function; /* ze_pci_address_ext_t */
  int32_t genVersion, width;              /* ze_pci_speed_ext_t */
  int64_t maxBandwidth;
} gz_pci_props_t;

/* With the real header at hand, prove the hand-written declarations match it. */
#if defined(__has_include)
#if __has_include(<level_zero/ze_api.h>)
#include <level_zero/ze_api.h>
#define GPU_ZE_FIELD(ours, theirs, m) \
  _Static_assert(offsetof(ours, m) == offsetof(theirs, m), #ours "." #m " is misplaced")
#define GPU_ZE_EQ(ours, theirs) ((long)(ours) == (long)(theirs)) /* enums of different types */
_Static_assert(GPU_ZE_EQ(GZ_SUCCESS, ZE_RESULT_SUCCESS) &&
                   GPU_ZE_EQ(GZ_INIT_GPU_ONLY, ZE_INIT_FLAG_GPU_ONLY) &&
                   GPU_ZE_EQ(GZ_DEVICE_TYPE_GPU, ZE_DEVICE_TYPE_GPU) &&
                   GPU_ZE_EQ(GZ_STYPE_DEVICE_PROPS, ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES) &&
                   GPU_ZE_EQ(GZ_STYPE_MEMORY_PROPS, ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES) &&
                   GPU_ZE_EQ(GZ_STYPE_PCI_EXT_PROPS, ZE_STRUCTURE_TYPE_PCI_EXT_PROPERTIES),
               "Level Zero constants differ from ze_api.h");
_Static_assert(sizeof(ze_result_t) == sizeof(gz_result_t), "ze_result_t is not 32-bit");
_Static_assert(ZE_RESULT_ERROR_DEVICE_LOST == 0x70000001 &&
                   ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY == 0x70000002 &&
                   ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY == 0x70000003 &&
                   ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS == 0x70010000 &&
                   ZE_RESULT_ERROR_DEPENDENCY_UNAVAILABLE == 0x70020000 &&
                   ZE_RESULT_ERROR_UNINITIALIZED == 0x78000001 &&
                   ZE_RESULT_ERROR_UNSUPPORTED_VERSION == 0x78000002 &&
                   ZE_RESULT_ERROR_UNSUPPORTED_FEATURE == 0x78000003 &&
                   ZE_RESULT_ERROR_INVALID_ARGUMENT == 0x78000004 &&
                   ZE_RESULT_ERROR_UNKNOWN == 0x7ffffffe,
               "gz_error()'s result codes differ from ze_api.h");
_Static_assert(sizeof(gz_device_props_t) == sizeof(ze_device_properties_t), "device props size");
GPU_ZE_FIELD(gz_device_props_t, ze_device_properties_t, type);
GPU_ZE_FIELD(gz_device_props_t, ze_device_properties_t, maxMemAllocSize);
GPU_ZE_FIELD(gz_device_props_t, ze_device_properties_t, timerResolution);
GPU_ZE_FIELD(gz_device_props_t, ze_device_properties_t, uuid);
GPU_ZE_FIELD(gz_device_props_t, ze_device_properties_t, name);
_Static_assert(sizeof(gz_memory_props_t) == sizeof(ze_device_memory_properties_t),
               "memory props size");
GPU_ZE_FIELD(gz_memory_props_t, ze_device_memory_properties_t, totalSize);
_Static_assert(sizeof(gz_pci_props_t) == sizeof(ze_pci_ext_properties_t), "pci props size");
_Static_assert(offsetof(gz_pci_props_t, domain) == offsetof(ze_pci_ext_properties_t, address) &&
                   offsetof(gz_pci_props_t, device) == offsetof(ze_pci_ext_properties_t, address) +
                                                           offsetof(ze_pci_address_ext_t, device) &&
                   offsetof(gz_pci_props_t, genVersion) ==
                       offsetof(ze_pci_ext_properties_t, maxSpeed),
               "pci props layout");
#undef GPU_ZE_FIELD
#undef GPU_ZE_EQ
#endif
#endif

typedef struct gz_fns {
  gz_result_t (*zeInit)(uint32_t flags);
  gz_result_t (*zeDriverGet)(uint32_t *count, gz_driver_t *drivers);
  gz_result_t (*zeDeviceGet)(gz_driver_t driver, uint32_t *count, gz_device_t *devices);
  gz_result_t (*zeDeviceGetProperties)(gz_device_t device, gz_device_props_t *props);
  gz_result_t (*zeDeviceGetMemoryProperties)(gz_device_t device, uint32_t *count,
                                             gz_memory_props_t *props);
  gz_result_t (*zeDriverGetApiVersion)(gz_driver_t driver, uint32_t *version);
  gz_result_t (*zeDevicePciGetPropertiesExt)(gz_device_t device, gz_pci_props_t *props);
} gz_fns_t;

static const gpu_sym_t gz_syms[] = {
#define SYM(m, req) \
  { #m, offsetof(gz_fns_t, m), req }
    SYM(zeInit, 1),
    SYM(zeDriverGet, 1),
    SYM(zeDeviceGet, 1),
    SYM(zeDeviceGetProperties, 1),
    SYM(zeDeviceGetMemoryProperties, 1),
    SYM(zeDriverGetApiVersion, 0),
    SYM(zeDevicePciGetPropertiesExt, 0),
#undef SYM
};

/* Level Zero has no error-string call that works without a driver: name the common codes. */
static void gz_error(char *buf, size_t n, const char *call, gz_result_t r) {
  static const struct {
    uint32_t code;
    const char *name;
  } names[] = {
      {0x70000001, "ZE_RESULT_ERROR_DEVICE_LOST"},
      {0x70000002, "ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY"},
      {0x70000003, "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY"},
      {0x70010000, "ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS"},
      {0x70020000, "ZE_RESULT_ERROR_DEPENDENCY_UNAVAILABLE"},
      {0x78000001, "ZE_RESULT_ERROR_UNINITIALIZED"},
      {0x78000002, "ZE_RESULT_ERROR_UNSUPPORTED_VERSION"},
      {0x78000003, "ZE_RESULT_ERROR_UNSUPPORTED_FEATURE"},
      {0x78000004, "ZE_RESULT_ERROR_INVALID_ARGUMENT"},
      {0x7ffffffe, "ZE_RESULT_ERROR_UNKNOWN"},
  };
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
    if (names[i].code != r) continue;
    /* What the loader answers when it found no GPU driver to load. */
    snprintf(buf, n, "%s: %s%s", call, names[i].name,
             r == 0x78000001 ? ": no Level Zero GPU driver could be initialised" : "");
    return;
  }
  snprintf(buf, n, "%s: ze_result_t 0x%x", call, r);
}

static int gpu_scan_intel(void *h, kiln_gpu_driver_t *d) {
  gz_fns_t f;
  if (!gpu_lookup(h, gz_syms, sizeof(gz_syms) / sizeof(gz_syms[0]), &f, d)) return 1;
  int ok = 1;
  gz_driver_t *drivers = NULL;
  gz_device_t *devices = NULL;
  uint32_t ndrivers = 0, ndevices = 0;
  gz_result_t r = f.zeInit(GZ_INIT_GPU_ONLY);
  if (r != GZ_SUCCESS) {
    gz_error(d->error, sizeof(d->error), "zeInit", r);
    goto failed;
  }
  if ((r = f.zeDriverGet(&ndrivers, NULL)) != GZ_SUCCESS) {
    gz_error(d->error, sizeof(d->error), "zeDriverGet", r);
    goto failed;
  }
  if (ndrivers && !(drivers = calloc(ndrivers, sizeof(*drivers)))) goto oom;
  if (ndrivers && (r = f.zeDriverGet(&ndrivers, drivers)) != GZ_SUCCESS) {
    gz_error(d->error, sizeof(d->error), "zeDriverGet", r);
    goto failed;
  }
  uint32_t api = 0;
  if (ndrivers && f.zeDriverGetApiVersion &&
      f.zeDriverGetApiVersion(drivers[0], &api) == GZ_SUCCESS)
    snprintf(d->version, sizeof(d->version), "Level Zero API %u.%u", api >> 16, api & 0xffff);
  /* Every root device of every driver, then keep the GPUs. */
  for (uint32_t i = 0; i < ndrivers; i++) {
    uint32_t n = 0;
    if ((r = f.zeDeviceGet(drivers[i], &n, NULL)) != GZ_SUCCESS) {
      gz_error(d->error, sizeof(d->error), "zeDeviceGet", r);
      goto failed;
    }
    if (n == 0) continue;
    gz_device_t *grown = realloc(devices, (size_t)(ndevices + n) * sizeof(*devices));
    if (!grown) goto oom;
    devices = grown;
    if ((r = f.zeDeviceGet(drivers[i], &n, devices + ndevices)) != GZ_SUCCESS) {
      gz_error(d->error, sizeof(d->error), "zeDeviceGet", r);
      goto failed;
    }
    ndevices += n;
  }
  if (!gpu_alloc_devices(d, ndevices)) goto oom;
  for (uint32_t i = 0; i < ndevices; i++) {
    gz_device_props_t p;
    memset(&p, 0, sizeof(p));
    p.stype = GZ_STYPE_DEVICE_PROPS;
    r = f.zeDeviceGetProperties(devices[i], &p);
    if (r == GZ_SUCCESS && p.type != GZ_DEVICE_TYPE_GPU) continue;
    kiln_gpu_device_t *g = &d->devices[d->device_count++];
    if (r != GZ_SUCCESS) {
      gz_error(g->error, sizeof(g->error), "zeDeviceGetProperties", r);
      continue;
    }
    snprintf(g->name, sizeof(g->name), "%.*s", (int)sizeof(p.name), p.name);
    /* Device-local memory may come as several entries (HBM stacks, tiles): add them up. */
    gz_memory_props_t mem[8];
    memset(mem, 0, sizeof(mem));
    uint32_t nmem = 8;
    for (uint32_t k = 0; k < nmem; k++) mem[k].stype = GZ_STYPE_MEMORY_PROPS;
    if ((r = f.zeDeviceGetMemoryProperties(devices[i], &nmem, mem)) == GZ_SUCCESS) {
      for (uint32_t k = 0; k < nmem && k < 8; k++) g->total_memory += mem[k].totalSize;
    } else {
      gz_error(g->error, sizeof(g->error), "zeDeviceGetMemoryProperties", r);
    }
    gz_pci_props_t pci;
    memset(&pci, 0, sizeof(pci));
    pci.stype = GZ_STYPE_PCI_EXT_PROPS;
    if (f.zeDevicePciGetPropertiesExt &&
        f.zeDevicePciGetPropertiesExt(devices[i], &pci) == GZ_SUCCESS)
      g->pci_bus_id = (pci.domain << 16) | ((pci.bus & 0xff) << 8) | (pci.device & 0xff);
  }
  d->state = KILN_GPU_DRIVER_OK;
  goto done;
oom:
  ok = 0;
  goto done;
failed:
  d->state = KILN_GPU_DRIVER_FAILED;
done:
  free(drivers);
  free(devices);
  return ok;
}

/* ============================================================================================
 * The scan
 * ==========================================================================================*/

static const char *const gpu_default_nvidia[] = {"libcuda.so.1", NULL};
/* ROCm 6 first: a machine with both keeps 5 only for old programs. */
static const char *const gpu_default_amd[] = {"libamdhip64.so.6", "libamdhip64.so.5",
                                              "libamdhip64.so", NULL};
static const char *const gpu_default_intel[] = {"libze_loader.so.1", NULL};

kiln_status_t kiln_gpu_scan_with(const kiln_gpu_scan_options_t *options,
                                 kiln_gpu_scan_t **out_scan) {
  *out_scan = NULL;
  kiln_gpu_scan_t *s = calloc(1, sizeof(*s));
  if (!s) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "GPU scan: out of memory");
  static const char *const vendor_names[KILN_GPU_VENDOR_COUNT] = {"NVIDIA", "AMD", "Intel"};
  const char *const *defaults[KILN_GPU_VENDOR_COUNT] = {gpu_default_nvidia, gpu_default_amd,
                                                        gpu_default_intel};
  const char *kfd = options && options->kfd_nodes_dir ? options->kfd_nodes_dir
                                                      : "/sys/class/kfd/kfd/topology/nodes";
  int ok = 1;
  for (int v = 0; v < KILN_GPU_VENDOR_COUNT && ok; v++) {
    kiln_gpu_driver_t *d = &s->drivers[v];
    d->vendor = v;
    d->vendor_name = vendor_names[v];
    const char *const *names =
        options && options->libraries[v] ? options->libraries[v] : defaults[v];
    void *h = gpu_open(names, d); /* kept open for the life of the process: see the top */
    if (h) {
      if (v == KILN_GPU_NVIDIA)
        ok = gpu_scan_nvidia(h, d);
      else if (v == KILN_GPU_AMD)
        ok = gpu_scan_amd(h, d, kfd);
      else
        ok = gpu_scan_intel(h, d);
    }
    KILN_LOG_D("GPU scan: %s: %s: %d device(s)%s%s", d->vendor_name, d->library, d->device_count,
               d->error[0] ? "; " : "", d->error);
  }
  if (!ok) {
    kiln_gpu_scan_free(s);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "GPU scan: out of memory");
  }
  *out_scan = s;
  return NULL;
}

kiln_status_t kiln_gpu_scan(kiln_gpu_scan_t **out_scan) {
  return kiln_gpu_scan_with(NULL, out_scan);
}

void kiln_gpu_scan_free(kiln_gpu_scan_t *scan) {
  if (!scan) return;
  for (int v = 0; v < KILN_GPU_VENDOR_COUNT; v++) free(scan->drivers[v].devices);
  free(scan);
}
