/* loader.c - backend plugin discovery, loading, version negotiation and selection. */
#define _GNU_SOURCE /* dladdr */
#include "hal/loader.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "base/strbuf.h"
#include "kiln/hal_util.h"

#ifndef KILN_INSTALL_PLUGINDIR
#define KILN_INSTALL_PLUGINDIR "/usr/local/lib/kiln"
#endif

#define PLUGIN_PREFIX "libkiln-backend-"
#define PLUGIN_SUFFIX ".so"

typedef struct plugin_record plugin_record_t;

/* One file a registry looked at. */
typedef struct loader_entry {
  kiln_hal_plugin_t pub;     /* first member: a kiln_hal_plugin_t * is a loader_entry_t * */
  void *handle;              /* dlopen handle, never dlclose'd once the plugin ran */
  kiln_hal_registry_t *registry;
  plugin_record_t *record;   /* while OPEN: the plugin's process-wide record, one reference */
  int open_order;            /* order of opening in this registry, for release in reverse */
} loader_entry_t;

/* A key of [plugin.<name>] and its value, copied from a registry's config. */
typedef struct record_kv {
  char *key;
  char *value; /* NULL: read and unset (cached miss; lazy mode only) */
} record_kv_t;

/* The process-wide state of one initialised plugin file (one dlopen handle), shared by every
 * registry that opened it: the context behind the kiln_hal_host_t handed to init(). Lives from
 * the first open (before init) to the last release (after shutdown). */
struct plugin_record {
  plugin_record_t *next;
  void *handle; /* identity */
  char *name;   /* immutable while the record lives: host_log reads it without a lock */
  char *path;
  kiln_hal_backend_t table; /* normalised copy: what load_backend hands to wrappers */
  kiln_hal_host_t host;     /* ctx = this record */
  int refs;                 /* registries holding it open + records that loaded it */
  bool initialising;        /* inside init(): opening it again is a wrapper cycle */
  /* Registries holding it open, in the order they opened it; [0] serves lazy config reads
   * and load_backend. Changed under both locks. */
  kiln_hal_registry_t **regs;
  int nregs, capregs;
  plugin_record_t **deps; /* backends it loaded (host->load_backend), one reference each */
  int ndeps, capdeps;
  /* [plugin.<name>]: the whole section when kv_complete (copied at creation), else the keys
   * read so far. Under g_cfg_lock. */
  record_kv_t *kv;
  size_t nkv, capkv;
  bool kv_complete;
};

/* g_lock (recursive: init() re-enters the loader through load_backend) guards g_records and
 * every record's refs, deps, initialising and the calls of init/shutdown/probe. g_cfg_lock
 * guards records' regs and kv, so that config_get never waits for an init. Order: g_lock,
 * then g_cfg_lock. */
static pthread_mutex_t g_lock;
static pthread_once_t g_lock_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_cfg_lock = PTHREAD_MUTEX_INITIALIZER;
static plugin_record_t *g_records;

static void loader_lock_init(void) {
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&g_lock, &a);
  pthread_mutexattr_destroy(&a);
}

static void loader_lock(void) {
  pthread_once(&g_lock_once, loader_lock_init);
  pthread_mutex_lock(&g_lock);
}

static void loader_unlock(void) { pthread_mutex_unlock(&g_lock); }

struct kiln_hal_registry {
  loader_entry_t **entries; /* pointers, so entries keep their address as the array grows */
  int count, capacity;
  char *search_path;
  kiln_hal_registry_options_t options;
  int next_open_order;
};

/* The members a 1.0 plugin must provide; the rest are optional groups. */
static const struct {
  const char *name;
  size_t offset;
} required_members[] = {
#define REQ(m) {#m, offsetof(kiln_hal_backend_t, m)}
    REQ(init),         REQ(shutdown),     REQ(probe),       REQ(device_count),
    REQ(device_info),  REQ(device_open),  REQ(device_close), REQ(device_memory),
    REQ(buffer_alloc), REQ(buffer_free),  REQ(stream_create), REQ(stream_destroy),
    REQ(stream_sync),  REQ(copy_h2d),     REQ(copy_d2h),    REQ(copy_d2d),
    REQ(fill),         REQ(gemm),         REQ(embedding),   REQ(rmsnorm),
    REQ(rope),         REQ(silu_mul),     REQ(add),         REQ(copy),
    REQ(kv_write),     REQ(attention),    REQ(argmax),      REQ(topk),
    REQ(penalize),     REQ(sample),
#undef REQ
};

/* ---- small helpers --------------------------------------------------------------------- */

