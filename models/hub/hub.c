/* hub.c - Hub ids, the huggingface_hub cache layout, and resolution cache first (hub.h); the
 * HTTP side is hub_fetch.c. */
#define _GNU_SOURCE /* strcasecmp; dirent's d_type is not needed */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/json.h"
#include "base/log.h"
#include "models/hub/hub_internal.h"

const char *const hub_optional_files[] = {
    "tokenizer.json",           "tokenizer_config.json", "generation_config.json",
    "special_tokens_map.json",  "chat_template.jinja",   "chat_template.json",
    "preprocessor_config.json", "processor_config.json", NULL,
};

bool hub_pathf(char *buf, size_t size, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, size, fmt, ap);
  va_end(ap);
  return n >= 0 && (size_t)n < size;
}

bool hub_is_hex(const char *s, size_t n) {
  if (strlen(s) != n) return false;
  for (size_t i = 0; i < n; i++)
    if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return false;
  return true;
}

const char *hub_bytes(char *buf, size_t size, double b) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (b >= 1024 && u < 6) {
    b /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, size, "%.0f B", b);
  else
    snprintf(buf, size, "%.*f %s", b < 10 ? 2 : b < 100 ? 1 : 0, b, units[u]);
  return buf;
}

/* ---- ids ------------------------------------------------------------------------------------ */

static bool id_char(char ch) {
  return isalnum((unsigned char)ch) || ch == '-' || ch == '_' || ch == '.';
}

/* One of ORG and NAME: [A-Za-z0-9._-]+, not starting or ending with '-' or '.', no "--"/".."
 * (the Hub's own rule for a repository id's parts). */
static const char *id_part_error(const char *p, size_t n) {
  if (n == 0) return "is empty";
  for (size_t i = 0; i < n; i++)
    if (!id_char(p[i])) return "may hold only letters, digits, '-', '_' and '.'";
  if (p[0] == '-' || p[0] == '.' || p[n - 1] == '-' || p[n - 1] == '.')
    return "may not start or end with '-' or '.'";
  for (size_t i = 0; i + 1 < n; i++)
    if ((p[i] == '-' && p[i + 1] == '-') || (p[i] == '.' && p[i + 1] == '.'))
      return "may not contain \"--\" or \"..\"";
  return NULL;
}

kiln_status_t kiln_hub_parse_id(const char *s, kiln_hub_id_t *out) {
  if (!s || !s[0])
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "Hub id: empty (want ORG/NAME)");
  const char *at = strchr(s, '@');
  size_t head = at ? (size_t)(at - s) : strlen(s);
  const char *slash = memchr(s, '/', head);
  if (!slash)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "Hub id '%s': want ORG/NAME[/FILE.gguf][@REVISION]", s);
  size_t org = (size_t)(slash - s);
  const char *name = slash + 1;
  const char *slash2 = memchr(name, '/', head - org - 1);
  size_t nlen = slash2 ? (size_t)(slash2 - name) : head - org - 1;
  const char *why;
  if ((why = id_part_error(s, org)))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "Hub id '%s': the organization %s", s, why);
  if ((why = id_part_error(name, nlen)))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "Hub id '%s': the name %s", s, why);
  if (org + 1 + nlen > 96)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "Hub id '%s': ORG/NAME is longer than 96 characters", s);
  kiln_hub_id_t id;
  memset(&id, 0, sizeof(id));
  snprintf(id.repo, sizeof(id.repo), "%.*s", (int)(org + 1 + nlen), s);
  if (slash2) {
    const char *f = slash2 + 1;
    size_t flen = head - (size_t)(f - s);
    if (flen == 0 || flen >= sizeof(id.file))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "Hub id '%s': the file after ORG/NAME/ is %s", s,
                              flen ? "too long" : "empty");
    if (flen < 6 || strncasecmp(f + flen - 5, ".gguf", 5) != 0)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "Hub id '%s': a file after ORG/NAME/ must be a .gguf file (a "
                              "safetensors model is named by ORG/NAME alone)",
                              s);
    /* Each component: not empty, not "." or "..", no control characters or backslashes. */
    for (const char *c = f, *end = f + flen; c < end;) {
      const char *e = memchr(c, '/', (size_t)(end - c));
      size_t cl = e ? (size_t)(e - c) : (size_t)(end - c);
      bool bad = cl == 0 || (cl == 1 && c[0] == '.') || (cl == 2 && c[0] == '.' && c[1] == '.');
      for (size_t i = 0; i < cl && !bad; i++)
        bad = (unsigned char)c[i] < 0x20 || c[i] == '\\' || c[i] == 0x7f;
      if (bad)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "Hub id '%s': the file path '%.*s' is not a plain relative path", s,
                                (int)flen, f);
      c += cl + 1;
    }
    memcpy(id.file, f, flen);
  }
  if (at) {
    const char *r = at + 1;
    size_t rl = strlen(r);
    if (rl == 0 || rl >= sizeof(id.revision))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "Hub id '%s': the revision after @ is %s",
                              s, rl ? "too long" : "empty");
    bool bad = r[0] == '/' || r[rl - 1] == '/' || strstr(r, "..") || strstr(r, "//");
    for (size_t i = 0; i < rl && !bad; i++)
      bad = (unsigned char)r[i] <= 0x20 || r[i] == '\\' || r[i] == 0x7f || r[i] == '@';
    if (bad)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "Hub id '%s': '%s' is not a branch, tag or commit", s, r);
    memcpy(id.revision, r, rl);
  } else {
    strcpy(id.revision, "main");
  }
  *out = id;
  return NULL;
}

