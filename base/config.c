/* config.c - the table of every INI key, and the loader, validator and writer it drives.
 *
 * Loading parses into a deep copy of the config and swaps the copy in only once the whole text
 * has passed, so a load is all-or-nothing even when it runs out of memory halfway; configs are
 * small, so the copy costs nothing that matters. inih is driven through ini_parse_stream() with
 * our own line reader, for two reasons: the reader's line count is the line of the key being
 * handled (Debian builds inih without INI_HANDLER_LINENO), and it can refuse a line longer than
 * inih's fixed buffer, which inih would otherwise cut (older releases even read the rest as a
 * line of its own).
 */
#define _POSIX_C_SOURCE 200809L
#include "config.h"
#include "base/strbuf.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---- the table ------------------------------------------------------------------------------ */

typedef enum config_type {
  CONFIG_STRING,
  CONFIG_INT,   /* int64_t within [imin, imax] */
  CONFIG_FLOAT, /* finite double within [fmin, fmax] */
  CONFIG_BOOL,
  CONFIG_ENUM,     /* one of choices[], matched case-insensitively */
  CONFIG_INT_LIST, /* non-empty, comma-separated; each element within [imin, imax] */
} config_type_t;

/* Extra validation for a STRING key: NULL if value is fine, else why not (static text). */
typedef const char *(*config_check_fn)(const char *value);

typedef struct config_row {
  const char *section;
  const char *key;
  config_type_t type;
  const char *def;            /* the default, as it would be written in the file */
  int64_t imin, imax;         /* INT, INT_LIST */
  double fmin, fmax;          /* FLOAT */
  const char *const *choices; /* ENUM: NULL-terminated */
  config_check_fn check;      /* STRING: optional */
  const char *allowed;        /* STRING with check: the allowed values, for --help-config */
  const char *help;
} config_row_t;

#define ROW_STRING(s, k, d, h) \
  { .section = (s), .key = (k), .type = CONFIG_STRING, .def = (d), .help = (h) }
#define ROW_CHECKED(s, k, d, fn, what, h)                                         \
  {                                                                               \
    .section = (s), .key = (k), .type = CONFIG_STRING, .def = (d), .check = (fn), \
    .allowed = (what), .help = (h)                                                \
  }
#define ROW_INT(s, k, d, lo, hi, h)                                                         \
  {                                                                                         \
    .section = (s), .key = (k), .type = CONFIG_INT, .def = (d), .imin = (lo), .imax = (hi), \
    .help = (h)                                                                             \
  }
#define ROW_FLOAT(s, k, d, lo, hi, h)                                                         \
  {                                                                                           \
    .section = (s), .key = (k), .type = CONFIG_FLOAT, .def = (d), .fmin = (lo), .fmax = (hi), \
    .help = (h)                                                                               \
  }
#define ROW_BOOL(s, k, d, h) \
  { .section = (s), .key = (k), .type = CONFIG_BOOL, .def = (d), .help = (h) }
#define ROW_ENUM(s, k, d, c, h) \
  { .section = (s), .key = (k), .type = CONFIG_ENUM, .def = (d), .choices = (c), .help = (h) }
#define ROW_INT_LIST(s, k, d, lo, hi, h)                                                         \
  {                                                                                              \
    .section = (s), .key = (k), .type = CONFIG_INT_LIST, .def = (d), .imin = (lo), .imax = (hi), \
    .help = (h)                                                                                  \
  }

static const char *const config_sections[] = {
    "model", "hub",    "engine",   "cache", "scheduler", "speculative",
    "backend", "server", "parallel", "graph", "log",      NULL};

static const char *const config_dtypes[] = {"auto", "float32", "float16", "bfloat16", NULL};
static const char *const config_quantizations[] = {"none", "fp8", NULL};
static const char *const config_fp8_weights[] = {"auto", "keep", "widen", NULL};
static const char *const config_fp8_activations[] = {"none", "dynamic", NULL};
static const char *const config_block_sizes[] = {"8", "16", "32", "64", "128", NULL};
static const char *const config_kv_dtypes[] = {"auto", "fp8_e4m3", NULL};
static const char *const config_policies[] = {"fcfs", "priority", NULL};
static const char *const config_spec_methods[] = {"off", "ngram", "draft", NULL};
static const char *const config_log_levels[] = {"error", "warn", "info", "debug", NULL};
static const char *const config_log_formats[] = {"text", "json", NULL};
static const char *const config_hub_progress[] = {"auto", "bar", "lines", "none", NULL};
static const char *const config_warmup[] = {"auto", "on", "off", NULL};

static const char *config_check_endpoint(const char *value) {
  return !value[0] || !strncmp(value, "http://", 7) || !strncmp(value, "https://", 8)
             ? NULL
             : "is not an http:// or https:// URL";
}
static const char *const config_tool_parsers[] = {"auto",    "hermes", "llama3_json",
                                                  "mistral", "none",   NULL};

/* auto, a plugin name (libkiln-backend-<name>.so: cpu, cuda, rocm or a third party's), or a
 * path. Whether that plugin exists and loads is the loader's to say, with the reason. */
static const char *config_check_backend(const char *value) {
  if (strchr(value, '/')) return NULL;
  bool ok = value[0] != '\0';
  for (const char *c = value; *c; c++)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-'))
      ok = false;
  return ok ? NULL
            : "is not a backend: use auto, a plugin name such as cpu, cuda or rocm (the <name> "
              "of libkiln-backend-<name>.so, in [a-z0-9_-]), or a path containing '/'";
}

static const char *config_check_host(const char *value) {
  return value[0] ? NULL : "is not an address: give one to listen on, e.g. 127.0.0.1 or 0.0.0.0";
}

/* Every key Kiln reads from its config file, in the order --help-config and the writer list
 * them. Sections appear in the order of config_sections[]. */
