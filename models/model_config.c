/* model_config.c - a Hugging Face config.json (+ generation_config.json) read into a
 * kiln_model_config_t, with every key Kiln cannot run exactly refused by name.
 *
 * The defaults are those of transformers' LlamaConfig / MistralConfig / Qwen2Config /
 * Qwen3Config, so a key a config.json leaves out means what it means to transformers. Both
 * config generations are read: transformers 4.x writes "rope_theta" + "rope_scaling" and
 * "torch_dtype"; 5.x writes "rope_parameters" (with rope_theta inside) and "dtype". Where the
 * two transformers versions compute a different model from the same file (YaRN's factor, see
 * parse_rope()), Kiln follows 5.x.
 */
#include "models/model_config.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "kiln/hal.h"

/* ---- the architectures ----------------------------------------------------------------- */

static const struct {
  const char *model_type;
  const char *architecture;
  int32_t arch;
} k_archs[] = {
    {"llama", "LlamaForCausalLM", KILN_ARCH_LLAMA},
    {"mistral", "MistralForCausalLM", KILN_ARCH_MISTRAL},
    {"qwen2", "Qwen2ForCausalLM", KILN_ARCH_QWEN2},
    {"qwen3", "Qwen3ForCausalLM", KILN_ARCH_QWEN3},
    {"qwen2_vl", "Qwen2VLForConditionalGeneration", KILN_ARCH_QWEN2_VL},
    {"qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", KILN_ARCH_QWEN2_5_VL},
};
#define N_ARCHS (sizeof(k_archs) / sizeof(k_archs[0]))
#define SUPPORTED_ARCHS                                                                      \
  "llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 " \
  "(Qwen3ForCausalLM), qwen2_vl (Qwen2VLForConditionalGeneration), qwen2_5_vl "              \
  "(Qwen2_5_VLForConditionalGeneration)"
#define SUPPORTED_ROPE "default, linear, dynamic, llama3, yarn"

const char *kiln_arch_name(int32_t arch) {
  for (size_t i = 0; i < N_ARCHS; i++)
    if (k_archs[i].arch == arch) return k_archs[i].architecture;
  return "unknown";
}

/* ---- typed reads, each naming the key on failure ---------------------------------------- */

/* A short rendering of a JSON value for messages: "\"abc\" (string)", "1.5 (number)". */
static void describe(const kiln_json_t *v, char *buf, size_t n) {
  switch (kiln_json_type(v)) {
    case KILN_JSON_NULL: snprintf(buf, n, "null"); break;
    case KILN_JSON_BOOL: snprintf(buf, n, "%s (bool)", kiln_json_bool(v) ? "true" : "false"); break;
    case KILN_JSON_NUMBER: {
      int64_t i;
      if (kiln_json_int64(v, &i))
        snprintf(buf, n, "%lld (number)", (long long)i);
      else
        snprintf(buf, n, "%.17g (number)", kiln_json_number(v));
      break;
    }
    case KILN_JSON_STRING: {
      size_t len = 0;
      const char *s = kiln_json_string(v, &len);
      if (len > 48)
        snprintf(buf, n, "\"%.45s...\" (string)", s);
      else
        snprintf(buf, n, "\"%s\" (string)", s);
      break;
    }
    case KILN_JSON_ARRAY: snprintf(buf, n, "an array of %zu (array)", kiln_json_len(v)); break;
    case KILN_JSON_OBJECT: snprintf(buf, n, "an object (object)"); break;
  }
}

static kiln_status_t bad_value(const char *name, const char *key, const char *want,
                               const kiln_json_t *v) {
  char got[96];
  describe(v, got, sizeof(got));
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s: want %s, got %s", name, key, want,
                          got);
}

/* obj[key], or NULL when the key is absent or null (JSON null means "unset" to transformers for
 * every optional key read through this). */
static const kiln_json_t *opt(const kiln_json_t *obj, const char *key) {
  const kiln_json_t *v = kiln_json_get(obj, key);
  return kiln_json_is(v, KILN_JSON_NULL) ? NULL : v;
}

/* An integer in [lo, hi]. */
static kiln_status_t read_int(const char *name, const char *key, const kiln_json_t *v, int64_t lo,
                              int64_t hi, int64_t *out) {
  int64_t x;
  if (!kiln_json_int64(v, &x) || x < lo || x > hi) {
    char want[96];
    if (lo == 1 && hi == INT64_MAX)
      snprintf(want, sizeof(want), "a positive integer");
    else if (lo == 0 && hi == INT64_MAX)
      snprintf(want, sizeof(want), "an integer >= 0");
    else
      snprintf(want, sizeof(want), "an integer in [%lld, %lld]", (long long)lo, (long long)hi);
    return bad_value(name, key, want, v);
  }
  *out = x;
  return NULL;
}

/* A required positive integer. */
static kiln_status_t req_pos_int(const kiln_json_t *root, const char *name, const char *key,
                                 int64_t *out) {
  const kiln_json_t *v = kiln_json_get(root, key);
  if (!v)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s: missing (want a positive integer)",
                            name, key);
  return read_int(name, key, v, 1, INT64_MAX, out);
}

/* An optional positive integer: *out keeps its default when absent or null. */
static kiln_status_t opt_pos_int(const kiln_json_t *root, const char *name, const char *key,
                                 int64_t *out) {
  const kiln_json_t *v = opt(root, key);
  return v ? read_int(name, key, v, 1, INT64_MAX, out) : NULL;
}

static kiln_status_t read_num(const char *name, const char *key, const kiln_json_t *v,
                              double *out) {
  if (!kiln_json_is(v, KILN_JSON_NUMBER)) return bad_value(name, key, "a number", v);
  *out = kiln_json_number(v);
  return NULL;
}

static kiln_status_t opt_num(const kiln_json_t *obj, const char *name, const char *key,
                             double *out) {
  const kiln_json_t *v = opt(obj, key);
  return v ? read_num(name, key, v, out) : NULL;
}

static kiln_status_t opt_bool(const kiln_json_t *obj, const char *name, const char *key,
                              bool *out) {
  const kiln_json_t *v = opt(obj, key);
  if (!v) return NULL;
  if (!kiln_json_is(v, KILN_JSON_BOOL)) return bad_value(name, key, "true or false", v);
  *out = kiln_json_bool(v);
  return NULL;
}

/* An optional string: *out stays NULL when absent or null. */
static kiln_status_t opt_str(const kiln_json_t *obj, const char *name, const char *key,
                             const char **out) {
  const kiln_json_t *v = opt(obj, key);
  if (!v) return NULL;
  if (!kiln_json_is(v, KILN_JSON_STRING)) return bad_value(name, key, "a string", v);
  *out = kiln_json_string(v, NULL);
  return NULL;
}

/* ---- token ids ------------------------------------------------------------------------- */

/* A token id: a non-negative int32, or null / -1 for none (some early Llama conversions write
 * "pad_token_id": -1). */
static kiln_status_t read_token_id(const char *name, const char *key, const kiln_json_t *v,
                                   int32_t *out) {
  if (kiln_json_is(v, KILN_JSON_NULL)) {
    *out = -1;
    return NULL;
  }
  int64_t x = 0;
  kiln_status_t st = read_int(name, key, v, -1, INT32_MAX, &x);
  if (st) return st;
  *out = (int32_t)x;
  return NULL;
}

/* Appends id to ids[0..*n) unless present; -1 is skipped. */
static kiln_status_t add_eos(const char *name, const char *key, int32_t *ids, int32_t *n,
                             int32_t id) {
  if (id < 0) return NULL;
  for (int32_t i = 0; i < *n; i++)
    if (ids[i] == id) return NULL;
  if (*n >= KILN_MODEL_MAX_EOS)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s: more than %d distinct end-of-sequence ids", name, key,
                            KILN_MODEL_MAX_EOS);
  ids[(*n)++] = id;
  return NULL;
}

/* eos_token_id: an id, a list of ids, or null. */
static kiln_status_t read_eos(const char *name, const kiln_json_t *v, int32_t *ids, int32_t *n) {
  kiln_status_t st = NULL;
  if (kiln_json_is(v, KILN_JSON_ARRAY)) {
    for (size_t i = 0; i < kiln_json_len(v) && !st; i++) {
      char key[48];
      snprintf(key, sizeof(key), "eos_token_id[%zu]", i);
      int32_t id;
      st = read_token_id(name, key, kiln_json_at(v, i), &id);
      if (!st) st = add_eos(name, "eos_token_id", ids, n, id);
    }
    return st;
  }
  if (kiln_json_is(v, KILN_JSON_NULL)) return NULL;
  if (!kiln_json_is(v, KILN_JSON_NUMBER))
    return bad_value(name, "eos_token_id", "an integer, a list of integers or null", v);
  int32_t id;
  st = read_token_id(name, "eos_token_id", v, &id);
  if (!st) st = add_eos(name, "eos_token_id", ids, n, id);
  return st;
}

/* ---- pieces of config.json ------------------------------------------------------------- */

static int find_arch_by_type(const char *model_type) {
  for (size_t i = 0; i < N_ARCHS; i++)
    if (strcmp(k_archs[i].model_type, model_type) == 0) return (int)i;
  return -1;
}

static int find_arch_by_name(const char *architecture) {
  for (size_t i = 0; i < N_ARCHS; i++)
    if (strcmp(k_archs[i].architecture, architecture) == 0) return (int)i;
  return -1;
}

static bool is_vl(const kiln_model_config_t *c) {
  return c->arch == KILN_ARCH_QWEN2_VL || c->arch == KILN_ARCH_QWEN2_5_VL;
}

