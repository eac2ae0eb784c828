/* fake_ze.c - a stand-in for the Level Zero loader (libze_loader.so.1) with one driver holding
 * one Intel GPU and one non-GPU device (which a GPU scan must skip): the entry points Kiln's
 * GPU scan (hal/src/gpus.c) looks up. Built against <level_zero/ze_api.h> when it exists, so
 * the structs are the real ones; otherwise (or with FAKE_ZE_NO_HEADER) against the same
 * layout declared here. FAKE_ZE_FAIL=1 makes zeInit fail as the real loader does when it
 * finds no driver (ZE_RESULT_ERROR_UNINITIALIZED). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__has_include) && !defined(FAKE_ZE_NO_HEADER)
#if __has_include(<level_zero/ze_api.h>)
#include <level_zero/ze_api.h>
#define FAKE_ZE_HEADER 1
#endif
#endif

#ifndef FAKE_ZE_HEADER
/* The subset of ze_api.h (Level Zero 1.x) this fake needs. */
typedef uint32_t ze_result_t;
typedef uint32_t ze_init_flags_t;
typedef uint32_t ze_api_version_t;
typedef struct _ze_driver_handle_t *ze_driver_handle_t;
typedef struct _ze_device_handle_t *ze_device_handle_t;
#define ZE_RESULT_SUCCESS 0u
#define ZE_RESULT_ERROR_UNINITIALIZED 0x78000001u
#define ZE_RESULT_ERROR_INVALID_ARGUMENT 0x78000004u
#define ZE_RESULT_ERROR_INVALID_NULL_POINTER 0x78000007u
#define ZE_INIT_FLAG_GPU_ONLY 1u
#define ZE_DEVICE_TYPE_GPU 1u
#define ZE_DEVICE_TYPE_VPU 5u
#define ZE_MAKE_VERSION(major, minor) (((major) << 16) | ((minor)&0x0000ffff))
typedef struct _ze_device_properties_t {
  uint32_t stype;
  void *pNext;
  uint32_t type;
  uint32_t vendorId, deviceId, flags, subdeviceId, coreClockRate;
  uint64_t maxMemAllocSize;
  uint32_t maxHardwareContexts, maxCommandQueuePriority, numThreadsPerEU, physicalEUSimdWidth;
  uint32_t numEUsPerSubslice, numSubslicesPerSlice, numSlices;
  uint64_t timerResolution;
  uint32_t timestampValidBits, kernelTimestampValidBits;
  struct {
    uint8_t id[16];
  } uuid;
  char name[256];
} ze_device_properties_t;
typedef struct _ze_device_memory_properties_t {
  uint32_t stype;
  void *pNext;
  uint32_t flags, maxClockRate, maxBusWidth;
  uint64_t totalSize;
  char name[256];
} ze_device_memory_properties_t;
typedef struct _ze_pci_ext_properties_t {
  uint32_t stype;
  void *pNext;
  struct {
    uint32_t domain, bus, device, function;
  } address;
  struct {
    int32_t genVersion, width;
    int64_t maxBandwidth;
  } maxSpeed;
} ze_pci_ext_properties_t;
ze_result_t zeInit(ze_init_flags_t flags);
ze_result_t zeDriverGet(uint32_t *pCount, ze_driver_handle_t *phDrivers);
ze_result_t zeDriverGetApiVersion(ze_driver_handle_t hDriver, ze_api_version_t *version);
ze_result_t zeDeviceGet(ze_driver_handle_t hDriver, uint32_t *pCount,
                        ze_device_handle_t *phDevices);
ze_result_t zeDeviceGetProperties(ze_device_handle_t hDevice, ze_device_properties_t *props);
ze_result_t zeDeviceGetMemoryProperties(ze_device_handle_t hDevice, uint32_t *pCount,
                                        ze_device_memory_properties_t *props);
ze_result_t zeDevicePciGetPropertiesExt(ze_device_handle_t hDevice, ze_pci_ext_properties_t *props);
#endif

/* Handles are addresses of these. */
static char the_driver, device_gpu, device_vpu;
static int initialised;