/* Takes ownership of err. */
kiln_status_t kiln_hal_status_from_error(kiln_hal_error_t *err, const char *context) {
  if (!err) return NULL;
  kiln_status_code_t code;
  switch (err->code) {
    case KILN_HAL_ERR_INVALID_ARGUMENT: code = KILN_ERR_INVALID_ARGUMENT; break;
    case KILN_HAL_ERR_UNSUPPORTED: code = KILN_ERR_UNSUPPORTED; break;
    case KILN_HAL_ERR_OUT_OF_MEMORY: code = KILN_ERR_OUT_OF_MEMORY; break;
    case KILN_HAL_ERR_NO_DEVICE: code = KILN_ERR_NOT_FOUND; break;
    case KILN_HAL_ERR_DEVICE: code = KILN_ERR_DEVICE; break;
    default: code = KILN_ERR_INTERNAL; break;
  }
  kiln_status_t st = kiln_status_make(code, "%s: %s", context,
                                      err->message ? err->message : "(no message)");
  kiln_hal_error_free(err);
  return st;
}

/* Checks a file name against libkiln-backend-<name>.so with <name> in [a-z0-9_-]+.
 * Writes the name to out (size outsz) and returns 1 when it matches. */
static int loader_parse_file_name(const char *file, char *out, size_t outsz) {
  size_t plen = strlen(PLUGIN_PREFIX), slen = strlen(PLUGIN_SUFFIX), n = strlen(file);
  if (n <= plen + slen) return 0;
  if (strncmp(file, PLUGIN_PREFIX, plen) != 0) return 0;
  if (strcmp(file + n - slen, PLUGIN_SUFFIX) != 0) return 0;
  size_t len = n - plen - slen;
  if (len + 1 > outsz) return 0;
  for (size_t i = 0; i < len; i++) {
    char c = file[plen + i];
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-')) return 0;
  }
  memcpy(out, file + plen, len);
  out[len] = '\0';
  return 1;
}

static const char *loader_basename(const char *path) {
  const char *s = strrchr(path, '/');
  return s ? s + 1 : path;
}

/* ---- host services handed to plugins ------------------------------------------------------
 * ctx is the plugin's record, which outlives every registry's use of it: nothing here may
 * reach a registry except through record->regs, under the locks. */

static void host_log(void *ctx, int32_t level, const char *message) {
  plugin_record_t *rec = ctx;
  kiln_log_level_t lv = level <= KILN_HAL_LOG_ERROR  ? KILN_LOG_ERROR
                        : level == KILN_HAL_LOG_WARN ? KILN_LOG_WARN
                        : level == KILN_HAL_LOG_INFO ? KILN_LOG_INFO
                                                     : KILN_LOG_DEBUG;
  kiln_log(lv, "backend %s: %s", rec->name, message ? message : "(null)");
}

/* Index of key in rec->kv, or -1. g_cfg_lock held. */
static long record_kv_find(const plugin_record_t *rec, const char *key) {
  for (size_t i = 0; i < rec->nkv; i++)
    if (strcmp(rec->kv[i].key, key) == 0) return (long)i;
  return -1;
}

/* Appends copies of key and value (value may be NULL). Returns the new pair, NULL when out of
 * memory (then rec->kv is unchanged). g_cfg_lock held, or the record not yet shared. */
static record_kv_t *record_kv_add(plugin_record_t *rec, const char *key, const char *value) {
  if (rec->nkv == rec->capkv) {
    size_t cap = rec->capkv ? rec->capkv * 2 : 8;
    record_kv_t *n = realloc(rec->kv, cap * sizeof(*n));
    if (!n) return NULL;
    rec->kv = n;
    rec->capkv = cap;
  }
  record_kv_t kv = {strdup(key), value ? strdup(value) : NULL};
  if (!kv.key || (value && !kv.value)) {
    free(kv.key);
    free(kv.value);
    return NULL;
  }
  rec->kv[rec->nkv] = kv;
  return &rec->kv[rec->nkv++];
}

static const char *host_config_get(void *ctx, const char *key) {
  plugin_record_t *rec = ctx;
  if (!key) return NULL;
  pthread_mutex_lock(&g_cfg_lock);
  const char *value = NULL;
  long i = record_kv_find(rec, key);
  if (i >= 0) {
    value = rec->kv[i].value;
  } else if (!rec->kv_complete && rec->nregs > 0) {
    /* Lazy mode (the options list no keys): copy the value from the first registry still
     * holding the plugin, once; later reads return the same copy. */
    const kiln_hal_registry_options_t *o = &rec->regs[0]->options;
    const char *raw = o->config_get ? o->config_get(o->config_ctx, rec->name, key) : NULL;
    record_kv_t *kv = record_kv_add(rec, key, raw);
    value = kv ? kv->value : NULL;
  }
  pthread_mutex_unlock(&g_cfg_lock);
  return value;
}

/* Installed only when the record holds the whole section (kv_complete): every pair is a key
 * that is set. */