static const config_row_t config_rows[] = {
    ROW_STRING("model", "path", "",
               "Hugging Face model directory or GGUF file, or a Hub id ORG/NAME[/FILE.gguf]"
               "[@REVISION] (docs/hub.md); empty = the embedded default model"),
    ROW_ENUM("model", "dtype", "auto", config_dtypes,
             "Weight and activation dtype; auto = the dtype in the model's config"),
    ROW_ENUM("model", "quantization", "none", config_quantizations,
             "Quantize a float checkpoint at load: fp8 = its decoder Linear weights to FP8 e4m3 "
             "with per-channel scales (weight-only; docs/models.md); none = as stored (FP8, GPTQ, "
             "AWQ and GGUF checkpoints are always run as they are quantized)"),
    ROW_ENUM("model", "fp8_weights", "auto", config_fp8_weights,
             "FP8 Linear weights (FP8 checkpoints, quantization = fp8): keep = stored and "
             "multiplied in FP8 where the backend can (half of bf16's bytes); widen = "
             "dequantized to the serving dtype at load; auto = keep on the CPU backend and with "
             "fp8_activations = dynamic (FP8 tensor-core GEMM), else widen on GPUs (weight-only "
             "FP8 prefills at CUDA-core speed)"),
    ROW_ENUM("model", "fp8_activations", "none", config_fp8_activations,
             "Activations of FP8 Linears kept in FP8: none = used as they are (weight-only, "
             "W8A16); dynamic = each token's row quantized to FP8 e4m3 with its own scale (W8A8: "
             "FP8 tensor cores on sm_89+; small error, docs/models.md)"),
    ROW_INT("model", "max_model_len", "0", 0, 16777216,
            "Longest sequence (prompt + output) in tokens; 0 = from the model's config"),
    ROW_INT("model", "max_images_per_prompt", "8", 0, 1024,
            "Most images one request may carry (vision-language models); more is refused"),
    ROW_INT("model", "encoder_cache_mb", "1024", 1, 1048576,
            "MiB of device memory for vision encoder outputs awaiting prefill (docs/engine.md)"),
    ROW_INT("model", "image_threads", "0", 0, 32,
            "Threads that resize and patchify one image on the host (vision-language models); "
            "0 = min(4, cores)"),

    ROW_STRING("hub", "cache_dir", "",
               "Hugging Face Hub cache folder; empty = $HF_HUB_CACHE, else $HF_HOME/hub, else "
               "~/.cache/huggingface/hub"),
    ROW_CHECKED("hub", "endpoint", "", config_check_endpoint, "empty, or an http(s):// URL",
                "Hub server to download from; empty = $HF_ENDPOINT, else https://huggingface.co"),
    ROW_BOOL("hub", "offline", "false",
             "Never download: Hub ids resolve from the cache only (as HF_HUB_OFFLINE=1 does)"),
    ROW_ENUM("hub", "progress", "auto", config_hub_progress,
             "Download progress on stderr: auto = a bar on a terminal, else lines; bar, lines, "
             "none"),
    ROW_FLOAT("hub", "timeout", "30", 1, 3600,
              "Seconds a Hub connection may take to open, or a download may stall, before it "
              "fails"),

    ROW_INT("engine", "max_num_seqs", "256", 1, 65536,
            "Most sequences (requests) scheduled together in one engine step"),
    ROW_INT("engine", "max_num_batched_tokens", "8192", 1, 16777216,
            "Most tokens (prefill + decode) processed in one engine step"),
    ROW_INT("engine", "seed", "0", 0, INT64_MAX,
            "Random seed for sampling, used by requests that do not set their own"),
    ROW_ENUM("engine", "warmup", "auto", config_warmup,
             "Run a few dummy requests at start-up (prefills of several lengths, a sampled "
             "decode, an image on vision-language models) so that the first real request does "
             "not pay for kernel loading and GEMM algorithm choice: auto = on for GPUs, off on "
             "the CPU backend; on; off"),
    ROW_INT("engine", "guide_precompute_ms", "200", 0, 60000,
            "Constrained decoding: milliseconds a background thread may spend classifying a "
            "newly compiled constraint's first contexts while its request's prompt is "
            "prefilled (at most 4096 matcher states; the masks are the same without it); 0 = "
            "off"),

    ROW_ENUM("cache", "block_size", "16", config_block_sizes, "Tokens per KV-cache block"),
    ROW_ENUM("cache", "dtype", "auto", config_kv_dtypes,
             "Storage of the KV cache: auto = the model's dtype; fp8_e4m3 = FP8 codes with a "
             "scale per layer for K and for V (the checkpoint's k_scale / v_scale, else 1.0): "
             "twice the tokens of bf16 in the same memory, a small error (docs/engine.md)"),
    ROW_FLOAT("cache", "gpu_memory_utilization", "0.9", 0.01, 1.0,
              "Fraction of device memory Kiln may use for weights, activations and KV cache"),
    ROW_INT("cache", "num_blocks", "0", 0, 1000000000,
            "Number of KV-cache blocks; 0 = as many as gpu_memory_utilization leaves room for"),
    ROW_BOOL("cache", "enable_prefix_caching", "true",
             "Reuse the KV-cache blocks of a prompt prefix that an earlier request computed"),

    ROW_BOOL("scheduler", "enable_chunked_prefill", "true",
             "Split long prompts into chunks that are scheduled alongside decode steps"),
    ROW_ENUM("scheduler", "policy", "fcfs", config_policies,
             "Admission order: fcfs = first come first served, priority = by request priority"),

    ROW_ENUM("speculative", "method", "off", config_spec_methods,
             "Speculative decoding: off, or ngram = propose the tokens that "
             "followed the latest earlier match of the sequence's last tokens (prompt lookup), "
             "draft = a smaller model with the same tokenizer (draft_model) proposes them "
             "greedily; the output is the same as without it (docs/engine.md)"),
    ROW_INT("speculative", "num_speculative_tokens", "4", 1, 32,
            "Most tokens proposed per sequence and step; the model verifies them and the next "
            "token in one forward"),
    ROW_INT("speculative", "ngram_min", "2", 1, 64,
            "Shortest suffix of the sequence that a proposal must match earlier in it"),
    ROW_INT("speculative", "ngram_max", "4", 1, 64,
            "Longest suffix tried first (at least ngram_min)"),
    ROW_STRING("speculative", "draft_model", "",
               "method = draft: the draft model (a folder, a .gguf file or a Hub id), with the "
               "target's vocabulary; loaded on the same device, with its own KV pool"),
    ROW_FLOAT("speculative", "draft_kv_fraction", "0", 0, 0.9,
              "method = draft: the share of the KV memory budget given to the draft's pool; "
              "0 = as many tokens as the target's pool holds"),
    ROW_INT("speculative", "disable_by_batch_size", "8", 1, 65536,
            "Speculation is off in a step where more sequences than this are running (a large "
            "batch already keeps the device busy: proposals would cost more than they save)"),

    ROW_CHECKED("backend", "name", "auto", config_check_backend, "auto, cuda, rocm, cpu, or a path",
                "Compute backend: auto, cuda, rocm, cpu, or a path to a libkiln-backend-*.so"),
    ROW_STRING("backend", "path", "",
               "Extra backend plugin directories (colon-separated), searched after "
               "$KILN_BACKEND_PATH"),
    ROW_INT("backend", "device", "0", 0, 1023, "Index of the device the backend runs on"),
    ROW_INT("backend", "threads", "0", 0, 4096, "CPU backend threads; 0 = all cores"),

    ROW_CHECKED("server", "host", "127.0.0.1", config_check_host, "an address",
                "Address the HTTP server listens on (0.0.0.0 = all interfaces)"),
    ROW_INT("server", "port", "8000", 0, 65535,
            "TCP port the HTTP server listens on; 0 = any free port (printed at start-up)"),
    ROW_STRING("server", "served_model_name", "",
               "The model's name in the API (the 'model' field); empty = the model "
               "directory's name"),
    ROW_STRING("server", "api_key", "",
               "If set, requests must send 'Authorization: Bearer <api_key>'; empty = no check"),
    ROW_INT("server", "max_queued_requests", "1024", 0, 1000000,
            "Most requests waiting to be scheduled; requests beyond it are rejected"),
    ROW_FLOAT("server", "shutdown_timeout", "30", 0, 3600,
              "Seconds running requests get to finish on shutdown before they are aborted"),
    ROW_FLOAT("server", "request_timeout", "600", 0, 86400,
              "Seconds after which a request is aborted; 0 = no limit"),
    ROW_INT("server", "max_body_bytes", "33554432", 1024, 1073741824,
            "Largest HTTP request body accepted, in bytes"),
    ROW_INT("server", "max_image_bytes", "20971520", 1024, 1073741824,
            "Largest image accepted in a request (a data URL's decoded bytes, or a fetched URL's "
            "body), in bytes"),
    ROW_BOOL("server", "allow_remote_images", "false",
             "Fetch http:// and https:// image URLs in chat messages; off = only data: URLs"),
    ROW_FLOAT("server", "image_fetch_timeout", "10", 0.1, 600,
              "Seconds a remote image fetch may take (allow_remote_images)"),
    ROW_ENUM("server", "tool_parser", "auto", config_tool_parsers,
             "Tool-call format of chat replies: auto = the chat template's (hermes, llama3_json "
             "or mistral); none = tool calls are not parsed"),

    ROW_INT("parallel", "tensor_parallel_size", "1", 1, 64,
            "Ranks a model is split over by tensor parallelism (heads and MLP columns; "
            "docs/parallel.md); 1 = none. The ranks are threads of one process: on GPUs devices "
            "[backend] device .. device + N - 1, on the cpu backend all on its one device. Llama "
            "family, float safetensors; N must divide the attention heads"),

    ROW_BOOL("graph", "enabled", "true",
             "Capture decode steps as device graphs (e.g. CUDA graphs) and replay them"),
    ROW_INT_LIST("graph", "capture_sizes",
                 "1,2,4,8,16,24,32,40,48,56,64,72,80,88,96,104,112,120,128,136,144,152,160,168,"
                 "176,184,192,200,208,216,224,232,240,248,256",
                 1, 4096, "Decode batch sizes to capture a graph for, comma-separated"),
    ROW_FLOAT("graph", "capture_budget_s", "60", 0, 3600,
              "Time limit for capturing graphs at start-up, in seconds"),
    ROW_BOOL("graph", "multi_token", "true",
             "With speculative decoding, also capture graphs of num_speculative_tokens + 1 "
             "rows per sequence (the verification) and of the draft model's two-token catch-up, "
             "for up to disable_by_batch_size sequences; false runs those eagerly"),

    ROW_ENUM("log", "level", "warn", config_log_levels,
             "Least severe messages that are logged: error, warn, info or debug (kiln serve "
             "raises warn to info, so that it logs one line per request)"),
    ROW_ENUM("log", "format", "text", config_log_formats,
             "Log line format: text, or json (one object per line)"),
};

