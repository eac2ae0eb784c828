/* test_gpus.c - the GPU scan (hal/src/gpus.c) against fake vendor libraries (tests/vendor/):
 * every device field from libcuda, HIP and Level Zero, the AMD arch from a KFD topology tree,
 * init failures with the library's own reason, libraries that are missing, broken or lack
 * entry points. CTest puts the fakes (named like the real libraries) on LD_LIBRARY_PATH. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "hal/gpus.h"

/* The fake libraries' directory, also the one on LD_LIBRARY_PATH. */
static const char *vendor_dir(void) {
  const char *d = getenv("KILN_VENDOR_LIB_DIR");
  assert_non_null(d);
  return d;
}

/* A fresh scan with options; fails the test on error. */
static kiln_gpu_scan_t *scan_with(const kiln_gpu_scan_options_t *o) {
  kiln_gpu_scan_t *s = (kiln_gpu_scan_t *)1;
  kiln_status_t st = kiln_gpu_scan_with(o, &s);
  if (st) fail_msg("scan: %s", kiln_status_message(st));
  assert_non_null(s);
  return s;
}

/* Only the fake HIP is tried (a machine with ROCm 6 would otherwise answer first), and the
 * KFD tree is one that does not exist unless the test gives one. */
static const char *const fake_hip_only[] = {"libamdhip64.so.5", NULL};

static void test_fakes_found_by_soname(void **state) {
  (void)state;
  vendor_dir();
  kiln_gpu_scan_options_t o;
  memset(&o, 0, sizeof(o));
  o.libraries[KILN_GPU_AMD] = fake_hip_only;
  o.kfd_nodes_dir = "/nonexistent/kfd/nodes";
  kiln_gpu_scan_t *s = scan_with(&o);

  const kiln_gpu_driver_t *nv = &s->drivers[KILN_GPU_NVIDIA];
  assert_int_equal(nv->vendor, KILN_GPU_NVIDIA);
  assert_string_equal(nv->vendor_name, "NVIDIA");
  assert_int_equal(nv->state, KILN_GPU_DRIVER_OK);
  assert_string_equal(nv->library, "libcuda.so.1");
  assert_string_equal(nv->version, "driver 12.8");
  assert_string_equal(nv->error, "");
  assert_string_equal(nv->missing, "");
  assert_int_equal(nv->device_count, 2);
  assert_string_equal(nv->devices[0].name, "NVIDIA H200");
  assert_string_equal(nv->devices[0].arch, "sm_90");
  assert_int_equal(nv->devices[0].total_memory, 150754820096ull);
  assert_int_equal(nv->devices[0].pci_bus_id, 0x1900);
  assert_string_equal(nv->devices[0].error, "");
  assert_string_equal(nv->devices[1].name, "NVIDIA A100-SXM4-80GB");
  assert_string_equal(nv->devices[1].arch, "sm_80");
  assert_int_equal(nv->devices[1].total_memory, 85899345920ull);
  assert_int_equal(nv->devices[1].pci_bus_id, (1u << 16) | (0x3bu << 8) | 0x02u);

  const kiln_gpu_driver_t *amd = &s->drivers[KILN_GPU_AMD];
  assert_string_equal(amd->vendor_name, "AMD");
  assert_int_equal(amd->state, KILN_GPU_DRIVER_OK);
  assert_string_equal(amd->library, "libamdhip64.so.5");
  assert_string_equal(amd->version, "HIP 5.2.21153");
  assert_int_equal(amd->device_count, 1);
  assert_string_equal(amd->devices[0].name, "AMD Instinct MI300X");
  assert_string_equal(amd->devices[0].arch, ""); /* no KFD tree */
  assert_int_equal(amd->devices[0].total_memory, 206158430208ull);
  assert_int_equal(amd->devices[0].pci_bus_id, 0xc100);

  const kiln_gpu_driver_t *intel = &s->drivers[KILN_GPU_INTEL];
  assert_string_equal(intel->vendor_name, "Intel");
  assert_int_equal(intel->state, KILN_GPU_DRIVER_OK);
  assert_string_equal(intel->library, "libze_loader.so.1");
  assert_string_equal(intel->version, "Level Zero API 1.3");
  assert_int_equal(intel->device_count, 1); /* the non-GPU device is left out */
  assert_string_equal(intel->devices[0].name, "Intel(R) Data Center GPU Max 1550");
  assert_string_equal(intel->devices[0].arch, "");
  assert_int_equal(intel->devices[0].total_memory, 128ull << 30); /* two 64 GiB memories */
  assert_int_equal(intel->devices[0].pci_bus_id, 0x3a00);
  kiln_gpu_scan_free(s);
}

