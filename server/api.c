/* api.c - OpenAI request parsing and response writing (see api.h). */
#define _POSIX_C_SOURCE 200809L
#include "server/api.h"

#include "base/base64.h"
#include "server/tools.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kiln_api_limits_default(kiln_api_limits_t *l) {
  l->max_n = 256;
  l->max_prompts = 256;
  l->max_stop = 16;
  l->max_logprobs = 20;
  l->vocab_size = INT32_MAX;
  l->max_images = 8;
  l->max_image_bytes = (size_t)20 << 20;
  l->allow_remote_images = false;
}

void kiln_api_error_set(kiln_api_error_t *err, int status, const char *type, const char *param,
                        const char *fmt, ...) {
  err->status = status;
  err->type = type;
  snprintf(err->param, sizeof(err->param), "%s", param ? param : "");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->message, sizeof(err->message), fmt, ap);
  va_end(ap);
}

static bool api_bad(kiln_api_error_t *err, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool api_bad(kiln_api_error_t *err, const char *param, const char *fmt, ...) {
  err->status = 400;
  err->type = "invalid_request_error";
  snprintf(err->param, sizeof(err->param), "%s", param ? param : "");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->message, sizeof(err->message), fmt, ap);
  va_end(ap);
  return false;
}

static bool api_oom(kiln_api_error_t *err) {
  kiln_api_error_set(err, 500, "server_error", NULL, "out of memory");
  return false;
}

#define BAD(...) api_bad(err, __VA_ARGS__)
#define OOM() api_oom(err)

/* ---- typed field readers: each returns false with err set when the field is present but
 * wrong; an absent field or JSON null leaves *out untouched and returns true. ------------- */

static bool absent(const kiln_json_t *v) { return !v || kiln_json_type(v) == KILN_JSON_NULL; }

static const char *type_of(const kiln_json_t *v) { return kiln_json_type_name(kiln_json_type(v)); }

static bool get_bool(const kiln_json_t *o, const char *key, bool *out, kiln_api_error_t *err) {
  const kiln_json_t *v = kiln_json_get(o, key);
  if (absent(v)) return true;
  if (!kiln_json_is(v, KILN_JSON_BOOL))
    return BAD(key, "%s: must be a boolean, got %s", key, type_of(v));
  *out = kiln_json_bool(v);
  return true;
}

static bool get_int(const kiln_json_t *o, const char *key, int64_t lo, int64_t hi, int64_t *out,
                    kiln_api_error_t *err) {
  const kiln_json_t *v = kiln_json_get(o, key);
  if (absent(v)) return true;
  int64_t x;
  if (!kiln_json_is(v, KILN_JSON_NUMBER) || !kiln_json_int64(v, &x))
    return BAD(key, "%s: must be an integer, got %s", key,
               kiln_json_is(v, KILN_JSON_NUMBER) ? "a fraction" : type_of(v));
  if (x < lo || x > hi)
    return BAD(key, "%s: must be in [%lld, %lld], got %lld", key, (long long)lo, (long long)hi,
               (long long)x);
  *out = x;
  return true;
}

static bool get_num(const kiln_json_t *o, const char *key, double lo, double hi, bool lo_open,
                    double *out, kiln_api_error_t *err) {
  const kiln_json_t *v = kiln_json_get(o, key);
  if (absent(v)) return true;
  if (!kiln_json_is(v, KILN_JSON_NUMBER))
    return BAD(key, "%s: must be a number, got %s", key, type_of(v));
  double x = kiln_json_number(v);
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi))
    return BAD(key, "%s: must be in %s%g, %g], got %g", key, lo_open ? "(" : "[", lo, hi, x);
  *out = x;
  return true;
}

static char *dup_n(const char *s, size_t n) {
  char *d = malloc(n + 1);
  if (d) {
    memcpy(d, s, n);
    d[n] = 0;
  }
  return d;
}

static bool get_string(const kiln_json_t *o, const char *key, char **out, kiln_api_error_t *err) {
  const kiln_json_t *v = kiln_json_get(o, key);
  if (absent(v)) return true;
  size_t n;
  const char *s = kiln_json_string(v, &n);
  if (!s) return BAD(key, "%s: must be a string, got %s", key, type_of(v));
  if (!(*out = dup_n(s, n))) return OOM();
  return true;
}

/* An array of token ids in [0, vocab). */
static bool read_ids(const kiln_json_t *a, const char *what, int32_t vocab, int32_t **out,
                     int32_t *out_n, kiln_api_error_t *err) {
  size_t n = kiln_json_len(a);
  int32_t *ids = malloc((n ? n : 1) * sizeof(*ids));
  if (!ids) return OOM();
  for (size_t i = 0; i < n; i++) {
    int64_t x;
    const kiln_json_t *e = kiln_json_at(a, i);
    if (!kiln_json_is(e, KILN_JSON_NUMBER) || !kiln_json_int64(e, &x) || x < 0 || x >= vocab) {
      free(ids);
      if (kiln_json_is(e, KILN_JSON_NUMBER) && kiln_json_int64(e, &x))
        return BAD(what, "%s[%zu]: token id %lld is outside the vocabulary [0, %d)", what, i,
                   (long long)x, vocab);
      return BAD(what, "%s[%zu]: must be a token id (a non-negative integer), got %s", what, i,
                 type_of(e));
    }
    ids[i] = (int32_t)x;
  }
  *out = ids;
  *out_n = (int32_t)n;
  return true;
}

static bool is_id_array(const kiln_json_t *v) {
  if (!kiln_json_is(v, KILN_JSON_ARRAY) || kiln_json_len(v) == 0) return false;
  return kiln_json_is(kiln_json_at(v, 0), KILN_JSON_NUMBER);
}

/* prompt: a string, a list of strings, a list of ids, or a list of lists of ids. */
static bool parse_prompts(const kiln_json_t *root, kiln_api_request_t *r,
                          const kiln_api_limits_t *l, kiln_api_error_t *err) {
  const kiln_json_t *p = kiln_json_get(root, "prompt");
  if (absent(p)) return BAD("prompt", "prompt: is required");
  size_t count = 1;
  bool list = kiln_json_is(p, KILN_JSON_ARRAY) && !is_id_array(p);
  if (kiln_json_is(p, KILN_JSON_ARRAY) && !list && kiln_json_len(p) == 0) list = true;
  if (list) count = kiln_json_len(p);
  if (!kiln_json_is(p, KILN_JSON_STRING) && !kiln_json_is(p, KILN_JSON_ARRAY))
    return BAD("prompt",
               "prompt: must be a string, a list of strings or a list of token ids, got %s",
               type_of(p));
  if (count == 0) return BAD("prompt", "prompt: must not be empty");
  if (count > (size_t)l->max_prompts)
    return BAD("prompt", "prompt: at most %d prompts per request, got %zu", l->max_prompts, count);
  if (!(r->prompts = calloc(count, sizeof(*r->prompts)))) return OOM();
  r->num_prompts = (int32_t)count;
  for (size_t i = 0; i < count; i++) {
    const kiln_json_t *e = list ? kiln_json_at(p, i) : p;
    kiln_api_prompt_t *dst = &r->prompts[i];
    char what[32];
    snprintf(what, sizeof(what), list ? "prompt[%zu]" : "prompt", i);
    size_t n;
    const char *s = kiln_json_string(e, &n);
    if (s) {
      if (n == 0) return BAD("prompt", "%s: must not be empty", what);
      if (!(dst->text = dup_n(s, n))) return OOM();
      dst->text_len = n;
    } else if (kiln_json_is(e, KILN_JSON_ARRAY)) {
      if (kiln_json_len(e) == 0) return BAD("prompt", "%s: must not be empty", what);
      if (!read_ids(e, what, l->vocab_size, &dst->ids, &dst->num_ids, err)) {
        snprintf(err->param, sizeof(err->param), "prompt");
        return false;
      }
    } else {
      return BAD("prompt", "%s: must be a string or a list of token ids, got %s", what, type_of(e));
    }
  }
  return true;
}