static const char *host_config_key(void *ctx, int32_t index) {
  plugin_record_t *rec = ctx;
  pthread_mutex_lock(&g_cfg_lock);
  const char *key = index >= 0 && (size_t)index < rec->nkv ? rec->kv[index].key : NULL;
  pthread_mutex_unlock(&g_cfg_lock);
  return key;
}

/* Copies the whole [plugin.<name>] section of the registry's config into a new record, when
 * its options can list the keys. Out of memory is an error. */
static kiln_status_t record_snapshot_config(plugin_record_t *rec,
                                            const kiln_hal_registry_options_t *o) {
  if (!o->config_get) {
    rec->kv_complete = true; /* no config at all: no keys */
    return NULL;
  }
  if (!o->config_key) return NULL; /* lazy: values copied as they are read */
  for (int32_t i = 0; i < INT32_MAX; i++) {
    const char *key = o->config_key(o->config_ctx, rec->name, i);
    if (!key) break;
    if (record_kv_find(rec, key) >= 0) continue;
    const char *value = o->config_get(o->config_ctx, rec->name, key);
    if (!value) continue; /* listed but unset: not a key that is set */
    if (!record_kv_add(rec, key, value))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  }
  rec->kv_complete = true;
  return NULL;
}

/* True when from (transitively) loaded to. g_lock held. */
static bool record_depends_on(const plugin_record_t *from, const plugin_record_t *to) {
  if (from == to) return true;
  for (int i = 0; i < from->ndeps; i++)
    if (record_depends_on(from->deps[i], to)) return true;
  return false;
}

static const kiln_hal_backend_t *host_load_backend(void *ctx, const char *name,
                                                   kiln_hal_error_t **out_error) {
  plugin_record_t *rec = ctx;
  kiln_hal_error_t *ignored = NULL;
  if (!out_error) out_error = &ignored;
  *out_error = NULL;
  if (!name || !*name) {
    *out_error = kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT, "load_backend: no name");
    return NULL;
  }
  if (strcmp(name, rec->name) == 0) {
    *out_error = kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                                    "backend '%s' cannot wrap itself", name);
    return NULL;
  }
  const kiln_hal_backend_t *table = NULL;
  loader_lock();
  kiln_hal_registry_t *r = rec->nregs > 0 ? rec->regs[0] : NULL;
  if (!r) {
    *out_error = kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE,
                                    "backend '%s': no registry holds it open any more, so "
                                    "'%s' cannot be loaded for it",
                                    rec->name, name);
    goto done;
  }
  const kiln_hal_plugin_t *p = NULL;
  kiln_status_t st = kiln_hal_registry_open(r, name, &p);
  if (st) {
    *out_error = kiln_hal_error_new(KILN_HAL_ERR_NO_DEVICE, "%s", kiln_status_message(st));
    kiln_status_free(st);
    goto done;
  }
  plugin_record_t *dep = ((const loader_entry_t *)p)->record;
  if (record_depends_on(dep, rec)) {
    *out_error = kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                                    "backend '%s' cannot wrap '%s', which wraps it (or is it)",
                                    rec->name, p->name);
    goto done;
  }
  int have = 0;
  for (int i = 0; i < rec->ndeps && !have; i++) have = rec->deps[i] == dep;
  if (!have) {
    if (rec->ndeps == rec->capdeps) {
      int cap = rec->capdeps ? rec->capdeps * 2 : 4;
      plugin_record_t **n = realloc(rec->deps, (size_t)cap * sizeof(*n));
      if (!n) {
        *out_error = kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY,
                                        "load_backend: out of memory");
        goto done;
      }
      rec->deps = n;
      rec->capdeps = cap;
    }
    rec->deps[rec->ndeps++] = dep;
    dep->refs++;
  }
  table = &dep->table;
done:
  loader_unlock();
  kiln_hal_error_free(ignored);
  return table;
}

/* ---- plugin records ------------------------------------------------------------------------ */

static plugin_record_t *record_find(void *handle) {
  for (plugin_record_t *r = g_records; r; r = r->next)
    if (r->handle == handle) return r;
  return NULL;
}

static void record_free(plugin_record_t *rec) {
  if (!rec) return;
  for (size_t i = 0; i < rec->nkv; i++) {
    free(rec->kv[i].key);
    free(rec->kv[i].value);
  }
  free(rec->kv);
  free(rec->regs);
  free(rec->deps);
  free(rec->name);
  free(rec->path);
  free(rec);
}

static void record_unlink(plugin_record_t *rec) {
  for (plugin_record_t **pp = &g_records; *pp; pp = &(*pp)->next)
    if (*pp == rec) {
      *pp = rec->next;
      return;
    }
}