/* ---- environment ---------------------------------------------------------------------------- */

static const char *env(const char *name) {
  const char *v = getenv(name);
  return v && v[0] ? v : NULL;
}

static const char *home_dir(void) {
  const char *h = env("HOME");
  if (h) return h;
  struct passwd *pw = getpwuid(getuid());
  return pw && pw->pw_dir ? pw->pw_dir : "/";
}

/* $HF_HOME, else $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface. */
static void hf_home(char *buf, size_t size) {
  const char *h = env("HF_HOME");
  if (h)
    snprintf(buf, size, "%s", h);
  else if ((h = env("XDG_CACHE_HOME")))
    snprintf(buf, size, "%s/huggingface", h);
  else
    snprintf(buf, size, "%s/.cache/huggingface", home_dir());
}

static bool env_true(const char *name) {
  const char *v = env(name);
  return v && (!strcasecmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes") ||
               !strcasecmp(v, "on"));
}

kiln_status_t kiln_hub_cache_dir(const kiln_hub_options_t *o, char *buf, size_t size) {
  char home[KILN_HUB_PATH_MAX];
  const char *v = o && o->cache_dir && o->cache_dir[0] ? o->cache_dir : NULL;
  int n;
  if (!v) v = env("HF_HUB_CACHE");
  if (!v) v = env("HUGGINGFACE_HUB_CACHE"); /* the older name huggingface_hub still reads */
  if (v) {
    n = snprintf(buf, size, "%s", v);
  } else {
    hf_home(home, sizeof(home));
    n = snprintf(buf, size, "%s/hub", home);
  }
  if (n < 0 || (size_t)n >= size)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "the Hub cache folder's path is too long");
  /* "~/x" as a shell would have expanded it (a value from an INI file is not). */
  if (buf[0] == '~' && (buf[1] == '/' || !buf[1])) {
    char tmp[KILN_HUB_PATH_MAX];
    n = snprintf(tmp, sizeof(tmp), "%s%s", home_dir(), buf + 1);
    if (n < 0 || (size_t)n >= size)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "the Hub cache folder's path is too long");
    memcpy(buf, tmp, (size_t)n + 1);
  }
  while (strlen(buf) > 1 && buf[strlen(buf) - 1] == '/') buf[strlen(buf) - 1] = 0;
  return NULL;
}