/* An image_url part of messages[i].content[j]: a data URL (decoded now) or, when allowed, an
 * http(s) URL for the server to fetch; appended to r->images. */
static bool parse_image_part(const kiln_json_t *part, size_t i, size_t j, kiln_api_request_t *r,
                             const kiln_api_limits_t *l, kiln_api_error_t *err) {
  if (l->max_images <= 0)
    return BAD("messages",
               "messages[%zu].content[%zu]: content of type 'image_url' is not supported by this "
               "model (text only)",
               i, j);
  if (r->num_images >= l->max_images)
    return BAD("messages",
               "messages[%zu].content[%zu]: more than %d images in the request ([model] "
               "max_images_per_prompt)",
               i, j, l->max_images);
  const kiln_json_t *iu = kiln_json_get(part, "image_url");
  const kiln_json_t *u = kiln_json_is(iu, KILN_JSON_STRING) ? iu : kiln_json_get(iu, "url");
  size_t ul = 0;
  const char *url = kiln_json_string(u, &ul);
  if (!url)
    return BAD("messages",
               "messages[%zu].content[%zu].image_url: must be an object with a string \"url\"", i,
               j);
  kiln_api_image_t im = {.message = (int32_t)i, .part = (int32_t)j};
  if (ul >= 5 && !strncmp(url, "data:", 5)) {
    const char *comma = memchr(url, ',', ul);
    if (!comma)
      return BAD("messages", "messages[%zu].content[%zu]: a data URL needs a ',' before its data",
                 i, j);
    size_t hl = (size_t)(comma - url); /* "data:image/png;base64" */
    const char *mt = url + 5;
    size_t ml = 0;
    while (5 + ml < hl && mt[ml] != ';') ml++;
    bool b64 = hl >= 7 && !strncmp(url + hl - 7, ";base64", 7);
    static const char *const types[] = {"image/png", "image/jpeg", "image/jpg", "image/webp"};
    bool known = false;
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++)
      known |= ml == strlen(types[k]) && !strncmp(mt, types[k], ml);
    if (!known)
      return BAD("messages",
                 "messages[%zu].content[%zu]: unsupported image type '%.*s' in the data URL "
                 "(image/png, image/jpeg and image/webp are supported)",
                 i, j, (int)(ml > 64 ? 64 : ml), mt);
    if (!b64)
      return BAD("messages",
                 "messages[%zu].content[%zu]: the data URL must be base64 (data:%.*s;base64,...)",
                 i, j, (int)(ml > 64 ? 64 : ml), mt);
    const char *b = comma + 1;
    size_t bl = ul - hl - 1;
    if (bl / 4 * 3 > l->max_image_bytes + 3)
      return BAD("messages",
                 "messages[%zu].content[%zu]: the image is over the limit of %zu bytes ([server] "
                 "max_image_bytes)",
                 i, j, l->max_image_bytes);
    int64_t at = -1;
    if (!kiln_base64_decode(b, bl, &im.data, &im.size, &at)) {
      if (at < 0) return OOM();
      return BAD("messages",
                 "messages[%zu].content[%zu]: the data URL is not valid base64 (at character "
                 "%lld of its data)",
                 i, j, (long long)at);
    }
    if (im.size == 0) {
      free(im.data);
      return BAD("messages", "messages[%zu].content[%zu]: the data URL holds no image data", i, j);
    }
    if (im.size > l->max_image_bytes) {
      free(im.data);
      return BAD("messages",
                 "messages[%zu].content[%zu]: the image is over the limit of %zu bytes ([server] "
                 "max_image_bytes)",
                 i, j, l->max_image_bytes);
    }
  } else if ((ul > 7 && !strncmp(url, "http://", 7)) || (ul > 8 && !strncmp(url, "https://", 8))) {
    if (!l->allow_remote_images)
      return BAD("messages",
                 "messages[%zu].content[%zu]: image URLs are not fetched by this server ([server] "
                 "allow_remote_images is off): send the image as a data URL",
                 i, j);
    if (memchr(url, '\0', ul) || !(im.url = dup_n(url, ul))) return OOM();
  } else {
    return BAD("messages",
               "messages[%zu].content[%zu].image_url.url: must be a data: URL "
               "(data:image/png;base64,...) or an http(s):// URL",
               i, j);
  }
  kiln_api_image_t *grown = realloc(r->images, (size_t)(r->num_images + 1) * sizeof(*grown));
  if (!grown) {
    free(im.data);
    free(im.url);
    return OOM();
  }
  r->images = grown;
  r->images[r->num_images++] = im;
  return true;
}

/* messages: [{"role": str, "content": str | null | [{"type": "text", "text": str} |
 * {"type": "image_url", "image_url": {"url": str}}, ...], ...}]. Text-only content-part lists
 * are joined into one string (text parts separated by "\n", as vLLM does for templates that
 * expect string content); a list with images stays a list, each image becoming {"type":
 * "image"} (its bytes go to r->images) so the chat template writes its placeholder there;
 * other members pass through unchanged. */