#define CONFIG_NUM_ROWS (sizeof(config_rows) / sizeof(config_rows[0]))
#define CONFIG_PLUGIN_PREFIX "plugin."
#define CONFIG_PLUGIN_PREFIX_LEN (sizeof(CONFIG_PLUGIN_PREFIX) - 1)

/* ---- the config object ---------------------------------------------------------------------- */

typedef struct config_value {
  char *raw;     /* the value as given (owned) */
  char *origin;  /* "default", "<file>:<line>", "--set" (owned) */
  int64_t i;     /* INT; ENUM whose choices are all integers (has_int) */
  double f;      /* FLOAT */
  bool b;        /* BOOL */
  bool has_int;  /* ENUM: i holds the choice as an integer */
  size_t choice; /* ENUM: index into the row's choices */
  int64_t *list; /* INT_LIST: [list_len] (owned) */
  size_t list_len;
} config_value_t;

/* A key of a [plugin.<name>] section: stored as given, validated by the plugin. */
typedef struct config_extra {
  char *section;
  char *key;
  char *raw;
  char *origin;
} config_extra_t;

struct kiln_config {
  config_value_t values[CONFIG_NUM_ROWS]; /* by row of config_rows[] */
  config_extra_t *extras;                 /* [n_extras], in the order first set */
  size_t n_extras;
  size_t cap_extras;
};

/* Aborts on a programmer bug (in release builds too: a wrong key would read out of bounds). */
static _Noreturn void config_die(const char *func, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static _Noreturn void config_die(const char *func, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "kiln: %s: ", func);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  abort();
}

#define CONFIG_CHECK(cond, ...)                     \
  do {                                              \
    if (!(cond)) config_die(__func__, __VA_ARGS__); \
  } while (0)

static kiln_status_t config_oom(void) {
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory in the config");
}

static void config_value_clear(config_value_t *v) {
  free(v->raw);
  free(v->origin);
  free(v->list);
  memset(v, 0, sizeof(*v));
}

static void config_extra_clear(config_extra_t *e) {
  free(e->section);
  free(e->key);
  free(e->raw);
  free(e->origin);
  memset(e, 0, sizeof(*e));
}

/* Index of section.key in config_rows[], or -1. */
static int config_find_row(const char *section, const char *key) {
  for (size_t r = 0; r < CONFIG_NUM_ROWS; r++)
    if (strcmp(config_rows[r].section, section) == 0 && strcmp(config_rows[r].key, key) == 0)
      return (int)r;
  return -1;
}

static bool config_is_section(const char *section) {
  for (size_t s = 0; config_sections[s]; s++)
    if (strcmp(config_sections[s], section) == 0) return true;
  return false;
}

static bool config_is_plugin_section(const char *section) {
  return strncmp(section, CONFIG_PLUGIN_PREFIX, CONFIG_PLUGIN_PREFIX_LEN) == 0;
}

/* Index of the plugin key section.key in cfg->extras, or -1. */
static long config_find_extra(const kiln_config_t *cfg, const char *section, const char *key) {
  for (size_t e = 0; e < cfg->n_extras; e++)
    if (strcmp(cfg->extras[e].section, section) == 0 && strcmp(cfg->extras[e].key, key) == 0)
      return (long)e;
  return -1;
}

/* ---- suggestions for unknown names ---------------------------------------------------------- */

/* Case-insensitive Levenshtein distance; SIZE_MAX for names too long to bother with. */
static size_t config_edit_distance(const char *a, const char *b) {
  enum { MAX_LEN = 63 };
  size_t la = strlen(a), lb = strlen(b);
  if (la > MAX_LEN || lb > MAX_LEN) return SIZE_MAX;
  size_t prev[MAX_LEN + 1], cur[MAX_LEN + 1];
  for (size_t j = 0; j <= lb; j++) prev[j] = j;
  for (size_t i = 1; i <= la; i++) {
    cur[0] = i;
    for (size_t j = 1; j <= lb; j++) {
      size_t cost = tolower((unsigned char)a[i - 1]) == tolower((unsigned char)b[j - 1]) ? 0 : 1;
      size_t best = prev[j - 1] + cost;
      if (prev[j] + 1 < best) best = prev[j] + 1;
      if (cur[j - 1] + 1 < best) best = cur[j - 1] + 1;
      cur[j] = best;
    }
    memcpy(prev, cur, (lb + 1) * sizeof(prev[0]));
  }
  return prev[lb];
}

/* The closest of names[0..n) to name within edit distance 2, or NULL. */
static const char *config_closest(const char *name, const char *const *names, size_t n) {
  const char *best = NULL;
  size_t best_d = 3;
  for (size_t i = 0; i < n; i++) {
    size_t d = config_edit_distance(name, names[i]);
    if (d < best_d) {
      best = names[i];
      best_d = d;
    }
  }
  return best;
}

/* Writes "a, b, c" for a NULL-terminated list into buf. */
static void config_join(const char *const *names, const char *sep, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (size_t i = 0; names[i] && used < size; i++) {
    int n = snprintf(buf + used, size - used, "%s%s", i ? sep : "", names[i]);
    if (n < 0) break;
    used += (size_t)n;
  }
}

static kiln_status_t config_unknown_section(const char *section, const char *key) {
  const char *hint = config_closest(section, config_sections,
                                    sizeof(config_sections) / sizeof(config_sections[0]) - 1);
  char valid[256];
  config_join(config_sections, ", ", valid, sizeof(valid));
  if (section[0] == '\0')
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "key '%s' comes before any [section] header; valid sections: %s, "
                            "plugin.<name>",
                            key, valid);
  return kiln_status_make(
      KILN_ERR_INVALID_ARGUMENT, "unknown section [%s]%s%s%s; valid sections: %s, plugin.<name>",
      section, hint ? " (did you mean [" : "", hint ? hint : "", hint ? "]?)" : "", valid);
}

static kiln_status_t config_unknown_key(const char *section, const char *key) {
  const char *names[CONFIG_NUM_ROWS + 1];
  size_t n = 0;
  const char *elsewhere = NULL;
  for (size_t r = 0; r < CONFIG_NUM_ROWS; r++) {
    if (strcmp(config_rows[r].section, section) == 0)
      names[n++] = config_rows[r].key;
    else if (!elsewhere && strcmp(config_rows[r].key, key) == 0)
      elsewhere = config_rows[r].section;
  }
  names[n] = NULL;
  char valid[1024];
  config_join(names, ", ", valid, sizeof(valid));
  if (elsewhere)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "unknown key '%s' in [%s] (it belongs in [%s]); valid keys: %s", key,
                            section, elsewhere, valid);
  const char *hint = config_closest(key, names, n);
  return kiln_status_make(
      KILN_ERR_INVALID_ARGUMENT, "unknown key '%s' in [%s]%s%s%s; valid keys: %s", key, section,
      hint ? " (did you mean '" : "", hint ? hint : "", hint ? "'?)" : "", valid);
}

