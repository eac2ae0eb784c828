/* loader.h - finds, loads, version-checks and probes backend plugins; picks one.
 *
 * A registry is built once at start-up by scanning the search path:
 *   1. each directory of $KILN_BACKEND_PATH (colon-separated)
 *   2. each directory of the INI [backend] path (colon-separated)
 *   3. $ORIGIN/../lib/kiln relative to libkiln.so (the build tree and relocated installs)
 *   4. the install directory (KILN_INSTALL_PLUGINDIR)
 * Only files named exactly libkiln-backend-<name>.so, <name> in [a-z0-9_-]+, are considered.
 * The first file found for a name wins; later ones with the same name are listed as shadowed.
 * Every candidate is dlopen'ed (RTLD_NOW | RTLD_LOCAL), queried, version-checked and probed;
 * one that fails is kept in the registry with the exact reason, for `kiln info`.
 *
 * Plugin life cycle, as one registry sees an entry:
 *
 *     found --dlopen/query/version--> rejected (reason)            kiln_hal_registry_create()
 *       |
 *       +--probe() score 0----------> rejected (probe's reason)
 *       |
 *       +--probe() score > 0--------> usable --init()--> initialised  kiln_hal_registry_open()
 *                                                            |   (init only if no other
 *                                                            |    registry holds it open)
 *                                                  shutdown() at kiln_hal_registry_free() of
 *                                                  the last registry (or wrapper) holding it
 *
 * Plugins are never dlclose'd: GPU runtimes install threads and atexit handlers that crash
 * when their code is unmapped.
 *
 * One life cycle per plugin file, shared by all registries (hal.h, LIFETIME). A plugin file is
 * dlopen'ed once per process however many registries scan it, so init()/shutdown() are not
 * per entry: the loader keeps a process-wide record per dlopen handle, reference-counted
 * under a mutex. The first registry to open the plugin creates the record and calls init();
 * a registry that opens it meanwhile takes a reference; kiln_hal_registry_free() drops its
 * references (in reverse order of opening) and the last one calls shutdown(). The record owns
 * the kiln_hal_host_t handed to init() and what it returns:
 *   - config: at the first open the record copies the plugin's whole [plugin.<name>] section
 *     from that registry's options (config_key lists the keys, config_get reads them), so the
 *     values outlive that registry and its config. With options that have config_get but no
 *     config_key, the host's config_key is NULL and each value is copied when first read:
 *     from the first opener while it lives, else from another registry holding the plugin.
 *   - num_threads: the first opener's.
 *   - load_backend: opens the backend in a registry holding the plugin (the first opener while
 *     it lives) and gives the plugin the wrapped backend's record's table; the record of the
 *     plugin that loaded it holds a reference on the wrapped one, dropped after its own
 *     shutdown, so a wrapper always shuts down before what it wraps, across registries too.
 *   - log: kiln_log, prefixed with the plugin's name.
 *
 * Thread-safety: a registry is built and opened from one thread; different registries may be
 * created, opened and freed from different threads at once. The tables a registry hands out
 * are immutable and may be used from any thread under the ABI's own rules.
 */
#ifndef KILN_HAL_LOADER_H
#define KILN_HAL_LOADER_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"
#include "kiln/hal.h"

typedef struct kiln_hal_registry kiln_hal_registry_t;

typedef enum kiln_hal_plugin_state {
  KILN_HAL_PLUGIN_REJECTED = 0, /* could not be used: see reason */
  KILN_HAL_PLUGIN_USABLE = 1,   /* loaded, compatible, probe > 0 */
  KILN_HAL_PLUGIN_OPEN = 2,     /* init() succeeded */
  KILN_HAL_PLUGIN_SHADOWED = 3, /* an earlier directory had a plugin of the same name */
} kiln_hal_plugin_state_t;

/* One file the loader looked at. Borrowed from the registry. */
typedef struct kiln_hal_plugin {
  char *path;      /* absolute or as found */
  char *name;      /* from the file name: libkiln-backend-<name>.so */
  int state;       /* kiln_hal_plugin_state_t */
  char *reason;    /* why it was rejected/shadowed; NULL when usable */
  int32_t score;   /* probe score (0 when rejected) */
  uint32_t abi_major, abi_minor; /* what the plugin reported (0.0 if it never answered) */
  /* The plugin's table normalised to this host's layout: members the plugin did not have
   * are NULL, so callers test members for NULL instead of checking struct_size. Valid for
   * usable/open plugins, until the registry is freed. */
  kiln_hal_backend_t table;
  const char *build_info; /* borrowed from the plugin, "" when absent */
} kiln_hal_plugin_t;

typedef struct kiln_hal_registry_options {
  const char *config_path;  /* [backend] path, colon-separated; NULL or "" = none */
  bool skip_env;            /* ignore $KILN_BACKEND_PATH (tests) */
  bool skip_default_dirs;   /* search only the explicit directories (tests) */
  int32_t num_threads;      /* passed to plugins through kiln_hal_host_t */
  /* Raw values for [plugin.<name>] sections: returns NULL when unset. May be NULL (then
   * plugins see no keys). The strings need to last only for the call: the loader copies them. */
  const char *(*config_get)(void *ctx, const char *plugin_name, const char *key);
  /* The index-th key set in [plugin.<plugin_name>] (0, 1, ... in a stable order), NULL past
   * the last. May be NULL: plugins then get no host->config_key (see above). */
  const char *(*config_key)(void *ctx, const char *plugin_name, int32_t index);
  void *config_ctx; /* passed to both; must outlive the registry */
} kiln_hal_registry_options_t;

/* Scans the search path and fills a registry. Fails only on out-of-memory: plugins that do
 * not load are recorded as rejected, not returned as errors. *out_registry = NULL on entry. */
kiln_status_t kiln_hal_registry_create(const kiln_hal_registry_options_t *options,
                                       kiln_hal_registry_t **out_registry);

/* Releases every plugin the registry opened (shutting down those no other registry or
 * wrapper holds, wrappers first) and frees the registry. NULL is a no-op. */
void kiln_hal_registry_free(kiln_hal_registry_t *registry);

/* Number of entries, and entry i (borrowed). */
int kiln_hal_registry_count(const kiln_hal_registry_t *registry);
const kiln_hal_plugin_t *kiln_hal_registry_get(const kiln_hal_registry_t *registry, int index);

/* Directories that were searched, in order, as one colon-separated string (borrowed). */
const char *kiln_hal_registry_search_path(const kiln_hal_registry_t *registry);

/* Chooses and initialises a backend:
 *   "auto"            the usable plugin with the highest probe score above 99 (a GPU);
 *                     otherwise "cpu", logging why no accelerator was chosen.
 *   "cpu" | "cuda" | any name   the plugin of that name; an error quoting its rejection
 *                     reason if it is not usable.
 *   a path (contains '/')       that exact file, loaded now even if outside the search path.
 * An explicitly named backend that cannot be used is an error (never a silent fallback).
 * On success *out_plugin points at the registry's entry (state OPEN). Opening an already
 * open plugin returns it again. */
kiln_status_t kiln_hal_registry_open(kiln_hal_registry_t *registry, const char *name,
                                     const kiln_hal_plugin_t **out_plugin);

/* Converts a plugin's error object into a status (taking ownership of err) with context. */
kiln_status_t kiln_hal_status_from_error(kiln_hal_error_t *err, const char *context);

#endif /* KILN_HAL_LOADER_H */