/* The token: $HF_TOKEN, else the file $HF_TOKEN_PATH, else $HF_HOME/token (NULL: none). */
static kiln_status_t read_token(const kiln_hub_options_t *o, char **out) {
  *out = NULL;
  const char *t = o->token ? o->token : env("HF_TOKEN");
  if (!t && !o->token) t = env("HUGGING_FACE_HUB_TOKEN"); /* the older name */
  char *own = NULL;
  if (!t && !o->token) {
    char path[KILN_HUB_PATH_MAX];
    const char *p = env("HF_TOKEN_PATH");
    if (p) {
      snprintf(path, sizeof(path), "%s", p);
    } else {
      char home[KILN_HUB_PATH_MAX - 8];
      hf_home(home, sizeof(home));
      snprintf(path, sizeof(path), "%s/token", home);
    }
    FILE *f = fopen(path, "rb");
    if (f) {
      char buf[4096];
      size_t n = fread(buf, 1, sizeof(buf) - 1, f);
      fclose(f);
      buf[n] = 0;
      if (!(own = strdup(buf))) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
      t = own;
    }
  }
  if (!t) return NULL;
  while (isspace((unsigned char)*t)) t++;
  size_t n = strlen(t);
  while (n && isspace((unsigned char)t[n - 1])) n--;
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)t[i] < 0x21 || t[i] == 0x7f) {
      free(own);
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "the Hugging Face token holds a space or control character");
    }
  if (n) *out = strndup(t, n);
  free(own);
  if (n && !*out) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  return NULL;
}

/* ---- files ---------------------------------------------------------------------------------- */

kiln_status_t hub_mkdirs(const char *path) {
  char tmp[KILN_HUB_PATH_MAX];
  size_t n = strlen(path);
  if (n >= sizeof(tmp)) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "path too long");
  memcpy(tmp, path, n + 1);
  for (size_t i = 1; i <= n; i++) {
    if (tmp[i] != '/' && tmp[i] != 0) continue;
    char keep = tmp[i];
    tmp[i] = 0;
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) {
      int e = errno;
      return kiln_status_make(KILN_ERR_IO, "cannot create %s: %s", tmp, strerror(e));
    }
    tmp[i] = keep;
  }
  return NULL;
}

kiln_status_t hub_write_file(const char *path, const char *text) {
  char tmp[KILN_HUB_PATH_MAX + 32];
  snprintf(tmp, sizeof(tmp), "%s.%ld.tmp", path, (long)getpid());
  FILE *f = fopen(tmp, "wb");
  if (!f) return kiln_status_make(KILN_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
  size_t n = strlen(text);
  bool ok = fwrite(text, 1, n, f) == n;
  int e = errno;
  if (fclose(f) != 0 && ok) {
    ok = false;
    e = errno;
  }
  if (ok && rename(tmp, path) != 0) {
    ok = false;
    e = errno;
  }
  if (!ok) {
    unlink(tmp);
    return kiln_status_make(KILN_ERR_IO, "cannot write %s: %s", path, strerror(e));
  }
  return NULL;
}

void hub_snapshot_dir(const hub_ctx_t *c, const char *commit, char *buf, size_t size) {
  hub_pathf(buf, size, "%s/snapshots/%s", c->repo_dir, commit);
}

static bool exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0; /* follows the symlink: the blob must be there too */
}

/* The commit id the cache holds for the revision: the revision itself when it is one, else
 * refs/REVISION. False when unknown. */
static bool cached_commit(const hub_ctx_t *c, char commit[41]) {
  if (hub_is_hex(c->id->revision, 40)) {
    memcpy(commit, c->id->revision, 41);
    return true;
  }
  char path[KILN_HUB_PATH_MAX + 300];
  snprintf(path, sizeof(path), "%s/refs/%s", c->repo_dir, c->id->revision);
  FILE *f = fopen(path, "rb");
  if (!f) return false;
  char buf[64] = {0};
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  while (n && isspace((unsigned char)buf[n - 1])) buf[--n] = 0;
  if (!hub_is_hex(buf, 40)) return false;
  memcpy(commit, buf, 41);
  return true;
}

static void add_missing(kiln_strbuf_t *sb, const char *name) {
  if (!sb) return;
  if (sb->len) kiln_strbuf_append_str(sb, ", ");
  kiln_strbuf_append_str(sb, name);
}