/* ---- parsing values ------------------------------------------------------------------------- */

/* A hint for values that hold a '#', which inih does not treat as an inline comment. */
static const char *config_hash_hint(const char *s) {
  return strchr(s, '#') ? " (only ';' after a space starts an inline comment, not '#')" : "";
}

static kiln_status_t config_parse_int(const char *s, int64_t lo, int64_t hi, int64_t *out) {
  const char *digits = (*s == '+' || *s == '-') ? s + 1 : s;
  if (*s == '\0')
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "empty value; expected an integer in [%" PRId64 ", %" PRId64 "]", lo,
                            hi);
  if (!isdigit((unsigned char)*digits))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "'%s' is not an integer%s", s,
                            config_hash_hint(s));
  errno = 0;
  char *end = NULL;
  long long v = strtoll(s, &end, 10);
  if (*end != '\0')
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "'%s' is not an integer (trailing '%s' after the number)%s", s, end,
                            config_hash_hint(s));
  if (errno == ERANGE)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "'%s' overflows a 64-bit integer; expected [%" PRId64 ", %" PRId64 "]",
                            s, lo, hi);
  if (v < lo || v > hi)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s is out of range [%" PRId64 ", %" PRId64 "]", s, lo, hi);
  *out = (int64_t)v;
  return NULL;
}

static kiln_status_t config_parse_float(const char *s, double lo, double hi, double *out) {
  if (*s == '\0')
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "empty value; expected a number in [%g, %g]",
                            lo, hi);
  char *end = (char *)s;
  double v = isspace((unsigned char)*s) ? 0.0 : strtod(s, &end); /* strtod skips spaces */
  if (end == s)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "'%s' is not a number%s", s,
                            config_hash_hint(s));
  if (*end != '\0')
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "'%s' is not a number (trailing '%s' after the number)%s", s, end,
                            config_hash_hint(s));
  if (!isfinite(v))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "'%s' is not a finite number; expected [%g, %g]", s, lo, hi);
  if (v < lo || v > hi)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s is out of range [%g, %g]", s, lo, hi);
  *out = v;
  return NULL;
}

static kiln_status_t config_parse_bool(const char *s, bool *out) {
  static const char *const yes[] = {"true", "yes", "on", "1"};
  static const char *const no[] = {"false", "no", "off", "0"};
  for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
    if (strcasecmp(s, yes[i]) == 0) {
      *out = true;
      return NULL;
    }
    if (strcasecmp(s, no[i]) == 0) {
      *out = false;
      return NULL;
    }
  }
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "'%s' is not a boolean; use true/false, yes/no, on/off or 1/0%s", s,
                          config_hash_hint(s));
}

static kiln_status_t config_parse_enum(const char *const *choices, const char *s, size_t *out) {
  for (size_t i = 0; choices[i]; i++) {
    if (strcasecmp(s, choices[i]) == 0) {
      *out = i;
      return NULL;
    }
  }
  char allowed[256];
  config_join(choices, ", ", allowed, sizeof(allowed));
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "'%s' is not allowed; use one of: %s%s", s,
                          allowed, config_hash_hint(s));
}

/* Parses "1, 2,3" into a new array. One cleanup path: the element copy and, on error, the
 * array. */
static kiln_status_t config_parse_int_list(const char *s, int64_t lo, int64_t hi,
                                           int64_t **out_list, size_t *out_len) {
  kiln_status_t st = NULL;
  int64_t *list = NULL;
  char *elem = NULL;
  size_t n = 1;
  *out_list = NULL;
  *out_len = 0;
  if (*s == '\0') {
    st = kiln_status_make(
        KILN_ERR_INVALID_ARGUMENT,
        "empty list; expected comma-separated integers in [%" PRId64 ", %" PRId64 "]", lo, hi);
    goto done;
  }
  for (const char *p = s; *p; p++) n += *p == ',';
  list = malloc(n * sizeof(*list));
  elem = malloc(strlen(s) + 1);
  if (!list || !elem) {
    st = config_oom();
    goto done;
  }
  const char *p = s;
  for (size_t i = 0; i < n; i++) {
    const char *comma = strchr(p, ',');
    const char *stop = comma ? comma : p + strlen(p);
    while (p < stop && (*p == ' ' || *p == '\t')) p++;
    while (stop > p && (stop[-1] == ' ' || stop[-1] == '\t')) stop--;
    memcpy(elem, p, (size_t)(stop - p));
    elem[stop - p] = '\0';
    if (elem[0] == '\0') {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "element %zu of '%s' is empty", i + 1, s);
      goto done;
    }
    st = config_parse_int(elem, lo, hi, &list[i]);
    if (st) {
      st = kiln_status_annotate(st, "element %zu of '%s'", i + 1, s);
      goto done;
    }
    p = comma ? comma + 1 : stop;
  }
  *out_list = list;
  *out_len = n;
  list = NULL;
done:
  free(list);
  free(elem);
  return st;
}

static bool config_choices_are_ints(const char *const *choices) {
  for (size_t i = 0; choices[i]; i++) {
    const char *p = choices[i];
    if (!*p) return false;
    for (; *p; p++)
      if (!isdigit((unsigned char)*p)) return false;
  }
  return true;
}

/* Parses value for row into *v (empty on entry; on error it holds nothing). The message says
 * what is wrong with the value, without naming the key. */
static kiln_status_t config_parse(const config_row_t *row, const char *value, config_value_t *v) {
  kiln_status_t st = NULL;
  const char *why = NULL;
  switch (row->type) {
    case CONFIG_STRING:
      why = row->check ? row->check(value) : NULL;
      if (why) st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "'%s' %s", value, why);
      break;
    case CONFIG_INT: st = config_parse_int(value, row->imin, row->imax, &v->i); break;
    case CONFIG_FLOAT: st = config_parse_float(value, row->fmin, row->fmax, &v->f); break;
    case CONFIG_BOOL: st = config_parse_bool(value, &v->b); break;
    case CONFIG_ENUM:
      st = config_parse_enum(row->choices, value, &v->choice);
      if (!st && config_choices_are_ints(row->choices)) {
        v->has_int = true;
        v->i = strtoll(row->choices[v->choice], NULL, 10);
      }
      break;
    case CONFIG_INT_LIST:
      st = config_parse_int_list(value, row->imin, row->imax, &v->list, &v->list_len);
      break;
  }
  return st;
}

/* ---- storing values ------------------------------------------------------------------------- */

/* Why value cannot be written back into an INI file as `key = value`, or NULL if it can. */
static kiln_status_t config_check_writable(const char *key, const char *value) {
  size_t len = strlen(value);
  if (strpbrk(value, "\r\n"))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "the value contains a line break");
  if (len && (isspace((unsigned char)value[0]) || isspace((unsigned char)value[len - 1])))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "the value '%s' starts or ends with whitespace, which an INI file "
                            "cannot hold",
                            value);
  for (size_t i = 1; i < len; i++)
    if (value[i] == ';' && isspace((unsigned char)value[i - 1]))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "the value '%s' contains ';' after whitespace, which an INI file "
                              "reads as the start of a comment",
                              value);
  size_t line = strlen(key) + 3 + len;
  if (line > KILN_CONFIG_MAX_LINE)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "the value is too long: '%s = ...' is %zu characters, and a config "
                            "line holds at most %d",
                            key, line, KILN_CONFIG_MAX_LINE);
  return NULL;
}

/* Plugin names and keys: letters, digits, '_', '-' (and '.' inside plugin names). */
static bool config_is_name(const char *s, bool allow_dot) {
  if (!*s) return false;
  for (; *s; s++)
    if (!isalnum((unsigned char)*s) && *s != '_' && *s != '-' && !(allow_dot && *s == '.'))
      return false;
  return true;
}