/* Adds r to the registries holding rec. g_lock held. */
static kiln_status_t record_add_registry(plugin_record_t *rec, kiln_hal_registry_t *r) {
  kiln_status_t st = NULL;
  pthread_mutex_lock(&g_cfg_lock);
  if (rec->nregs == rec->capregs) {
    int cap = rec->capregs ? rec->capregs * 2 : 4;
    kiln_hal_registry_t **n = realloc(rec->regs, (size_t)cap * sizeof(*n));
    if (!n) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
      goto done;
    }
    rec->regs = n;
    rec->capregs = cap;
  }
  rec->regs[rec->nregs++] = r;
done:
  pthread_mutex_unlock(&g_cfg_lock);
  return st;
}

static void record_remove_registry(plugin_record_t *rec, kiln_hal_registry_t *r) {
  pthread_mutex_lock(&g_cfg_lock);
  for (int i = 0; i < rec->nregs; i++)
    if (rec->regs[i] == r) {
      memmove(&rec->regs[i], &rec->regs[i + 1],
              (size_t)(rec->nregs - i - 1) * sizeof(*rec->regs));
      rec->nregs--;
      break;
    }
  pthread_mutex_unlock(&g_cfg_lock);
}

/* Drops one reference; the last one shuts the plugin down, then releases what it loaded (so a
 * wrapper goes before what it wraps) and frees the record. g_lock held. */
static void record_unref(plugin_record_t *rec) {
  if (--rec->refs > 0) return;
  rec->table.shutdown();
  for (int i = rec->ndeps - 1; i >= 0; i--) record_unref(rec->deps[i]);
  record_unlink(rec);
  record_free(rec);
}

/* A new record for entry e opened by its registry (references: that registry), linked into
 * g_records, not yet initialised. g_lock held. */
static kiln_status_t record_create(loader_entry_t *e, plugin_record_t **out) {
  *out = NULL;
  plugin_record_t *rec = calloc(1, sizeof(*rec));
  if (!rec) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  rec->handle = e->handle;
  rec->name = strdup(e->pub.name);
  rec->path = strdup(e->pub.path);
  kiln_status_t st = NULL;
  if (!rec->name || !rec->path)
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  const kiln_hal_registry_options_t *o = &e->registry->options;
  if (!st) st = record_snapshot_config(rec, o);
  if (!st) st = record_add_registry(rec, e->registry);
  if (st) {
    record_free(rec);
    return st;
  }
  rec->table = e->pub.table;
  rec->host.struct_size = sizeof(rec->host);
  rec->host.ctx = rec;
  rec->host.log = host_log;
  rec->host.config_get = host_config_get;
  rec->host.load_backend = host_load_backend;
  rec->host.num_threads = o->num_threads;
  rec->host.config_key = rec->kv_complete ? host_config_key : NULL;
  rec->refs = 1;
  rec->next = g_records;
  g_records = rec;
  *out = rec;
  return NULL;
}

/* ---- registry ---------------------------------------------------------------------------- */

static kiln_status_t registry_push(kiln_hal_registry_t *r, loader_entry_t *e) {
  if (r->count == r->capacity) {
    int cap = r->capacity ? r->capacity * 2 : 8;
    loader_entry_t **n = realloc(r->entries, (size_t)cap * sizeof(*n));
    if (!n) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
    r->entries = n;
    r->capacity = cap;
  }
  r->entries[r->count++] = e;
  return NULL;
}

/* The reason of an entry whose real reason could not be allocated: a rejected or shadowed entry
 * always has a reason. Never freed. */
static char entry_reason_oom[] = "out of memory while recording the reason";

static void entry_set_reason(loader_entry_t *e, char *reason) {
  if (e->pub.reason != entry_reason_oom) free(e->pub.reason);
  e->pub.reason = reason;
}

static void entry_free(loader_entry_t *e) {
  if (!e) return;
  free(e->pub.path);
  free(e->pub.name);
  entry_set_reason(e, NULL);
  free(e);
}

/* Marks e rejected with a formatted reason (entry_reason_oom if that cannot be allocated:
 * registry_add_file() turns it into an out-of-memory error). */