static bool parse_messages(const kiln_json_t *root, kiln_api_request_t *r,
                           const kiln_api_limits_t *limits, kiln_api_error_t *err) {
  const kiln_json_t *m = kiln_json_get(root, "messages");
  if (absent(m)) return BAD("messages", "messages: is required");
  if (!kiln_json_is(m, KILN_JSON_ARRAY))
    return BAD("messages", "messages: must be a list of messages, got %s", type_of(m));
  size_t n = kiln_json_len(m);
  if (n == 0) return BAD("messages", "messages: must not be empty");
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_strbuf_append_char(&sb, '[');
  for (size_t i = 0; i < n; i++) {
    const kiln_json_t *msg = kiln_json_at(m, i);
    if (!kiln_json_is(msg, KILN_JSON_OBJECT)) {
      kiln_strbuf_free(&sb);
      return BAD("messages", "messages[%zu]: must be an object, got %s", i, type_of(msg));
    }
    const kiln_json_t *role = kiln_json_get(msg, "role");
    if (!kiln_json_is(role, KILN_JSON_STRING)) {
      kiln_strbuf_free(&sb);
      return BAD("messages", "messages[%zu].role: must be a string, got %s", i,
                 role ? type_of(role) : "nothing");
    }
    if (i) kiln_strbuf_append_str(&sb, ", ");
    kiln_strbuf_append_char(&sb, '{');
    size_t nm = kiln_json_len(msg);
    bool first = true;
    for (size_t k = 0; k < nm; k++) {
      size_t kl;
      const char *key = kiln_json_key_at(msg, k, &kl);
      const kiln_json_t *val = kiln_json_value_at(msg, k);
      /* a duplicated key: write its last value once (lookups see the last one) */
      if (kiln_json_getn(msg, key, kl) != val) continue;
      if (!first) kiln_strbuf_append_str(&sb, ", ");
      first = false;
      kiln_json_write_string(&sb, key, kl, false);
      kiln_strbuf_append_str(&sb, ": ");
      if (kl == 7 && !memcmp(key, "content", 7) && kiln_json_is(val, KILN_JSON_ARRAY)) {
        kiln_strbuf_t text = KILN_STRBUF_INIT;
        size_t np = kiln_json_len(val);
        bool images = false;
        for (size_t j = 0; j < np; j++) {
          const char *type = kiln_json_string(kiln_json_get(kiln_json_at(val, j), "type"), NULL);
          images |= type && !strcmp(type, "image_url");
        }
        if (images) kiln_strbuf_append_char(&text, '[');
        for (size_t j = 0; j < np; j++) {
          const kiln_json_t *part = kiln_json_at(val, j);
          const char *type = kiln_json_string(kiln_json_get(part, "type"), NULL);
          size_t tl;
          const char *t = kiln_json_string(kiln_json_get(part, "text"), &tl);
          if (!kiln_json_is(part, KILN_JSON_OBJECT) || !type) {
            kiln_strbuf_free(&text);
            kiln_strbuf_free(&sb);
            return BAD("messages", "messages[%zu].content[%zu]: must be an object with a \"type\"",
                       i, j);
          }
          if (!strcmp(type, "image_url")) {
            if (!parse_image_part(part, i, j, r, limits, err)) {
              kiln_strbuf_free(&text);
              kiln_strbuf_free(&sb);
              return false;
            }
            kiln_strbuf_append_str(&text, j ? ", {\"type\": \"image\"}" : "{\"type\": \"image\"}");
            continue;
          }
          if (strcmp(type, "text") != 0) {
            kiln_strbuf_free(&text);
            kiln_strbuf_free(&sb);
            return BAD("messages",
                       "messages[%zu].content[%zu]: content of type '%s' is not supported by "
                       "this model (text only)",
                       i, j, type);
          }
          if (!t) {
            kiln_strbuf_free(&text);
            kiln_strbuf_free(&sb);
            return BAD("messages", "messages[%zu].content[%zu].text: must be a string", i, j);
          }
          if (images) {
            if (j) kiln_strbuf_append_str(&text, ", ");
            kiln_strbuf_append_str(&text, "{\"type\": \"text\", \"text\": ");
            kiln_json_write_string(&text, t, tl, false);
            kiln_strbuf_append_char(&text, '}');
            continue;
          }
          if (j) kiln_strbuf_append_char(&text, '\n');
          kiln_strbuf_append(&text, t, tl);
        }
        if (images) {
          kiln_strbuf_append_char(&text, ']');
          kiln_strbuf_append(&sb, kiln_strbuf_cstr(&text), text.len);
        } else {
          kiln_json_write_string(&sb, kiln_strbuf_cstr(&text), text.len, false);
        }
        bool ok = kiln_strbuf_ok(&text);
        kiln_strbuf_free(&text);
        if (!ok) {
          kiln_strbuf_free(&sb);
          return OOM();
        }
      } else if (kl == 7 && !memcmp(key, "content", 7) && !absent(val) &&
                 !kiln_json_is(val, KILN_JSON_STRING)) {
        kiln_strbuf_free(&sb);
        return BAD("messages", "messages[%zu].content: must be a string or a list of parts, got %s",
                   i, type_of(val));
      } else {
        kiln_json_write(&sb, val, false, false);
      }
    }
    kiln_strbuf_append_char(&sb, '}');
  }
  kiln_strbuf_append_char(&sb, ']');
  if (!kiln_strbuf_ok(&sb)) {
    kiln_strbuf_free(&sb);
    return OOM();
  }
  r->messages_json = kiln_strbuf_detach(&sb, &r->messages_len);
  return r->messages_json ? true : OOM();
}

static bool write_member(const kiln_json_t *root, const char *key, kiln_json_type_t want,
                         char **out, size_t *out_len, kiln_api_error_t *err) {
  const kiln_json_t *v = kiln_json_get(root, key);
  if (absent(v)) return true;
  if (!kiln_json_is(v, want))
    return BAD(key, "%s: must be %s, got %s", key, want == KILN_JSON_ARRAY ? "a list" : "an object",
               type_of(v));
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_json_write(&sb, v, false, false);
  if (!kiln_strbuf_ok(&sb) || !(*out = kiln_strbuf_detach(&sb, out_len))) {
    kiln_strbuf_free(&sb);
    return OOM();
  }
  return true;
}

static bool parse_stop(const kiln_json_t *root, kiln_api_request_t *r, const kiln_api_limits_t *l,
                       kiln_api_error_t *err) {
  const kiln_json_t *v = kiln_json_get(root, "stop");
  if (absent(v)) return true;
  size_t n = kiln_json_is(v, KILN_JSON_ARRAY) ? kiln_json_len(v) : 1;
  if (!kiln_json_is(v, KILN_JSON_ARRAY) && !kiln_json_is(v, KILN_JSON_STRING))
    return BAD("stop", "stop: must be a string or a list of strings, got %s", type_of(v));
  if (n > (size_t)l->max_stop)
    return BAD("stop", "stop: at most %d stop strings, got %zu", l->max_stop, n);
  if (n == 0) return true;
  if (!(r->stop = calloc(n, sizeof(*r->stop)))) return OOM();
  for (size_t i = 0; i < n; i++) {
    const kiln_json_t *e = kiln_json_is(v, KILN_JSON_ARRAY) ? kiln_json_at(v, i) : v;
    size_t sl;
    const char *s = kiln_json_string(e, &sl);
    if (!s) return BAD("stop", "stop[%zu]: must be a string, got %s", i, type_of(e));
    if (sl == 0) return BAD("stop", "stop[%zu]: must not be empty", i);
    if (memchr(s, 0, sl)) return BAD("stop", "stop[%zu]: must not contain NUL", i);
    if (!(r->stop[r->num_stop] = dup_n(s, sl))) return OOM();
    r->num_stop++;
  }
  r->sp.stop = (const char *const *)r->stop;
  r->sp.num_stop = r->num_stop;
  return true;
}

static bool parse_logit_bias(const kiln_json_t *root, kiln_api_request_t *r,
                             const kiln_api_limits_t *l, kiln_api_error_t *err) {
  const kiln_json_t *v = kiln_json_get(root, "logit_bias");
  if (absent(v)) return true;
  if (!kiln_json_is(v, KILN_JSON_OBJECT))
    return BAD("logit_bias", "logit_bias: must be an object of token id -> bias, got %s",
               type_of(v));
  size_t n = kiln_json_len(v);
  if (n == 0) return true;
  if (n > 1024) return BAD("logit_bias", "logit_bias: at most 1024 entries, got %zu", n);
  if (!(r->bias_ids = malloc(n * sizeof(int32_t))) || !(r->bias_values = malloc(n * sizeof(float))))
    return OOM();
  for (size_t i = 0; i < n; i++) {
    size_t kl;
    const char *key = kiln_json_key_at(v, i, &kl);
    char *end = NULL;
    char buf[24];
    long long id = -1;
    if (kl > 0 && kl < sizeof(buf)) {
      memcpy(buf, key, kl);
      buf[kl] = 0;
      id = strtoll(buf, &end, 10);
    }
    if (!end || *end || buf[0] == '-' || buf[0] == '+' || buf[0] == ' ' || id < 0 ||
        id >= l->vocab_size)
      return BAD("logit_bias", "logit_bias: key '%.*s' is not a token id in [0, %d)",
                 (int)(kl < 40 ? kl : 40), key, l->vocab_size);
    const kiln_json_t *b = kiln_json_value_at(v, i);
    if (!kiln_json_is(b, KILN_JSON_NUMBER))
      return BAD("logit_bias", "logit_bias[%lld]: must be a number, got %s", id, type_of(b));
    double x = kiln_json_number(b);
    if (!(x >= -100 && x <= 100))
      return BAD("logit_bias", "logit_bias[%lld]: must be in [-100, 100], got %g", id, x);
    r->bias_ids[i] = (int32_t)id;
    r->bias_values[i] = (float)x;
  }
  r->sp.logit_bias_ids = r->bias_ids;
  r->sp.logit_bias_values = r->bias_values;
  r->sp.num_logit_bias = (int32_t)n;
  return true;
}