static kiln_status_t config_store_extra(kiln_config_t *cfg, const char *section, const char *key,
                                        const char *value, const char *origin, bool name_key) {
  kiln_status_t st = NULL;
  const char *plugin = section + CONFIG_PLUGIN_PREFIX_LEN;
  config_extra_t e = {0};
  if (!config_is_name(plugin, true) || plugin[strlen(plugin) - 1] == '.') {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "bad plugin section [%s]: the name after 'plugin.' must be letters, "
                          "digits, '_', '-' or '.'",
                          section);
    goto done;
  }
  if (strlen(section) > KILN_CONFIG_MAX_SECTION) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "section name [%s] is too long (at most %d characters)", section,
                          KILN_CONFIG_MAX_SECTION);
    goto done;
  }
  if (!config_is_name(key, false)) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "bad key name '%s' in [%s]: use letters, digits, '_' and '-'", key,
                          section);
    goto done;
  }
  st = config_check_writable(key, value);
  if (st) {
    if (name_key) st = kiln_status_annotate(st, "%s.%s", section, key);
    goto done;
  }
  long idx = config_find_extra(cfg, section, key);
  e.raw = strdup(value);
  e.origin = strdup(origin);
  if (!e.raw || !e.origin) {
    st = config_oom();
    goto done;
  }
  if (idx >= 0) {
    config_extra_t *old = &cfg->extras[idx];
    free(old->raw);
    free(old->origin);
    old->raw = e.raw;
    old->origin = e.origin;
    e.raw = e.origin = NULL;
    goto done;
  }
  e.section = strdup(section);
  e.key = strdup(key);
  if (!e.section || !e.key) {
    st = config_oom();
    goto done;
  }
  if (cfg->n_extras == cfg->cap_extras) {
    size_t cap = cfg->cap_extras ? cfg->cap_extras * 2 : 8;
    config_extra_t *grown = realloc(cfg->extras, cap * sizeof(*grown));
    if (!grown) {
      st = config_oom();
      goto done;
    }
    cfg->extras = grown;
    cfg->cap_extras = cap;
  }
  cfg->extras[cfg->n_extras++] = e;
  memset(&e, 0, sizeof(e));
done:
  config_extra_clear(&e);
  return st;
}

/* Validates and stores one value. Messages name the key unless name_key is false (--set
 * messages already start with it). */
static kiln_status_t config_store(kiln_config_t *cfg, const char *section, const char *key,
                                  const char *value, const char *origin, bool name_key) {
  kiln_status_t st = NULL;
  config_value_t v = {0};
  int r = config_find_row(section, key);
  if (r < 0 && config_is_plugin_section(section)) {
    st = config_store_extra(cfg, section, key, value, origin, name_key);
    goto done;
  }
  if (r < 0) {
    st = config_is_section(section) ? config_unknown_key(section, key)
                                    : config_unknown_section(section, key);
    goto done;
  }
  st = config_parse(&config_rows[r], value, &v);
  if (!st) st = config_check_writable(key, value);
  if (st) {
    if (name_key) st = kiln_status_annotate(st, "%s.%s", section, key);
    goto done;
  }
  v.raw = strdup(value);
  v.origin = strdup(origin);
  if (!v.raw || !v.origin) {
    st = config_oom();
    goto done;
  }
  config_value_clear(&cfg->values[r]);
  cfg->values[r] = v;
  memset(&v, 0, sizeof(v));
done:
  config_value_clear(&v);
  return st;
}

kiln_status_t kiln_config_set_value(kiln_config_t *cfg, const char *section, const char *key,
                                    const char *value, const char *origin) {
  CONFIG_CHECK(cfg && section && key && value, "NULL argument");
  if (!origin) origin = "api";
  bool is_set = strcmp(origin, "--set") == 0;
  kiln_status_t st = config_store(cfg, section, key, value, origin, !is_set);
  if (st && is_set) return kiln_status_annotate(st, "--set %s.%s", section, key);
  return kiln_status_annotate(st, "%s", origin);
}

/* ---- create, free, copy --------------------------------------------------------------------- */

void kiln_config_free(kiln_config_t *cfg) {
  if (!cfg) return;
  for (size_t r = 0; r < CONFIG_NUM_ROWS; r++) config_value_clear(&cfg->values[r]);
  for (size_t e = 0; e < cfg->n_extras; e++) config_extra_clear(&cfg->extras[e]);
  free(cfg->extras);
  free(cfg);
}

kiln_status_t kiln_config_create(kiln_config_t **out_cfg) {
  CONFIG_CHECK(out_cfg, "NULL out_cfg");
  kiln_status_t st = NULL;
  *out_cfg = NULL;
  kiln_config_t *cfg = calloc(1, sizeof(*cfg));
  if (!cfg) {
    st = config_oom();
    goto done;
  }
  for (size_t r = 0; r < CONFIG_NUM_ROWS && !st; r++) {
    const config_row_t *row = &config_rows[r];
    st = config_store(cfg, row->section, row->key, row->def, "default", true);
    if (st && kiln_status_code(st) != KILN_ERR_OUT_OF_MEMORY) {
      kiln_status_t bug = kiln_status_make(KILN_ERR_INTERNAL, "config table: bad default: %s",
                                           kiln_status_message(st));
      kiln_status_free(st);
      st = bug;
    }
  }
  if (st) goto done;
  *out_cfg = cfg;
  cfg = NULL;
done:
  kiln_config_free(cfg);
  return st;
}

/* Deep copy, for transactional loading. */
static kiln_status_t config_clone(const kiln_config_t *src, kiln_config_t **out_cfg) {
  kiln_status_t st = NULL;
  *out_cfg = NULL;
  kiln_config_t *cfg = calloc(1, sizeof(*cfg));
  if (!cfg) goto oom;
  for (size_t r = 0; r < CONFIG_NUM_ROWS; r++) {
    const config_value_t *from = &src->values[r];
    config_value_t *to = &cfg->values[r];
    *to = *from;
    to->raw = strdup(from->raw);
    to->origin = strdup(from->origin);
    to->list = NULL;
    if (from->list_len) {
      to->list = malloc(from->list_len * sizeof(*to->list));
      if (to->list) memcpy(to->list, from->list, from->list_len * sizeof(*to->list));
    }
    if (!to->raw || !to->origin || (from->list_len && !to->list)) goto oom;
  }
  if (src->n_extras) {
    cfg->extras = calloc(src->n_extras, sizeof(*cfg->extras));
    if (!cfg->extras) goto oom;
    cfg->cap_extras = src->n_extras;
  }
  for (size_t e = 0; e < src->n_extras; e++) {
    const config_extra_t *from = &src->extras[e];
    config_extra_t *to = &cfg->extras[e];
    cfg->n_extras++;
    to->section = strdup(from->section);
    to->key = strdup(from->key);
    to->raw = strdup(from->raw);
    to->origin = strdup(from->origin);
    if (!to->section || !to->key || !to->raw || !to->origin) goto oom;
  }
  *out_cfg = cfg;
  return NULL;
oom:
  st = config_oom();
  kiln_config_free(cfg);
  return st;
}

/* ---- loading INI text ----------------------------------------------------------------------- */

/* State of one load: inih calls config_read_line() for each line and config_handle() for each
 * key, so the reader's line count is the line of the key being handled. */
typedef struct config_load {
  kiln_config_t *cfg;    /* the working copy; replaces the caller's on success */
  const char *name;      /* file name for messages and origins */
  const char *pos, *end; /* unread text */
  const char *line;      /* the line inih is parsing (in the text, not terminated) */
  int lineno;
  kiln_status_t err; /* the first error; reading stops there */
  int err_line;
  int row_line[CONFIG_NUM_ROWS]; /* line where each table key was set in this load; 0 = not */
  int *extra_line;               /* same for cfg->extras, by index; [cap_extra_line] */
  size_t cap_extra_line;
  char prev_section[64]; /* section and key of the previous key line, to recognize */
  char prev_key[KILN_CONFIG_MAX_LINE + 1]; /* inih's continuation lines */
  int prev_line;
} config_load_t;