/* model_type and architectures[0]: both must name the same supported architecture. */
static kiln_status_t parse_arch(const kiln_json_t *root, const char *name, kiln_model_config_t *c) {
  const char *model_type = NULL, *architecture = NULL;
  kiln_status_t st = opt_str(root, name, "model_type", &model_type);
  if (st) return st;
  const kiln_json_t *archs = opt(root, "architectures");
  if (archs) {
    if (!kiln_json_is(archs, KILN_JSON_ARRAY))
      return bad_value(name, "architectures", "a list of strings", archs);
    if (kiln_json_len(archs) > 0) {
      const kiln_json_t *a0 = kiln_json_at(archs, 0);
      if (!kiln_json_is(a0, KILN_JSON_STRING))
        return bad_value(name, "architectures[0]", "a string", a0);
      architecture = kiln_json_string(a0, NULL);
    }
  }
  int k;
  if (model_type) {
    k = find_arch_by_type(model_type);
    if (k < 0)
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "%s: model_type: \"%s\" is not supported (supported: %s)", name,
                              model_type, SUPPORTED_ARCHS);
    if (architecture && strcmp(architecture, k_archs[k].architecture) != 0)
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "%s: architectures[0]: \"%s\" is not supported with model_type "
                              "\"%s\" (want \"%s\"; supported: %s)",
                              name, architecture, model_type, k_archs[k].architecture,
                              SUPPORTED_ARCHS);
  } else if (architecture) {
    k = find_arch_by_name(architecture);
    if (k < 0)
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "%s: architectures[0]: \"%s\" is not supported (supported: %s)", name,
                              architecture, SUPPORTED_ARCHS);
  } else {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: model_type: missing (and no architectures list to infer it from)",
                            name);
  }
  c->arch = k_archs[k].arch;
  snprintf(c->model_type, sizeof(c->model_type), "%s", k_archs[k].model_type);
  snprintf(c->architecture, sizeof(c->architecture), "%s", k_archs[k].architecture);
  return NULL;
}

/* A quantization_config key that Kiln does not run: KILN_ERR_UNSUPPORTED naming it. */
static kiln_status_t quant_refuse(const char *name, const char *key, const kiln_json_t *v,
                                  const char *why) {
  char got[96];
  describe(v, got, sizeof(got));
  return kiln_status_make(KILN_ERR_UNSUPPORTED, "%s: quantization_config.%s = %s: %s", name, key,
                          got, why);
}

/* quantization_config.<key> as a string / bool (NULL / unchanged when absent or null). */
static kiln_status_t q_str(const kiln_json_t *q, const char *name, const char *key,
                           const char **out) {
  const kiln_json_t *v = opt(q, key);
  if (!v) return NULL;
  char full[96];
  snprintf(full, sizeof(full), "quantization_config.%s", key);
  if (!kiln_json_is(v, KILN_JSON_STRING)) return bad_value(name, full, "a string", v);
  *out = kiln_json_string(v, NULL);
  return NULL;
}

static kiln_status_t q_bool(const kiln_json_t *q, const char *name, const char *key, bool *out) {
  const kiln_json_t *v = opt(q, key);
  if (!v) return NULL;
  char full[96];
  snprintf(full, sizeof(full), "quantization_config.%s", key);
  if (!kiln_json_is(v, KILN_JSON_BOOL)) return bad_value(name, full, "true or false", v);
  *out = kiln_json_bool(v);
  return NULL;
}

/* ---- FP8 (docs/models.md "FP8") ---------------------------------------------------------- */

/* Appends the names / "re:" patterns of list (a JSON array of strings, or absent) to out's
 * ignore list; a "re:" pattern must compile (PCRE2). key names the list in messages. */
static kiln_status_t fp8_ignore_list(const kiln_json_t *list, const char *name, const char *key,
                                     kiln_quant_config_t *out) {
  if (!list) return NULL;
  if (!kiln_json_is(list, KILN_JSON_ARRAY))
    return bad_value(name, key, "a list of module names", list);
  size_t used = 0;
  for (int32_t i = 0; i < out->n_ignore; i++) used += strlen(out->ignore + used) + 1;
  for (size_t i = 0; i < kiln_json_len(list); i++) {
    const kiln_json_t *v = kiln_json_at(list, i);
    char full[128];
    snprintf(full, sizeof(full), "%s[%zu]", key, i);
    size_t len = 0;
    const char *s = kiln_json_string(v, &len);
    if (!s || len == 0 || strlen(s) != len) return bad_value(name, full, "a module name", v);
    if (used + len + 1 > sizeof(out->ignore))
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "%s: %s: the list is longer than the %zu bytes Kiln keeps", name,
                              key, sizeof(out->ignore));
    if (strncmp(s, "re:", 3) == 0) {
      int err;
      PCRE2_SIZE off;
      pcre2_code *re = pcre2_compile((PCRE2_SPTR)(s + 3), len - 3, PCRE2_UTF, &err, &off, NULL);
      if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(err, msg, sizeof(msg));
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: %s: \"%s\" is not a regular expression (%s at offset %zu)",
                                name, full, s, (const char *)msg, (size_t)off);
      }
      pcre2_code_free(re);
    }
    memcpy(out->ignore + used, s, len + 1);
    used += len + 1;
    out->n_ignore++;
  }
  return NULL;
}

bool kiln_quant_ignored(const kiln_quant_config_t *q, const char *module) {
  const char *e = q->ignore;
  for (int32_t i = 0; i < q->n_ignore; e += strlen(e) + 1, i++) {
    if (strncmp(e, "re:", 3) != 0) {
      if (strcmp(e, module) == 0) return true;
      continue;
    }
    /* As compressed-tensors' re.match: anchored at the start, not necessarily the end. */
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)(e + 3), PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_ANCHORED, &(int){0}, &(PCRE2_SIZE){0}, NULL);
    if (!re) continue; /* checked at parse time */
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    const int rc = md ? pcre2_match(re, (PCRE2_SPTR)module, strlen(module), 0, 0, md, NULL) : -1;
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    if (rc >= 0) return true;
  }
  return false;
}

/* A compressed-tensors "type": "float" quantization args object (weights or
 * input_activations) with num_bits 8 and symmetric true; key names it in messages. */
static kiln_status_t ct_float8_args(const kiln_json_t *a, const char *name, const char *key) {
  char full[128];
  if (!kiln_json_is(a, KILN_JSON_OBJECT)) {
    snprintf(full, sizeof(full), "quantization_config.%s", key);
    return bad_value(name, full, "an object", a);
  }
  const kiln_json_t *v;
  int64_t bits = 8;
  snprintf(full, sizeof(full), "quantization_config.%s.num_bits", key);
  if ((v = opt(a, "num_bits"))) {
    kiln_status_t st = read_int(name, full, v, 1, 64, &bits);
    if (st) return st;
    if (bits != 8)
      return kiln_status_make(KILN_ERR_UNSUPPORTED, "%s: %s = %lld: FP8 has 8 bits", name, full,
                              (long long)bits);
  }
  snprintf(full, sizeof(full), "quantization_config.%s.type", key);
  v = opt(a, "type");
  const char *type = kiln_json_string(v, NULL);
  if (!type || strcmp(type, "float") != 0) {
    char got[96];
    describe(v, got, sizeof(got));
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: %s = %s: only \"float\" (FP8 e4m3) is supported here (integer "
                            "compressed-tensors schemes are not)",
                            name, full, v ? got : "missing");
  }
  snprintf(full, sizeof(full), "quantization_config.%s.symmetric", key);
  if ((v = opt(a, "symmetric")) && (!kiln_json_is(v, KILN_JSON_BOOL) || !kiln_json_bool(v))) {
    char got[96];
    describe(v, got, sizeof(got));
    return kiln_status_make(KILN_ERR_UNSUPPORTED, "%s: %s = %s: asymmetric FP8 is not supported",
                            name, full, got);
  }
  return NULL;
}

/* compressed-tensors: one config group of FP8 weights ("float-quantized"). */
static kiln_status_t parse_ct_fp8(const kiln_json_t *q, const char *name, kiln_quant_config_t *out) {
  kiln_status_t st;
  const char *fmt = NULL;
  if ((st = q_str(q, name, "format", &fmt))) return st;
  if (!fmt || (strcmp(fmt, "float-quantized") != 0 && strcmp(fmt, "naive-quantized") != 0))
    return quant_refuse(name, "format", opt(q, "format"),
                        "only \"float-quantized\" (and \"naive-quantized\" with float weights) "
                        "compressed-tensors checkpoints are supported");
  const kiln_json_t *groups = opt(q, "config_groups");
  if (!kiln_json_is(groups, KILN_JSON_OBJECT) || kiln_json_len(groups) != 1)
    return quant_refuse(name, "config_groups", groups,
                        "want exactly one config group (several schemes in one checkpoint are "
                        "not supported)");
  size_t gl = 0;
  const char *gname = kiln_json_key_at(groups, 0, &gl);
  const kiln_json_t *g = kiln_json_value_at(groups, 0);
  char key[160];
  snprintf(key, sizeof(key), "config_groups.%.*s", (int)gl, gname);
  if (!kiln_json_is(g, KILN_JSON_OBJECT))
    return quant_refuse(name, key, g, "want an object");
  /* targets: ["Linear"] */
  const kiln_json_t *t = opt(g, "targets");
  bool linear = kiln_json_is(t, KILN_JSON_ARRAY) && kiln_json_len(t) == 1 &&
                kiln_json_string(kiln_json_at(t, 0), NULL) &&
                strcmp(kiln_json_string(kiln_json_at(t, 0), NULL), "Linear") == 0;
  char sub[200];
  snprintf(sub, sizeof(sub), "%s.targets", key);
  if (!linear) return quant_refuse(name, sub, t, "only [\"Linear\"] is supported");
  snprintf(sub, sizeof(sub), "%s.output_activations", key);
  if (opt(g, "output_activations"))
    return quant_refuse(name, sub, opt(g, "output_activations"),
                        "quantized outputs are not supported");
  snprintf(sub, sizeof(sub), "%s.weights", key);
  const kiln_json_t *w = opt(g, "weights");
  if (!w)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: quantization_config.%s: missing",
                            name, sub);
  if ((st = ct_float8_args(w, name, sub))) return st;
  const kiln_json_t *v;
  char full[240];
  snprintf(full, sizeof(full), "%s.dynamic", sub);
  if ((v = opt(w, "dynamic")) && kiln_json_is(v, KILN_JSON_BOOL) && kiln_json_bool(v))
    return quant_refuse(name, full, v, "weights quantized at run time are not a checkpoint format");
  snprintf(full, sizeof(full), "%s.actorder", sub);
  if ((v = opt(w, "actorder")))
    return quant_refuse(name, full, v, "activation ordering is not supported for FP8 weights");
  snprintf(full, sizeof(full), "%s.strategy", sub);
  v = opt(w, "strategy");
  const char *strat = kiln_json_string(v, NULL);
  if (strat && strcmp(strat, "tensor") == 0) {
    out->fp8_scheme = KILN_FP8_TENSOR;
  } else if (strat && strcmp(strat, "channel") == 0) {
    out->fp8_scheme = KILN_FP8_CHANNEL;
  } else if (strat && strcmp(strat, "block") == 0) {
    out->fp8_scheme = KILN_FP8_BLOCK;
    const kiln_json_t *bs = opt(w, "block_structure");
    int64_t b[2] = {0, 0};
    snprintf(full, sizeof(full), "quantization_config.%s.block_structure", sub);
    if (!kiln_json_is(bs, KILN_JSON_ARRAY) || kiln_json_len(bs) != 2)
      return bad_value(name, full, "[rows, columns] of a block", bs);
    for (int i = 0; i < 2; i++)
      if ((st = read_int(name, full, kiln_json_at(bs, (size_t)i), 1, 1 << 20, &b[i]))) return st;
    out->block_n = (int32_t)b[0];
    out->block_k = (int32_t)b[1];
  } else {
    return quant_refuse(name, full, v,
                        "only \"tensor\", \"channel\" and \"block\" FP8 weight scales are "
                        "supported (not \"group\" or others)");
  }
  snprintf(sub, sizeof(sub), "%s.input_activations", key);
  const kiln_json_t *ia = opt(g, "input_activations");
  if (ia) {
    if ((st = ct_float8_args(ia, name, sub))) return st;
    out->act_quantized = true;
    bool dyn = false;
    snprintf(full, sizeof(full), "quantization_config.%s.dynamic", sub);
    if ((v = opt(ia, "dynamic"))) {
      if (!kiln_json_is(v, KILN_JSON_BOOL)) return bad_value(name, full, "true or false", v);
      dyn = kiln_json_bool(v);
    }
    out->act_static = !dyn;
    snprintf(full, sizeof(full), "%s.strategy", sub);
    v = opt(ia, "strategy");
    strat = kiln_json_string(v, NULL);
    if (!strat || (strcmp(strat, "token") != 0 && strcmp(strat, "tensor") != 0))
      return quant_refuse(name, full, v, "only \"token\" and \"tensor\" activation scales");
  }
  out->scale_inv = false;
  const kiln_json_t *kvs = opt(q, "kv_cache_scheme");
  if (kvs && kiln_json_type(kvs) != KILN_JSON_NULL) {
    const char *kt = kiln_json_string(opt(kvs, "type"), NULL);
    int64_t nbits = 0;
    out->kv_cache_scheme =
        kt && !strcmp(kt, "float") && kiln_json_int64(opt(kvs, "num_bits"), &nbits) && nbits == 8
            ? 1
            : 2;
  }
  return fp8_ignore_list(opt(q, "ignore"), name, "quantization_config.ignore", out);
}