/* ---- structured outputs ---------------------------------------------------------------- */

/* One constraint field: kind, its JSON value, and the name for messages ("guided_json",
 * "response_format.json_schema.schema", "structured_outputs.regex", ...). */
static bool set_guide(kiln_api_request_t *r, kiln_guide_kind_t kind, const kiln_json_t *v,
                      const char *field, kiln_api_error_t *err) {
  if (r->sp.guide != KILN_GUIDE_NONE)
    return BAD(field,
               "%s: only one constraint per request (already %s); response_format, guided_json, "
               "guided_regex, guided_choice, guided_grammar and structured_outputs exclude each "
               "other",
               field, r->guide_field);
  snprintf(r->guide_field, sizeof(r->guide_field), "%s", field);
  r->sp.guide = kind;
  if (kind == KILN_GUIDE_JSON_OBJECT) return true;
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  size_t n;
  const char *str = kiln_json_string(v, &n);
  switch (kind) {
    case KILN_GUIDE_JSON_SCHEMA: /* a schema object (or true/false), or its JSON text */
      if (str)
        kiln_strbuf_append(&sb, str, n);
      else if (kiln_json_is(v, KILN_JSON_OBJECT) || kiln_json_is(v, KILN_JSON_BOOL))
        kiln_json_write(&sb, v, false, false);
      else
        return BAD(field, "%s: must be a JSON Schema (an object), got %s", field, type_of(v));
      break;
    case KILN_GUIDE_REGEX:
    case KILN_GUIDE_GRAMMAR:
      if (!str) return BAD(field, "%s: must be a string, got %s", field, type_of(v));
      if (!n) return BAD(field, "%s: must not be empty", field);
      kiln_strbuf_append(&sb, str, n);
      break;
    case KILN_GUIDE_CHOICE:
      if (!kiln_json_is(v, KILN_JSON_ARRAY) || !kiln_json_len(v))
        return BAD(field, "%s: must be a non-empty list of strings, got %s", field, type_of(v));
      for (size_t i = 0; i < kiln_json_len(v); i++) {
        size_t cl;
        const kiln_json_t *c = kiln_json_at(v, i);
        if (!kiln_json_string(c, &cl))
          return BAD(field, "%s[%zu]: must be a string, got %s", field, i, type_of(c));
        if (!cl) return BAD(field, "%s[%zu]: must not be empty", field, i);
      }
      kiln_json_write(&sb, v, false, false);
      break;
    default: break;
  }
  if (!kiln_strbuf_ok(&sb) || !(r->guide_spec = kiln_strbuf_detach(&sb, &n))) {
    kiln_strbuf_free(&sb);
    return OOM();
  }
  r->sp.guide_spec = r->guide_spec;
  r->sp.guide_spec_len = n;
  return true;
}

/* Fields that would change the output and are not supported: present and not null/false. */
static bool refuse_set(const kiln_json_t *o, const char *prefix, const char *const *keys,
                       kiln_api_error_t *err) {
  for (int i = 0; keys[i]; i++) {
    const kiln_json_t *v = kiln_json_get(o, keys[i]);
    if (absent(v) || (kiln_json_is(v, KILN_JSON_BOOL) && !kiln_json_bool(v))) continue;
    char f[64];
    snprintf(f, sizeof(f), "%s%s", prefix, keys[i]);
    return BAD(f, "%s: is not supported", f);
  }
  return true;
}

/* response_format (OpenAI), guided_* (vLLM) and structured_outputs (vLLM's newer form): at
 * most one constraint. The engine compiles it at submission; its errors come back as 400s
 * naming guide_field. */
static bool parse_guide(const kiln_json_t *root, kiln_api_request_t *r, kiln_api_error_t *err) {
  const kiln_json_t *rf = kiln_json_get(root, "response_format");
  if (!absent(rf)) {
    const char *t = kiln_json_string(kiln_json_get(rf, "type"), NULL);
    if (!kiln_json_is(rf, KILN_JSON_OBJECT) || !t)
      return BAD("response_format", "response_format: must be an object with a \"type\"");
    if (!strcmp(t, "json_object")) {
      if (!set_guide(r, KILN_GUIDE_JSON_OBJECT, NULL, "response_format", err)) return false;
    } else if (!strcmp(t, "json_schema")) {
      const kiln_json_t *js = kiln_json_get(rf, "json_schema");
      if (!kiln_json_is(js, KILN_JSON_OBJECT))
        return BAD("response_format",
                   "response_format.json_schema: must be an object with \"name\" and \"schema\"");
      const kiln_json_t *nm = kiln_json_get(js, "name"), *st = kiln_json_get(js, "strict");
      if (!absent(nm) && !kiln_json_is(nm, KILN_JSON_STRING))
        return BAD("response_format", "response_format.json_schema.name: must be a string, got %s",
                   type_of(nm));
      if (!absent(st) && !kiln_json_is(st, KILN_JSON_BOOL))
        return BAD("response_format",
                   "response_format.json_schema.strict: must be a boolean, got %s", type_of(st));
      const kiln_json_t *sc = kiln_json_get(js, "schema");
      if (absent(sc))
        return BAD("response_format", "response_format.json_schema.schema: is required");
      if (!set_guide(r, KILN_GUIDE_JSON_SCHEMA, sc, "response_format.json_schema.schema", err))
        return false;
    } else if (strcmp(t, "text") != 0) {
      return BAD("response_format",
                 "response_format: type '%s' is not supported (text, json_object, json_schema)", t);
    }
  }
  static const struct {
    const char *key;
    kiln_guide_kind_t kind;
  } g[] = {{"guided_json", KILN_GUIDE_JSON_SCHEMA},
           {"guided_regex", KILN_GUIDE_REGEX},
           {"guided_choice", KILN_GUIDE_CHOICE},
           {"guided_grammar", KILN_GUIDE_GRAMMAR}};
  for (size_t i = 0; i < sizeof(g) / sizeof(g[0]); i++) {
    const kiln_json_t *v = kiln_json_get(root, g[i].key);
    if (!absent(v) && !set_guide(r, g[i].kind, v, g[i].key, err)) return false;
  }
  /* guided_decoding_backend only picks vLLM's implementation: the output is the same */
  static const char *const refused[] = {"guided_whitespace_pattern", NULL};
  if (!refuse_set(root, "", refused, err)) return false;
  const kiln_json_t *so = kiln_json_get(root, "structured_outputs");
  if (!absent(so)) {
    if (!kiln_json_is(so, KILN_JSON_OBJECT))
      return BAD("structured_outputs", "structured_outputs: must be an object, got %s",
                 type_of(so));
    static const struct {
      const char *key, *field;
      kiln_guide_kind_t kind;
    } h[] = {{"json", "structured_outputs.json", KILN_GUIDE_JSON_SCHEMA},
             {"regex", "structured_outputs.regex", KILN_GUIDE_REGEX},
             {"choice", "structured_outputs.choice", KILN_GUIDE_CHOICE},
             {"grammar", "structured_outputs.grammar", KILN_GUIDE_GRAMMAR}};
    for (size_t i = 0; i < sizeof(h) / sizeof(h[0]); i++) {
      const kiln_json_t *v = kiln_json_get(so, h[i].key);
      if (!absent(v) && !set_guide(r, h[i].kind, v, h[i].field, err)) return false;
    }
    bool jo = false;
    if (!get_bool(so, "json_object", &jo, err)) return false;
    if (jo && !set_guide(r, KILN_GUIDE_JSON_OBJECT, NULL, "structured_outputs.json_object", err))
      return false;
    static const char *const so_refused[] = {"whitespace_pattern", "structural_tag",
                                             "disable_any_whitespace", NULL};
    if (!refuse_set(so, "structured_outputs.", so_refused, err)) return false;
  }
  return true;
}