static void entry_reject(loader_entry_t *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void entry_reject(loader_entry_t *e, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  char *reason = strdup(buf);
  entry_set_reason(e, reason ? reason : entry_reason_oom);
  e->pub.state = KILN_HAL_PLUGIN_REJECTED;
  e->pub.score = 0;
}

/* dlopen + query + version check + required members + probe. Leaves e USABLE or REJECTED. */
static void entry_load(loader_entry_t *e) {
  dlerror();
  e->handle = dlopen(e->pub.path, RTLD_NOW | RTLD_LOCAL);
  if (!e->handle) {
    const char *why = dlerror();
    entry_reject(e, "dlopen failed: %s", why ? why : "unknown error");
    return;
  }
  kiln_hal_query_fn query;
  void *sym = dlsym(e->handle, KILN_HAL_ENTRY_SYMBOL);
  if (!sym) {
    entry_reject(e, "missing entry symbol %s (not a Kiln backend, or built without exporting it)",
                 KILN_HAL_ENTRY_SYMBOL);
    dlclose(e->handle); /* none of its code ran: safe to unmap */
    e->handle = NULL;
    return;
  }
  memcpy(&query, &sym, sizeof(query));
  const kiln_hal_backend_t *t = query(KILN_HAL_ABI_MAJOR, KILN_HAL_ABI_MINOR);
  if (!t) {
    entry_reject(e, "%s(%d, %d) returned NULL: the plugin declined to serve host ABI %d.%d",
                 KILN_HAL_ENTRY_SYMBOL, KILN_HAL_ABI_MAJOR, KILN_HAL_ABI_MINOR,
                 KILN_HAL_ABI_MAJOR, KILN_HAL_ABI_MINOR);
    return;
  }
  size_t frozen = offsetof(kiln_hal_backend_t, name) + sizeof(t->name);
  if (t->struct_size < frozen) {
    entry_reject(e, "backend table is %u bytes, smaller than the %zu-byte frozen header",
                 t->struct_size, frozen);
    return;
  }
  e->pub.abi_major = t->abi_major;
  e->pub.abi_minor = t->abi_minor;
  if (t->abi_major != KILN_HAL_ABI_MAJOR) {
    entry_reject(e, "plugin ABI %u.%u, host ABI %d.%d: majors differ; rebuild the plugin "
                 "against this Kiln's SDK",
                 t->abi_major, t->abi_minor, KILN_HAL_ABI_MAJOR, KILN_HAL_ABI_MINOR);
    return;
  }
  if (!t->name || strcmp(t->name, e->pub.name) != 0) {
    entry_reject(e, "file is named for backend '%s' but the plugin calls itself '%s'",
                 e->pub.name, t->name ? t->name : "(null)");
    return;
  }
  /* Normalise: copy what the plugin has, leave what it lacks zero. A newer minor's extra
   * members are beyond sizeof and ignored. */
  size_t n = t->struct_size < sizeof(kiln_hal_backend_t) ? t->struct_size
                                                         : sizeof(kiln_hal_backend_t);
  memset(&e->pub.table, 0, sizeof(e->pub.table));
  memcpy(&e->pub.table, t, n);
  e->pub.table.struct_size = sizeof(kiln_hal_backend_t);
  e->pub.build_info = e->pub.table.build_info ? e->pub.table.build_info : "";
  for (size_t i = 0; i < sizeof(required_members) / sizeof(required_members[0]); i++) {
    void *fn;
    memcpy(&fn, (const char *)&e->pub.table + required_members[i].offset, sizeof(fn));
    if (!fn) {
      entry_reject(e, "ABI %u.%u table lacks required member '%s'%s", t->abi_major,
                   t->abi_minor, required_members[i].name,
                   required_members[i].offset >= t->struct_size ? " (table too short)" : " (NULL)");
      return;
    }
  }
  /* Graph members form an optional group: all or none. */
  const kiln_hal_backend_t *nt = &e->pub.table;
  int ngraph = !!nt->graph_begin + !!nt->graph_end + !!nt->graph_replay + !!nt->graph_destroy;
  if (ngraph != 0 && ngraph != 4) {
    entry_reject(e, "graph members must be all present or all NULL (%d of 4 present)", ngraph);
    return;
  }
  int32_t score = 0;
  loader_lock(); /* probe is serialised with every init/shutdown (hal.h, LIFETIME) */
  kiln_hal_error_t *err = nt->probe(&score);
  loader_unlock();
  if (err || score <= 0) {
    entry_reject(e, "probe found no usable device%s%s", err ? ": " : "",
                 err && err->message ? err->message : "");
    kiln_hal_error_free(err);
    return;
  }
  e->pub.score = score;
  e->pub.state = KILN_HAL_PLUGIN_USABLE;
  entry_set_reason(e, NULL);
}

static loader_entry_t *registry_find(kiln_hal_registry_t *r, const char *name) {
  for (int i = 0; i < r->count; i++) {
    loader_entry_t *e = r->entries[i];
    if (e->pub.state != KILN_HAL_PLUGIN_SHADOWED && e->pub.name && strcmp(e->pub.name, name) == 0)
      return e;
  }
  return NULL;
}

/* path with its directory resolved but not its last component: plugins are often symlinks
 * whose own name (not the target's) is what counts. Returns malloc'ed or NULL. */
static char *loader_canonical(const char *path) {
  const char *slash = strrchr(path, '/');
  char *dir = slash ? malloc((size_t)(slash - path) + 2) : strdup(".");
  if (!dir) {
    errno = ENOMEM;
    return NULL;
  }
  if (slash) {
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    memcpy(dir, path, n);
    dir[n] = '\0';
  }
  char *real = realpath(dir, NULL);
  free(dir);
  if (!real) return NULL;
  char *out = kiln_strprintf("%s/%s", real, slash ? slash + 1 : path);
  free(real);
  if (!out) errno = ENOMEM;
  return out;
}

/* The entry already loaded from path, or NULL. Out of memory is an error: a miss would load
 * the same file as a second entry and run its init() twice. */
static kiln_status_t registry_find_path(kiln_hal_registry_t *r, const char *path,
                                        loader_entry_t **out_entry) {
  *out_entry = NULL;
  errno = 0;
  char *want = loader_canonical(path);
  int oom = !want && errno == ENOMEM;
  for (int i = 0; want && !*out_entry && !oom && i < r->count; i++) {
    errno = 0;
    char *have = loader_canonical(r->entries[i]->pub.path);
    if (have && strcmp(have, want) == 0) *out_entry = r->entries[i];
    oom = !have && errno == ENOMEM;
    free(have);
  }
  free(want);
  if (oom) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  return NULL;
}

/* Creates an entry for path; a file name that breaks the naming rule is recorded as rejected
 * when it at least starts with the plugin prefix (so typos show up in `kiln info`). On error
 * (out of memory) the registry is as it was, except that a plugin it loaded stays mapped. */
static kiln_status_t registry_add_file(kiln_hal_registry_t *r, const char *path, int explicit_path,
                                       loader_entry_t **out_entry) {
  if (out_entry) *out_entry = NULL;
  const char *base = loader_basename(path);
  char name[128];
  int ok = loader_parse_file_name(base, name, sizeof(name));
  if (!ok && !explicit_path && strncmp(base, PLUGIN_PREFIX, strlen(PLUGIN_PREFIX)) != 0)
    return NULL; /* an unrelated file in a plugin directory */
  loader_entry_t *e = calloc(1, sizeof(*e));
  if (!e) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  e->registry = r;
  e->pub.path = strdup(path);
  e->pub.name = strdup(ok ? name : base);
  if (!e->pub.path || !e->pub.name) {
    entry_free(e);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  }
  kiln_status_t st = registry_push(r, e);
  if (st) {
    entry_free(e);
    return st;
  }
  if (!ok) {
    entry_reject(e, "file name does not match %s<name>%s with <name> in [a-z0-9_-]",
                 PLUGIN_PREFIX, PLUGIN_SUFFIX);
  } else if (!explicit_path && registry_find(r, name) != e) {
    loader_entry_t *first = registry_find(r, name);
    char *reason =
        kiln_strprintf("shadowed by %s, found earlier in the search path", first->pub.path);
    entry_set_reason(e, reason ? reason : entry_reason_oom);
    e->pub.state = KILN_HAL_PLUGIN_SHADOWED;
  } else {
    entry_load(e);
  }
  if (e->pub.reason == entry_reason_oom) {
    r->count--; /* e is the last entry: take it back out */
    entry_free(e);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  }
  if (out_entry) *out_entry = e;
  return NULL;
}

static int loader_cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Adds every plugin file of one directory, in sorted order. A missing directory is fine. */
static kiln_status_t registry_scan_dir(kiln_hal_registry_t *r, const char *dir) {
  DIR *d = opendir(dir);
  if (!d) {
    KILN_LOG_D("plugin directory %s: %s", dir, strerror(errno));
    return NULL;
  }
  kiln_status_t st = NULL;
  char **names = NULL;
  size_t n = 0, cap = 0;
  struct dirent *de;
  while ((de = readdir(d))) {
    if (strncmp(de->d_name, PLUGIN_PREFIX, strlen(PLUGIN_PREFIX)) != 0) continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      char **nn = realloc(names, cap * sizeof(*nn));
      if (!nn) goto oom;
      names = nn;
    }
    if (!(names[n] = strdup(de->d_name))) goto oom;
    n++;
  }
  if (n) qsort(names, n, sizeof(*names), loader_cmp_str);
  for (size_t i = 0; i < n && !st; i++) {
    char *path = kiln_strprintf("%s/%s", dir, names[i]);
    if (!path) goto oom;
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISREG(sb.st_mode)) st = registry_add_file(r, path, 0, NULL);
    free(path);
  }
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
done:
  for (size_t i = 0; i < n; i++) free(names[i]);
  free(names);
  closedir(d);
  return st;
}