/* The shard names model.safetensors.index.json lists (its weight_map's values, each once). */
kiln_status_t hub_index_shards(const char *index_path, char ***out, size_t *out_n);
kiln_status_t hub_index_shards(const char *index_path, char ***out, size_t *out_n) {
  *out = NULL;
  *out_n = 0;
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse_file(index_path, &doc);
  if (st) return st;
  const kiln_json_t *map = kiln_json_get(kiln_json_root(doc), "weight_map");
  if (!kiln_json_is(map, KILN_JSON_OBJECT)) {
    kiln_json_doc_free(doc);
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: no \"weight_map\" object", index_path);
  }
  size_t n = kiln_json_len(map), k = 0;
  char **names = calloc(n ? n : 1, sizeof(char *));
  if (!names) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  for (size_t i = 0; !st && i < n; i++) {
    const char *s = kiln_json_string(kiln_json_value_at(map, i), NULL);
    if (!s || !s[0] || s[0] == '/' || strstr(s, "..")) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: weight_map values must be shard file names", index_path);
      break;
    }
    bool seen = false;
    for (size_t j = 0; j < k && !seen; j++) seen = strcmp(names[j], s) == 0;
    if (seen) continue;
    if (!(names[k] = strdup(s)))
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    else
      k++;
  }
  kiln_json_doc_free(doc);
  if (st) {
    for (size_t j = 0; names && j < k; j++) free(names[j]);
    free(names);
    return st;
  }
  *out = names;
  *out_n = k;
  return NULL;
}

bool hub_snapshot_complete(const hub_ctx_t *c, const char *commit, kiln_strbuf_t *missing,
                           int32_t *present) {
  char snap[KILN_HUB_PATH_MAX], path[KILN_HUB_PATH_MAX + 600];
  hub_snapshot_dir(c, commit, snap, sizeof(snap));
  bool ok = true;
  int32_t have = 0;
  if (c->id->file[0]) {
    snprintf(path, sizeof(path), "%s/%s", snap, c->id->file);
    if (exists(path))
      have++;
    else
      ok = false, add_missing(missing, c->id->file);
  } else {
    snprintf(path, sizeof(path), "%s/config.json", snap);
    if (exists(path))
      have++;
    else
      ok = false, add_missing(missing, "config.json");
    /* tokenizer.json, unless the cache knows the repository has none */
    snprintf(path, sizeof(path), "%s/tokenizer.json", snap);
    if (exists(path)) {
      have++;
    } else {
      snprintf(path, sizeof(path), "%s/.no_exist/%s/tokenizer.json", c->repo_dir, commit);
      if (!exists(path)) ok = false, add_missing(missing, "tokenizer.json");
    }
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", snap);
    char **shards = NULL;
    size_t ns = 0;
    if (exists(path)) {
      have++;
      kiln_status_t st = hub_index_shards(path, &shards, &ns);
      if (st) {
        ok = false;
        add_missing(missing, "a readable model.safetensors.index.json");
        kiln_status_free(st);
      }
      for (size_t i = 0; i < ns; i++) {
        snprintf(path, sizeof(path), "%s/%s", snap, shards[i]);
        if (exists(path))
          have++;
        else
          ok = false, add_missing(missing, shards[i]);
        free(shards[i]);
      }
      free(shards);
    } else {
      snprintf(path, sizeof(path), "%s/model.safetensors", snap);
      if (exists(path))
        have++;
      else
        ok = false, add_missing(missing, "model.safetensors (or an index and its shards)");
    }
    /* the optional files that are there count too */
    for (int i = 1; hub_optional_files[i]; i++) {
      snprintf(path, sizeof(path), "%s/%s", snap, hub_optional_files[i]);
      if (exists(path)) have++;
    }
  }
  if (present) *present = have;
  return ok;
}

