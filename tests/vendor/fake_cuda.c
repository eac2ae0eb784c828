/* fake_cuda.c - a stand-in for NVIDIA's libcuda.so.1 with two GPUs, for tests on machines
 * without one: the entry points Kiln's GPU scan (hal/src/gpus.c) looks up, with cuda.h's
 * signatures and values. FAKE_CUDA_FAIL=1 makes cuInit fail with CUDA_ERROR_NO_DEVICE.
 * Built with FAKE_CUDA_MINIMAL it exports only the five entry points the scan cannot do
 * without (an old or stripped driver): the others must be reported missing, never called. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult; /* CUDA_SUCCESS 0, CUDA_ERROR_INVALID_VALUE 1, CUDA_ERROR_NOT_INITIALIZED
                       * 3, CUDA_ERROR_NO_DEVICE 100, CUDA_ERROR_INVALID_DEVICE 101 */
typedef int CUdevice;

/* Prototypes (the library exports exactly these). */
CUresult cuInit(unsigned int flags);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
#ifndef FAKE_CUDA_MINIMAL
CUresult cuDriverGetVersion(int *version);
CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev);
CUresult cuGetErrorName(CUresult error, const char **str);
CUresult cuGetErrorString(CUresult error, const char **str);
#endif

static const struct {
  const char *name;
  size_t memory;
  int cc_major, cc_minor, domain, bus, device;
} devices[] = {
    {"NVIDIA H200", 150754820096ull, 9, 0, 0x0000, 0x19, 0x00},
    {"NVIDIA A100-SXM4-80GB", 85899345920ull, 8, 0, 0x0001, 0x3b, 0x02},
};
static int initialised;

CUresult cuInit(unsigned int flags) {
  const char *fail = getenv("FAKE_CUDA_FAIL");
  if (flags != 0) return 1;
  if (fail && strcmp(fail, "1") == 0) return 100;
  initialised = 1;
  return 0;
}

CUresult cuDeviceGetCount(int *count) {
  if (!count) return 1;
  if (!initialised) return 3;
  *count = (int)(sizeof(devices) / sizeof(devices[0]));
  return 0;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  if (!device) return 1;
  if (!initialised) return 3;
  if (ordinal < 0 || ordinal >= (int)(sizeof(devices) / sizeof(devices[0]))) return 101;
  *device = ordinal + 1000; /* a handle, not the ordinal: callers must use cuDeviceGet */
  return 0;
}

static int fake_index(CUdevice dev) {
  int i = dev - 1000;
  return initialised && i >= 0 && i < (int)(sizeof(devices) / sizeof(devices[0])) ? i : -1;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  int i = fake_index(dev);
  if (i < 0) return 101;
  if (!name || len <= 0) return 1;
  snprintf(name, (size_t)len, "%s", devices[i].name);
  return 0;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
  int i = fake_index(dev);
  if (i < 0) return 101;
  if (!bytes) return 1;
  *bytes = devices[i].memory;
  return 0;
}

#ifndef FAKE_CUDA_MINIMAL
CUresult cuDriverGetVersion(int *version) {
  if (!version) return 1;
  *version = 12080; /* 12.8: works before cuInit, as the real one does */
  return 0;
}

CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
  int i = fake_index(dev);
  if (i < 0) return 101;
  if (!value) return 1;
  switch (attrib) {
    case 33: *value = devices[i].bus; return 0;      /* CU_DEVICE_ATTRIBUTE_PCI_BUS_ID */
    case 34: *value = devices[i].device; return 0;   /* CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID */
    case 50: *value = devices[i].domain; return 0;   /* CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID */
    case 75: *value = devices[i].cc_major; return 0; /* ..._COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = devices[i].cc_minor; return 0; /* ..._COMPUTE_CAPABILITY_MINOR */
    default: return 1;
  }
}

CUresult cuGetErrorName(CUresult error, const char **str) {
  if (!str) return 1;
  switch (error) {
    case 0: *str = "CUDA_SUCCESS"; return 0;
    case 1: *str = "CUDA_ERROR_INVALID_VALUE"; return 0;
    case 3: *str = "CUDA_ERROR_NOT_INITIALIZED"; return 0;
    case 100: *str = "CUDA_ERROR_NO_DEVICE"; return 0;
    case 101: *str = "CUDA_ERROR_INVALID_DEVICE"; return 0;
    default: *str = NULL; return 1;
  }
}

CUresult cuGetErrorString(CUresult error, const char **str) {
  if (!str) return 1;
  switch (error) {
    case 0: *str = "no error"; return 0;
    case 1: *str = "invalid argument"; return 0;
    case 3: *str = "initialization error"; return 0;
    case 100: *str = "no CUDA-capable device is detected"; return 0;
    case 101: *str = "invalid device ordinal"; return 0;
    default: *str = NULL; return 1;
  }
}
#endif /* FAKE_CUDA_MINIMAL */