/* Appends dir to the colon-separated search path string (skipping duplicates). */
static kiln_status_t registry_add_dir(kiln_hal_registry_t *r, const char *dir) {
  if (!dir || !*dir) return NULL;
  size_t dl = strlen(dir);
  for (const char *p = r->search_path; p && *p;) {
    const char *c = strchr(p, ':');
    size_t len = c ? (size_t)(c - p) : strlen(p);
    if (len == dl && strncmp(p, dir, dl) == 0) return NULL;
    p = c ? c + 1 : p + len;
  }
  char *n = r->search_path && *r->search_path ? kiln_strprintf("%s:%s", r->search_path, dir)
                                              : strdup(dir);
  if (!n) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  free(r->search_path);
  r->search_path = n;
  return registry_scan_dir(r, dir);
}

static kiln_status_t registry_add_dir_list(kiln_hal_registry_t *r, const char *list) {
  if (!list) return NULL;
  char *copy = strdup(list);
  if (!copy) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  kiln_status_t st = NULL;
  char *save = NULL;
  for (char *tok = strtok_r(copy, ":", &save); tok && !st; tok = strtok_r(NULL, ":", &save))
    st = registry_add_dir(r, tok);
  free(copy);
  return st;
}

/* The directory of the plugins shipped beside this libkiln: <dir of libkiln.so>/kiln, which is
 * $ORIGIN/../lib/kiln for an executable in bin/. *out_dir is NULL when that cannot be found
 * out; the error is out-of-memory only. */
