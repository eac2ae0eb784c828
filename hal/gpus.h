/* gpus.h - the GPUs each vendor's own driver library can see, independent of Kiln's plugins.
 *
 * `kiln info` lists what NVIDIA's CUDA driver (libcuda.so.1), AMD's HIP runtime
 * (libamdhip64.so.6, .so.5, .so) and Intel's Level Zero loader (libze_loader.so.1) report, so
 * that a GPU no installed plugin can drive still shows up, with the reason. libkiln links none
 * of these libraries: each is dlopen'ed at run time and its few entry points are looked up by
 * name; an entry point the library lacks is reported, never called.
 *
 * Ownership: kiln_gpu_scan() returns an owned scan, released with kiln_gpu_scan_free(); every
 * string and array in it belongs to the scan.
 *
 * Thread-safety: a scan is immutable once returned and may be read from any thread. Scans may
 * run from several threads only if the vendor libraries' initialisation is thread-safe (it is
 * for the three libraries named above); `kiln info` scans once, from its main thread.
 */
#ifndef KILN_HAL_GPUS_H
#define KILN_HAL_GPUS_H

#include <stdint.h>

#include "base/status.h"

typedef enum kiln_gpu_vendor {
  KILN_GPU_NVIDIA = 0, /* the CUDA driver API */
  KILN_GPU_AMD = 1,    /* the HIP runtime */
  KILN_GPU_INTEL = 2,  /* the Level Zero loader */
  KILN_GPU_VENDOR_COUNT = 3,
} kiln_gpu_vendor_t;

typedef enum kiln_gpu_driver_state {
  KILN_GPU_DRIVER_MISSING = 0,    /* no library of any of the names tried could be found */
  KILN_GPU_DRIVER_UNLOADABLE = 1, /* a library was found but dlopen() failed: error holds why */
  KILN_GPU_DRIVER_FAILED = 2,     /* loaded, but an entry point Kiln needs is missing or the
                                   * library's init or device count failed: error says which
                                   * call, with the library's own reason */
  KILN_GPU_DRIVER_OK = 3,         /* devices[] is what the driver reported (possibly none) */
} kiln_gpu_driver_state_t;

/* One GPU as its vendor's library reports it. */
typedef struct kiln_gpu_device {
  char name[256];        /* "NVIDIA H200", "AMD Instinct MI300X" */
  char arch[32];         /* "sm_90", "gfx942"; "" when unknown */
  uint64_t total_memory; /* bytes; 0 when unknown */
  uint32_t pci_bus_id;   /* (domain << 16 | bus << 8 | device) as in kiln_hal_device_info_t;
                          * 0 when unknown */
  char error[256];       /* a query that failed for this device (the rest may be partial);
                          * "" when none did */
} kiln_gpu_device_t;

/* What one vendor's library said. */
typedef struct kiln_gpu_driver {
  int32_t vendor;          /* kiln_gpu_vendor_t */
  const char *vendor_name; /* "NVIDIA", "AMD", "Intel" (static) */
  int32_t state;           /* kiln_gpu_driver_state_t */
  char library[256];       /* the name that was dlopen'ed; when none loaded, every name tried,
                            * comma-separated ("libamdhip64.so.6, libamdhip64.so.5, ...") */
  char version[64];        /* "driver 12.8", "HIP 5.2.21153", "Level Zero API 1.3"; "" unknown */
  char error[512];         /* why the state is not OK ("" when OK): dlerror()'s text, the
                            * required entry points missing, or the failing call and the
                            * library's reason ("cuInit: CUDA_ERROR_NO_DEVICE: no CUDA-capable
                            * device is detected") */
  char missing[256];       /* optional entry points the library lacks, comma-separated; what
                            * they would have filled in is left unknown. "" when none */
  int32_t device_count;
  kiln_gpu_device_t *devices; /* [device_count], NULL when 0 */
} kiln_gpu_driver_t;

typedef struct kiln_gpu_scan {
  kiln_gpu_driver_t drivers[KILN_GPU_VENDOR_COUNT]; /* indexed by kiln_gpu_vendor_t */
} kiln_gpu_scan_t;

/* Overrides for tests. A zeroed struct means the defaults. */
typedef struct kiln_gpu_scan_options {
  /* Per vendor, a NULL-terminated list of library names to dlopen, first found wins; NULL =
   * the vendor's defaults above. */
  const char *const *libraries[KILN_GPU_VENDOR_COUNT];
  /* Where AMD GPU archs are read from (gfx_target_version in <dir>/<node>/properties); NULL =
   * /sys/class/kfd/kfd/topology/nodes. */
  const char *kfd_nodes_dir;
} kiln_gpu_scan_options_t;

/* Asks each vendor's library for its GPUs. A library that is missing, cannot be loaded or
 * fails to initialise (the usual case on a machine without that vendor's GPU or kernel
 * driver) is recorded in its driver entry, not returned as an error: the only error is
 * KILN_ERR_OUT_OF_MEMORY, and then *out_scan is NULL. *out_scan = NULL on entry.
 * The libraries stay loaded after the scan (see gpus.c for why). */
kiln_status_t kiln_gpu_scan(kiln_gpu_scan_t **out_scan);
/* The same with overrides; options may be NULL. */
kiln_status_t kiln_gpu_scan_with(const kiln_gpu_scan_options_t *options,
                                 kiln_gpu_scan_t **out_scan);

/* Frees a scan; NULL is a no-op. */
void kiln_gpu_scan_free(kiln_gpu_scan_t *scan);

#endif /* KILN_HAL_GPUS_H */