/* quant_method "fp8": transformers' FineGrainedFP8 / DeepSeek-V3 blocks (weight_block_size,
 * weight_scale_inv), or without weight_block_size per-tensor weight_scale (AutoFP8). */
static kiln_status_t parse_block_fp8(const kiln_json_t *q, const char *name,
                                     kiln_quant_config_t *out) {
  kiln_status_t st;
  const char *fmt = NULL, *act = NULL;
  if ((st = q_str(q, name, "fmt", &fmt)) || (st = q_str(q, name, "activation_scheme", &act)))
    return st;
  if (fmt && strcmp(fmt, "e4m3") != 0)
    return quant_refuse(name, "fmt", opt(q, "fmt"), "only e4m3 FP8 weights are supported");
  if (act && strcmp(act, "dynamic") != 0 && strcmp(act, "static") != 0)
    return quant_refuse(name, "activation_scheme", opt(q, "activation_scheme"),
                        "want \"dynamic\" or \"static\"");
  out->act_quantized = true;
  out->act_static = act && strcmp(act, "static") == 0;
  const kiln_json_t *bs = opt(q, "weight_block_size");
  if (bs) {
    int64_t b[2] = {0, 0};
    if (!kiln_json_is(bs, KILN_JSON_ARRAY) || kiln_json_len(bs) != 2)
      return bad_value(name, "quantization_config.weight_block_size", "[rows, columns]", bs);
    for (int i = 0; i < 2; i++)
      if ((st = read_int(name, "quantization_config.weight_block_size",
                         kiln_json_at(bs, (size_t)i), 1, 1 << 20, &b[i])))
        return st;
    out->fp8_scheme = KILN_FP8_BLOCK;
    out->block_n = (int32_t)b[0];
    out->block_k = (int32_t)b[1];
    out->scale_inv = true;
  } else {
    out->fp8_scheme = KILN_FP8_TENSOR;
    out->scale_inv = false;
  }
  if ((st = fp8_ignore_list(opt(q, "modules_to_not_convert"), name,
                            "quantization_config.modules_to_not_convert", out)))
    return st;
  return fp8_ignore_list(opt(q, "ignored_layers"), name, "quantization_config.ignored_layers",
                         out);
}

/* quantization_config: GPTQ (bits 4/8, checkpoint_format gptq / gptq_v2) and AWQ (bits 4,
 * version gemm, zero_point) are read into *out; every other method or setting is refused. */
static kiln_status_t parse_quant(const kiln_json_t *root, const char *name,
                                 kiln_quant_config_t *out) {
  memset(out, 0, sizeof(*out));
  const kiln_json_t *q = opt(root, "quantization_config");
  if (!q) return NULL;
  if (!kiln_json_is(q, KILN_JSON_OBJECT))
    return bad_value(name, "quantization_config", "an object", q);
  const char *method = NULL;
  kiln_status_t st = q_str(q, name, "quant_method", &method);
  if (!st && !method)
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: quantization_config.quant_method: missing (want \"gptq\", \"awq\", "
                          "\"compressed-tensors\" or \"fp8\")",
                          name);
  if (st) return st;
  if (strcmp(method, "gptq") == 0) {
    out->method = KILN_QUANT_GPTQ;
  } else if (strcmp(method, "awq") == 0) {
    out->method = KILN_QUANT_AWQ;
  } else if (strcmp(method, "compressed-tensors") == 0 || strcmp(method, "fp8") == 0) {
    out->method = KILN_QUANT_FP8;
    out->bits = 8;
    out->sym = true;
    return method[0] == 'c' ? parse_ct_fp8(q, name, out) : parse_block_fp8(q, name, out);
  } else {
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: quantization_config: quant_method \"%s\" is not supported (only "
                            "\"gptq\", \"awq\", \"compressed-tensors\" FP8 and \"fp8\"); use "
                            "such a checkpoint or an unquantized one",
                            name, method);
  }
  const bool gptq = out->method == KILN_QUANT_GPTQ;
  int64_t bits = 4, gs = 128;
  const kiln_json_t *v;
  if ((v = opt(q, "bits")) && (st = read_int(name, "quantization_config.bits", v, 1, 64, &bits)))
    return st;
  if (bits != 4 && (gptq ? bits != 8 : true))
    return quant_refuse(name, "bits", v,
                        gptq ? "GPTQ runs with 4 or 8 bits only" : "AWQ runs with 4 bits only");
  if ((v = opt(q, "group_size")) &&
      (st = read_int(name, "quantization_config.group_size", v, -1, 1 << 30, &gs)))
    return st;
  if (gs == 0) return quant_refuse(name, "group_size", v, "want a positive size or -1");
  out->bits = (int32_t)bits;
  out->group_size = (int32_t)gs;
  if (gptq) {
    out->sym = true;
    if ((st = q_bool(q, name, "desc_act", &out->desc_act)) ||
        (st = q_bool(q, name, "sym", &out->sym)))
      return st;
    const char *fmt = NULL;
    const char *fkey = opt(q, "checkpoint_format") ? "checkpoint_format" : "format";
    if ((st = q_str(q, name, fkey, &fmt))) return st;
    if (!fmt || strcmp(fmt, "gptq") == 0)
      out->zero_minus_one = true;
    else if (strcmp(fmt, "gptq_v2") != 0)
      return quant_refuse(name, fkey, opt(q, fkey),
                          "only \"gptq\" (v1) and \"gptq_v2\" are supported (marlin, bitblas and "
                          "other repacked formats are not)");
    bool flag = false;
    if ((st = q_bool(q, name, "is_marlin_format", &flag))) return st;
    if (flag)
      return quant_refuse(name, "is_marlin_format", opt(q, "is_marlin_format"),
                          "Marlin-packed GPTQ weights are not supported");
    flag = false;
    if ((st = q_bool(q, name, "lm_head", &flag))) return st;
    if (flag)
      return quant_refuse(name, "lm_head", opt(q, "lm_head"),
                          "a quantized lm_head is not supported");
    const char *pack = NULL;
    if ((st = q_str(q, name, "pack_dtype", &pack))) return st;
    if (pack && strcmp(pack, "int32") != 0 && strcmp(pack, "torch.int32") != 0)
      return quant_refuse(name, "pack_dtype", opt(q, "pack_dtype"),
                          "only int32 packing is supported");
    if ((v = opt(q, "dynamic")) && kiln_json_len(v) > 0)
      return quant_refuse(name, "dynamic", v, "per-module GPTQModel overrides are not supported");
  } else {
    const char *version = NULL;
    if ((st = q_str(q, name, "version", &version))) return st;
    if (version && strcasecmp(version, "gemm") != 0)
      return quant_refuse(name, "version", opt(q, "version"),
                          "only AWQ's GEMM packing is supported (not gemv, gemv_fast, exllama, "
                          "marlin or ipex)");
    bool zp = true;
    if ((st = q_bool(q, name, "zero_point", &zp))) return st;
    if (!zp)
      return quant_refuse(name, "zero_point", opt(q, "zero_point"),
                          "AWQ without zero points is not supported");
    if (gs < 0)
      return quant_refuse(name, "group_size", opt(q, "group_size"),
                          "AWQ needs a positive group size");
  }
  if ((v = opt(q, "modules_to_not_convert")) && !kiln_json_is(v, KILN_JSON_ARRAY))
    return bad_value(name, "quantization_config.modules_to_not_convert", "a list of names", v);
  return NULL;
}