void hub_cache_summary(const hub_ctx_t *c, kiln_strbuf_t *sb) {
  struct stat st;
  if (stat(c->repo_dir, &st) != 0) {
    kiln_strbuf_printf(sb, "the cache (%s) holds nothing of %s", c->cache, c->id->repo);
    return;
  }
  char commit[41];
  if (!cached_commit(c, commit)) {
    kiln_strbuf_printf(sb, "the cache (%s) has %s but not its revision '%s'", c->repo_dir,
                       c->id->repo, c->id->revision);
  } else {
    kiln_strbuf_t missing = {0};
    int32_t present = 0;
    bool ok = hub_snapshot_complete(c, commit, &missing, &present);
    kiln_strbuf_printf(sb, "the cache (%s) has %s@%s (commit %.12s) with %d of its files", c->cache,
                       c->id->repo, c->id->revision, commit, (int)present);
    if (!ok) kiln_strbuf_printf(sb, "; missing: %s", kiln_strbuf_cstr(&missing));
    kiln_strbuf_free(&missing);
  }
  /* partial downloads */
  char blobs[KILN_HUB_PATH_MAX + 8];
  snprintf(blobs, sizeof(blobs), "%s/blobs", c->repo_dir);
  DIR *d = opendir(blobs);
  if (!d) return;
  int n = 0;
  double bytes = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (l <= 11 || strcmp(e->d_name + l - 11, ".incomplete") != 0) continue;
    char p[KILN_HUB_PATH_MAX + 300];
    snprintf(p, sizeof(p), "%s/%s", blobs, e->d_name);
    if (stat(p, &st) == 0) bytes += (double)st.st_size;
    n++;
  }
  closedir(d);
  char b[32];
  if (n)
    kiln_strbuf_printf(sb, "; %d partial download%s (%s) resume%s on the next try", n,
                       n == 1 ? "" : "s", hub_bytes(b, sizeof(b), bytes), n == 1 ? "s" : "");
}

/* ---- resolution ----------------------------------------------------------------------------- */

kiln_status_t kiln_hub_resolve(const kiln_hub_options_t *o, const kiln_hub_id_t *id,
                               kiln_hub_result_t *out) {
  kiln_hub_options_t none;
  memset(&none, 0, sizeof(none));
  if (!o) o = &none;
  memset(out, 0, sizeof(*out));
  hub_ctx_t *c = calloc(1, sizeof(*c));
  if (!c) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  c->id = id;
  c->out = out;
  kiln_status_t st = kiln_hub_cache_dir(o, c->cache, sizeof(c->cache));
  if (st) goto done;
  snprintf(c->folder, sizeof(c->folder), "models--%s", id->repo);
  char *sl = strchr(c->folder, '/');
  if (sl) {
    memmove(sl + 2, sl + 1, strlen(sl + 1) + 1);
    sl[0] = sl[1] = '-';
  }
  if ((size_t)snprintf(c->repo_dir, sizeof(c->repo_dir), "%s/%s", c->cache, c->folder) >=
      sizeof(c->repo_dir) - 700) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "the Hub cache folder's path is too long");
    goto done;
  }
  bool offline = o->offline || env_true("HF_HUB_OFFLINE");

  /* Cache first. */
  char commit[41];
  if ((!o->refresh || offline) && cached_commit(c, commit) &&
      hub_snapshot_complete(c, commit, NULL, &out->files)) {
    memcpy(out->commit, commit, sizeof(commit));
    char snap[KILN_HUB_PATH_MAX];
    hub_snapshot_dir(c, commit, snap, sizeof(snap));
    if (id->file[0])
      hub_pathf(out->path, sizeof(out->path), "%s/%s", snap, id->file);
    else
      hub_pathf(out->path, sizeof(out->path), "%s", snap);
    KILN_LOG_I("%s@%s: from the cache, %s", id->repo, id->revision, out->path);
    goto done;
  }
  if (offline) {
    kiln_strbuf_t sb = {0};
    hub_cache_summary(c, &sb);
    st = kiln_status_make(KILN_ERR_NOT_FOUND, "%s@%s: offline (%s) and not in the cache: %s",
                          id->repo, id->revision,
                          o->offline ? "[hub] offline" : "HF_HUB_OFFLINE is set",
                          kiln_strbuf_ok(&sb) ? kiln_strbuf_cstr(&sb) : "out of memory");
    kiln_strbuf_free(&sb);
    goto done;
  }

  /* The network. */
  const char *ep = o->endpoint && o->endpoint[0] ? o->endpoint : env("HF_ENDPOINT");
  if (!ep) ep = "https://huggingface.co";
  size_t el = strlen(ep);
  while (el && ep[el - 1] == '/') el--;
  if (el == 0 || el >= sizeof(c->endpoint) ||
      (strncmp(ep, "http://", 7) != 0 && strncmp(ep, "https://", 8) != 0)) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "the Hub endpoint '%s' is not an http:// or https:// URL", ep);
    goto done;
  }
  memcpy(c->endpoint, ep, el);
  c->endpoint[el] = 0;
  if ((st = read_token(o, &c->token))) goto done;
  c->timeout_s = o->timeout_s > 0 ? o->timeout_s : 30;
  c->progress = o->progress;
  if (c->progress == KILN_HUB_PROGRESS_AUTO)
    c->progress = isatty(STDERR_FILENO) ? KILN_HUB_PROGRESS_BAR : KILN_HUB_PROGRESS_LINES;
  out->network = true;
  st = hub_fetch(c);
  if (!st) {
    char snap[KILN_HUB_PATH_MAX];
    hub_snapshot_dir(c, out->commit, snap, sizeof(snap));
    if (id->file[0])
      hub_pathf(out->path, sizeof(out->path), "%s/%s", snap, id->file);
    else
      hub_pathf(out->path, sizeof(out->path), "%s", snap);
  }