/* Beam search (vLLM's legacy use_beam_search with best_of as the width, or the beam_width
 * extra; length_penalty, early_stopping true / false / "never"). Without it, best_of is
 * accepted only when it asks for nothing more than n. */
static bool parse_beam(const kiln_json_t *root, kiln_api_request_t *r, const kiln_api_limits_t *l,
                       kiln_api_error_t *err) {
  kiln_sampling_params_t *sp = &r->sp;
  bool use = false;
  if (!get_bool(root, "use_beam_search", &use, err)) return false;
  int64_t best_of = -1, width = -1;
  if (!get_int(root, "best_of", 1, INT32_MAX, &best_of, err)) return false;
  if (!get_int(root, "beam_width", 1, l->max_n, &width, err)) return false;
  bool beam = use || width > 0;
  if (!beam) {
    if (best_of > 0 && best_of != sp->n)
      return BAD("best_of",
                 "best_of: only best_of == n is supported without beam search, got best_of %lld "
                 "with n %d",
                 (long long)best_of, sp->n);
    static const char *const beam_only[] = {"length_penalty", "early_stopping"};
    for (size_t i = 0; i < 2; i++)
      if (!absent(kiln_json_get(root, beam_only[i])))
        return BAD(beam_only[i], "%s: needs beam search (use_beam_search or beam_width)",
                   beam_only[i]);
    return true;
  }
  if (width > 0 && best_of > 0 && best_of != width)
    return BAD("best_of", "best_of: with beam_width %lld it must be absent or equal, got %lld",
               (long long)width, (long long)best_of);
  if (width < 0) width = best_of > 0 ? best_of : sp->n;
  if (width > l->max_n)
    return BAD("best_of", "best_of: the beam width must be at most %d, got %lld", l->max_n,
               (long long)width);
  if (sp->n > width)
    return BAD("n", "n: must be at most the beam width (%lld) with beam search, got %d",
               (long long)width, sp->n);
  sp->beam_width = (int32_t)width;
  double d = 1.0;
  if (!get_num(root, "length_penalty", -1e6, 1e6, false, &d, err)) return false;
  sp->length_penalty = (float)d;
  const kiln_json_t *es = kiln_json_get(root, "early_stopping");
  if (!absent(es)) {
    const char *str = NULL;
    if (kiln_json_is(es, KILN_JSON_BOOL)) {
      bool b = false;
      if (!get_bool(root, "early_stopping", &b, err)) return false;
      sp->early_stopping = b ? KILN_EARLY_STOPPING_TRUE : KILN_EARLY_STOPPING_FALSE;
    } else if (kiln_json_is(es, KILN_JSON_STRING) && (str = kiln_json_string(es, NULL)) &&
               !strcmp(str, "never")) {
      sp->early_stopping = KILN_EARLY_STOPPING_NEVER;
    } else {
      return BAD("early_stopping", "early_stopping: must be true, false or \"never\"");
    }
  }
  return true;
}

/* What beam search cannot go with (after every field is read). */
static bool check_beam(const kiln_json_t *root, const kiln_api_request_t *r, kiln_api_error_t *err) {
  if (r->sp.beam_width <= 0) return true;
  if (r->stream) return BAD("stream", "stream: is not supported with beam search");
  if (r->logprobs >= 0) return BAD("logprobs", "logprobs: is not supported with beam search");
  if (r->sp.prompt_logprobs >= 0)
    return BAD("prompt_logprobs", "prompt_logprobs: is not supported with beam search");
  if (r->sp.num_stop) return BAD("stop", "stop: is not supported with beam search");
  if (r->sp.min_tokens > 0) return BAD("min_tokens", "min_tokens: is not supported with beam search");
  if (r->sp.num_logit_bias) return BAD("logit_bias", "logit_bias: is not supported with beam search");
  if (r->sp.guide != KILN_GUIDE_NONE)
    return BAD(NULL, "structured output (guided_* / response_format) is not supported with beam "
                     "search");
  static const char *const pen[] = {"presence_penalty", "frequency_penalty", "repetition_penalty"};
  if (r->sp.presence_penalty != 0 || r->sp.frequency_penalty != 0 || r->sp.repetition_penalty != 1)
    for (size_t i = 0; i < 3; i++)
      if (!absent(kiln_json_get(root, pen[i])))
        return BAD(pen[i], "%s: is not supported with beam search", pen[i]);
  return true;
}

/* The sampling fields shared by completions and chat. */
static bool parse_sampling(const kiln_json_t *root, kiln_api_request_t *r,
                           const kiln_api_limits_t *l, kiln_api_error_t *err) {
  kiln_sampling_params_t *sp = &r->sp;
  int64_t x;
  double d;
  /* max_tokens; chat's newer max_completion_tokens takes precedence */
  const char *mt = "max_tokens";
  if (!absent(kiln_json_get(root, "max_completion_tokens"))) mt = "max_completion_tokens";
  x = -2;
  if (!get_int(root, mt, 1, INT32_MAX, &x, err)) {
    if (strstr(err->message, "must be in")) {
      int64_t bad = 0;
      kiln_json_int64(kiln_json_get(root, mt), &bad);
      return BAD(mt, "%s: must be at least 1, got %lld", mt, (long long)bad);
    }
    return false;
  }
  if (x != -2) {
    sp->max_tokens = (int32_t)x;
    r->max_tokens_given = true;
  }
  x = sp->min_tokens;
  if (!get_int(root, "min_tokens", 0, INT32_MAX, &x, err)) return false;
  sp->min_tokens = (int32_t)x;
  d = 1.0;
  if (!get_num(root, "temperature", 0, 100, false, &d, err)) return false;
  sp->temperature = (float)d;
  d = 1.0;
  if (!get_num(root, "top_p", 0, 1, true, &d, err)) return false;
  sp->top_p = (float)d;
  x = 0;
  if (!get_int(root, "top_k", -1, INT32_MAX, &x, err)) return false;
  sp->top_k = x < 0 ? 0 : (int32_t)x;
  d = 0;
  if (!get_num(root, "min_p", 0, 1, false, &d, err)) return false;
  sp->min_p = (float)d;
  x = 1;
  if (!get_int(root, "n", 1, l->max_n, &x, err)) return false;
  sp->n = (int32_t)x;
  if (!parse_beam(root, r, l, err)) return false;
  d = 0;
  if (!get_num(root, "presence_penalty", -2, 2, false, &d, err)) return false;
  sp->presence_penalty = (float)d;
  d = 0;
  if (!get_num(root, "frequency_penalty", -2, 2, false, &d, err)) return false;
  sp->frequency_penalty = (float)d;
  d = 1;
  if (!get_num(root, "repetition_penalty", 0, 100, true, &d, err)) return false;
  sp->repetition_penalty = (float)d;
  const kiln_json_t *seed = kiln_json_get(root, "seed");
  if (!absent(seed)) {
    if (!kiln_json_is(seed, KILN_JSON_NUMBER) || !kiln_json_int64(seed, &x))
      return BAD("seed", "seed: must be an integer, got %s", type_of(seed));
    sp->has_seed = true;
    sp->seed = (uint64_t)x;
  }
  if (!get_bool(root, "ignore_eos", &sp->ignore_eos, err) ||
      !get_bool(root, "skip_special_tokens", &sp->skip_special_tokens, err) ||
      !get_bool(root, "include_stop_str_in_output", &sp->include_stop_str_in_output, err))
    return false;
  x = 0;
  if (!get_int(root, "priority", INT32_MIN, INT32_MAX, &x, err)) return false;
  sp->priority = (int32_t)x;
  const kiln_json_t *sti = kiln_json_get(root, "stop_token_ids");
  if (!absent(sti)) {
    if (!kiln_json_is(sti, KILN_JSON_ARRAY))
      return BAD("stop_token_ids", "stop_token_ids: must be a list of token ids, got %s",
                 type_of(sti));
    if (kiln_json_len(sti) > 1024) return BAD("stop_token_ids", "stop_token_ids: at most 1024 ids");
    if (kiln_json_len(sti)) {
      if (!read_ids(sti, "stop_token_ids", l->vocab_size, &r->stop_token_ids,
                    &sp->num_stop_token_ids, err))
        return false;
      sp->stop_token_ids = r->stop_token_ids;
    }
  }
  if (!parse_stop(root, r, l, err) || !parse_logit_bias(root, r, l, err)) return false;
  if (!get_bool(root, "stream", &r->stream, err) || !get_string(root, "user", &r->user, err))
    return false;
  const kiln_json_t *so = kiln_json_get(root, "stream_options");
  if (!absent(so)) {
    if (!kiln_json_is(so, KILN_JSON_OBJECT))
      return BAD("stream_options", "stream_options: must be an object, got %s", type_of(so));
    if (!get_bool(so, "include_usage", &r->include_usage, err) ||
        !get_bool(so, "continuous_usage_stats", &r->continuous_usage, err)) {
      snprintf(err->param, sizeof(err->param), "stream_options");
      return false;
    }
    if (!r->stream)
      return BAD("stream_options", "stream_options: only allowed when stream is true");
  }
  return parse_guide(root, r, err);
}

