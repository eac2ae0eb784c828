/* cmd_info.c - `kiln info`: every plugin found, its devices, and why rejected ones were. */
#include <inttypes.h>
#include <string.h>

#include "cli.h"
#include "kiln/hal_util.h"

static const char *info_state_name(int state) {
  switch (state) {
    case KILN_HAL_PLUGIN_USABLE: return "usable";
    case KILN_HAL_PLUGIN_OPEN: return "usable";
    case KILN_HAL_PLUGIN_SHADOWED: return "shadowed";
    default: return "rejected";
  }
}

static void info_caps(char *buf, size_t n, uint64_t caps) {
  static const struct {
    uint64_t bit;
    const char *name;
  } names[] = {{KILN_HAL_CAP_F16, "f16"},
               {KILN_HAL_CAP_BF16, "bf16"},
               {KILN_HAL_CAP_GRAPHS, "graphs"},
               {KILN_HAL_CAP_MIXED_BATCH_GRAPHS, "mixed-batch-graphs"},
               {KILN_HAL_CAP_HOST_MEMORY, "host-memory"},
               {KILN_HAL_CAP_DEVICE_SAMPLING, "device-sampling"},
               {KILN_HAL_CAP_TF32, "tf32"}};
  buf[0] = '\0';
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
    if (!(caps & names[i].bit)) continue;
    size_t len = strlen(buf);
    snprintf(buf + len, n - len, "%s%s", len ? " " : "", names[i].name);
  }
}

/* Lists the devices of an initialised plugin. */
static void info_devices(const kiln_hal_plugin_t *p) {
  const kiln_hal_backend_t *t = &p->table;
  int32_t count = 0;
  kiln_hal_error_t *err = t->device_count(&count);
  if (err) {
    printf("           devices: error: %s\n", err->message);
    kiln_hal_error_free(err);
    return;
  }
  for (int32_t i = 0; i < count; i++) {
    kiln_hal_device_info_t di;
    memset(&di, 0, sizeof(di));
    di.struct_size = sizeof(di);
    if ((err = t->device_info(i, &di))) {
      printf("           device %d: error: %s\n", i, err->message);
      kiln_hal_error_free(err);
      continue;
    }
    char total[32], avail[32], caps[160];
    info_caps(caps, sizeof(caps), di.caps);
    printf("           device %d: %s | arch %s | memory %s (%s free) | %d %s | warp %d\n", i,
           di.name, di.arch, kiln_cli_bytes(total, sizeof(total), di.total_memory),
           kiln_cli_bytes(avail, sizeof(avail), di.free_memory), di.compute_units,
           di.kind == KILN_HAL_DEVICE_CPU ? "threads" : "compute units", di.warp_size);
    printf("                     caps: %s\n", caps[0] ? caps : "(none)");
  }
}

int kiln_cmd_info(kiln_cli_t *cli) {
  kiln_status_t st = kiln_cli_registry(cli);
  if (st) return kiln_cli_fail(st);
  kiln_hal_registry_t *reg = cli->registry;
  printf("Kiln %s (backend ABI %d.%d)\n", KILN_VERSION_STRING, KILN_HAL_ABI_MAJOR,
         KILN_HAL_ABI_MINOR);
  printf("config: %s\n", cli->config_path ? cli->config_path : "(built-in defaults)");
  printf("plugin search path: %s\n\n", kiln_hal_registry_search_path(reg));
  int n = kiln_hal_registry_count(reg);
  if (n == 0) printf("no backend plugins found\n");
  for (int i = 0; i < n; i++) {
    const kiln_hal_plugin_t *p = kiln_hal_registry_get(reg, i);
    /* Open usable plugins so they can list their devices. */
    if (p->state == KILN_HAL_PLUGIN_USABLE) {
      const kiln_hal_plugin_t *opened = NULL;
      kiln_status_t ost = kiln_hal_registry_open(reg, p->name, &opened);
      if (ost) kiln_status_free(ost); /* the entry now carries the reason */
    }
    printf("  %-8s %s\n", p->name, p->path);
    if (p->abi_major || p->abi_minor)
      printf("           ABI %u.%u", p->abi_major, p->abi_minor);
    else
      printf("           ABI ?");
    printf(" | %s", info_state_name(p->state));
    if (p->state == KILN_HAL_PLUGIN_USABLE || p->state == KILN_HAL_PLUGIN_OPEN)
      printf(" | probe score %d", p->score);
    printf("\n");
    if (p->reason) printf("           reason: %s\n", p->reason);
    if (p->build_info && *p->build_info) printf("           build: %s\n", p->build_info);
    if (p->state == KILN_HAL_PLUGIN_OPEN) info_devices(p);
  }
  const char *want = kiln_config_get_string(cli->config, "backend", "name");
  const kiln_hal_plugin_t *chosen = NULL;
  st = kiln_hal_registry_open(reg, want, &chosen);
  if (st) {
    printf("\nbackend = %s: cannot be used: %s\n", want, kiln_status_message(st));
    kiln_status_free(st);
    return 1;
  }
  printf("\nbackend = %s -> %s (%s)\n", want, chosen->name, chosen->path);
  return 0;
}