void kiln_model_quant_describe(const kiln_quant_config_t *q, char *buf, size_t size) {
  if (!size) return;
  if (q->method == KILN_QUANT_NONE) {
    snprintf(buf, size, "none");
    return;
  }
  if (q->method == KILN_QUANT_FP8) {
    static const char *const schemes[] = {"per-tensor", "per-channel", "block", "per-channel"};
    char scales[48];
    if (q->fp8_scheme == KILN_FP8_BLOCK)
      snprintf(scales, sizeof(scales), "%dx%d-block", (int)q->block_n, (int)q->block_k);
    else
      snprintf(scales, sizeof(scales), "%s", schemes[q->fp8_scheme & 3]);
    snprintf(buf, size, "fp8 e4m3, %s weight scales%s, %s", scales,
             q->fp8_scheme == KILN_FP8_ON_THE_FLY ? " (made at load)" : "",
             q->act_quantized ? "activations not quantized (W8A16)" : "weight-only");
    return;
  }
  char group[32];
  if (q->group_size > 0)
    snprintf(group, sizeof(group), "group %d", (int)q->group_size);
  else
    snprintf(group, sizeof(group), "one group per row");
  if (q->method == KILN_QUANT_AWQ)
    snprintf(buf, size, "awq %d-bit, %s", (int)q->bits, group);
  else
    snprintf(buf, size, "gptq %d-bit, %s, %s%s, %s", (int)q->bits, group, q->sym ? "sym" : "asym",
             q->desc_act ? ", desc_act" : "", q->zero_minus_one ? "gptq (v1)" : "gptq_v2");
}

/* Keys whose presence changes the computation in a way Kiln does not implement. */
static kiln_status_t refuse_unsupported(const kiln_json_t *root, const char *name) {
  static const char *const softcaps[] = {"attn_logit_softcapping", "final_logit_softcapping"};
  for (size_t i = 0; i < 2; i++) {
    const kiln_json_t *v = opt(root, softcaps[i]);
    if (v) {
      char got[96];
      describe(v, got, sizeof(got));
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "%s: %s: logit soft-capping is not supported (got %s)", name,
                              softcaps[i], got);
    }
  }
  return NULL;
}

static kiln_status_t parse_act(const kiln_json_t *root, const char *name, int32_t *out) {
  const char *act = NULL;
  kiln_status_t st = opt_str(root, name, "hidden_act", &act);
  if (st) return st;
  if (!act || strcmp(act, "silu") == 0 || strcmp(act, "swish") == 0)
    *out = KILN_HAL_ACT_SILU;
  else if (strcmp(act, "gelu_pytorch_tanh") == 0 || strcmp(act, "gelu_new") == 0)
    *out = KILN_HAL_ACT_GELU_TANH;
  else if (strcmp(act, "gelu") == 0)
    *out = KILN_HAL_ACT_GELU;
  else
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: hidden_act: \"%s\" is not supported (supported: silu, gelu, "
                            "gelu_pytorch_tanh, gelu_new)",
                            name, act);
  return NULL;
}

/* "dtype" (transformers 5) or "torch_dtype" (4.x); F32 when neither is given. */
static kiln_status_t parse_dtype(const kiln_json_t *root, const char *name, int32_t *out) {
  const char *key = "dtype";
  const kiln_json_t *v = opt(root, key);
  if (!v) {
    key = "torch_dtype";
    v = opt(root, key);
  }
  *out = KILN_HAL_F32;
  if (!v) return NULL;
  if (!kiln_json_is(v, KILN_JSON_STRING)) return bad_value(name, key, "a dtype string", v);
  const char *s = kiln_json_string(v, NULL);
  if (strcmp(s, "float32") == 0)
    *out = KILN_HAL_F32;
  else if (strcmp(s, "float16") == 0)
    *out = KILN_HAL_F16;
  else if (strcmp(s, "bfloat16") == 0)
    *out = KILN_HAL_BF16;
  else
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: %s: \"%s\" is not supported (supported: float32, float16, "
                            "bfloat16)",
                            name, key, s);
  return NULL;
}

/* Builds "<prefix>.<key>" for messages about rope keys. */
static const char *rkey(char *buf, size_t n, const char *prefix, const char *key) {
  snprintf(buf, n, "%s.%s", prefix, key);
  return buf;
}

/* The rope settings. Sources, in transformers 5's order of priority: a non-empty "rope_scaling"
 * object (4.x files; transformers 5 converts it), else "rope_parameters"; rope_theta and
 * partial_rotary_factor from that object, else the top level, else 10000 and 1.
 *
 * original_max_position_embeddings (llama3, yarn): a top-level key of that name wins (as in
 * transformers 5's standardize_rope_params), then the one in the rope object, then
 * max_position_embeddings. Dynamic scaling always uses max_position_embeddings, as
 * _compute_dynamic_ntk_parameters does.
 *
 * YaRN's factor: transformers 5 uses the explicit "factor" and derives it as
 * max_position_embeddings / original_max_position_embeddings only when it is null.
 * transformers 4.5x instead replaced an explicit factor by that ratio whenever
 * original_max_position_embeddings was in rope_scaling (a Qwen3 config with factor 4, original
 * 32768 and max 40960 ran with factor 1.25). Kiln follows 5.x, which is also what vLLM and the
 * model authors intend. The correction range uses original_max_position_embeddings in both. */
static kiln_status_t parse_rope(const kiln_json_t *root, const char *name, kiln_model_config_t *c) {
  kiln_rope_config_t *r = &c->rope;
  char kb[96];
  kiln_status_t st = NULL;
  r->style = KILN_HAL_ROPE_NEOX;
  r->factor = 1.0;
  r->theta = 10000.0;
  r->truncate = true;

  const char *pk = "rope_scaling";
  const kiln_json_t *rp = opt(root, pk);
  if (rp && !kiln_json_is(rp, KILN_JSON_OBJECT))
    return bad_value(name, pk, "an object or null", rp);
  if (!rp || kiln_json_len(rp) == 0) {
    pk = "rope_parameters";
    rp = opt(root, pk);
    if (rp && !kiln_json_is(rp, KILN_JSON_OBJECT))
      return bad_value(name, pk, "an object or null", rp);
  }
  if (rp) {
    static const char *const per_layer[] = {"full_attention", "sliding_attention"};
    for (size_t i = 0; i < 2; i++)
      if (kiln_json_is(kiln_json_get(rp, per_layer[i]), KILN_JSON_OBJECT))
        return kiln_status_make(KILN_ERR_UNSUPPORTED,
                                "%s: %s.%s: per-layer-type rope parameters are not supported", name,
                                pk, per_layer[i]);
  }

  /* theta and partial_rotary_factor: the rope object first, then the top level. */
  const char *tk = rkey(kb, sizeof(kb), pk, "rope_theta");
  const kiln_json_t *tv = rp ? opt(rp, "rope_theta") : NULL;
  if (!tv) {
    tk = "rope_theta";
    tv = opt(root, tk);
  }
  if (tv && (st = read_num(name, tk, tv, &r->theta))) return st;
  if (!(r->theta > 0) || !isfinite(r->theta))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s: want a positive number, got %g",
                            name, tk, r->theta);
  double prf = 1.0;
  const char *fk = rkey(kb, sizeof(kb), pk, "partial_rotary_factor");
  const kiln_json_t *fv = rp ? opt(rp, "partial_rotary_factor") : NULL;
  if (!fv) {
    fk = "partial_rotary_factor";
    fv = opt(root, fk);
  }
  if (fv && (st = read_num(name, fk, fv, &prf))) return st;
  if (!(prf > 0 && prf <= 1))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s: want a number in (0, 1], got %g",
                            name, fk, prf);
  double rd = (double)c->head_dim * prf; /* Python's int(head_dim * partial_rotary_factor) */
  r->rotary_dim = rd < (double)INT32_MAX ? (int32_t)rd : INT32_MAX; /* validate() bounds it */

  /* M-RoPE (Qwen2-VL): mrope_section in the rope object; its type "mrope" (published
   * checkpoints) is plain default rope to transformers. */
  bool mrope_type = false;
  if (is_vl(c)) {
    const char *sk = rkey(kb, sizeof(kb), pk, "mrope_section");
    const kiln_json_t *sv = rp ? opt(rp, "mrope_section") : NULL;
    if (!sv)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: %s: missing (model_type \"%s\" needs the M-RoPE sections)", name,
                              rp ? sk : "rope_scaling.mrope_section", c->model_type);
    if (!kiln_json_is(sv, KILN_JSON_ARRAY) || kiln_json_len(sv) != 3)
      return bad_value(name, sk, "a list of 3 positive integers", sv);
    for (size_t i = 0; i < 3; i++) {
      int64_t x = 0;
      char ek[128];
      snprintf(ek, sizeof(ek), "%s[%zu]", sk, i);
      if ((st = read_int(name, ek, kiln_json_at(sv, i), 1, KILN_ROPE_MAX_FREQS, &x))) return st;
      c->mrope_section[i] = (int32_t)x;
    }
    c->mrope = true;
    const kiln_json_t *tyv = rp ? opt(rp, "rope_type") : NULL;
    if (!tyv && rp) tyv = opt(rp, "type");
    mrope_type =
        kiln_json_is(tyv, KILN_JSON_STRING) && strcmp(kiln_json_string(tyv, NULL), "mrope") == 0;
  }

  /* The type: "rope_type", or "type" (older 4.x files); "default" when neither. */
  const char *type = "default";
  const char *type_key = rkey(kb, sizeof(kb), pk, "rope_type");
  if (rp) {
    const kiln_json_t *tyv = opt(rp, "rope_type");
    if (!tyv && (tyv = opt(rp, "type"))) type_key = rkey(kb, sizeof(kb), pk, "type");
    if (tyv && !kiln_json_is(tyv, KILN_JSON_STRING))
      return bad_value(name, type_key, "a string", tyv);
    if (tyv) type = kiln_json_string(tyv, NULL);
  }
  if (mrope_type) type = "default";
  if (is_vl(c) && strcmp(type, "default") != 0)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: %s: \"%s\" with M-RoPE is not supported (supported: default, "
                            "mrope)",
                            name, type_key, type);
  if (strcmp(type, "default") == 0)
    r->kind = KILN_ROPE_DEFAULT;
  else if (strcmp(type, "linear") == 0)
    r->kind = KILN_ROPE_LINEAR;
  else if (strcmp(type, "dynamic") == 0)
    r->kind = KILN_ROPE_DYNAMIC;
  else if (strcmp(type, "llama3") == 0)
    r->kind = KILN_ROPE_LLAMA3;
  else if (strcmp(type, "yarn") == 0)
    r->kind = KILN_ROPE_YARN;
  else
    return kiln_status_make(KILN_ERR_UNSUPPORTED, "%s: %s: \"%s\" is not supported (supported: %s)",
                            name, type_key, type, SUPPORTED_ROPE);
  if (r->kind == KILN_ROPE_DEFAULT) return NULL;

  /* original_max_position_embeddings */
  if (r->kind == KILN_ROPE_DYNAMIC) {
    r->original_max_position = c->max_position_embeddings;
  } else if (r->kind == KILN_ROPE_LLAMA3 || r->kind == KILN_ROPE_YARN) {
    r->original_max_position = c->max_position_embeddings;
    const char *ok = "original_max_position_embeddings";
    const kiln_json_t *ov = opt(root, ok);
    if (!ov) {
      ok = rkey(kb, sizeof(kb), pk, "original_max_position_embeddings");
      ov = opt(rp, "original_max_position_embeddings");
    }
    if (ov && (st = read_int(name, ok, ov, 1, INT64_MAX, &r->original_max_position))) return st;
  }

  /* factor */
  const char *fak = rkey(kb, sizeof(kb), pk, "factor");
  const kiln_json_t *fav = kiln_json_get(rp, "factor");
  if (!fav)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s: missing (rope_type \"%s\" needs it)", name, fak, type);
  if (kiln_json_is(fav, KILN_JSON_NULL) && r->kind == KILN_ROPE_YARN) {
    r->factor = (double)c->max_position_embeddings / (double)r->original_max_position;
  } else {
    if ((st = read_num(name, fak, fav, &r->factor))) return st;
  }
  if (!(r->factor >= 1.0) || !isfinite(r->factor))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s: want a number >= 1, got %g", name,
                            fak, r->factor);

  if (r->kind == KILN_ROPE_LLAMA3) {
    static const char *const keys[] = {"low_freq_factor", "high_freq_factor"};
    double *dst[] = {&r->low_freq_factor, &r->high_freq_factor};
    for (size_t i = 0; i < 2; i++) {
      const char *k = rkey(kb, sizeof(kb), pk, keys[i]);
      const kiln_json_t *v = kiln_json_get(rp, keys[i]);
      if (!v)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: %s: missing (rope_type \"llama3\" needs it)", name, k);
      if ((st = read_num(name, k, v, dst[i]))) return st;
    }
  } else if (r->kind == KILN_ROPE_YARN) {
    /* beta_fast / beta_slow: `get(...) or 32` / `or 1`, so 0 and null also mean the default. */
    r->beta_fast = 32;
    r->beta_slow = 1;
    static const char *const keys[] = {"beta_fast", "beta_slow", "attention_factor", "mscale",
                                       "mscale_all_dim"};
    double *dst[] = {&r->beta_fast, &r->beta_slow, &r->attention_factor, &r->mscale,
                     &r->mscale_all_dim};
    for (size_t i = 0; i < 5; i++) {
      const kiln_json_t *v = opt(rp, keys[i]);
      double x = 0;
      if (v && (st = read_num(name, rkey(kb, sizeof(kb), pk, keys[i]), v, &x))) return st;
      if (x != 0) *dst[i] = x;
    }
    const kiln_json_t *attn = opt(rp, "attention_factor");
    if (attn && !(r->attention_factor > 0))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: %s.attention_factor: want a positive number, got %g", name, pk,
                              r->attention_factor);
    /* truncate: rope_parameters.get("truncate", True), so an explicit null means false. */
    const kiln_json_t *tr = kiln_json_get(rp, "truncate");
    if (tr && kiln_json_is(tr, KILN_JSON_NULL))
      r->truncate = false;
    else if (tr && !kiln_json_is(tr, KILN_JSON_BOOL))
      return bad_value(name, rkey(kb, sizeof(kb), pk, "truncate"), "true or false", tr);
    else if (tr)
      r->truncate = kiln_json_bool(tr);
  }
  return NULL;
}