/* inih reports keys only, so a section header is checked as its line is read: an unknown
 * [section] with no keys under it (a typo) is an error too. */
static void config_check_header(config_load_t *ld, const char *line) {
  while (*line == ' ' || *line == '\t') line++;
  if (*line != '[') return;
  const char *close = strchr(line, ']');
  if (!close) return; /* inih reports the syntax error */
  char section[KILN_CONFIG_MAX_LINE + 1];
  const char *b = line + 1, *e = close;
  while (b < e && (*b == ' ' || *b == '\t')) b++;
  while (e > b && (e[-1] == ' ' || e[-1] == '\t')) e--;
  memcpy(section, b, (size_t)(e - b));
  section[e - b] = '\0';
  if (config_is_section(section) || config_is_plugin_section(section)) return;
  ld->err = kiln_status_annotate(config_unknown_section(section, ""), "%s:%d", ld->name,
                                 ld->lineno);
  ld->err_line = ld->lineno;
}

/* An ini_reader: hands inih one line at a time, counting lines and refusing lines that do not
 * fit inih's buffer (inih would otherwise split them silently). */
static char *config_read_line(char *buf, int size, void *stream) {
  config_load_t *ld = stream;
  size_t left = (size_t)(ld->end - ld->pos);
  if (ld->err || left == 0) return NULL;
  const char *nl = memchr(ld->pos, '\n', left);
  size_t len = nl ? (size_t)(nl - ld->pos) : left; /* without the '\n' */
  size_t text_len = len;
  if (text_len > 0 && ld->pos[text_len - 1] == '\r') text_len--;
  ld->lineno++;
  ld->line = ld->pos;
  if (text_len > KILN_CONFIG_MAX_LINE || len + 2 > (size_t)size) {
    ld->err = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                               "%s:%d: line is too long (%zu characters; at most %d)", ld->name,
                               ld->lineno, text_len, KILN_CONFIG_MAX_LINE);
    ld->err_line = ld->lineno;
    return NULL;
  }
  memcpy(buf, ld->pos, len);
  if (nl) buf[len++] = '\n';
  buf[len] = '\0';
  ld->pos = nl ? nl + 1 : ld->end;
  config_check_header(ld, buf);
  return ld->err ? NULL : buf;
}

/* True if inih passed the current line as a continuation of the previous key: an indented line
 * after a key line, handed over with the previous key's name and the whole line as value. */
static bool config_is_continuation(const config_load_t *ld, const char *section, const char *key,
                                   const char *value) {
  if (ld->prev_line == 0 || (ld->line[0] != ' ' && ld->line[0] != '\t')) return false;
  if (strcmp(section, ld->prev_section) != 0 || strcmp(key, ld->prev_key) != 0) return false;
  const char *text = ld->line;
  while (*text == ' ' || *text == '\t') text++;
  return strncmp(text, value, strlen(value)) == 0;
}

/* Records that the key set at ld->lineno was set in this load, for the duplicate check. */
static kiln_status_t config_load_mark(config_load_t *ld, const char *section, const char *key) {
  int r = config_find_row(section, key);
  if (r >= 0) {
    ld->row_line[r] = ld->lineno;
    return NULL;
  }
  long e = config_find_extra(ld->cfg, section, key);
  if (e < 0) return NULL;
  if ((size_t)e >= ld->cap_extra_line) {
    size_t cap = ld->cfg->cap_extras;
    int *grown = realloc(ld->extra_line, cap * sizeof(*grown));
    if (!grown) return config_oom();
    memset(grown + ld->cap_extra_line, 0, (cap - ld->cap_extra_line) * sizeof(*grown));
    ld->extra_line = grown;
    ld->cap_extra_line = cap;
  }
  ld->extra_line[e] = ld->lineno;
  return NULL;
}

/* Line where section.key was already set in this load, or 0. */
static int config_load_seen(const config_load_t *ld, const char *section, const char *key) {
  int r = config_find_row(section, key);
  if (r >= 0) return ld->row_line[r];
  long e = config_find_extra(ld->cfg, section, key);
  return (e >= 0 && (size_t)e < ld->cap_extra_line) ? ld->extra_line[e] : 0;
}

/* The ini_handler: validates and stores one key into the working copy. */
static int config_handle(void *user, const char *section, const char *key, const char *value) {
  config_load_t *ld = user;
  kiln_status_t st = NULL;
  char *origin = NULL;
  int seen = 0;
  if (ld->err) return 0;
  if (config_is_continuation(ld, section, key, value)) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s:%d: this indented line continues %s.%s from line %d; multi-line "
                          "values are not supported (remove the indentation)",
                          ld->name, ld->lineno, section, key, ld->prev_line);
    goto done;
  }
  if (strlen(section) > KILN_CONFIG_MAX_SECTION) {
    /* inih truncates section names to 49 characters, so this one may be cut short. */
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s:%d: section name [%s...] is too long (at most %d characters)",
                          ld->name, ld->lineno, section, KILN_CONFIG_MAX_SECTION);
    goto done;
  }
  snprintf(ld->prev_section, sizeof(ld->prev_section), "%s", section);
  snprintf(ld->prev_key, sizeof(ld->prev_key), "%s", key);
  ld->prev_line = ld->lineno;
  seen = config_load_seen(ld, section, key);
  if (seen) {
    st =
        kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s:%d: %s.%s is given twice (lines %d and %d)",
                         ld->name, ld->lineno, section, key, seen, ld->lineno);
    goto done;
  }
  origin = kiln_strprintf("%s:%d", ld->name, ld->lineno);
  if (!origin) {
    st = config_oom();
    goto done;
  }
  st = kiln_config_set_value(ld->cfg, section, key, value, origin);
  if (!st) st = config_load_mark(ld, section, key);
done:
  free(origin);
  if (st) {
    ld->err = st;
    ld->err_line = ld->lineno;
  }
  return st ? 0 : 1;
}

/* The error for a line inih could not parse: no '=' or ':', or a '[' without ']'. */
static kiln_status_t config_syntax_error(const char *name, const char *text, const char *end,
                                         int lineno) {
  const char *line = text;
  for (int n = 1; n < lineno && line < end; n++) {
    const char *nl = memchr(line, '\n', (size_t)(end - line));
    line = nl ? nl + 1 : end;
  }
  const char *stop = memchr(line, '\n', (size_t)(end - line));
  if (!stop) stop = end;
  while (line < stop && isspace((unsigned char)*line)) line++;
  size_t len = (size_t)(stop - line);
  while (len > 0 && isspace((unsigned char)line[len - 1])) len--;
  enum { SHOWN = 60 };
  const char *more = len > SHOWN ? "..." : "";
  int shown = len > SHOWN ? SHOWN : (int)len;
  if (len > 0 && *line == '[')
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s:%d: syntax error: section header '%.*s%s' has no closing ']'", name,
                            lineno, shown, line, more);
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s:%d: syntax error: '%.*s%s' is neither a [section] header nor a "
                          "key = value line",
                          name, lineno, shown, line, more);
}

/* Loads text[0..len) into a copy of cfg and, if all of it is valid, swaps the copy in. */
static kiln_status_t config_load_text(kiln_config_t *cfg, const char *text, size_t len,
                                      const char *name) {
  kiln_status_t st = NULL;
  config_load_t *ld = calloc(1, sizeof(*ld));
  if (!ld) return config_oom();
  st = config_clone(cfg, &ld->cfg);
  if (st) goto done;
  ld->name = name;
  ld->pos = text;
  ld->end = text + len;
  int rc = ini_parse_stream(config_read_line, ld, config_handle, ld);
  if (rc > 0 && (!ld->err || rc < ld->err_line)) {
    /* A syntax error (inih keeps going after one) before any error of ours. */
    kiln_status_free(ld->err);
    ld->err = config_syntax_error(name, text, text + len, rc);
  } else if (rc < 0 && !ld->err) {
    ld->err = config_oom(); /* -2: inih could not allocate its line buffer */
  }
  st = ld->err;
  if (st) goto done;
  kiln_config_t swap = *cfg;
  *cfg = *ld->cfg;
  *ld->cfg = swap;
done:
  kiln_config_free(ld->cfg);
  free(ld->extra_line);
  free(ld);
  return st;
}

