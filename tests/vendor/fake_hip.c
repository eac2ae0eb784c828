/* fake_hip.c - a stand-in for AMD's HIP runtime (built as libamdhip64.so.5) with one GPU: the
 * entry points Kiln's GPU scan (hal/src/gpus.c) looks up, with HIP 5.2's signatures and
 * values (hipDevice_t is an int). FAKE_HIP_FAIL=1 makes hipGetDeviceCount fail with
 * hipErrorNoDevice (100), as the real runtime does on a machine without an AMD GPU. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int hipError_t; /* hipSuccess 0, hipErrorInvalidValue 1, hipErrorNoDevice 100,
                         * hipErrorInvalidDevice 101 */

hipError_t hipGetDeviceCount(int *count);
hipError_t hipDeviceGet(int *device, int ordinal);
hipError_t hipDeviceGetName(char *name, int len, int device);
hipError_t hipDeviceTotalMem(size_t *bytes, int device);
hipError_t hipDeviceGetPCIBusId(char *bus_id, int len, int device);
hipError_t hipRuntimeGetVersion(int *version);
const char *hipGetErrorName(hipError_t error);
const char *hipGetErrorString(hipError_t error);

static int failing(void) {
  const char *f = getenv("FAKE_HIP_FAIL");
  return f && strcmp(f, "1") == 0;
}

hipError_t hipGetDeviceCount(int *count) {
  if (!count) return 1;
  *count = 0;
  if (failing()) return 100;
  *count = 1;
  return 0;
}

hipError_t hipDeviceGet(int *device, int ordinal) {
  if (!device) return 1;
  if (failing() || ordinal != 0) return 101;
  *device = ordinal;
  return 0;
}

hipError_t hipDeviceGetName(char *name, int len, int device) {
  if (!name || len <= 0) return 1;
  if (failing() || device != 0) return 101;
  snprintf(name, (size_t)len, "AMD Instinct MI300X");
  return 0;
}

hipError_t hipDeviceTotalMem(size_t *bytes, int device) {
  if (!bytes) return 1;
  if (failing() || device != 0) return 101;
  *bytes = 206158430208ull; /* 192 GiB */
  return 0;
}

hipError_t hipDeviceGetPCIBusId(char *bus_id, int len, int device) {
  if (!bus_id || len <= 12) return 1; /* the real one wants 13 bytes */
  if (failing() || device != 0) return 101;
  snprintf(bus_id, (size_t)len, "%04x:%02x:%02x.%01x", 0x0000, 0xc1, 0x00, 0);
  return 0;
}

hipError_t hipRuntimeGetVersion(int *version) {
  if (!version) return 1;
  *version = 50221153; /* HIP_VERSION of 5.2.21153: major * 10000000 + minor * 100000 + patch */
  return 0;
}

const char *hipGetErrorName(hipError_t error) {
  switch (error) {
    case 0: return "hipSuccess";
    case 1: return "hipErrorInvalidValue";
    case 100: return "hipErrorNoDevice";
    case 101: return "hipErrorInvalidDevice";
    default: return "hipErrorUnknown";
  }
}

const char *hipGetErrorString(hipError_t error) {
  switch (error) {
    case 0: return "no error";
    case 1: return "invalid argument";
    case 100: return "no ROCm-capable device is detected";
    case 101: return "invalid device ordinal";
    default: return "unknown error";
  }
}