static kiln_status_t loader_origin_dir(char **out_dir) {
  *out_dir = NULL;
  Dl_info info;
  if (!dladdr((void *)kiln_hal_registry_create, &info) || !info.dli_fname) return NULL;
  errno = 0;
  char *lib = realpath(info.dli_fname, NULL);
  if (!lib && errno == ENOMEM)
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  if (!lib) return NULL;
  char *slash = strrchr(lib, '/');
  if (slash) *slash = '\0';
  *out_dir = kiln_strprintf("%s/kiln", lib);
  free(lib);
  if (!*out_dir) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  return NULL;
}

kiln_status_t kiln_hal_registry_create(const kiln_hal_registry_options_t *options,
                                       kiln_hal_registry_t **out_registry) {
  *out_registry = NULL;
  kiln_hal_registry_t *r = calloc(1, sizeof(*r));
  if (!r) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  if (options) r->options = *options;
  kiln_status_t st = NULL;
  if (!r->options.skip_env) st = registry_add_dir_list(r, getenv("KILN_BACKEND_PATH"));
  if (!st) st = registry_add_dir_list(r, r->options.config_path);
  if (!st && !r->options.skip_default_dirs) {
    char *origin = NULL;
    st = loader_origin_dir(&origin);
    if (!st && origin) st = registry_add_dir(r, origin);
    free(origin);
    if (!st) st = registry_add_dir(r, KILN_INSTALL_PLUGINDIR);
  }
  if (!st && !r->search_path && !(r->search_path = strdup("")))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "plugin registry: out of memory");
  if (st) {
    kiln_hal_registry_free(r);
    return st;
  }
  *out_registry = r;
  return NULL;
}

void kiln_hal_registry_free(kiln_hal_registry_t *r) {
  if (!r) return;
  /* Release plugins in reverse order of opening. A plugin is shut down with its last
   * reference, and a wrapper's record holds one on each backend it loaded, so a wrapper goes
   * before what it wraps whichever registry goes first. */
  loader_lock();
  for (int order = r->next_open_order - 1; order >= 0; order--) {
    for (int i = 0; i < r->count; i++) {
      loader_entry_t *e = r->entries[i];
      if (e->pub.state == KILN_HAL_PLUGIN_OPEN && e->record && e->open_order == order) {
        record_remove_registry(e->record, r);
        record_unref(e->record);
        e->record = NULL;
      }
    }
  }
  loader_unlock();
  for (int i = 0; i < r->count; i++) entry_free(r->entries[i]); /* handles stay mapped */
  free(r->entries);
  free(r->search_path);
  free(r);
}

int kiln_hal_registry_count(const kiln_hal_registry_t *r) { return r->count; }

const kiln_hal_plugin_t *kiln_hal_registry_get(const kiln_hal_registry_t *r, int index) {
  if (index < 0 || index >= r->count) return NULL;
  return &r->entries[index]->pub;
}

const char *kiln_hal_registry_search_path(const kiln_hal_registry_t *r) { return r->search_path; }

/* Opens e in its registry: takes a reference on the plugin's record when another registry has
 * it initialised, else creates the record and calls init(). */
