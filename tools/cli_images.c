/* cli_images.c - image input for kiln generate and kiln score (see cli_images.h). */
#define _POSIX_C_SOURCE 200809L
#include "cli_images.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base64.h"
#include "base/json.h"
#include "base/strbuf.h"

#define MAX_IMAGE_FILE ((long)256 << 20)

static kiln_status_t oom(void) { return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory"); }

/* Appends one image (bytes taken) named name. */
static kiln_status_t add_image(kiln_cli_images_t *im, unsigned char *bytes, size_t len,
                               const char *name) {
  int32_t n = im->num + 1;
  kiln_image_input_t *ii = realloc(im->images, (size_t)n * sizeof(*ii));
  if (ii) im->images = ii;
  char **nm = ii ? realloc(im->names, (size_t)n * sizeof(*nm)) : NULL;
  if (nm) im->names = nm;
  unsigned char **by = nm ? realloc(im->bytes, (size_t)n * sizeof(*by)) : NULL;
  if (by) im->bytes = by;
  char *dn = by ? strdup(name) : NULL;
  if (!dn) {
    free(bytes);
    return oom();
  }
  memset(&im->images[im->num], 0, sizeof(im->images[im->num]));
  im->images[im->num].data = bytes;
  im->images[im->num].size = len;
  im->names[im->num] = dn;
  im->bytes[im->num] = bytes;
  im->num = n;
  return NULL;
}

static kiln_status_t read_file(const char *path, const char *what, unsigned char **out,
                               size_t *len) {
  *out = NULL;
  *len = 0;
  FILE *f = fopen(path, "rb");
  if (!f)
    return kiln_status_make(errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO, "%s: %s: %s", what,
                            path, strerror(errno));
  long sz = -1;
  if (fseek(f, 0, SEEK_END) == 0) sz = ftell(f);
  if (sz < 0 || fseek(f, 0, SEEK_SET) != 0) {
    fclose(f);
    return kiln_status_make(KILN_ERR_IO, "%s: %s: not a regular file", what, path);
  }
  if (sz > MAX_IMAGE_FILE) {
    fclose(f);
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s: %ld bytes is over %ld", what, path,
                            sz, MAX_IMAGE_FILE);
  }
  unsigned char *b = malloc((size_t)sz + 1);
  if (!b) {
    fclose(f);
    return oom();
  }
  size_t got = fread(b, 1, (size_t)sz, f);
  fclose(f);
  if (got != (size_t)sz) {
    free(b);
    return kiln_status_make(KILN_ERR_IO, "%s: %s: read %zu of %ld bytes", what, path, got, sz);
  }
  *out = b;
  *len = got;
  return NULL;
}

kiln_status_t kiln_cli_images_read(const char *const *paths, int32_t n, kiln_cli_images_t *out) {
  for (int32_t i = 0; i < n; i++) {
    unsigned char *b;
    size_t len;
    kiln_status_t st = read_file(paths[i], "--image", &b, &len);
    if (!st) st = add_image(out, b, len, paths[i]);
    if (st) return st;
  }
  return NULL;
}

/* An image part's URL: a data: URL (decoded), a file:// URL or a path (read). */
kiln_status_t kiln_cli_image_add_url(const char *url, size_t ul, const char *where,
                                     kiln_cli_images_t *im) {
  unsigned char *b = NULL;
  size_t len = 0;
  if (ul >= 5 && !strncmp(url, "data:", 5)) {
    const char *comma = memchr(url, ',', ul);
    if (!comma || comma - url < 12 || strncmp(comma - 7, ";base64", 7) != 0)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: a data URL must be data:image/...;base64,...", where);
    int64_t at = -1;
    if (!kiln_base64_decode(comma + 1, ul - (size_t)(comma + 1 - url), &b, &len, &at)) {
      if (at < 0) return oom();
      return kiln_status_make(
          KILN_ERR_INVALID_ARGUMENT,
          "%s: the data URL is not valid base64 (at character %lld of its data)", where,
          (long long)at);
    }
  } else if ((ul > 7 && !strncmp(url, "http://", 7)) || (ul > 8 && !strncmp(url, "https://", 8))) {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: kiln generate does not fetch URLs: save the image and give its "
                            "path (or a data: URL)",
                            where);
  } else {
    const char *path = ul > 7 && !strncmp(url, "file://", 7) ? url + 7 : url;
    kiln_status_t st = read_file(path, where, &b, &len);
    if (st) return st;
  }
  return add_image(im, b, len, where);
}

