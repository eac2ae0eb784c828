/* cmd_info.c - `kiln info`: every plugin found, its devices, and why rejected ones were. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "hal/gpus.h"
#include "kiln/hal_quant.h"
#include "kiln/hal_util.h"
#include "models/model_config.h"

/* The PCI addresses of the devices the open plugins listed, to tell which plugin drives each
 * GPU the vendors' libraries see. A fixed table: beyond 256 devices the rest go unmatched. */
typedef struct info_seen {
  int count;
  struct {
    uint32_t pci_bus_id;
    const char *plugin; /* borrowed from the registry */
  } devices[256];
} info_seen_t;

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
               {KILN_HAL_CAP_TF32, "tf32"},
               {KILN_HAL_CAP_COLLECTIVES, "collectives"},
               {KILN_HAL_CAP_KV_FP8, "kv-fp8"}};
  buf[0] = '\0';
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
    if (!(caps & names[i].bit)) continue;
    size_t len = strlen(buf);
    snprintf(buf + len, n - len, "%s%s", len ? " " : "", names[i].name);
  }
  /* The weight formats gemm_quant takes (GGUF blocks; int4_g / int8_g: GPTQ and AWQ). */
  for (int32_t f = 1; f < KILN_HAL_QFMT_GROUP_END; f++) {
    if (f >= KILN_HAL_QFMT_COUNT && !kiln_hal_qfmt_is_group(f)) continue;
    if (!(caps & KILN_HAL_CAP_QUANT(f))) continue;
    size_t len = strlen(buf);
    snprintf(buf + len, n - len, "%s%s", len ? " " : "", kiln_hal_qfmt_name(f));
  }
}

static void info_seen_add(info_seen_t *seen, uint32_t pci_bus_id, const char *plugin) {
  if (!pci_bus_id || seen->count >= (int)(sizeof(seen->devices) / sizeof(seen->devices[0]))) return;
  seen->devices[seen->count].pci_bus_id = pci_bus_id;
  seen->devices[seen->count].plugin = plugin;
  seen->count++;
}

/* Records the devices of a plugin that was not listed (one chosen by path), quietly. */
static void info_seen_add_plugin(info_seen_t *seen, const kiln_hal_plugin_t *p) {
  const kiln_hal_backend_t *t = &p->table;
  int32_t count = 0;
  kiln_hal_error_t *err = t->device_count(&count);
  for (int32_t i = 0; !err && i < count; i++) {
    kiln_hal_device_info_t di;
    memset(&di, 0, sizeof(di));
    di.struct_size = sizeof(di);
    if ((err = t->device_info(i, &di))) break;
    info_seen_add(seen, di.pci_bus_id, p->name);
  }
  kiln_hal_error_free(err);
}

/* Lists the devices of an initialised plugin, recording their PCI addresses in seen. */
static void info_devices(const kiln_hal_plugin_t *p, info_seen_t *seen) {
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
    info_seen_add(seen, di.pci_bus_id, p->name);
    char total[32], avail[32], caps[256];
    info_caps(caps, sizeof(caps), di.caps);
    printf("           device %d: %s | arch %s | memory %s (%s free) | %d %s | warp %d\n", i,
           di.name, di.arch, kiln_cli_bytes(total, sizeof(total), di.total_memory),
           kiln_cli_bytes(avail, sizeof(avail), di.free_memory), di.compute_units,
           di.kind == KILN_HAL_DEVICE_CPU ? "threads" : "compute units", di.warp_size);
    printf("                     caps: %s\n", caps[0] ? caps : "(none)");
  }
}

/* The plugin meant for a vendor's GPUs, by name: the first entry that is not shadowed. */
static const kiln_hal_plugin_t *info_find_plugin(kiln_hal_registry_t *reg, const char *name) {
  for (int i = 0; i < kiln_hal_registry_count(reg); i++) {
    const kiln_hal_plugin_t *p = kiln_hal_registry_get(reg, i);
    if (p->state != KILN_HAL_PLUGIN_SHADOWED && strcmp(p->name, name) == 0) return p;
  }
  return NULL;
}