/* kiln_gpu_scan() with no options: the default names reach the same fakes (HIP only when no
 * libamdhip64.so.6 is installed, which the default list tries first). */
static void test_default_names(void **state) {
  (void)state;
  vendor_dir();
  kiln_gpu_scan_t *s = (kiln_gpu_scan_t *)1;
  assert_null(kiln_gpu_scan(&s));
  assert_non_null(s);
  assert_string_equal(s->drivers[KILN_GPU_NVIDIA].library, "libcuda.so.1");
  assert_int_equal(s->drivers[KILN_GPU_NVIDIA].device_count, 2);
  assert_string_equal(s->drivers[KILN_GPU_INTEL].library, "libze_loader.so.1");
  assert_int_equal(s->drivers[KILN_GPU_INTEL].device_count, 1);
  const kiln_gpu_driver_t *amd = &s->drivers[KILN_GPU_AMD];
  if (strcmp(amd->library, "libamdhip64.so.6") == 0) {
    print_message("note: a real libamdhip64.so.6 is installed; AMD default-name check skipped\n");
  } else {
    assert_string_equal(amd->library, "libamdhip64.so.5");
    assert_int_equal(amd->device_count, 1);
  }
  kiln_gpu_scan_free(s);
  kiln_gpu_scan_free(NULL);
}