/* Which layers use the sliding window, and its size. */
static kiln_status_t parse_sliding(const kiln_json_t *root, const char *name,
                                   kiln_model_config_t *c) {
  kiln_status_t st = NULL;
  int64_t window = 0; /* 0 = no window configured (None) */
  const kiln_json_t *wv = opt(root, "sliding_window");
  bool use = true;
  if (is_vl(c)) {
    /* Qwen2-VL's text model: sliding windows only with use_sliding_window, which the eager and
     * SDPA paths ignore; Kiln refuses it rather than pick one meaning. */
    use = false;
    if ((st = opt_bool(root, name, "use_sliding_window", &use))) return st;
    if (use)
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "%s: use_sliding_window: true is not supported for model_type \"%s\"",
                              name, c->model_type);
    const kiln_json_t *lt = opt(root, "layer_types");
    if (lt && !kiln_json_is(lt, KILN_JSON_ARRAY))
      return bad_value(name, "layer_types", "a list", lt);
    for (size_t i = 0; lt && i < kiln_json_len(lt); i++) {
      const kiln_json_t *e = kiln_json_at(lt, i);
      if (!kiln_json_is(e, KILN_JSON_STRING) || strcmp(kiln_json_string(e, NULL), "full_attention"))
        return kiln_status_make(KILN_ERR_UNSUPPORTED,
                                "%s: layer_types[%zu]: only \"full_attention\" is supported for "
                                "model_type \"%s\"",
                                name, i, c->model_type);
    }
    if (lt && (int64_t)kiln_json_len(lt) != c->num_layers)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: layer_types: has %zu entries, want num_hidden_layers = %lld",
                              name, kiln_json_len(lt), (long long)c->num_layers);
    c->sliding_window = 0;
    return NULL;
  }
  if (c->arch == KILN_ARCH_QWEN2 || c->arch == KILN_ARCH_QWEN3) {
    /* Qwen2Config/Qwen3Config: sliding_window = sliding_window if use_sliding_window else None
     * (sliding_window defaults to 4096, use_sliding_window to false). */
    use = false;
    if ((st = opt_bool(root, name, "use_sliding_window", &use))) return st;
    if (use) {
      window = 4096;
      if (kiln_json_get(root, "sliding_window") && !wv) window = 0; /* explicit null */
    }
  } else if (c->arch == KILN_ARCH_MISTRAL) {
    window = kiln_json_get(root, "sliding_window") ? 0 : 4096; /* MistralConfig default 4096 */
  } else {
    use = false; /* Llama has no sliding window; transformers ignores the key */
  }
  if (use && wv && (st = read_int(name, "sliding_window", wv, 1, INT32_MAX, &window))) return st;

  /* The default pattern. */
  int64_t max_window_layers = 28;
  if (c->arch == KILN_ARCH_QWEN2 || c->arch == KILN_ARCH_QWEN3) {
    const kiln_json_t *mv = opt(root, "max_window_layers");
    if (mv && (st = read_int(name, "max_window_layers", mv, 0, INT64_MAX, &max_window_layers)))
      return st;
  }
  for (int64_t i = 0; i < c->num_layers; i++) {
    bool s = false;
    if (window > 0) {
      if (c->arch == KILN_ARCH_MISTRAL) s = true;
      if (c->arch == KILN_ARCH_QWEN2 || c->arch == KILN_ARCH_QWEN3) s = i >= max_window_layers;
    }
    c->layer_sliding[i] = s;
  }

  /* An explicit layer_types list (transformers 5 writes one). Qwen2/Qwen3 follow it; Mistral
   * and Llama ignore it in transformers, so a list that disagrees with what they run is
   * ambiguous and refused. */
  const kiln_json_t *lt = opt(root, "layer_types");
  if (lt) {
    if (!kiln_json_is(lt, KILN_JSON_ARRAY)) return bad_value(name, "layer_types", "a list", lt);
    if ((int64_t)kiln_json_len(lt) != c->num_layers)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: layer_types: has %zu entries, want num_hidden_layers = %lld",
                              name, kiln_json_len(lt), (long long)c->num_layers);
    for (size_t i = 0; i < kiln_json_len(lt); i++) {
      const kiln_json_t *e = kiln_json_at(lt, i);
      char key[48];
      snprintf(key, sizeof(key), "layer_types[%zu]", i);
      if (!kiln_json_is(e, KILN_JSON_STRING)) return bad_value(name, key, "a string", e);
      const char *s = kiln_json_string(e, NULL);
      bool sl;
      if (strcmp(s, "full_attention") == 0)
        sl = false;
      else if (strcmp(s, "sliding_attention") == 0)
        sl = true;
      else
        return kiln_status_make(KILN_ERR_UNSUPPORTED,
                                "%s: %s: \"%s\" is not supported (supported: full_attention, "
                                "sliding_attention)",
                                name, key, s);
      if (c->arch == KILN_ARCH_QWEN2 || c->arch == KILN_ARCH_QWEN3) {
        if (sl && window == 0)
          return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                  "%s: %s: \"sliding_attention\" but no sliding window is set "
                                  "(use_sliding_window %s, sliding_window %s)",
                                  name, key, use ? "true" : "false", wv ? "set" : "null");
        c->layer_sliding[i] = sl;
      } else if (sl != (c->layer_sliding[i] != 0)) {
        return kiln_status_make(KILN_ERR_UNSUPPORTED,
                                "%s: %s: \"%s\" disagrees with what transformers runs for "
                                "model_type \"%s\" (which ignores layer_types)",
                                name, key, s, c->model_type);
      }
    }
  }
  bool any = false;
  for (int64_t i = 0; i < c->num_layers; i++) any = any || c->layer_sliding[i];
  c->sliding_window = any ? (int32_t)window : 0;
  return NULL;
}

/* ---- vision-language models (Qwen2-VL, Qwen2.5-VL) ------------------------------------- */