ze_result_t zeInit(ze_init_flags_t flags) {
  const char *f = getenv("FAKE_ZE_FAIL");
  if (flags & ~(ze_init_flags_t)3) return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (f && strcmp(f, "1") == 0) return ZE_RESULT_ERROR_UNINITIALIZED;
  initialised = 1;
  return ZE_RESULT_SUCCESS;
}

ze_result_t zeDriverGet(uint32_t *pCount, ze_driver_handle_t *phDrivers) {
  if (!initialised) return ZE_RESULT_ERROR_UNINITIALIZED;
  if (!pCount) return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (*pCount == 0 || !phDrivers) {
    *pCount = 1;
    return ZE_RESULT_SUCCESS;
  }
  *pCount = 1;
  phDrivers[0] = (ze_driver_handle_t)(void *)&the_driver;
  return ZE_RESULT_SUCCESS;
}

ze_result_t zeDriverGetApiVersion(ze_driver_handle_t hDriver, ze_api_version_t *version) {
  if ((void *)hDriver != &the_driver || !version) return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  *version = (ze_api_version_t)ZE_MAKE_VERSION(1, 3);
  return ZE_RESULT_SUCCESS;
}

ze_result_t zeDeviceGet(ze_driver_handle_t hDriver, uint32_t *pCount,
                        ze_device_handle_t *phDevices) {
  if ((void *)hDriver != &the_driver) return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (!pCount) return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  ze_device_handle_t all[2] = {(ze_device_handle_t)(void *)&device_vpu,
                               (ze_device_handle_t)(void *)&device_gpu};
  if (*pCount == 0 || !phDevices) {
    *pCount = 2;
    return ZE_RESULT_SUCCESS;
  }
  if (*pCount > 2) *pCount = 2;
  for (uint32_t i = 0; i < *pCount; i++) phDevices[i] = all[i];
  return ZE_RESULT_SUCCESS;
}

ze_result_t zeDeviceGetProperties(ze_device_handle_t hDevice, ze_device_properties_t *props) {
  if (!props) return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if ((void *)hDevice == &device_gpu) {
    props->type = ZE_DEVICE_TYPE_GPU;
    props->vendorId = 0x8086;
    props->deviceId = 0x0bd5;
    snprintf(props->name, sizeof(props->name), "Intel(R) Data Center GPU Max 1550");
  } else if ((void *)hDevice == &device_vpu) {
    props->type = ZE_DEVICE_TYPE_VPU;
    props->vendorId = 0x8086;
    snprintf(props->name, sizeof(props->name), "Intel(R) AI Boost");
  } else {
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  }
  props->maxMemAllocSize = 1ull << 32;
  return ZE_RESULT_SUCCESS;
}

/* Two device-local memories (one per tile) of 64 GiB each. */
ze_result_t zeDeviceGetMemoryProperties(ze_device_handle_t hDevice, uint32_t *pCount,
                                        ze_device_memory_properties_t *props) {
  if ((void *)hDevice != &device_gpu && (void *)hDevice != &device_vpu)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (!pCount) return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  uint32_t have = (void *)hDevice == &device_gpu ? 2 : 0;
  if (*pCount == 0 || !props) {
    *pCount = have;
    return ZE_RESULT_SUCCESS;
  }
  if (*pCount > have) *pCount = have;
  for (uint32_t i = 0; i < *pCount; i++) {
    props[i].totalSize = 64ull << 30;
    snprintf(props[i].name, sizeof(props[i].name), "HBM");
  }
  return ZE_RESULT_SUCCESS;
}

ze_result_t zeDevicePciGetPropertiesExt(ze_device_handle_t hDevice,
                                        ze_pci_ext_properties_t *props) {
  if ((void *)hDevice != &device_gpu) return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (!props) return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  props->address.domain = 0;
  props->address.bus = 0x3a;
  props->address.device = 0;
  props->address.function = 0;
  props->maxSpeed.genVersion = 5;
  props->maxSpeed.width = 16;
  props->maxSpeed.maxBandwidth = 64000000000ll;
  return ZE_RESULT_SUCCESS;
}