/* Writes messages with each image part (image_url, or {"type": "image", "image": path}) turned
 * into {"type": "image"}, collecting the images. */
static kiln_status_t rewrite_messages(const kiln_json_t *msgs, const char *file, kiln_strbuf_t *sb,
                                      kiln_cli_images_t *im) {
  if (!kiln_json_is(msgs, KILN_JSON_ARRAY))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: want a JSON array of messages (or an object with \"messages\")",
                            file);
  kiln_strbuf_append_char(sb, '[');
  for (size_t i = 0; i < kiln_json_len(msgs); i++) {
    const kiln_json_t *m = kiln_json_at(msgs, i);
    if (!kiln_json_is(m, KILN_JSON_OBJECT))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: messages[%zu]: must be an object",
                              file, i);
    if (i) kiln_strbuf_append_str(sb, ", ");
    kiln_strbuf_append_char(sb, '{');
    for (size_t k = 0; k < kiln_json_len(m); k++) {
      size_t kl;
      const char *key = kiln_json_key_at(m, k, &kl);
      const kiln_json_t *v = kiln_json_value_at(m, k);
      if (k) kiln_strbuf_append_str(sb, ", ");
      kiln_json_write_string(sb, key, kl, false);
      kiln_strbuf_append_str(sb, ": ");
      if (!(kl == 7 && !memcmp(key, "content", 7) && kiln_json_is(v, KILN_JSON_ARRAY))) {
        kiln_json_write(sb, v, false, false);
        continue;
      }
      kiln_strbuf_append_char(sb, '[');
      for (size_t j = 0; j < kiln_json_len(v); j++) {
        const kiln_json_t *p = kiln_json_at(v, j);
        const char *type = kiln_json_string(kiln_json_get(p, "type"), NULL);
        if (j) kiln_strbuf_append_str(sb, ", ");
        char where[1200];
        snprintf(where, sizeof(where), "%s: messages[%zu].content[%zu]", file, i, j);
        const kiln_json_t *u = NULL;
        if (type && !strcmp(type, "image_url")) {
          const kiln_json_t *iu = kiln_json_get(p, "image_url");
          u = kiln_json_is(iu, KILN_JSON_STRING) ? iu : kiln_json_get(iu, "url");
        } else if (type && !strcmp(type, "image")) {
          u = kiln_json_get(p, "image");
        } else {
          kiln_json_write(sb, p, false, false);
          continue;
        }
        size_t ul = 0;
        const char *url = kiln_json_string(u, &ul);
        if (!url)
          return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                  "%s: an image part needs a string url (image_url.url)", where);
        kiln_status_t st = kiln_cli_image_add_url(url, ul, where, im);
        if (st) return st;
        kiln_strbuf_append_str(sb, "{\"type\": \"image\"}");
      }
      kiln_strbuf_append_char(sb, ']');
    }
    kiln_strbuf_append_char(sb, '}');
  }
  kiln_strbuf_append_char(sb, ']');
  return kiln_strbuf_ok(sb) ? NULL : oom();
}

/* Renders the rewritten messages in sb (or the one user message of the images and prompt, when
 * sb is empty) with the chat template and tokenizes the result. */
static kiln_status_t chat_render(kiln_engine_t *eng, kiln_strbuf_t *sb, const char *prompt,
                                 kiln_cli_images_t *images, int32_t **out_ids, int32_t *out_n);