/* A required token id of the top-level config (the vision special tokens). */
static kiln_status_t req_token(const kiln_json_t *root, const char *name, const char *key,
                               int32_t *out) {
  const kiln_json_t *v = opt(root, key);
  if (!v)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s: missing (want a token id)", name,
                            key);
  kiln_status_t st = read_token_id(name, key, v, out);
  if (!st && *out < 0) st = bad_value(name, key, "a token id >= 0", v);
  return st;
}

/* An optional positive integer of vision_config, named "vision_config.<key>" in messages. */
static kiln_status_t vis_int(const kiln_json_t *vc, const char *name, const char *key,
                             int64_t *out) {
  char k[96];
  snprintf(k, sizeof(k), "vision_config.%s", key);
  const kiln_json_t *v = opt(vc, key);
  return v ? read_int(name, k, v, 1, INT32_MAX, out) : NULL;
}

static kiln_status_t vis_num(const kiln_json_t *vc, const char *name, const char *key,
                             double *out) {
  char k[96];
  snprintf(k, sizeof(k), "vision_config.%s", key);
  const kiln_json_t *v = opt(vc, key);
  return v ? read_num(name, k, v, out) : NULL;
}

/* vision_config, with Qwen2VLVisionConfig's / Qwen2_5_VLVisionConfig's defaults. */
static kiln_status_t parse_vision(const kiln_json_t *root, const char *name,
                                  kiln_model_config_t *c) {
  kiln_vision_config_t *vc = &c->vision;
  kiln_status_t st = NULL;
  const kiln_json_t *v = opt(root, "vision_config");
  if (!v)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: vision_config: missing (model_type \"%s\" has a vision tower)",
                            name, c->model_type);
  if (!kiln_json_is(v, KILN_JSON_OBJECT)) return bad_value(name, "vision_config", "an object", v);
  const bool v25 = c->arch == KILN_ARCH_QWEN2_5_VL;
  vc->present = true;
  vc->depth = 32;
  vc->num_heads = 16;
  vc->in_channels = 3;
  vc->patch_size = 14;
  vc->temporal_patch_size = 2;
  vc->spatial_merge_size = 2;
  const char *act = v25 ? "silu" : "quick_gelu";
  if ((st = vis_int(v, name, "depth", &vc->depth)) ||
      (st = vis_int(v, name, "num_heads", &vc->num_heads)) ||
      (st = vis_int(v, name, "in_channels", &vc->in_channels)) ||
      (st = vis_int(v, name, "patch_size", &vc->patch_size)) ||
      (st = vis_int(v, name, "temporal_patch_size", &vc->temporal_patch_size)) ||
      (st = vis_int(v, name, "spatial_merge_size", &vc->spatial_merge_size)) ||
      (st = opt_str(v, name, "hidden_act", &act)))
    return st;
  if (v25) {
    vc->embed_dim = 3584;
    vc->intermediate_size = 3420;
    vc->out_hidden_size = 3584;
    vc->window_size = 112;
    vc->tokens_per_second = 4;
    vc->gated_mlp = true;
    if ((st = vis_int(v, name, "hidden_size", &vc->embed_dim)) ||
        (st = vis_int(v, name, "intermediate_size", &vc->intermediate_size)) ||
        (st = vis_int(v, name, "out_hidden_size", &vc->out_hidden_size)) ||
        (st = vis_int(v, name, "window_size", &vc->window_size)) ||
        (st = vis_num(v, name, "tokens_per_second", &vc->tokens_per_second)))
      return st;
    const kiln_json_t *fv = kiln_json_get(v, "fullatt_block_indexes");
    if (!fv) {
      static const int32_t def[4] = {7, 15, 23, 31};
      vc->num_fullatt = 4;
      memcpy(vc->fullatt_blocks, def, sizeof(def));
    } else if (!kiln_json_is(fv, KILN_JSON_ARRAY) || kiln_json_len(fv) > KILN_MODEL_MAX_LAYERS) {
      return bad_value(name, "vision_config.fullatt_block_indexes", "a list of block indexes", fv);
    } else {
      vc->num_fullatt = (int32_t)kiln_json_len(fv);
      for (int32_t i = 0; i < vc->num_fullatt; i++) {
        int64_t x = 0;
        char k[96];
        snprintf(k, sizeof(k), "vision_config.fullatt_block_indexes[%d]", i);
        if ((st = read_int(name, k, kiln_json_at(fv, (size_t)i), 0, vc->depth - 1, &x))) return st;
        vc->fullatt_blocks[i] = (int32_t)x;
      }
    }
  } else {
    vc->embed_dim = 1280;
    vc->out_hidden_size = 3584;
    double ratio = 4;
    if ((st = vis_int(v, name, "embed_dim", &vc->embed_dim)) ||
        (st = vis_int(v, name, "hidden_size", &vc->out_hidden_size)) ||
        (st = vis_num(v, name, "mlp_ratio", &ratio)))
      return st;
    double w = (double)vc->embed_dim * ratio; /* Python's int(embed_dim * mlp_ratio) */
    if (!(ratio > 0) || !(w >= 1) || w > (double)INT32_MAX)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: vision_config.mlp_ratio: %g gives an MLP of %g", name, ratio, w);
    vc->intermediate_size = (int64_t)w;
  }
  /* The 2-D rotary: transformers 5 writes rope_parameters {rope_type: axial, rope_theta}. */
  vc->rope_theta = 10000.0;
  const kiln_json_t *rp = opt(v, "rope_parameters");
  if (rp) {
    if (!kiln_json_is(rp, KILN_JSON_OBJECT))
      return bad_value(name, "vision_config.rope_parameters", "an object", rp);
    const char *rt = NULL;
    const kiln_json_t *rtv = opt(rp, "rope_type");
    if (rtv && !kiln_json_is(rtv, KILN_JSON_STRING))
      return bad_value(name, "vision_config.rope_parameters.rope_type", "a string", rtv);
    if (rtv) rt = kiln_json_string(rtv, NULL);
    if (rt && strcmp(rt, "axial") != 0 && strcmp(rt, "default") != 0)
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "%s: vision_config.rope_parameters.rope_type: \"%s\" is not "
                              "supported (supported: axial, default)",
                              name, rt);
    const kiln_json_t *tv = opt(rp, "rope_theta");
    if (tv &&
        (st = read_num(name, "vision_config.rope_parameters.rope_theta", tv, &vc->rope_theta)))
      return st;
  } else if ((st = vis_num(v, name, "rope_theta", &vc->rope_theta))) {
    return st;
  }
  if (!(vc->rope_theta > 0) || !isfinite(vc->rope_theta))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: vision_config rope_theta: want a positive number, got %g", name,
                            vc->rope_theta);
  if (strcmp(act, "quick_gelu") == 0)
    vc->hidden_act = KILN_HAL_ACT_QUICK_GELU;
  else if (strcmp(act, "silu") == 0 || strcmp(act, "swish") == 0)
    vc->hidden_act = KILN_HAL_ACT_SILU;
  else if (strcmp(act, "gelu") == 0)
    vc->hidden_act = KILN_HAL_ACT_GELU;
  else if (strcmp(act, "gelu_pytorch_tanh") == 0 || strcmp(act, "gelu_new") == 0)
    vc->hidden_act = KILN_HAL_ACT_GELU_TANH;
  else
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: vision_config.hidden_act: \"%s\" is not supported (supported: "
                            "quick_gelu, silu, gelu, gelu_pytorch_tanh)",
                            name, act);
  if (vc->depth > KILN_MODEL_MAX_LAYERS)
    return kiln_status_make(KILN_ERR_UNSUPPORTED, "%s: vision_config.depth: %lld is more than %d",
                            name, (long long)vc->depth, KILN_MODEL_MAX_LAYERS);
  if (vc->embed_dim % vc->num_heads || (vc->embed_dim / vc->num_heads) % 4)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: vision_config: %lld wide with %lld heads: the head dim must be a "
                            "multiple of 4 (its 2-D rotary splits it in quarters)",
                            name, (long long)vc->embed_dim, (long long)vc->num_heads);
  if (vc->in_channels != 3)
    return kiln_status_make(
        KILN_ERR_UNSUPPORTED,
        "%s: vision_config.in_channels: %lld (only RGB images, 3, are supported)", name,
        (long long)vc->in_channels);
  if (vc->out_hidden_size != c->hidden_size)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: vision_config.%s: %lld, but the text hidden_size is %lld", name,
                            v25 ? "out_hidden_size" : "hidden_size", (long long)vc->out_hidden_size,
                            (long long)c->hidden_size);
  if (v25 && vc->window_size % (vc->patch_size * vc->spatial_merge_size))
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: vision_config.window_size: %lld is not a multiple of patch_size * "
                            "spatial_merge_size (%lld)",
                            name, (long long)vc->window_size,
                            (long long)(vc->patch_size * vc->spatial_merge_size));
  if (!(vc->tokens_per_second >= 0) || !isfinite(vc->tokens_per_second))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: vision_config.tokens_per_second: want a number >= 0, got %g", name,
                            vc->tokens_per_second);
  return NULL;
}

/* ---- the public functions -------------------------------------------------------------- */