static bool parse_logprobs(const kiln_json_t *root, kiln_api_request_t *r,
                           const kiln_api_limits_t *l, kiln_api_error_t *err) {
  int64_t x;
  r->logprobs = -1;
  if (r->kind == KILN_API_COMPLETIONS) {
    x = -1;
    if (!get_int(root, "logprobs", 0, l->max_logprobs, &x, err)) return false;
    r->logprobs = (int32_t)x;
  } else {
    if (!get_bool(root, "logprobs", &r->chat_logprobs, err)) return false;
    x = -1;
    if (!get_int(root, "top_logprobs", 0, l->max_logprobs, &x, err)) return false;
    if (x >= 0 && !r->chat_logprobs)
      return BAD("top_logprobs", "top_logprobs: needs logprobs to be true");
    if (r->chat_logprobs) r->logprobs = x < 0 ? 0 : (int32_t)x;
  }
  r->sp.logprobs = r->logprobs;
  x = -1;
  if (!get_int(root, "prompt_logprobs", 0, l->max_logprobs, &x, err)) return false;
  r->sp.prompt_logprobs = (int32_t)x;
  /* echo with logprobs returns the prompt tokens' logprobs too (OpenAI's behaviour) */
  if (r->echo && r->logprobs >= 0 && r->sp.prompt_logprobs < r->logprobs)
    r->sp.prompt_logprobs = r->logprobs;
  return true;
}

bool kiln_api_parse(kiln_api_kind_t kind, const char *body, size_t len,
                    const kiln_api_limits_t *limits, kiln_api_request_t **out_req,
                    kiln_api_error_t *err) {
  *out_req = NULL;
  memset(err, 0, sizeof(*err));
  kiln_api_limits_t dl;
  if (!limits) {
    kiln_api_limits_default(&dl);
    limits = &dl;
  }
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(body, len, "request body", &doc);
  if (st) {
    bool oom = kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY;
    if (oom)
      OOM();
    else
      BAD(NULL, "malformed JSON: %s", kiln_status_message(st));
    kiln_status_free(st);
    return false;
  }
  const kiln_json_t *root = kiln_json_root(doc);
  kiln_api_request_t *r = calloc(1, sizeof(*r));
  bool ok = false;
  if (!r) {
    OOM();
    goto done;
  }
  r->kind = kind;
  kiln_sampling_params_init(&r->sp);
  r->logprobs = -1;
  r->add_generation_prompt = true;
  if (!kiln_json_is(root, KILN_JSON_OBJECT)) {
    BAD(NULL, "the request body must be a JSON object, got %s", type_of(root));
    goto done;
  }
  if (!get_string(root, "model", &r->model, err)) goto done;
  switch (kind) {
    case KILN_API_COMPLETIONS:
      r->sp.max_tokens = 16; /* OpenAI's and vLLM's default for completions */
      r->add_special_tokens = true;
      if (!parse_prompts(root, r, limits, err) || !get_bool(root, "echo", &r->echo, err) ||
          !parse_sampling(root, r, limits, err) || !parse_logprobs(root, r, limits, err) ||
          !check_beam(root, r, err))
        goto done;
      if (!absent(kiln_json_get(root, "suffix"))) {
        BAD("suffix", "suffix: is not supported");
        goto done;
      }
      break;
    case KILN_API_CHAT:
      r->sp.max_tokens = -1; /* the rest of the context */
      r->add_special_tokens = false;
      if (!parse_messages(root, r, limits, err) || !parse_sampling(root, r, limits, err) ||
          !parse_logprobs(root, r, limits, err) || !check_beam(root, r, err) ||
          !get_bool(root, "add_generation_prompt", &r->add_generation_prompt, err) ||
          !get_bool(root, "add_special_tokens", &r->add_special_tokens, err) ||
          !kiln_api_parse_tools(root, r, err) ||
          !write_member(root, "chat_template_kwargs", KILN_JSON_OBJECT, &r->template_kwargs_json,
                        &r->template_kwargs_len, err))
        goto done;
      if (!absent(kiln_json_get(root, "echo"))) {
        bool e = false;
        if (!get_bool(root, "echo", &e, err)) goto done;
        if (e) {
          BAD("echo", "echo: is not supported for chat completions");
          goto done;
        }
      }
      break;
    case KILN_API_TOKENIZE:
      if (!absent(kiln_json_get(root, "messages"))) {
        r->add_special_tokens = false;
        if (!parse_messages(root, r, limits, err) ||
            !get_bool(root, "add_generation_prompt", &r->add_generation_prompt, err) ||
            !kiln_api_parse_tools(root, r, err) ||
            !write_member(root, "chat_template_kwargs", KILN_JSON_OBJECT, &r->template_kwargs_json,
                          &r->template_kwargs_len, err))
          goto done;
      } else {
        r->add_special_tokens = true;
        const kiln_json_t *p = kiln_json_get(root, "prompt");
        if (!kiln_json_is(p, KILN_JSON_STRING)) {
          BAD("prompt", "prompt: must be a string (or give messages), got %s",
              p ? type_of(p) : "nothing");
          goto done;
        }
        if (!parse_prompts(root, r, limits, err)) goto done;
      }
      if (!get_bool(root, "add_special_tokens", &r->add_special_tokens, err)) goto done;
      break;
    case KILN_API_DETOKENIZE: {
      const kiln_json_t *t = kiln_json_get(root, "tokens");
      if (!kiln_json_is(t, KILN_JSON_ARRAY)) {
        BAD("tokens", "tokens: must be a list of token ids, got %s", t ? type_of(t) : "nothing");
        goto done;
      }
      if (!read_ids(t, "tokens", limits->vocab_size, &r->tokens, &r->num_tokens, err)) goto done;
      break;
    }
  }
  ok = true;
done:
  kiln_json_doc_free(doc);
  if (!ok) {
    kiln_api_request_free(r);
    return false;
  }
  *out_req = r;
  return true;
}