/* Writes text to dir/node/properties. */
static void kfd_node(const char *dir, const char *node, const char *text) {
  char path[512];
  snprintf(path, sizeof(path), "%s/%s", dir, node);
  assert_int_equal(mkdir(path, 0700), 0);
  snprintf(path, sizeof(path), "%s/%s/properties", dir, node);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static void rm_kfd(const char *dir, const char *const *nodes) {
  char path[512];
  for (size_t i = 0; nodes[i]; i++) {
    snprintf(path, sizeof(path), "%s/%s/properties", dir, nodes[i]);
    unlink(path);
    snprintf(path, sizeof(path), "%s/%s", dir, nodes[i]);
    rmdir(path);
  }
  rmdir(dir);
}

/* The arch of the HIP device comes from the KFD node at its PCI address (0000:c1:00). */
static void test_amd_arch_from_kfd(void **state) {
  (void)state;
  char dir[] = "/tmp/kiln-kfd-XXXXXX";
  assert_non_null(mkdtemp(dir));
  /* A CPU node, another GPU (bus 0x83), the fake's GPU, and a file that is not a node. */
  kfd_node(dir, "0",
           "cpu_cores_count 16\nsimd_count 0\ngfx_target_version 0\n"
           "location_id 0\ndomain 0\n");
  kfd_node(dir, "1",
           "cpu_cores_count 0\nsimd_count 304\ngfx_target_version 90010\n"
           "location_id 33536\ndomain 0\n");
  kfd_node(dir, "2",
           "cpu_cores_count 0\nsimd_count 1216\ngfx_target_version 90402\n"
           "vendor_id 4098\nlocation_id 49408\ndomain 0\n");
  kiln_gpu_scan_options_t o;
  memset(&o, 0, sizeof(o));
  o.libraries[KILN_GPU_AMD] = fake_hip_only;
  o.kfd_nodes_dir = dir;
  kiln_gpu_scan_t *s = scan_with(&o);
  assert_int_equal(s->drivers[KILN_GPU_AMD].device_count, 1);
  assert_string_equal(s->drivers[KILN_GPU_AMD].devices[0].arch, "gfx942");
  kiln_gpu_scan_free(s);

  /* A partitioned GPU (partition number in location_id bits 31:28) still matches; gfx90a's
   * stepping prints in hex. */
  const char *const nodes[] = {"0", "1", "2", NULL};
  rm_kfd(dir, nodes);
  strcpy(dir, "/tmp/kiln-kfd-XXXXXX");
  assert_non_null(mkdtemp(dir));
  kfd_node(dir, "0", "gfx_target_version 90010\nlocation_id 268484864\ndomain 0\n");
  s = scan_with(&o);
  assert_string_equal(s->drivers[KILN_GPU_AMD].devices[0].arch, "gfx90a");
  kiln_gpu_scan_free(s);

  /* A node in another PCI domain does not match. */
  const char *const node0[] = {"0", NULL};
  rm_kfd(dir, node0);
  strcpy(dir, "/tmp/kiln-kfd-XXXXXX");
  assert_non_null(mkdtemp(dir));
  kfd_node(dir, "0", "gfx_target_version 110000\nlocation_id 49408\ndomain 1\n");
  s = scan_with(&o);
  assert_string_equal(s->drivers[KILN_GPU_AMD].devices[0].arch, "");
  kiln_gpu_scan_free(s);
  rm_kfd(dir, node0);
}

/* Present but no device: each library's own reason, no devices, the version still known. */
static void test_init_failures(void **state) {
  (void)state;
  vendor_dir();
  setenv("FAKE_CUDA_FAIL", "1", 1);
  setenv("FAKE_HIP_FAIL", "1", 1);
  setenv("FAKE_ZE_FAIL", "1", 1);
  kiln_gpu_scan_options_t o;
  memset(&o, 0, sizeof(o));
  o.libraries[KILN_GPU_AMD] = fake_hip_only;
  kiln_gpu_scan_t *s = scan_with(&o);
  unsetenv("FAKE_CUDA_FAIL");
  unsetenv("FAKE_HIP_FAIL");
  unsetenv("FAKE_ZE_FAIL");

  const kiln_gpu_driver_t *nv = &s->drivers[KILN_GPU_NVIDIA];
  assert_int_equal(nv->state, KILN_GPU_DRIVER_FAILED);
  assert_string_equal(nv->library, "libcuda.so.1");
  assert_string_equal(nv->version, "driver 12.8");
  assert_string_equal(nv->error,
                      "cuInit: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected");
  assert_int_equal(nv->device_count, 0);
  assert_null(nv->devices);

  const kiln_gpu_driver_t *amd = &s->drivers[KILN_GPU_AMD];
  assert_int_equal(amd->state, KILN_GPU_DRIVER_FAILED);
  assert_string_equal(amd->library, "libamdhip64.so.5");
  assert_string_equal(amd->version, "HIP 5.2.21153");
  assert_string_equal(amd->error,
                      "hipGetDeviceCount: hipErrorNoDevice: no ROCm-capable device is detected");
  assert_int_equal(amd->device_count, 0);
  assert_null(amd->devices);

  const kiln_gpu_driver_t *intel = &s->drivers[KILN_GPU_INTEL];
  assert_int_equal(intel->state, KILN_GPU_DRIVER_FAILED);
  assert_string_equal(intel->error,
                      "zeInit: ZE_RESULT_ERROR_UNINITIALIZED: no Level Zero GPU "
                      "driver could be initialised");
  assert_int_equal(intel->device_count, 0);
  kiln_gpu_scan_free(s);
}

/* Names that exist nowhere: "not installed", with every name tried and dlerror's text. */
static void test_not_installed(void **state) {
  (void)state;
  static const char *const cuda[] = {"libkiln-test-nosuch-cuda.so.1", NULL};
  static const char *const hip[] = {"libkiln-test-nosuch-hip.so.6", "libkiln-test-nosuch-hip.so",
                                    NULL};
  static const char *const ze[] = {"libkiln-test-nosuch-ze.so.1", NULL};
  kiln_gpu_scan_options_t o;
  memset(&o, 0, sizeof(o));
  o.libraries[KILN_GPU_NVIDIA] = cuda;
  o.libraries[KILN_GPU_AMD] = hip;
  o.libraries[KILN_GPU_INTEL] = ze;
  kiln_gpu_scan_t *s = scan_with(&o);
  for (int v = 0; v < KILN_GPU_VENDOR_COUNT; v++) {
    const kiln_gpu_driver_t *d = &s->drivers[v];
    assert_int_equal(d->vendor, v);
    assert_int_equal(d->state, KILN_GPU_DRIVER_MISSING);
    assert_int_equal(d->device_count, 0);
    assert_null(d->devices);
    assert_string_equal(d->version, "");
    assert_non_null(strstr(d->error, "cannot open shared object file"));
  }
  assert_string_equal(s->drivers[KILN_GPU_NVIDIA].library, "libkiln-test-nosuch-cuda.so.1");
  assert_string_equal(s->drivers[KILN_GPU_AMD].library,
                      "libkiln-test-nosuch-hip.so.6, libkiln-test-nosuch-hip.so");
  assert_non_null(strstr(s->drivers[KILN_GPU_AMD].error, "libkiln-test-nosuch-hip.so:"));
  kiln_gpu_scan_free(s);
}

/* A file that is there but is not a library: "cannot be loaded", even when a later name is
 * missing; a later name that loads wins. */
static void test_unloadable(void **state) {
  (void)state;
  char dir[] = "/tmp/kiln-gpus-XXXXXX";
  assert_non_null(mkdtemp(dir));
  char bad[512];
  snprintf(bad, sizeof(bad), "%s/libcuda.so.1", dir);
  FILE *f = fopen(bad, "w");
  assert_non_null(f);
  fputs("not an ELF file\n", f);
  fclose(f);
  const char *const cuda[] = {"libkiln-test-nosuch.so", bad, "libkiln-test-nosuch.so.2", NULL};
  const char *const hip[] = {bad, "libamdhip64.so.5", NULL};
  kiln_gpu_scan_options_t o;
  memset(&o, 0, sizeof(o));
  o.libraries[KILN_GPU_NVIDIA] = cuda;
  o.libraries[KILN_GPU_AMD] = hip;
  kiln_gpu_scan_t *s = scan_with(&o);
  const kiln_gpu_driver_t *nv = &s->drivers[KILN_GPU_NVIDIA];
  assert_int_equal(nv->state, KILN_GPU_DRIVER_UNLOADABLE);
  assert_string_equal(nv->library, bad);
  assert_non_null(strstr(nv->error, bad));
  assert_null(strstr(nv->error, "cannot open shared object file"));
  assert_int_equal(nv->device_count, 0);
  const kiln_gpu_driver_t *amd = &s->drivers[KILN_GPU_AMD];
  assert_int_equal(amd->state, KILN_GPU_DRIVER_OK);
  assert_string_equal(amd->library, "libamdhip64.so.5");
  assert_string_equal(amd->error, "");
  assert_int_equal(amd->device_count, 1);
  kiln_gpu_scan_free(s);
  unlink(bad);
  rmdir(dir);
}

/* Entry points the library lacks are named and never called: required ones stop the scan,
 * optional ones leave their fields unknown. */
static void test_missing_entry_points(void **state) {
  (void)state;
  /* The HIP fake as a "CUDA driver": nothing it needs is there. */
  static const char *const hip_as_cuda[] = {"libamdhip64.so.5", NULL};
  static const char *const minimal[] = {"libcuda-minimal.so.1", NULL};
  kiln_gpu_scan_options_t o;
  memset(&o, 0, sizeof(o));
  o.libraries[KILN_GPU_NVIDIA] = hip_as_cuda;
  o.libraries[KILN_GPU_AMD] = fake_hip_only;
  o.libraries[KILN_GPU_INTEL] = hip_as_cuda;
  kiln_gpu_scan_t *s = scan_with(&o);
  const kiln_gpu_driver_t *nv = &s->drivers[KILN_GPU_NVIDIA];
  assert_int_equal(nv->state, KILN_GPU_DRIVER_FAILED);
  assert_string_equal(nv->error,
                      "libamdhip64.so.5 lacks cuInit, cuDeviceGetCount, cuDeviceGet, "
                      "cuDeviceGetName, cuDeviceTotalMem_v2 (a driver older than Kiln supports?)");
  assert_string_equal(nv->missing,
                      "cuDriverGetVersion, cuDeviceGetAttribute, cuGetErrorName, cuGetErrorString");
  assert_int_equal(nv->device_count, 0);
  const kiln_gpu_driver_t *intel = &s->drivers[KILN_GPU_INTEL];
  assert_int_equal(intel->state, KILN_GPU_DRIVER_FAILED);
  assert_non_null(strstr(intel->error, "libamdhip64.so.5 lacks zeInit, zeDriverGet"));
  kiln_gpu_scan_free(s);

  /* A libcuda with only the five required entry points: devices without arch or PCI id. */
  o.libraries[KILN_GPU_NVIDIA] = minimal;
  s = scan_with(&o);
  nv = &s->drivers[KILN_GPU_NVIDIA];
  assert_int_equal(nv->state, KILN_GPU_DRIVER_OK);
  assert_string_equal(nv->version, "");
  assert_string_equal(nv->missing,
                      "cuDriverGetVersion, cuDeviceGetAttribute, cuGetErrorName, cuGetErrorString");
  assert_int_equal(nv->device_count, 2);
  assert_string_equal(nv->devices[1].name, "NVIDIA A100-SXM4-80GB");
  assert_int_equal(nv->devices[1].total_memory, 85899345920ull);
  assert_string_equal(nv->devices[1].arch, "");
  assert_int_equal(nv->devices[1].pci_bus_id, 0);
  kiln_gpu_scan_free(s);

  /* ...and its init failure without cuGetErrorName/String: the bare code. */
  setenv("FAKE_CUDA_FAIL", "1", 1);
  s = scan_with(&o);
  unsetenv("FAKE_CUDA_FAIL");
  assert_int_equal(s->drivers[KILN_GPU_NVIDIA].state, KILN_GPU_DRIVER_FAILED);
  assert_string_equal(s->drivers[KILN_GPU_NVIDIA].error, "cuInit: CUresult 100");
  kiln_gpu_scan_free(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fakes_found_by_soname), cmocka_unit_test(test_default_names),
      cmocka_unit_test(test_amd_arch_from_kfd),     cmocka_unit_test(test_init_failures),
      cmocka_unit_test(test_not_installed),         cmocka_unit_test(test_unloadable),
      cmocka_unit_test(test_missing_entry_points),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