kiln_status_t kiln_config_load_string(kiln_config_t *cfg, const char *text, const char *name) {
  CONFIG_CHECK(cfg && text, "NULL argument");
  return config_load_text(cfg, text, strlen(text), name ? name : "<string>");
}

/* A status for errno e while doing what ("open", "read") to path. */
static kiln_status_t config_file_error(int e, const char *what, const char *path) {
  char msg[128];
  if (strerror_r(e, msg, sizeof(msg)) != 0) snprintf(msg, sizeof(msg), "error %d", e);
  kiln_status_code_t code = (e == ENOENT || e == ENOTDIR) ? KILN_ERR_NOT_FOUND : KILN_ERR_IO;
  return kiln_status_make(code, "cannot %s config file '%s': %s", what, path, msg);
}

kiln_status_t kiln_config_load_file(kiln_config_t *cfg, const char *path) {
  enum { MAX_FILE = 16 << 20 };
  CONFIG_CHECK(cfg && path, "NULL argument");
  kiln_status_t st = NULL;
  char *buf = NULL;
  size_t len = 0, cap = 0;
  FILE *f = fopen(path, "rb");
  if (!f) {
    st = config_file_error(errno, "open", path);
    goto done;
  }
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 4096;
      char *grown = cap > MAX_FILE + 1 ? NULL : realloc(buf, cap);
      if (!grown) {
        st = cap > MAX_FILE + 1
                 ? kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                    "config file '%s' is larger than %d MiB", path, MAX_FILE >> 20)
                 : config_oom();
        goto done;
      }
      buf = grown;
    }
    errno = 0;
    size_t n = fread(buf + len, 1, cap - len, f);
    len += n;
    if (n == 0) break;
  }
  if (ferror(f)) {
    st = config_file_error(errno ? errno : EIO, "read", path);
    goto done;
  }
  const char *nul = memchr(buf, '\0', len);
  if (nul) {
    int line = 1;
    for (const char *p = buf; p < nul; p++) line += *p == '\n';
    st =
        kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s:%d: NUL byte in a config file", path, line);
    goto done;
  }
  st = config_load_text(cfg, buf, len, path);
done:
  if (f) fclose(f);
  free(buf);
  return st;
}

kiln_status_t kiln_config_set(kiln_config_t *cfg, const char *assignment) {
  CONFIG_CHECK(cfg && assignment, "NULL argument");
  kiln_status_t st = NULL;
  char *lhs = NULL;
  const char *eq = strchr(assignment, '=');
  if (!eq) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "--set '%s': expected section.key=value (there is no '=')", assignment);
    goto done;
  }
  lhs = strdup(assignment);
  if (!lhs) {
    st = config_oom();
    goto done;
  }
  /* lhs = "section.key\0value", each part trimmed in place. */
  char *value = lhs + (eq - assignment) + 1;
  lhs[eq - assignment] = '\0';
  char *dot = strrchr(lhs, '.');
  if (!dot) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "--set '%s': no section (expected section.key=value)", assignment);
    goto done;
  }
  *dot = '\0';
  char *parts[3] = {lhs, dot + 1, value};
  for (size_t i = 0; i < 3; i++) {
    char *s = parts[i];
    while (isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
    parts[i] = s;
  }
  if (!parts[0][0]) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "--set '%s': empty section (expected section.key=value)", assignment);
    goto done;
  }
  if (!parts[1][0]) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "--set '%s': empty key (expected section.key=value)", assignment);
    goto done;
  }
  st = kiln_config_set_value(cfg, parts[0], parts[1], parts[2], "--set");
done:
  free(lhs);
  return st;
}

/* ---- getters -------------------------------------------------------------------------------- */

/* The row index of section.key, aborting if it is not in the table or is not of a type in
 * types (a bit mask of 1 << config_type_t). */
static size_t config_get_row(const kiln_config_t *cfg, const char *section, const char *key,
                             unsigned types, const char *func) {
  if (!cfg || !section || !key) config_die(func, "NULL argument");
  int r = config_find_row(section, key);
  if (r < 0) config_die(func, "%s.%s is not a key in the config table", section, key);
  if (!(types & (1u << config_rows[r].type)))
    config_die(func, "%s.%s has another type; use the getter of its type", section, key);
  return (size_t)r;
}

const char *kiln_config_get_string(const kiln_config_t *cfg, const char *section, const char *key) {
  size_t r =
      config_get_row(cfg, section, key, (1u << CONFIG_STRING) | (1u << CONFIG_ENUM), __func__);
  const config_value_t *v = &cfg->values[r];
  return config_rows[r].type == CONFIG_ENUM ? config_rows[r].choices[v->choice] : v->raw;
}

int64_t kiln_config_get_int(const kiln_config_t *cfg, const char *section, const char *key) {
  size_t r = config_get_row(cfg, section, key, (1u << CONFIG_INT) | (1u << CONFIG_ENUM), __func__);
  const config_value_t *v = &cfg->values[r];
  if (config_rows[r].type == CONFIG_ENUM && !v->has_int)
    config_die(__func__, "%s.%s is an enum of words, not integers", section, key);
  return v->i;
}

double kiln_config_get_float(const kiln_config_t *cfg, const char *section, const char *key) {
  return cfg->values[config_get_row(cfg, section, key, 1u << CONFIG_FLOAT, __func__)].f;
}

bool kiln_config_get_bool(const kiln_config_t *cfg, const char *section, const char *key) {
  return cfg->values[config_get_row(cfg, section, key, 1u << CONFIG_BOOL, __func__)].b;
}

size_t kiln_config_get_int_list(const kiln_config_t *cfg, const char *section, const char *key,
                                const int64_t **out_values) {
  CONFIG_CHECK(out_values, "NULL out_values");
  *out_values = NULL;
  size_t r = config_get_row(cfg, section, key, 1u << CONFIG_INT_LIST, __func__);
  *out_values = cfg->values[r].list;
  return cfg->values[r].list_len;
}

const char *kiln_config_get_raw(const kiln_config_t *cfg, const char *section, const char *key) {
  CONFIG_CHECK(cfg && section && key, "NULL argument");
  int r = config_find_row(section, key);
  if (r >= 0) return cfg->values[r].raw;
  long e = config_find_extra(cfg, section, key);
  return e >= 0 ? cfg->extras[e].raw : NULL;
}

const char *kiln_config_section_key(const kiln_config_t *cfg, const char *section, size_t index) {
  CONFIG_CHECK(cfg && section, "NULL argument");
  for (size_t e = 0; e < cfg->n_extras; e++)
    if (strcmp(cfg->extras[e].section, section) == 0 && index-- == 0) return cfg->extras[e].key;
  return NULL;
}

const char *kiln_config_origin(const kiln_config_t *cfg, const char *section, const char *key) {
  CONFIG_CHECK(cfg && section && key, "NULL argument");
  int r = config_find_row(section, key);
  if (r >= 0) return cfg->values[r].origin;
  long e = config_find_extra(cfg, section, key);
  return e >= 0 ? cfg->extras[e].origin : NULL;
}

/* ---- help and writing ----------------------------------------------------------------------- */

static const char *config_type_name(config_type_t type) {
  switch (type) {
    case CONFIG_STRING: return "string";
    case CONFIG_INT: return "int";
    case CONFIG_FLOAT: return "float";
    case CONFIG_BOOL: return "bool";
    case CONFIG_ENUM: return "enum";
    case CONFIG_INT_LIST: return "int list";
  }
  return "?";
}