/* Why no plugin drives a GPU of this vendor, into buf. */
static void info_why_unused(char *buf, size_t n, kiln_hal_registry_t *reg, int vendor,
                            const kiln_gpu_device_t *g, const kiln_hal_plugin_t *chosen) {
  const char *want = vendor == KILN_GPU_NVIDIA ? "cuda" : vendor == KILN_GPU_AMD ? "rocm" : NULL;
  if (!want) {
    if (chosen)
      snprintf(buf, n, "Kiln has no Level Zero backend yet; this machine runs on %s", chosen->name);
    else
      snprintf(buf, n, "Kiln has no Level Zero backend yet");
    return;
  }
  const kiln_hal_plugin_t *p = info_find_plugin(reg, want);
  if (!p)
    snprintf(buf, n, "no plugin for %s GPUs is installed (libkiln-backend-%s.so)",
             vendor == KILN_GPU_NVIDIA ? "NVIDIA" : "AMD", want);
  else if (p->state == KILN_HAL_PLUGIN_REJECTED)
    snprintf(buf, n, "no installed plugin drives it: the %s plugin was rejected: %s", want,
             p->reason ? p->reason : "(no reason given)");
  else if (!g->pci_bus_id)
    snprintf(buf, n, "its PCI address is unknown, so which plugin drives it cannot be told");
  else
    snprintf(buf, n,
             "no installed plugin drives it: the %s plugin does not list a device at "
             "this PCI address",
             want);
}

/* The GPUs each vendor's driver library sees, whether or not a plugin drives them. */
static void info_gpus(kiln_hal_registry_t *reg, const info_seen_t *seen,
                      const kiln_hal_plugin_t *chosen) {
  printf("\nGPUs seen through the vendors' driver libraries (independent of the plugins above):\n");
  kiln_gpu_scan_t *scan = NULL;
  kiln_status_t st = kiln_gpu_scan(&scan);
  if (st) {
    printf("  error: %s\n", kiln_status_message(st));
    kiln_status_free(st);
    return;
  }
  for (int v = 0; v < KILN_GPU_VENDOR_COUNT; v++) {
    const kiln_gpu_driver_t *d = &scan->drivers[v];
    printf("  %-8s %s%s%s: ", d->vendor_name, d->library, d->version[0] ? ", " : "", d->version);
    switch (d->state) {
      case KILN_GPU_DRIVER_MISSING: printf("not installed\n"); break;
      case KILN_GPU_DRIVER_UNLOADABLE: printf("cannot be loaded: %s\n", d->error); break;
      case KILN_GPU_DRIVER_FAILED: printf("%s\n", d->error); break;
      default:
        if (d->device_count == 0)
          printf("no devices");
        else
          printf("%d device%s", d->device_count, d->device_count == 1 ? "" : "s");
        if (d->missing[0]) printf(" (the library lacks %s)", d->missing);
        printf("\n");
        break;
    }
    for (int i = 0; i < d->device_count; i++) {
      const kiln_gpu_device_t *g = &d->devices[i];
      printf("           device %d: %s", i, g->name[0] ? g->name : "(unnamed)");
      if (g->arch[0]) printf(" | %s", g->arch);
      if (g->total_memory) {
        char mem[32];
        printf(" | %s", kiln_cli_bytes(mem, sizeof(mem), g->total_memory));
      }
      if (g->pci_bus_id)
        printf(" | PCI %04x:%02x:%02x.0", g->pci_bus_id >> 16, (g->pci_bus_id >> 8) & 0xff,
               g->pci_bus_id & 0xff);
      const char *user = NULL;
      for (int k = 0; g->pci_bus_id && !user && k < seen->count; k++)
        if (seen->devices[k].pci_bus_id == g->pci_bus_id) user = seen->devices[k].plugin;
      if (user) {
        printf(" | used by plugin %s\n", user);
      } else {
        char why[1024];
        info_why_unused(why, sizeof(why), reg, v, g, chosen);
        printf("\n                     %s\n", why);
      }
      if (g->error[0]) printf("                     error: %s\n", g->error);
    }
  }
  kiln_gpu_scan_free(scan);
}