void kiln_api_request_free(kiln_api_request_t *r) {
  if (!r) return;
  free(r->model);
  free(r->user);
  for (int32_t i = 0; i < r->num_prompts; i++) {
    free(r->prompts[i].text);
    free(r->prompts[i].ids);
  }
  free(r->prompts);
  free(r->messages_json);
  free(r->tools_json);
  free(r->tool_name);
  free(r->tool_guide);
  free(r->template_kwargs_json);
  for (int32_t i = 0; i < r->num_images; i++) {
    free(r->images[i].data);
    free(r->images[i].url);
  }
  free(r->images);
  free(r->tokens);
  for (int32_t i = 0; i < r->num_stop; i++) free(r->stop[i]);
  free(r->stop);
  free(r->stop_token_ids);
  free(r->bias_ids);
  free(r->bias_values);
  free(r->guide_spec);
  free(r);
}

/* ---- writing ------------------------------------------------------------------------------ */

static void wstr(kiln_strbuf_t *o, const char *s) {
  if (!s) {
    kiln_strbuf_append_str(o, "null");
    return;
  }
  kiln_json_write_string(o, s, strlen(s), false);
}

static void wfloat(kiln_strbuf_t *o, double x) {
  if (isnan(x))
    kiln_strbuf_append_str(o, "null");
  else if (isinf(x))
    kiln_strbuf_append_str(o, x < 0 ? "-9999.0" : "9999.0"); /* JSON has no infinities */
  else
    kiln_strbuf_printf(o, "%.9g", x);
}

void kiln_api_write_error(kiln_strbuf_t *out, const kiln_api_error_t *err) {
  kiln_strbuf_append_str(out, "{\"error\": {\"message\": ");
  wstr(out, err->message);
  kiln_strbuf_append_str(out, ", \"type\": ");
  wstr(out, err->type ? err->type : "invalid_request_error");
  kiln_strbuf_append_str(out, ", \"param\": ");
  wstr(out, err->param[0] ? err->param : NULL);
  kiln_strbuf_printf(out, ", \"code\": %d}}", err->status);
}

void kiln_api_write_stream_error(kiln_strbuf_t *out, const kiln_api_error_t *err) {
  kiln_strbuf_append_str(out, "data: ");
  kiln_api_write_error(out, err);
  kiln_strbuf_append_str(out, "\n\n");
}

const char *kiln_api_finish_name(kiln_finish_reason_t f) {
  switch (f) {
    case KILN_FINISH_STOP: return "stop";
    case KILN_FINISH_LENGTH: return "length";
    case KILN_FINISH_ABORT: return "abort";
    case KILN_FINISH_ERROR: return "error";
    default: return NULL;
  }
}

void kiln_api_token_free(kiln_api_token_t *t) {
  free(t->text);
  for (int32_t i = 0; i < t->num_top; i++) free(t->top_text ? t->top_text[i] : NULL);
  free(t->top_text);
  free(t->top_ids);
  free(t->top_logprobs);
  memset(t, 0, sizeof(*t));
}

void kiln_api_choice_reset_tokens(kiln_api_choice_t *c) {
  for (int32_t i = 0; i < c->num_tokens; i++) kiln_api_token_free(&c->tokens[i]);
  c->num_tokens = 0;
}

void kiln_api_choice_free(kiln_api_choice_t *c) {
  kiln_api_choice_reset_tokens(c);
  kiln_api_tool_state_free(c);
  free(c->tokens);
  kiln_strbuf_free(&c->text);
  free(c->stop_str);
  memset(c, 0, sizeof(*c));
}

bool kiln_api_choice_push_token(kiln_api_choice_t *c, kiln_api_token_t *t) {
  if (c->num_tokens == c->cap_tokens) {
    int32_t cap = c->cap_tokens ? 2 * c->cap_tokens : 16;
    kiln_api_token_t *nt = realloc(c->tokens, (size_t)cap * sizeof(*nt));
    if (!nt) {
      kiln_api_token_free(t);
      return false;
    }
    c->tokens = nt;
    c->cap_tokens = cap;
  }
  c->tokens[c->num_tokens++] = *t;
  memset(t, 0, sizeof(*t));
  return true;
}

/* The UTF-8 bytes of a token's text, as OpenAI's chat logprobs give them. */
static void wbytes(kiln_strbuf_t *o, const char *s) {
  kiln_strbuf_append_char(o, '[');
  for (size_t i = 0; s && s[i]; i++) kiln_strbuf_printf(o, i ? ", %u" : "%u", (unsigned char)s[i]);
  kiln_strbuf_append_char(o, ']');
}

/* Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]} */
static void write_chat_logprobs(kiln_strbuf_t *o, const kiln_api_choice_t *c) {
  kiln_strbuf_append_str(o, "{\"content\": [");
  for (int32_t i = 0; i < c->num_tokens; i++) {
    const kiln_api_token_t *t = &c->tokens[i];
    if (i) kiln_strbuf_append_str(o, ", ");
    kiln_strbuf_append_str(o, "{\"token\": ");
    wstr(o, t->text ? t->text : "");
    kiln_strbuf_append_str(o, ", \"logprob\": ");
    wfloat(o, t->logprob);
    kiln_strbuf_append_str(o, ", \"bytes\": ");
    wbytes(o, t->text);
    kiln_strbuf_append_str(o, ", \"top_logprobs\": [");
    for (int32_t k = 0; k < t->num_top; k++) {
      if (k) kiln_strbuf_append_str(o, ", ");
      kiln_strbuf_append_str(o, "{\"token\": ");
      wstr(o, t->top_text && t->top_text[k] ? t->top_text[k] : "");
      kiln_strbuf_append_str(o, ", \"logprob\": ");
      wfloat(o, t->top_logprobs[k]);
      kiln_strbuf_append_str(o, ", \"bytes\": ");
      wbytes(o, t->top_text ? t->top_text[k] : NULL);
      kiln_strbuf_append_char(o, '}');
    }
    kiln_strbuf_append_str(o, "]}");
  }
  kiln_strbuf_append_str(o, "]}");
}