kiln_status_t kiln_model_config_parse(const kiln_json_t *root, const char *name,
                                      kiln_model_config_t *out) {
  kiln_status_t st = NULL;
  kiln_model_config_t *c = out;
  memset(c, 0, sizeof(*c));
  if (!name) name = "config.json";
  if (!kiln_json_is(root, KILN_JSON_OBJECT))
    return bad_value(name, "(top level)", "an object", root);
  if ((st = parse_arch(root, name, c))) return st;
  if ((st = refuse_unsupported(root, name)) || (st = parse_quant(root, name, &c->quant))) return st;
  if (c->quant.method != KILN_QUANT_NONE && is_vl(c))
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: quantization_config: quantized vision-language checkpoints are "
                            "not supported",
                            name);
  c->image_token_id = c->video_token_id = c->vision_start_token_id = c->vision_end_token_id = -1;

  /* Vision-language checkpoints keep the text model's keys in "text_config" (transformers 5)
   * or at the top level (the published files); the vision tower in "vision_config". */
  const kiln_json_t *top = root;
  if (is_vl(c)) {
    const kiln_json_t *tc = opt(root, "text_config");
    if (tc && !kiln_json_is(tc, KILN_JSON_OBJECT))
      return bad_value(name, "text_config", "an object", tc);
    if (tc && kiln_json_len(tc) > 0) {
      if ((st = refuse_unsupported(tc, name))) return st;
      if (opt(tc, "quantization_config"))
        return kiln_status_make(KILN_ERR_UNSUPPORTED,
                                "%s: text_config.quantization_config: quantized vision-language "
                                "checkpoints are not supported",
                                name);
      /* tie_word_embeddings at both levels must agree: which one transformers reads has moved. */
      const kiln_json_t *a = opt(tc, "tie_word_embeddings"), *b = opt(root, "tie_word_embeddings");
      if (a && b && kiln_json_is(a, KILN_JSON_BOOL) && kiln_json_is(b, KILN_JSON_BOOL) &&
          kiln_json_bool(a) != kiln_json_bool(b))
        return kiln_status_make(
            KILN_ERR_INVALID_ARGUMENT,
            "%s: tie_word_embeddings: %s at the top level but %s in text_config", name,
            kiln_json_bool(b) ? "true" : "false", kiln_json_bool(a) ? "true" : "false");
      root = tc;
    }
    if ((st = req_token(top, name, "image_token_id", &c->image_token_id)) ||
        (st = req_token(top, name, "video_token_id", &c->video_token_id)) ||
        (st = req_token(top, name, "vision_start_token_id", &c->vision_start_token_id)) ||
        (st = req_token(top, name, "vision_end_token_id", &c->vision_end_token_id)))
      return st;
  }

  if ((st = req_pos_int(root, name, "vocab_size", &c->vocab_size)) ||
      (st = req_pos_int(root, name, "hidden_size", &c->hidden_size)) ||
      (st = req_pos_int(root, name, "intermediate_size", &c->intermediate_size)) ||
      (st = req_pos_int(root, name, "num_hidden_layers", &c->num_layers)) ||
      (st = req_pos_int(root, name, "num_attention_heads", &c->num_heads)) ||
      (st = req_pos_int(root, name, "max_position_embeddings", &c->max_position_embeddings)))
    return st;
  if (c->num_layers > KILN_MODEL_MAX_LAYERS)
    return kiln_status_make(KILN_ERR_UNSUPPORTED, "%s: num_hidden_layers: %lld is more than %d",
                            name, (long long)c->num_layers, KILN_MODEL_MAX_LAYERS);
  c->num_kv_heads = c->num_heads;
  if ((st = opt_pos_int(root, name, "num_key_value_heads", &c->num_kv_heads))) return st;
  /* head_dim: Qwen3Config defaults to 128 when the key is absent; null (Mistral writes it) and
   * the other architectures mean hidden_size // num_attention_heads. */
  c->head_dim = c->hidden_size / c->num_heads;
  if (c->arch == KILN_ARCH_QWEN3 && !kiln_json_get(root, "head_dim")) c->head_dim = 128;
  if ((st = opt_pos_int(root, name, "head_dim", &c->head_dim))) return st;
  if (is_vl(c) && (c->head_dim * c->num_heads != c->hidden_size))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: hidden_size %lld is not num_attention_heads %lld x head_dim %lld "
                            "(Qwen2-VL's attention needs head_dim = hidden_size / heads)",
                            name, (long long)c->hidden_size, (long long)c->num_heads,
                            (long long)c->head_dim);

  c->rms_norm_eps = 1e-6;
  if ((st = opt_num(root, name, "rms_norm_eps", &c->rms_norm_eps))) return st;
  if ((st = opt_bool(root, name, "tie_word_embeddings", &c->tie_word_embeddings))) return st;
  if (root != top && !opt(root, "tie_word_embeddings") &&
      (st = opt_bool(top, name, "tie_word_embeddings", &c->tie_word_embeddings)))
    return st;

  /* Biases, as each transformers architecture builds its projections. */
  bool attention_bias = false, mlp_bias = false;
  if ((st = opt_bool(root, name, "attention_bias", &attention_bias))) return st;
  if ((st = opt_bool(root, name, "mlp_bias", &mlp_bias))) return st;
  switch (c->arch) {
    case KILN_ARCH_LLAMA: /* q/k/v/o: bias=attention_bias; gate/up/down: bias=mlp_bias */
      c->qkv_bias = c->o_bias = attention_bias;
      c->mlp_bias = mlp_bias;
      break;
    case KILN_ARCH_MISTRAL: /* every projection bias=False */ break;
    case KILN_ARCH_QWEN2: /* q/k/v bias=True, o bias=False */ c->qkv_bias = true; break;
    case KILN_ARCH_QWEN2_VL:
    case KILN_ARCH_QWEN2_5_VL: /* as Qwen2 */ c->qkv_bias = true; break;
    case KILN_ARCH_QWEN3: /* q/k/v/o bias=attention_bias; q_norm/k_norm */
      c->qkv_bias = c->o_bias = attention_bias;
      c->qk_norm = true;
      break;
  }
  if ((st = parse_act(root, name, &c->hidden_act))) return st;
  if ((st =
           parse_dtype(opt(top, "dtype") || opt(top, "torch_dtype") ? top : root, name, &c->dtype)))
    return st;
  if ((st = parse_sliding(root, name, c))) return st;
  if ((st = parse_rope(root, name, c))) return st;
  if (is_vl(c) && (st = parse_vision(top, name, c))) return st;

  /* Token ids; when a key is absent, the architecture's config class default. */
  bool llama_like = c->arch == KILN_ARCH_LLAMA || c->arch == KILN_ARCH_MISTRAL;
  c->bos_token_id = llama_like ? 1 : -1;
  c->pad_token_id = -1;
  const kiln_json_t *v;
  /* A vision-language config may keep these at the top level only. */
  static const char *const id_keys[] = {"bos_token_id", "pad_token_id", "eos_token_id"};
  const kiln_json_t *ids_src[3] = {root, root, root};
  for (int i = 0; i < 3 && top != root; i++)
    if (!kiln_json_get(root, id_keys[i]) && kiln_json_get(top, id_keys[i])) ids_src[i] = top;
  if ((v = kiln_json_get(ids_src[0], "bos_token_id")) &&
      (st = read_token_id(name, "bos_token_id", v, &c->bos_token_id)))
    return st;
  if ((v = kiln_json_get(ids_src[1], "pad_token_id")) &&
      (st = read_token_id(name, "pad_token_id", v, &c->pad_token_id)))
    return st;
  if ((v = kiln_json_get(ids_src[2], "eos_token_id"))) {
    if ((st = read_eos(name, v, c->eos_token_ids, &c->num_eos))) return st;
  } else if (llama_like) {
    c->eos_token_ids[c->num_eos++] = 2;
  }
  return kiln_model_config_validate(c, name);
}

kiln_status_t kiln_model_config_parse_generation(const kiln_json_t *root, const char *name,
                                                 kiln_model_config_t *cfg) {
  kiln_status_t st = NULL;
  if (!name) name = "generation_config.json";
  if (!kiln_json_is(root, KILN_JSON_OBJECT))
    return bad_value(name, "(top level)", "an object", root);
  const kiln_json_t *v;
  int32_t bos = cfg->bos_token_id, pad = cfg->pad_token_id;
  if ((v = opt(root, "bos_token_id")) && (st = read_token_id(name, "bos_token_id", v, &bos)))
    return st;
  if ((v = opt(root, "pad_token_id")) && (st = read_token_id(name, "pad_token_id", v, &pad)))
    return st;
  /* eos: the union, generation_config.json's ids first (what generate() stops on first). */
  int32_t ids[KILN_MODEL_MAX_EOS];
  int32_t n = 0;
  if ((v = opt(root, "eos_token_id")) && (st = read_eos(name, v, ids, &n))) return st;
  for (int32_t i = 0; i < cfg->num_eos; i++)
    if ((st = add_eos(name, "eos_token_id", ids, &n, cfg->eos_token_ids[i]))) return st;

  double temperature = 0, top_p = 0, repetition_penalty = 0;
  int64_t top_k = 0;
  bool do_sample = cfg->do_sample;
  const kiln_json_t *tv = opt(root, "temperature"), *pv = opt(root, "top_p"),
                    *kv = opt(root, "top_k"), *rv = opt(root, "repetition_penalty");
  if (tv) {
    if ((st = read_num(name, "temperature", tv, &temperature))) return st;
    if (!(temperature >= 0)) return bad_value(name, "temperature", "a number >= 0", tv);
  }
  if (pv) {
    if ((st = read_num(name, "top_p", pv, &top_p))) return st;
    if (!(top_p >= 0 && top_p <= 1)) return bad_value(name, "top_p", "a number in [0, 1]", pv);
  }
  if (kv && (st = read_int(name, "top_k", kv, 0, INT32_MAX, &top_k))) return st;
  if (rv) {
    if ((st = read_num(name, "repetition_penalty", rv, &repetition_penalty))) return st;
    if (!(repetition_penalty > 0))
      return bad_value(name, "repetition_penalty", "a positive number", rv);
  }
  if ((st = opt_bool(root, name, "do_sample", &do_sample))) return st;

  /* Everything checked: commit. */
  cfg->bos_token_id = bos;
  cfg->pad_token_id = pad;
  memcpy(cfg->eos_token_ids, ids, sizeof(ids[0]) * (size_t)n);
  cfg->num_eos = n;
  if (tv) {
    cfg->has_temperature = true;
    cfg->temperature = temperature;
  }
  if (pv) {
    cfg->has_top_p = true;
    cfg->top_p = top_p;
  }
  if (kv) {
    cfg->has_top_k = true;
    cfg->top_k = (int32_t)top_k;
  }
  if (rv) {
    cfg->has_repetition_penalty = true;
    cfg->repetition_penalty = repetition_penalty;
  }
  cfg->do_sample = do_sample;
  return NULL;
}

/* dir + "/" + file, malloc'ed; NULL on out-of-memory. */
static char *join_path(const char *dir, const char *file) {
  size_t n = strlen(dir) + strlen(file) + 2;
  char *p = malloc(n);
  if (p) snprintf(p, n, "%s%s%s", dir, (*dir && dir[strlen(dir) - 1] != '/') ? "/" : "", file);
  return p;
}