/* The configured model's architecture and quantization, from its config.json alone (no
 * weights are read; a Hub id is not resolved: that may download). */
static void info_model(const kiln_cli_t *cli) {
  char path[4096];
  kiln_status_t st = kiln_config_model_path(cli->config, path, sizeof(path));
  if (st) {
    printf("model = ?: %s\n", kiln_status_message(st));
    kiln_status_free(st);
    return;
  }
  struct stat sb;
  size_t len = strlen(path);
  if (stat(path, &sb) != 0) {
    printf("model = %s (not a local path: a Hub id is resolved when a command loads it)\n", path);
    return;
  }
  if (S_ISREG(sb.st_mode) && len > 5 && strcmp(path + len - 5, ".gguf") == 0) {
    printf("model = %s (GGUF; its quantized types are listed when it loads: kiln serve's banner, "
           "/v1/models)\n", path);
    return;
  }
  kiln_model_config_t *mc = calloc(1, sizeof(*mc));
  if (!mc) return;
  if ((st = kiln_model_config_load(path, mc))) {
    printf("model = %s: %s\n", path, kiln_status_message(st));
    kiln_status_free(st);
    free(mc);
    return;
  }
  char q[160];
  kiln_model_quant_describe(&mc->quant, q, sizeof(q));
  const char *fly = kiln_config_get_string(cli->config, "model", "quantization");
  const bool on_the_fly = mc->quant.method == KILN_QUANT_NONE && fly && strcmp(fly, "fp8") == 0;
  printf("model = %s (%s; quantization %s%s)\n", path, mc->architecture, q,
         on_the_fly ? "; [model] quantization = fp8: FP8 e4m3 per-channel, made at load" : "");
  free(mc);
}

static const kiln_opts_t info_opts = {
    .cmd = "info",
    .usage =
        "usage: kiln info [--config FILE] [--set section.key=value]...\n"
        "Lists the backend plugins on the search path with their ABI, state, probe score and\n"
        "devices (and why any was rejected), the GPUs the vendors' drivers see, the backend\n"
        "that [backend] name picks and the configured model's architecture and quantization\n"
        "(from its config.json). Exit status: 1 when the backend cannot be used.\n",
    .common = &kiln_cli_common_opts,
};

int kiln_cmd_info(kiln_cli_t *cli) {
  bool help = false;
  kiln_status_t st = kiln_opts_parse(&info_opts, cli->argc, cli->argv, NULL, &help);
  if (st) return kiln_cli_fail(st);
  if (help) return 0;
  st = kiln_cli_registry(cli);
  if (st) return kiln_cli_fail(st);
  kiln_hal_registry_t *reg = cli->registry;
  printf("Kiln %s (backend ABI %d.%d)\n", KILN_VERSION_STRING, KILN_HAL_ABI_MAJOR,
         KILN_HAL_ABI_MINOR);
  printf("config: %s\n", cli->config_path ? cli->config_path : "(built-in defaults)");
  printf("plugin search path: %s\n\n", kiln_hal_registry_search_path(reg));
  info_seen_t seen;
  seen.count = 0;
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
    if (p->state == KILN_HAL_PLUGIN_OPEN) info_devices(p, &seen);
  }
  const char *want = kiln_config_get_string(cli->config, "backend", "name");
  const kiln_hal_plugin_t *chosen = NULL;
  st = kiln_hal_registry_open(reg, want, &chosen);
  if (!st && kiln_hal_registry_count(reg) > n) info_seen_add_plugin(&seen, chosen);
  info_gpus(reg, &seen, chosen);
  if (st) {
    printf("\nbackend = %s: cannot be used: %s\n", want, kiln_status_message(st));
    kiln_status_free(st);
    return 1;
  }
  printf("\nbackend = %s -> %s (%s)\n", want, chosen->name, chosen->path);
  info_model(cli);
  printf("tensor_parallel_size = %lld%s\n",
         (long long)kiln_config_get_int(cli->config, "parallel", "tensor_parallel_size"),
         KILN_HAL_HAS(&chosen->table, comm_create) && chosen->table.comm_create ? "" : " (this backend has no collectives: only 1 runs)");
  return 0;
}