/* Completions: {"tokens", "token_logprobs", "top_logprobs": [{text: lp}], "text_offset"} */
static void write_completion_logprobs(kiln_strbuf_t *o, kiln_api_choice_t *c) {
  kiln_strbuf_append_str(o, "{\"tokens\": [");
  for (int32_t i = 0; i < c->num_tokens; i++) {
    if (i) kiln_strbuf_append_str(o, ", ");
    wstr(o, c->tokens[i].text ? c->tokens[i].text : "");
  }
  kiln_strbuf_append_str(o, "], \"token_logprobs\": [");
  for (int32_t i = 0; i < c->num_tokens; i++) {
    if (i) kiln_strbuf_append_str(o, ", ");
    wfloat(o, c->tokens[i].logprob);
  }
  kiln_strbuf_append_str(o, "], \"top_logprobs\": [");
  for (int32_t i = 0; i < c->num_tokens; i++) {
    const kiln_api_token_t *t = &c->tokens[i];
    if (i) kiln_strbuf_append_str(o, ", ");
    if (isnan(t->logprob) && t->num_top == 0) {
      kiln_strbuf_append_str(o, "null");
      continue;
    }
    kiln_strbuf_append_char(o, '{');
    /* keys are token texts; two ids with the same text keep the first (higher) one */
    int32_t written = 0;
    for (int32_t k = 0; k < t->num_top; k++) {
      const char *tx = t->top_text && t->top_text[k] ? t->top_text[k] : "";
      bool dup = false;
      for (int32_t j = 0; j < k && !dup; j++)
        dup = !strcmp(t->top_text && t->top_text[j] ? t->top_text[j] : "", tx);
      if (dup) continue;
      if (written++) kiln_strbuf_append_str(o, ", ");
      wstr(o, tx);
      kiln_strbuf_append_str(o, ": ");
      wfloat(o, t->top_logprobs[k]);
    }
    kiln_strbuf_append_char(o, '}');
  }
  kiln_strbuf_append_str(o, "], \"text_offset\": [");
  for (int32_t i = 0; i < c->num_tokens; i++) {
    if (i) kiln_strbuf_append_str(o, ", ");
    kiln_strbuf_printf(o, "%zu", c->text_offset);
    c->text_offset += c->tokens[i].text ? strlen(c->tokens[i].text) : 0;
  }
  kiln_strbuf_append_str(o, "]}");
}

static void write_logprobs(kiln_strbuf_t *o, const kiln_api_request_t *req, kiln_api_choice_t *c) {
  if (req->logprobs < 0) {
    kiln_strbuf_append_str(o, "null");
    return;
  }
  if (req->kind == KILN_API_CHAT)
    write_chat_logprobs(o, c);
  else
    write_completion_logprobs(o, c);
}

/* vLLM's stop_reason: the stop string, or the id from stop_token_ids that ended the choice;
 * null for the model's own end-of-sequence token and for every other finish. */
static void write_stop_reason(kiln_strbuf_t *o, const kiln_api_request_t *req,
                              const kiln_api_choice_t *c) {
  kiln_strbuf_append_str(o, ", \"stop_reason\": ");
  bool listed = false;
  for (int32_t i = 0; i < req->sp.num_stop_token_ids && !listed; i++)
    listed = req->sp.stop_token_ids[i] == c->stop_token;
  if (c->stop_str)
    wstr(o, c->stop_str);
  else if (c->finish == KILN_FINISH_STOP && c->stop_token >= 0 && listed)
    kiln_strbuf_printf(o, "%d", c->stop_token);
  else
    kiln_strbuf_append_str(o, "null");
}

static void write_usage(kiln_strbuf_t *o, const kiln_usage_t *u) {
  kiln_strbuf_printf(o,
                     "{\"prompt_tokens\": %d, \"completion_tokens\": %d, \"total_tokens\": %d, "
                     "\"prompt_tokens_details\": {\"cached_tokens\": %d}}",
                     u->prompt_tokens, u->completion_tokens,
                     u->prompt_tokens + u->completion_tokens, u->cached_tokens);
}

static void write_head(kiln_strbuf_t *o, const kiln_api_response_t *r, const char *object) {
  kiln_strbuf_append_str(o, "{\"id\": ");
  wstr(o, r->id);
  kiln_strbuf_printf(o, ", \"object\": \"%s\", \"created\": %lld, \"model\": ", object,
                     (long long)r->created);
  wstr(o, r->model);
}

void kiln_api_write_response(kiln_strbuf_t *out, const kiln_api_response_t *r,
                             kiln_api_choice_t *choices, int32_t num_choices) {
  const bool chat = r->req->kind == KILN_API_CHAT;
  write_head(out, r, chat ? "chat.completion" : "text_completion");
  kiln_strbuf_append_str(out, ", \"choices\": [");
  for (int32_t i = 0; i < num_choices; i++) {
    kiln_api_choice_t *c = &choices[i];
    if (i) kiln_strbuf_append_str(out, ", ");
    kiln_strbuf_printf(out, "{\"index\": %d, ", c->index);
    if (chat) {
      kiln_strbuf_append_str(out, "\"message\": {\"role\": \"assistant\", ");
      kiln_api_write_message_body(out, c); /* content, and tool_calls */
      kiln_strbuf_append_str(out, "}");
    } else {
      kiln_strbuf_append_str(out, "\"text\": ");
      kiln_json_write_string(out, kiln_strbuf_cstr(&c->text), c->text.len, false);
    }
    kiln_strbuf_append_str(out, ", \"logprobs\": ");
    write_logprobs(out, r->req, c);
    kiln_strbuf_append_str(out, ", \"finish_reason\": ");
    wstr(out, kiln_api_choice_finish_name(c));
    write_stop_reason(out, r->req, c);
    kiln_strbuf_append_char(out, '}');
  }
  kiln_strbuf_append_str(out, "], \"usage\": ");
  write_usage(out, &r->usage);
  kiln_strbuf_append_str(out, "}");
}

void kiln_api_write_chunk(kiln_strbuf_t *out, const kiln_api_response_t *r, kiln_api_choice_t *c,
                          bool with_usage) {
  const bool chat = r->req->kind == KILN_API_CHAT;
  kiln_strbuf_append_str(out, "data: ");
  write_head(out, r, chat ? "chat.completion.chunk" : "text_completion");
  kiln_strbuf_printf(out, ", \"choices\": [{\"index\": %d, ", c->index);
  if (chat) {
    kiln_strbuf_append_str(out, "\"delta\": {");
    bool any = false;
    if (!c->started) {
      kiln_strbuf_append_str(out, "\"role\": \"assistant\"");
      any = true;
    }
    if (c->text.len || !c->started) {
      if (any) kiln_strbuf_append_str(out, ", ");
      kiln_strbuf_append_str(out, "\"content\": ");
      kiln_json_write_string(out, kiln_strbuf_cstr(&c->text), c->text.len, false);
      any = true;
    }
    kiln_api_write_tool_delta(out, c, any); /* at most one tool-call delta per chunk */
    kiln_strbuf_append_str(out, "}");
  } else {
    kiln_strbuf_append_str(out, "\"text\": ");
    kiln_json_write_string(out, kiln_strbuf_cstr(&c->text), c->text.len, false);
  }
  c->started = true;
  kiln_strbuf_append_str(out, ", \"logprobs\": ");
  if (c->num_tokens || r->req->logprobs < 0)
    write_logprobs(out, r->req, c);
  else
    kiln_strbuf_append_str(out, "null");
  kiln_strbuf_append_str(out, ", \"finish_reason\": ");
  wstr(out, kiln_api_choice_finish_name(c));
  write_stop_reason(out, r->req, c);
  kiln_strbuf_append_str(out, "}]");
  if (r->req->include_usage) {
    kiln_strbuf_append_str(out, ", \"usage\": ");
    if (with_usage)
      write_usage(out, &r->usage);
    else
      kiln_strbuf_append_str(out, "null");
  }
  kiln_strbuf_append_str(out, "}\n\n");
  kiln_strbuf_reset(&c->text);
  kiln_api_choice_reset_tokens(c);
}

void kiln_api_write_usage_chunk(kiln_strbuf_t *out, const kiln_api_response_t *r) {
  const bool chat = r->req->kind == KILN_API_CHAT;
  kiln_strbuf_append_str(out, "data: ");
  write_head(out, r, chat ? "chat.completion.chunk" : "text_completion");
  kiln_strbuf_append_str(out, ", \"choices\": [], \"usage\": ");
  write_usage(out, &r->usage);
  kiln_strbuf_append_str(out, "}\n\n");
}