kiln_status_t kiln_cli_chat_ids_json(kiln_engine_t *eng, const kiln_json_t *messages,
                                     const char *where, kiln_cli_images_t *images,
                                     int32_t **out_ids, int32_t *out_n) {
  *out_ids = NULL;
  *out_n = 0;
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_status_t st = rewrite_messages(messages, where, &sb, images);
  if (!st) st = chat_render(eng, &sb, NULL, images, out_ids, out_n);
  kiln_strbuf_free(&sb);
  return st;
}

kiln_status_t kiln_cli_chat_ids(kiln_engine_t *eng, const char *messages_file, const char *prompt,
                                kiln_cli_images_t *images, int32_t **out_ids, int32_t *out_n) {
  *out_ids = NULL;
  *out_n = 0;
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_status_t st = NULL;
  if (messages_file) {
    kiln_json_doc_t *doc = NULL;
    if ((st = kiln_json_parse_file(messages_file, &doc))) return st;
    const kiln_json_t *root = kiln_json_root(doc);
    const kiln_json_t *msgs =
        kiln_json_is(root, KILN_JSON_OBJECT) ? kiln_json_get(root, "messages") : root;
    st = rewrite_messages(msgs, messages_file, &sb, images);
    kiln_json_doc_free(doc);
  }
  if (!st) st = chat_render(eng, &sb, prompt, images, out_ids, out_n);
  kiln_strbuf_free(&sb);
  return st;
}

static kiln_status_t chat_render(kiln_engine_t *eng, kiln_strbuf_t *sb_in, const char *prompt,
                                 kiln_cli_images_t *images, int32_t **out_ids, int32_t *out_n) {
  kiln_strbuf_t own = KILN_STRBUF_INIT, *sbp = sb_in;
  kiln_status_t st = NULL;
  if (sb_in->len == 0) {
    sbp = &own;
    kiln_strbuf_t sb = KILN_STRBUF_INIT;
    kiln_strbuf_append_str(&sb, "[{\"role\": \"user\", \"content\": [");
    for (int32_t i = 0; i < images->num; i++)
      kiln_strbuf_append_str(&sb, "{\"type\": \"image\"}, ");
    kiln_strbuf_append_str(&sb, "{\"type\": \"text\", \"text\": ");
    kiln_json_write_string(&sb, prompt ? prompt : "", prompt ? strlen(prompt) : 0, false);
    kiln_strbuf_append_str(&sb, "}]}]");
    if (!kiln_strbuf_ok(&sb)) st = oom();
    own = sb;
  }
  char *text = NULL;
  size_t tl = 0;
  if (!st) {
    kiln_chat_args_t a = {.messages_json = kiln_strbuf_cstr(sbp),
                          .messages_len = sbp->len,
                          .add_generation_prompt = true};
    st = kiln_engine_apply_chat_template(eng, &a, &text, &tl);
  }
  if (!st) st = kiln_engine_tokenize(eng, text, tl, false, out_ids, out_n);
  free(text);
  kiln_strbuf_free(&own);
  return st;
}

kiln_status_t kiln_cli_images_error(const kiln_cli_images_t *im, kiln_status_t st) {
  const char *msg = kiln_status_message(st);
  int idx = -1, used = 0;
  if (sscanf(msg, "image %d: %n", &idx, &used) == 1 && used > 0 && idx >= 0 && idx < im->num) {
    kiln_status_t out =
        kiln_status_make(kiln_status_code(st), "%s: %s", im->names[idx], msg + used);
    kiln_status_free(st);
    return out;
  }
  return st;
}

void kiln_cli_images_free(kiln_cli_images_t *im) {
  for (int32_t i = 0; i < im->num; i++) {
    free(im->bytes[i]);
    free(im->names[i]);
  }
  free(im->images);
  free(im->names);
  free(im->bytes);
  memset(im, 0, sizeof(*im));
}