done:
  free(c->token);
  free(c);
  if (st) memset(out, 0, sizeof(*out));
  return st;
}

/* ---- configuration, and what commands load -------------------------------------------------- */

kiln_status_t kiln_hub_options_from_config(const kiln_config_t *cfg, kiln_hub_options_t *out,
                                           char *cache_buf, size_t cache_size) {
  memset(out, 0, sizeof(*out));
  kiln_status_t st = kiln_config_get_path(cfg, "hub", "cache_dir", cache_buf, cache_size);
  if (st) return st;
  out->cache_dir = cache_buf;
  const char *ep = kiln_config_get_string(cfg, "hub", "endpoint");
  out->endpoint = ep && ep[0] ? ep : NULL;
  out->offline = kiln_config_get_bool(cfg, "hub", "offline");
  const char *p = kiln_config_get_string(cfg, "hub", "progress");
  out->progress = !p || !strcasecmp(p, "auto") ? KILN_HUB_PROGRESS_AUTO
                  : !strcasecmp(p, "bar")      ? KILN_HUB_PROGRESS_BAR
                  : !strcasecmp(p, "lines")    ? KILN_HUB_PROGRESS_LINES
                                               : KILN_HUB_PROGRESS_NONE;
  out->timeout_s = kiln_config_get_float(cfg, "hub", "timeout");
  return NULL;
}

kiln_status_t kiln_model_resolve(const kiln_config_t *cfg, const char *model,
                                 kiln_model_location_t *out) {
  memset(out, 0, sizeof(*out));
  const char *raw = model && model[0] ? model : kiln_config_get_string(cfg, "model", "path");
  kiln_status_t st;
  if (model && model[0]) {
    if ((size_t)snprintf(out->path, sizeof(out->path), "%s", model) >= sizeof(out->path))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "the model path is too long");
  } else if ((st = kiln_config_model_path(cfg, out->path, sizeof(out->path)))) {
    return st;
  }
  if (!raw || !raw[0] || exists(out->path)) return NULL; /* a local path always wins */
  kiln_hub_id_t id;
  if ((st = kiln_hub_parse_id(raw, &id))) {
    kiln_status_free(st); /* not an id: the loader says the path is missing */
    return NULL;
  }
  char cache[KILN_HUB_PATH_MAX];
  kiln_hub_options_t o;
  if ((st = kiln_hub_options_from_config(cfg, &o, cache, sizeof(cache)))) return st;
  kiln_hub_result_t *r = malloc(sizeof(*r));
  if (!r) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  st = kiln_hub_resolve(&o, &id, r);
  if (st) {
    free(r);
    memset(out, 0, sizeof(*out));
    return kiln_status_annotate(st, "model %s (no such file or folder; as a Hugging Face Hub id)",
                                raw);
  }
  memcpy(out->path, r->path, sizeof(out->path));
  snprintf(out->hub_repo, sizeof(out->hub_repo), "%s", id.repo);
  free(r);
  return NULL;
}