kiln_status_t kiln_model_config_load(const char *dir, kiln_model_config_t *out) {
  kiln_status_t st = NULL;
  kiln_json_doc_t *doc = NULL;
  char *path = join_path(dir, "config.json");
  if (!path) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", dir);
    goto done;
  }
  if ((st = kiln_json_parse_file(path, &doc))) goto done;
  if ((st = kiln_model_config_parse(kiln_json_root(doc), path, out))) goto done;
  kiln_json_doc_free(doc);
  doc = NULL;
  free(path);
  path = join_path(dir, "generation_config.json");
  if (!path) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", dir);
    goto done;
  }
  st = kiln_json_parse_file(path, &doc);
  if (kiln_status_code(st) == KILN_ERR_NOT_FOUND) { /* optional */
    kiln_status_free(st);
    st = NULL;
    goto done;
  }
  if (st) goto done;
  st = kiln_model_config_parse_generation(kiln_json_root(doc), path, out);
done:
  kiln_json_doc_free(doc);
  free(path);
  return st;
}

/* ---- validation ------------------------------------------------------------------------ */

#define FAIL(...) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, __VA_ARGS__)

static kiln_status_t validate_rope(const kiln_model_config_t *c, const char *name) {
  const kiln_rope_config_t *r = &c->rope;
  if (r->kind < KILN_ROPE_DEFAULT || r->kind > KILN_ROPE_YARN)
    FAIL("%s: rope.kind: %d is not a rope kind", name, r->kind);
  if (r->style != KILN_HAL_ROPE_NEOX && r->style != KILN_HAL_ROPE_INTERLEAVED)
    FAIL("%s: rope.style: %d is not a rope style", name, r->style);
  if (r->rotary_dim <= 0 || r->rotary_dim % 2 != 0 || r->rotary_dim > c->head_dim)
    FAIL(
        "%s: rotary_dim: %d (head_dim %lld * partial_rotary_factor) must be even and in "
        "[2, head_dim]",
        name, r->rotary_dim, (long long)c->head_dim);
  if (!(r->theta > 0) || !isfinite(r->theta))
    FAIL("%s: rope_theta: want a positive finite number, got %g", name, r->theta);
  if (r->kind != KILN_ROPE_DEFAULT && (!(r->factor >= 1) || !isfinite(r->factor)))
    FAIL("%s: rope factor: want a finite number >= 1, got %g", name, r->factor);
  if (r->kind == KILN_ROPE_DYNAMIC && r->rotary_dim <= 2)
    FAIL("%s: rotary_dim: dynamic rope scaling needs more than 2, got %d", name, r->rotary_dim);
  if ((r->kind == KILN_ROPE_LLAMA3 || r->kind == KILN_ROPE_YARN) && r->original_max_position <= 0)
    FAIL("%s: original_max_position_embeddings: want a positive integer, got %lld", name,
         (long long)r->original_max_position);
  if (r->kind == KILN_ROPE_LLAMA3) {
    if (!(r->low_freq_factor > 0) || !isfinite(r->low_freq_factor))
      FAIL("%s: low_freq_factor: want a positive number, got %g", name, r->low_freq_factor);
    if (!(r->high_freq_factor > r->low_freq_factor) || !isfinite(r->high_freq_factor))
      FAIL("%s: high_freq_factor: want a number > low_freq_factor (%g), got %g", name,
           r->low_freq_factor, r->high_freq_factor);
  }
  if (r->kind == KILN_ROPE_YARN) {
    if (!(r->theta > 1)) FAIL("%s: rope_theta: yarn needs a base > 1, got %g", name, r->theta);
    if (!(r->beta_fast > 0) || !isfinite(r->beta_fast))
      FAIL("%s: beta_fast: want a positive number, got %g", name, r->beta_fast);
    if (!(r->beta_slow > 0) || !isfinite(r->beta_slow))
      FAIL("%s: beta_slow: want a positive number, got %g", name, r->beta_slow);
    if (!(r->attention_factor >= 0) || !isfinite(r->attention_factor))
      FAIL("%s: attention_factor: want a positive number (0 = derive), got %g", name,
           r->attention_factor);
    if (!isfinite(r->mscale) || !isfinite(r->mscale_all_dim))
      FAIL("%s: mscale / mscale_all_dim: want finite numbers, got %g / %g", name, r->mscale,
           r->mscale_all_dim);
  }
  if (r->n_freq_factors != 0 && r->n_freq_factors != r->rotary_dim / 2)
    FAIL("%s: rope freq_factors: %d entries, want rotary_dim / 2 = %d", name, r->n_freq_factors,
         r->rotary_dim / 2);
  for (int32_t i = 0; i < r->n_freq_factors; i++)
    if (!(r->freq_factors[i] > 0) || !isfinite(r->freq_factors[i]))
      FAIL("%s: rope freq_factors[%d]: want a positive finite number, got %g", name, i,
           (double)r->freq_factors[i]);
  return NULL;
}

kiln_status_t kiln_model_config_validate(const kiln_model_config_t *c, const char *name) {
  if (!name) name = "model config";
  if (c->arch < KILN_ARCH_LLAMA || c->arch > KILN_ARCH_QWEN2_5_VL)
    FAIL("%s: arch: %d is not a supported architecture", name, c->arch);
  const struct {
    const char *key;
    int64_t v;
  } pos[] = {
      {"vocab_size", c->vocab_size},
      {"hidden_size", c->hidden_size},
      {"intermediate_size", c->intermediate_size},
      {"num_hidden_layers", c->num_layers},
      {"num_attention_heads", c->num_heads},
      {"num_key_value_heads", c->num_kv_heads},
      {"head_dim", c->head_dim},
      {"max_position_embeddings", c->max_position_embeddings},
  };
  for (size_t i = 0; i < sizeof(pos) / sizeof(pos[0]); i++)
    if (pos[i].v <= 0)
      FAIL("%s: %s: want a positive integer, got %lld", name, pos[i].key, (long long)pos[i].v);
  if (c->vocab_size > INT32_MAX)
    FAIL("%s: vocab_size: %lld does not fit 32-bit token ids", name, (long long)c->vocab_size);
  if (c->num_layers > KILN_MODEL_MAX_LAYERS)
    FAIL("%s: num_hidden_layers: %lld is more than %d", name, (long long)c->num_layers,
         KILN_MODEL_MAX_LAYERS);
  if (c->num_heads % c->num_kv_heads != 0)
    FAIL("%s: num_key_value_heads: %lld does not divide num_attention_heads %lld", name,
         (long long)c->num_kv_heads, (long long)c->num_heads);
  if (c->head_dim % 2 != 0 || c->head_dim > 2 * KILN_ROPE_MAX_FREQS)
    FAIL("%s: head_dim: %lld must be even and at most %d", name, (long long)c->head_dim,
         2 * KILN_ROPE_MAX_FREQS);
  if (!(c->rms_norm_eps > 0) || !isfinite(c->rms_norm_eps))
    FAIL("%s: rms_norm_eps: want a positive number, got %g", name, c->rms_norm_eps);
  if (c->hidden_act != KILN_HAL_ACT_SILU && c->hidden_act != KILN_HAL_ACT_GELU_TANH &&
      c->hidden_act != KILN_HAL_ACT_GELU)
    FAIL("%s: hidden_act: %d is not a supported activation", name, c->hidden_act);
  if (c->dtype != KILN_HAL_F32 && c->dtype != KILN_HAL_F16 && c->dtype != KILN_HAL_BF16)
    FAIL("%s: dtype: %d is not float32, float16 or bfloat16", name, c->dtype);
  if (c->sliding_window < 0)
    FAIL("%s: sliding_window: want a positive integer or none, got %d", name, c->sliding_window);
  for (int64_t i = 0; i < c->num_layers; i++)
    if (c->layer_sliding[i] && c->sliding_window <= 0)
      FAIL("%s: layer %lld uses a sliding window but sliding_window is %d", name, (long long)i,
           c->sliding_window);
  kiln_status_t st = validate_rope(c, name);
  if (st) return st;
  if (c->mrope) {
    int64_t sum = (int64_t)c->mrope_section[0] + c->mrope_section[1] + c->mrope_section[2];
    if (c->mrope_section[0] < 0 || c->mrope_section[1] < 0 || c->mrope_section[2] < 0 ||
        sum != c->rope.rotary_dim / 2)
      FAIL("%s: mrope_section: [%d, %d, %d] must sum to rotary_dim / 2 = %d", name,
           c->mrope_section[0], c->mrope_section[1], c->mrope_section[2], c->rope.rotary_dim / 2);
    if (c->rope.style != KILN_HAL_ROPE_NEOX || c->rope.kind != KILN_ROPE_DEFAULT)
      FAIL("%s: M-RoPE needs default neox rope", name);
  }
  if (c->num_eos < 0 || c->num_eos > KILN_MODEL_MAX_EOS)
    FAIL("%s: eos_token_id: %d ids, at most %d", name, c->num_eos, KILN_MODEL_MAX_EOS);
  for (int32_t i = 0; i < c->num_eos; i++)
    if (c->eos_token_ids[i] < 0)
      FAIL("%s: eos_token_id: %d is not a token id", name, c->eos_token_ids[i]);
  if (c->bos_token_id < -1) FAIL("%s: bos_token_id: %d is not a token id", name, c->bos_token_id);
  if (c->pad_token_id < -1) FAIL("%s: pad_token_id: %d is not a token id", name, c->pad_token_id);
  if (c->has_temperature && !(c->temperature >= 0))
    FAIL("%s: temperature: want a number >= 0, got %g", name, c->temperature);
  if (c->has_top_p && !(c->top_p >= 0 && c->top_p <= 1))
    FAIL("%s: top_p: want a number in [0, 1], got %g", name, c->top_p);
  if (c->has_top_k && c->top_k < 0) FAIL("%s: top_k: want an integer >= 0, got %d", name, c->top_k);
  if (c->has_repetition_penalty && !(c->repetition_penalty > 0))
    FAIL("%s: repetition_penalty: want a positive number, got %g", name, c->repetition_penalty);
  return NULL;
}