/* The range or allowed values of a row, for --help-config. */
static void config_describe_range(const config_row_t *row, char *buf, size_t size) {
  buf[0] = '\0';
  switch (row->type) {
    case CONFIG_STRING:
      if (row->allowed) snprintf(buf, size, "%s", row->allowed);
      break;
    case CONFIG_INT: snprintf(buf, size, "[%" PRId64 ", %" PRId64 "]", row->imin, row->imax); break;
    case CONFIG_FLOAT: snprintf(buf, size, "[%g, %g]", row->fmin, row->fmax); break;
    case CONFIG_BOOL: snprintf(buf, size, "true or false"); break;
    case CONFIG_ENUM: config_join(row->choices, " | ", buf, size); break;
    case CONFIG_INT_LIST:
      snprintf(buf, size, "each in [%" PRId64 ", %" PRId64 "]", row->imin, row->imax);
      break;
  }
}

void kiln_config_print_help(FILE *f) {
  enum { DEFAULT_WIDTH = 9 };
  int key_width = 0;
  for (size_t r = 0; r < CONFIG_NUM_ROWS; r++) {
    int n = (int)strlen(config_rows[r].key);
    if (n > key_width) key_width = n;
  }
  fprintf(f,
          "Kiln configuration keys, by INI section. Set them in a config file, or override one\n"
          "with --set section.key=value (later --set options win).\n"
          "Types: int (decimal, 64-bit), float, bool (true/false, yes/no, on/off, 1/0; any case),\n"
          "enum (one of the listed words; any case), int list (comma-separated ints).\n");
  for (size_t s = 0; config_sections[s]; s++) {
    fprintf(f, "\n[%s]\n", config_sections[s]);
    fprintf(f, "  %-*s  %-8s  %-*s  %s\n", key_width, "KEY", "TYPE", DEFAULT_WIDTH, "DEFAULT",
            "RANGE / VALUES");
    for (size_t r = 0; r < CONFIG_NUM_ROWS; r++) {
      const config_row_t *row = &config_rows[r];
      if (strcmp(row->section, config_sections[s]) != 0) continue;
      char range[128];
      char line[512];
      config_describe_range(row, range, sizeof(range));
      const char *def = row->def[0] ? row->def : "\"\"";
      /* A default too long for its column (capture_sizes) goes on a line of its own. */
      bool long_def = strlen(def) > DEFAULT_WIDTH;
      snprintf(line, sizeof(line), "  %-*s  %-8s  %-*s  %s", key_width, row->key,
               config_type_name(row->type), DEFAULT_WIDTH, long_def ? "(below)" : def, range);
      size_t n = strlen(line);
      while (n && line[n - 1] == ' ') line[--n] = '\0';
      fprintf(f, "%s\n      %s\n", line, row->help);
      if (long_def) fprintf(f, "      default: %s\n", def);
    }
  }
  fprintf(f,
          "\n[plugin.<name>]\n"
          "      Any keys (letters, digits, '_', '-'), passed unchecked to the plugin <name>,\n"
          "      which validates them. E.g. [plugin.trace] or --set plugin.trace.level=2\n");
}

bool kiln_config_row_info(size_t index, const char **section, const char **key, const char **type,
                          const char **def, const char **help) {
  if (index >= CONFIG_NUM_ROWS) return false;
  const config_row_t *row = &config_rows[index];
  if (section) *section = row->section;
  if (key) *key = row->key;
  if (type) *type = config_type_name(row->type);
  if (def) *def = row->def;
  if (help) *help = row->help;
  return true;
}

/* Writes a comment line, replacing any control character so that it stays one line. */
static void config_write_comment(FILE *f, const char *prefix, const char *text) {
  fputs(prefix, f);
  for (const char *p = text; *p; p++) fputc(iscntrl((unsigned char)*p) ? '?' : *p, f);
  fputc('\n', f);
}

static void config_write_key(FILE *f, const char *key, const char *raw, const char *origin) {
  if (strcmp(origin, "default") != 0) config_write_comment(f, "; from ", origin);
  /* No space before a value that starts with ';': inih would read " ;" as a comment. */
  if (raw[0] && raw[0] != ';')
    fprintf(f, "%s = %s\n", key, raw);
  else
    fprintf(f, "%s =%s\n", key, raw);
}

void kiln_config_write(const kiln_config_t *cfg, FILE *f) {
  CONFIG_CHECK(cfg && f, "NULL argument");
  fputs("; Kiln configuration: every key with its effective value.\n", f);
  for (size_t s = 0; config_sections[s]; s++) {
    fprintf(f, "\n[%s]\n", config_sections[s]);
    for (size_t r = 0; r < CONFIG_NUM_ROWS; r++)
      if (strcmp(config_rows[r].section, config_sections[s]) == 0)
        config_write_key(f, config_rows[r].key, cfg->values[r].raw, cfg->values[r].origin);
  }
  /* Plugin sections in the order first set, each with all of its keys. */
  for (size_t e = 0; e < cfg->n_extras; e++) {
    const char *section = cfg->extras[e].section;
    bool done = false;
    for (size_t p = 0; p < e && !done; p++) done = strcmp(cfg->extras[p].section, section) == 0;
    if (done) continue;
    fprintf(f, "\n[%s]\n", section);
    for (size_t k = e; k < cfg->n_extras; k++)
      if (strcmp(cfg->extras[k].section, section) == 0)
        config_write_key(f, cfg->extras[k].key, cfg->extras[k].raw, cfg->extras[k].origin);
  }
}

/* ---- paths -------------------------------------------------------------------------------- */

kiln_status_t kiln_config_get_path(const kiln_config_t *cfg, const char *section, const char *key,
                                   char *buf, size_t size) {
  const char *v = kiln_config_get_string(cfg, section, key);
  const char *origin = kiln_config_origin(cfg, section, key);
  buf[0] = '\0';
  if (!v || !v[0]) return NULL;
  size_t dir_len = 0;
  if (v[0] != '/' && origin) {
    /* A file origin is "<path>:<line>": relative values are relative to that file's folder. */
    const char *colon = strrchr(origin, ':');
    bool digits = colon && colon[1];
    for (const char *p = colon ? colon + 1 : ""; *p && digits; p++) digits = *p >= '0' && *p <= '9';
    if (digits) {
      const char *slash = NULL;
      for (const char *p = origin; p < colon; p++)
        if (*p == '/') slash = p;
      dir_len = slash ? (size_t)(slash - origin) + 1 : 0;
    }
  }
  int n = snprintf(buf, size, "%.*s%s", (int)dir_len, origin ? origin : "", v);
  if (n < 0 || (size_t)n >= size)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "[%s] %s: the path is too long", section, key);
  return NULL;
}

#ifndef KILN_DEFAULT_MODEL_DIRS
#define KILN_DEFAULT_MODEL_DIRS ""
#endif

kiln_status_t kiln_config_model_path(const kiln_config_t *cfg, char *buf, size_t size) {
  kiln_status_t st = kiln_config_get_path(cfg, "model", "path", buf, size);
  if (st || buf[0]) return st;
  /* Empty: the embedded default model, from the source tree or the install. */
  const char *env = getenv("KILN_DEFAULT_MODEL");
  const char *dirs = env && env[0] ? env : KILN_DEFAULT_MODEL_DIRS;
  for (const char *p = dirs; *p;) {
    const char *end = strchr(p, ':');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len && len < size) {
      char cfgjson[4200];
      snprintf(cfgjson, sizeof(cfgjson), "%.*s/config.json", (int)len, p);
      FILE *f = fopen(cfgjson, "rb");
      if (f) {
        fclose(f);
        snprintf(buf, size, "%.*s", (int)len, p);
        return NULL;
      }
    }
    p = end ? end + 1 : p + len;
  }
  return kiln_status_make(KILN_ERR_NOT_FOUND,
                          "no model: [model] path is empty and the embedded default model is not "
                          "in %s; set [model] path (a Hugging Face directory or a .gguf file)",
                          dirs[0] ? dirs : "(no default model was built in)");
}