static kiln_status_t entry_open(loader_entry_t *e) {
  if (e->pub.state == KILN_HAL_PLUGIN_OPEN) return NULL;
  if (e->pub.state != KILN_HAL_PLUGIN_USABLE)
    return kiln_status_make(KILN_ERR_NOT_FOUND, "backend '%s' (%s) cannot be used: %s",
                            e->pub.name, e->pub.path, e->pub.reason ? e->pub.reason : "unknown");
  kiln_hal_registry_t *r = e->registry;
  kiln_status_t st = NULL;
  bool shared = false;
  loader_lock();
  plugin_record_t *rec = record_find(e->handle);
  if (rec && rec->initialising) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "backend '%s' is already starting: plugins wrap each other in a cycle",
                          e->pub.name);
    goto done;
  }
  if (rec) { /* initialised for another registry (or earlier in this one, by another path) */
    if ((st = record_add_registry(rec, r))) goto done;
    rec->refs++;
    shared = true;
  } else {
    if ((st = record_create(e, &rec))) goto done;
    rec->initialising = true;
    kiln_hal_error_t *err = rec->table.init(&rec->host);
    rec->initialising = false;
    if (err) {
      /* No shutdown after a failed init; drop what it loaded, and the record. */
      record_unlink(rec);
      for (int i = rec->ndeps - 1; i >= 0; i--) record_unref(rec->deps[i]);
      record_free(rec);
      st = kiln_hal_status_from_error(err, "init");
      entry_reject(e, "%s", kiln_status_message(st));
      st = kiln_status_annotate(st, "backend '%s' (%s)", e->pub.name, e->pub.path);
      goto done;
    }
  }
  e->record = rec;
  e->pub.state = KILN_HAL_PLUGIN_OPEN;
  e->open_order = r->next_open_order++;
  KILN_LOG_I("backend %s: %s (ABI %u.%u, probe score %d)", e->pub.name, e->pub.path,
             e->pub.abi_major, e->pub.abi_minor, e->pub.score);
  if (shared) KILN_LOG_D("backend %s: already initialised in this process: shared", e->pub.name);
done:
  loader_unlock();
  return st;
}

/* One line per plugin that could not be used, for error messages. */
static char *registry_reasons(kiln_hal_registry_t *r) {
  char *s = strdup("");
  for (int i = 0; s && i < r->count; i++) {
    loader_entry_t *e = r->entries[i];
    if (e->pub.state != KILN_HAL_PLUGIN_REJECTED) continue;
    char *n = kiln_strprintf("%s\n  %s (%s): %s", s, e->pub.name, e->pub.path, e->pub.reason);
    free(s);
    s = n;
  }
  return s;
}

static kiln_status_t registry_open_locked(kiln_hal_registry_t *r, const char *name,
                                          const kiln_hal_plugin_t **out_plugin);

/* Under g_lock as a whole: a plugin's load_backend may open plugins in this registry from the
 * plugin's own thread. */
kiln_status_t kiln_hal_registry_open(kiln_hal_registry_t *r, const char *name,
                                     const kiln_hal_plugin_t **out_plugin) {
  loader_lock();
  kiln_status_t st = registry_open_locked(r, name, out_plugin);
  loader_unlock();
  return st;
}

static kiln_status_t registry_open_locked(kiln_hal_registry_t *r, const char *name,
                                          const kiln_hal_plugin_t **out_plugin) {
  *out_plugin = NULL;
  loader_entry_t *e = NULL;
  kiln_status_t st = NULL;
  if (!name || !*name) name = "auto";
  if (strchr(name, '/')) {
    if ((st = registry_find_path(r, name, &e))) return st;
    if (!e) {
      struct stat sb;
      if (stat(name, &sb) != 0)
        return kiln_status_make(KILN_ERR_NOT_FOUND, "backend file %s: %s", name, strerror(errno));
      if ((st = registry_add_file(r, name, 1, &e))) return st;
    }
  } else if (strcmp(name, "auto") == 0) {
    loader_entry_t *best = NULL;
    for (int i = 0; i < r->count; i++) {
      loader_entry_t *c = r->entries[i];
      if ((c->pub.state == KILN_HAL_PLUGIN_USABLE || c->pub.state == KILN_HAL_PLUGIN_OPEN) &&
          c->pub.score >= 100 && (!best || c->pub.score > best->pub.score))
        best = c;
    }
    if (best) {
      st = entry_open(best);
      if (!st) {
        *out_plugin = &best->pub;
        return NULL;
      }
      KILN_LOG_W("backend auto: %s failed to start (%s); falling back to cpu", best->pub.name,
                 kiln_status_message(st));
      kiln_status_free(st);
    } else {
      char *why = registry_reasons(r);
      KILN_LOG_W("backend auto: no GPU backend is usable; using cpu%s%s",
                 why && *why ? ". Rejected plugins:" : "", why ? why : "");
      free(why);
    }
    e = registry_find(r, "cpu");
    if (!e) {
      char *why = registry_reasons(r);
      st = kiln_status_make(KILN_ERR_NOT_FOUND,
                            "backend auto: no usable backend and no cpu plugin in %s%s%s",
                            *r->search_path ? r->search_path : "(empty search path)",
                            why && *why ? ". Rejected:" : "", why ? why : "");
      free(why);
      return st;
    }
  } else {
    e = registry_find(r, name);
    if (!e)
      return kiln_status_make(KILN_ERR_NOT_FOUND,
                              "backend '%s': no file libkiln-backend-%s.so in the search path %s",
                              name, name, *r->search_path ? r->search_path : "(empty)");
  }
  if ((st = entry_open(e))) return st;
  *out_plugin = &e->pub;
  return NULL;
}
