/* hub_fetch.c - downloading a model into the huggingface_hub cache over HTTP (libcurl), as
 * huggingface_hub does (hub.h): the revision's commit and file list from the API, each file's
 * etag, size and location from a HEAD on its resolve URL, then the bytes into
 * blobs/ETAG.incomplete (resumed with a range request), checked against the etag, renamed
 * onto blobs/ETAG and linked from snapshots/COMMIT/FILE. */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "base/json.h"
#include "base/log.h"
#include "models/hub/hub_internal.h"
#include "models/hub/sha.h"

kiln_status_t hub_index_shards(const char *index_path, char ***out, size_t *out_n);

#ifndef KILN_HUB_CURL

kiln_status_t hub_fetch(hub_ctx_t *c) {
  kiln_strbuf_t sb = {0};
  hub_cache_summary(c, &sb);
  kiln_status_t st = kiln_status_make(
      KILN_ERR_UNSUPPORTED,
      "%s@%s is not in the cache and this build of Kiln cannot download (it was configured "
      "with -DKILN_HTTP=OFF, without libcurl): %s",
      c->id->repo, c->id->revision, kiln_strbuf_ok(&sb) ? kiln_strbuf_cstr(&sb) : "");
  kiln_strbuf_free(&sb);
  return st;
}

#else /* KILN_HUB_CURL */

#include <curl/curl.h>
#include <pthread.h>

#ifndef KILN_VERSION_STRING
#define KILN_VERSION_STRING "0"
#endif

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;
static void curl_init(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

/* ---- URLs ----------------------------------------------------------------------------------- */

/* Percent-encodes s into sb: everything but unreserved characters (and '/' when keep_slash). */
static void url_escape(kiln_strbuf_t *sb, const char *s, bool keep_slash) {
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (isalnum(ch) || ch == '-' || ch == '.' || ch == '_' || ch == '~' ||
        (keep_slash && ch == '/'))
      kiln_strbuf_append_char(sb, (char)ch);
    else
      kiln_strbuf_printf(sb, "%%%02X", ch);
  }
}

/* The length of "scheme://host[:port]" in url. */
static size_t origin_len(const char *url) {
  const char *p = strstr(url, "://");
  if (!p) return 0;
  p += 3;
  while (*p && *p != '/' && *p != '?' && *p != '#') p++;
  return (size_t)(p - url);
}

static bool same_origin(const char *a, const char *b) {
  size_t n = origin_len(a);
  return n && n == origin_len(b) && strncasecmp(a, b, n) == 0;
}

/* ---- HTTP ----------------------------------------------------------------------------------- */

typedef struct hub_resp {
  long status;
  char commit[64];
  char etag[160];
  char linked_etag[160];
  int64_t linked_size, content_length;
  char location[4096];
  char error_code[64];
  char error_message[512];
  char content_range[128];
  kiln_strbuf_t body; /* what a GET to memory, or an error, sent back (bounded) */
  size_t max_body;
} hub_resp_t;

static void resp_reset_headers(hub_resp_t *r) {
  r->status = 0;
  r->commit[0] = r->etag[0] = r->linked_etag[0] = r->location[0] = 0;
  r->error_code[0] = r->error_message[0] = r->content_range[0] = 0;
  r->linked_size = r->content_length = -1;
}

static void copy_value(char *dst, size_t size, const char *v, size_t n) {
  if (n >= size) n = size - 1;
  memcpy(dst, v, n);
  dst[n] = 0;
}

static size_t on_header(char *buf, size_t sz, size_t nitems, void *ud) {
  hub_resp_t *r = ud;
  size_t n = sz * nitems;
  if (n >= 5 && memcmp(buf, "HTTP/", 5) == 0) { /* a new response of a redirect chain */
    resp_reset_headers(r);
    const char *sp = memchr(buf, ' ', n);
    if (sp) r->status = strtol(sp + 1, NULL, 10);
    return n;
  }
  const char *colon = memchr(buf, ':', n);
  if (!colon) return n;
  size_t kl = (size_t)(colon - buf);
  const char *v = colon + 1, *end = buf + n;
  while (v < end && (*v == ' ' || *v == '\t')) v++;
  while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ')) end--;
  size_t vl = (size_t)(end - v);
#define IS(name) (kl == sizeof(name) - 1 && strncasecmp(buf, name, kl) == 0)
  if (IS("X-Repo-Commit"))
    copy_value(r->commit, sizeof(r->commit), v, vl);
  else if (IS("ETag"))
    copy_value(r->etag, sizeof(r->etag), v, vl);
  else if (IS("X-Linked-Etag"))
    copy_value(r->linked_etag, sizeof(r->linked_etag), v, vl);
  else if (IS("Location"))
    copy_value(r->location, sizeof(r->location), v, vl);
  else if (IS("X-Error-Code"))
    copy_value(r->error_code, sizeof(r->error_code), v, vl);
  else if (IS("X-Error-Message"))
    copy_value(r->error_message, sizeof(r->error_message), v, vl);
  else if (IS("Content-Range"))
    copy_value(r->content_range, sizeof(r->content_range), v, vl);
  else if (IS("X-Linked-Size") || IS("Content-Length")) {
    char tmp[32];
    copy_value(tmp, sizeof(tmp), v, vl);
    char *e;
    long long x = strtoll(tmp, &e, 10);
    if (e != tmp && *e == 0 && x >= 0) {
      if (IS("X-Linked-Size"))
        r->linked_size = x;
      else
        r->content_length = x;
    }
  }
#undef IS
  return n;
}

static size_t on_body_mem(char *buf, size_t sz, size_t nitems, void *ud) {
  hub_resp_t *r = ud;
  size_t n = sz * nitems;
  if (r->body.len + n > r->max_body) return 0; /* CURLE_WRITE_ERROR */
  return kiln_strbuf_append(&r->body, buf, n) ? n : 0;
}

/* The headers every request sends; Authorization only to the endpoint itself. */
static struct curl_slist *request_headers(const hub_ctx_t *c, const char *url, bool identity) {
  struct curl_slist *h = NULL, *t;
  if (identity && (t = curl_slist_append(h, "Accept-Encoding: identity"))) h = t;
  if (c->token && same_origin(url, c->endpoint)) {
    char *auth = kiln_strprintf("Authorization: Bearer %s", c->token);
    if (auth && (t = curl_slist_append(h, auth))) h = t;
    free(auth);
  }
  return h;
}

static void common_opts(const hub_ctx_t *c, CURL *e, char *errbuf) {
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, errbuf);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_USERAGENT, "kiln/" KILN_VERSION_STRING);
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)(c->timeout_s * 1000));
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, (long)(c->timeout_s + 0.999));
  curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(e, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
}

/* "cannot reach ..." for a transfer that failed below HTTP, with what the cache holds. */
static kiln_status_t net_error(const hub_ctx_t *c, const char *url, CURLcode rc,
                               const char *errbuf) {
  kiln_strbuf_t sb = {0};
  hub_cache_summary(c, &sb);
  kiln_status_t st = kiln_status_make(KILN_ERR_UNAVAILABLE, "cannot reach %s (%s%s%s); %s", url,
                                      curl_easy_strerror(rc), errbuf[0] ? ": " : "", errbuf,
                                      kiln_strbuf_ok(&sb) ? kiln_strbuf_cstr(&sb) : "");
  kiln_strbuf_free(&sb);
  return st;
}

/* A request to the endpoint (HEAD, or GET into r->body) that follows relative redirects only
 * (a renamed repository), as huggingface_hub does: an absolute one (a CDN) is left in
 * r->location for the caller. */
static kiln_status_t hub_request(const hub_ctx_t *c, bool head, const char *url0, hub_resp_t *r) {
  char *url = strdup(url0);
  if (!url) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kiln_status_t st = NULL;
  for (int hop = 0;; hop++) {
    CURL *e = curl_easy_init();
    if (!e) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "curl_easy_init failed");
      break;
    }
    char errbuf[CURL_ERROR_SIZE] = {0};
    resp_reset_headers(r);
    kiln_strbuf_reset(&r->body);
    struct curl_slist *h = request_headers(c, url, head);
    common_opts(c, e, errbuf);
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body_mem);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)(c->timeout_s * 4000));
    if (head) curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    CURLcode rc = curl_easy_perform(e);
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &r->status);
    curl_easy_cleanup(e);
    curl_slist_free_all(h);
    if (rc != CURLE_OK) {
      st = rc == CURLE_WRITE_ERROR
               ? kiln_status_make(KILN_ERR_UNAVAILABLE, "%s: the answer is larger than %zu bytes",
                                  url, r->max_body)
               : net_error(c, url, rc, errbuf);
      break;
    }
    if (r->status >= 300 && r->status < 400 && r->location[0] == '/' && r->location[1] != '/') {
      if (hop >= 10) {
        st = kiln_status_make(KILN_ERR_UNAVAILABLE, "%s: more than 10 redirects", url0);
        break;
      }
      char *next = kiln_strprintf("%.*s%s", (int)origin_len(url), url, r->location);
      if (!next) {
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
        break;
      }
      free(url);
      url = next;
      continue;
    }
    break;
  }
  free(url);
  return st;
}

/* The error for an HTTP status the Hub answered with (what = "the file list", a file name). */
static kiln_status_t http_error(const hub_ctx_t *c, const hub_resp_t *r, const char *what) {
  const char *code = r->error_code, *msg = r->error_message;
  const char *repo = c->id->repo, *rev = c->id->revision;
  char extra[700] = "";
  if (msg[0]) snprintf(extra, sizeof(extra), " (the Hub says: %s)", msg);
  if (!strcmp(code, "GatedRepo") ||
      ((r->status == 401 || r->status == 403) && strcmp(code, "RepoNotFound") != 0)) {
    if (!c->token)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s is gated or private (HTTP %ld) and no token was given: accept "
                              "its terms on %s/%s if it has any, then set HF_TOKEN or put the "
                              "token in ~/.cache/huggingface/token%s",
                              repo, r->status, c->endpoint, repo, extra);
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: the token was refused (HTTP %ld): it has no access to this "
                            "repository (gated: request access on %s/%s)%s",
                            repo, r->status, c->endpoint, repo, extra);
  }
  if (!strcmp(code, "RepoNotFound") || (r->status == 404 && !code[0] && !strcmp(what, "")))
    return kiln_status_make(KILN_ERR_NOT_FOUND, "unknown repository %s on %s (HTTP %ld)%s%s", repo,
                            c->endpoint, r->status,
                            c->token ? "" : "; if it is private, set HF_TOKEN", extra);
  if (!strcmp(code, "RevisionNotFound"))
    return kiln_status_make(KILN_ERR_NOT_FOUND, "%s has no revision '%s' (HTTP %ld)%s", repo, rev,
                            r->status, extra);
  if (!strcmp(code, "EntryNotFound") || r->status == 404)
    return kiln_status_make(KILN_ERR_NOT_FOUND, "%s@%s: %s%s not found (HTTP %ld)%s", repo, rev,
                            what[0] ? "no file " : "", what[0] ? what : "repository", r->status,
                            extra);
  kiln_strbuf_t sb = {0};
  hub_cache_summary(c, &sb);
  kiln_status_t st = kiln_status_make(
      r->status >= 500 ? KILN_ERR_UNAVAILABLE : KILN_ERR_INVALID_ARGUMENT,
      "%s@%s: %s: the Hub answered HTTP %ld%s; %s", repo, rev, what[0] ? what : "the file list",
      r->status, extra, kiln_strbuf_ok(&sb) ? kiln_strbuf_cstr(&sb) : "");
  kiln_strbuf_free(&sb);
  return st;
}

/* ---- the plan: which files, their etags and sizes ------------------------------------------- */

typedef struct hub_file {
  char *name;     /* its path in the repository */
  char etag[72];  /* normalized: no W/, no quotes */
  int64_t size;   /* -1 = unknown */
  char *location; /* where to GET it */
  bool linked;    /* snapshots/COMMIT/name already resolves */
  bool have_blob;
} hub_file_t;

typedef struct hub_plan {
  hub_file_t *f;
  size_t n, cap;
  char commit[41];
  char **siblings;
  size_t n_siblings;
} hub_plan_t;

static void plan_free(hub_plan_t *p) {
  for (size_t i = 0; i < p->n; i++) {
    free(p->f[i].name);
    free(p->f[i].location);
  }
  free(p->f);
  for (size_t i = 0; i < p->n_siblings; i++) free(p->siblings[i]);
  free(p->siblings);
}

static bool has_sibling(const hub_plan_t *p, const char *name) {
  for (size_t i = 0; i < p->n_siblings; i++)
    if (!strcmp(p->siblings[i], name)) return true;
  return false;
}

static kiln_status_t plan_add(hub_plan_t *p, const char *name) {
  for (size_t i = 0; i < p->n; i++)
    if (!strcmp(p->f[i].name, name)) return NULL;
  if (p->n == p->cap) {
    size_t cap = p->cap ? 2 * p->cap : 16;
    hub_file_t *f = realloc(p->f, cap * sizeof(*f));
    if (!f) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    p->f = f;
    p->cap = cap;
  }
  hub_file_t *f = &p->f[p->n];
  memset(f, 0, sizeof(*f));
  f->size = -1;
  if (!(f->name = strdup(name))) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  p->n++;
  return NULL;
}

/* GET /api/models/REPO/revision/REV: the commit and the file names. */
static kiln_status_t fetch_info(hub_ctx_t *c, hub_plan_t *p) {
  kiln_strbuf_t url = {0};
  kiln_strbuf_printf(&url, "%s/api/models/%s/revision/", c->endpoint, c->id->repo);
  url_escape(&url, c->id->revision, false);
  if (!kiln_strbuf_ok(&url)) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  hub_resp_t r;
  memset(&r, 0, sizeof(r));
  r.max_body = 64u << 20;
  kiln_status_t st = hub_request(c, false, kiln_strbuf_cstr(&url), &r);
  if (!st && r.status != 200) st = http_error(c, &r, "");
  kiln_json_doc_t *doc = NULL;
  if (!st)
    st = kiln_json_parse(r.body.data ? r.body.data : "", r.body.len, "the Hub's answer", &doc);
  if (!st) {
    const kiln_json_t *root = kiln_json_root(doc);
    const char *sha = kiln_json_string(kiln_json_get(root, "sha"), NULL);
    const kiln_json_t *sib = kiln_json_get(root, "siblings");
    if (!sha || !hub_is_hex(sha, 40) || !kiln_json_is(sib, KILN_JSON_ARRAY)) {
      st = kiln_status_make(KILN_ERR_UNAVAILABLE,
                            "%s: the answer has no 40-digit \"sha\" and \"siblings\" list: is "
                            "%s a Hugging Face Hub?",
                            kiln_strbuf_cstr(&url), c->endpoint);
    } else {
      memcpy(p->commit, sha, 41);
      size_t n = kiln_json_len(sib);
      p->siblings = calloc(n ? n : 1, sizeof(char *));
      if (!p->siblings) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
      for (size_t i = 0; !st && i < n; i++) {
        const char *f = kiln_json_string(kiln_json_get(kiln_json_at(sib, i), "rfilename"), NULL);
        if (!f) continue;
        if (!(p->siblings[p->n_siblings] = strdup(f)))
          st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
        else
          p->n_siblings++;
      }
    }
  }
  kiln_json_doc_free(doc);
  kiln_strbuf_free(&r.body);
  kiln_strbuf_free(&url);
  return st;
}

/* An etag as huggingface_hub keeps it: without a weak prefix and quotes. */
static void normalize_etag(char *dst, size_t size, const char *v) {
  if (!strncmp(v, "W/", 2)) v += 2;
  size_t n = strlen(v);
  if (n >= 2 && v[0] == '"' && v[n - 1] == '"') v++, n -= 2;
  copy_value(dst, size, v, n);
}

/* HEAD /REPO/resolve/COMMIT/FILE: the etag, the size and where the bytes are. */
static kiln_status_t fetch_meta(hub_ctx_t *c, const hub_plan_t *p, hub_file_t *f) {
  kiln_strbuf_t url = {0};
  kiln_strbuf_printf(&url, "%s/%s/resolve/%s/", c->endpoint, c->id->repo, p->commit);
  url_escape(&url, f->name, true);
  if (!kiln_strbuf_ok(&url)) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  hub_resp_t r;
  memset(&r, 0, sizeof(r));
  r.max_body = 1 << 16;
  kiln_status_t st = hub_request(c, true, kiln_strbuf_cstr(&url), &r);
  if (!st && !(r.status == 200 || (r.status >= 300 && r.status < 400 && r.location[0])))
    st = http_error(c, &r, f->name);
  if (!st) {
    normalize_etag(f->etag, sizeof(f->etag), r.linked_etag[0] ? r.linked_etag : r.etag);
    f->size = r.linked_size >= 0 ? r.linked_size : r.content_length;
    bool usable = f->etag[0] && f->etag[0] != '.';
    for (const char *e = f->etag; *e && usable; e++)
      usable = isalnum((unsigned char)*e) || *e == '-' || *e == '_' || *e == '.' || *e == '+';
    if (!usable)
      st = kiln_status_make(KILN_ERR_UNAVAILABLE,
                            "%s: the Hub sent no usable ETag or X-Linked-Etag, so the file "
                            "cannot be checked or cached",
                            kiln_strbuf_cstr(&url));
    else if (r.status >= 300)
      f->location = r.location[0] == '/' ? kiln_strprintf("%.*s%s", (int)origin_len(c->endpoint),
                                                          c->endpoint, r.location)
                                         : strdup(r.location);
    else
      f->location = strdup(kiln_strbuf_cstr(&url));
    if (!st && !f->location) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  }
  kiln_strbuf_free(&r.body);
  kiln_strbuf_free(&url);
  return st;
}

/* ---- progress ------------------------------------------------------------------------------- */

typedef struct progress {
  const hub_ctx_t *c;
  const char *name;
  int index, count;
  int64_t total, done, start_done;
  double t0, last;
  bool shown;
} progress_t;

static void fmt_eta(char *buf, size_t size, double s) {
  if (!(s >= 0) || s > 360000) {
    snprintf(buf, size, "--:--");
    return;
  }
  long t = (long)(s + 0.5);
  if (t >= 3600)
    snprintf(buf, size, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else
    snprintf(buf, size, "%ld:%02ld", t / 60, t % 60);
}

static void progress_show(progress_t *pg, bool final) {
  if (pg->c->progress == KILN_HUB_PROGRESS_NONE) return;
  double t = now_s();
  bool lines = pg->c->progress == KILN_HUB_PROGRESS_LINES;
  if (!final && t - pg->last < (lines ? 10.0 : 0.1)) return;
  pg->last = t;
  double el = t - pg->t0, rate = el > 0 ? (double)(pg->done - pg->start_done) / el : 0;
  char d[32], tot[32], r[32], eta[32];
  hub_bytes(d, sizeof(d), (double)pg->done);
  hub_bytes(tot, sizeof(tot), pg->total >= 0 ? (double)pg->total : 0);
  hub_bytes(r, sizeof(r), rate);
  fmt_eta(eta, sizeof(eta),
          pg->total >= 0 && rate > 0 ? (double)(pg->total - pg->done) / rate : -1);
  int pct = pg->total > 0 ? (int)(100.0 * (double)pg->done / (double)pg->total) : 100;
  if (lines) {
    if (final)
      fprintf(stderr, "kiln: hub: [%d/%d] %s: %s in %.1f s (%s/s)\n", pg->index, pg->count,
              pg->name, d, el, r);
    else
      fprintf(stderr, "kiln: hub: [%d/%d] %s: %d%% (%s of %s, %s/s, ETA %s)\n", pg->index,
              pg->count, pg->name, pct, d, tot, r, eta);
  } else {
    size_t nl = strlen(pg->name);
    const char *nm = nl > 36 ? pg->name + nl - 36 : pg->name;
    fprintf(stderr, "\r[%d/%d] %s%-36s %3d%% %10s / %-10s %10s/s  ETA %s\033[K", pg->index,
            pg->count, nl > 36 ? "..." : "", nm, pct, d, tot, r, final ? "0:00" : eta);
    if (final) fputc('\n', stderr);
  }
  fflush(stderr);
  pg->shown = true;
}

/* ---- one blob ------------------------------------------------------------------------------- */

typedef struct blob_dl {
  int fd;
  int64_t off; /* bytes in the file */
  bool sha256; /* else a git blob SHA-1 (or no check at all: !check) */
  bool check;
  kiln_sha256_t s256;
  kiln_sha1_t s1;
  int64_t expect; /* the size, -1 = unknown */
  int write_errno;
  bool bad_range; /* a 206 that does not start where the file ends */
  bool started;   /* the body of this attempt has begun */
  long status;
  kiln_strbuf_t errbody;
  progress_t *pg;
  CURL *e;
} blob_dl_t;

static void hasher_reset(blob_dl_t *b) {
  if (b->sha256)
    kiln_sha256_init(&b->s256);
  else if (b->expect >= 0)
    kiln_sha1_git_blob_init(&b->s1, (uint64_t)b->expect);
}

static void hasher_update(blob_dl_t *b, const void *p, size_t n) {
  if (!b->check) return;
  if (b->sha256)
    kiln_sha256_update(&b->s256, p, n);
  else
    kiln_sha1_update(&b->s1, p, n);
}

static size_t on_blob(char *buf, size_t sz, size_t nitems, void *ud) {
  blob_dl_t *b = ud;
  size_t n = sz * nitems;
  if (!b->started) {
    b->started = true;
    curl_easy_getinfo(b->e, CURLINFO_RESPONSE_CODE, &b->status);
    if (b->status == 200 && b->off > 0) { /* the range was ignored: start over */
      if (ftruncate(b->fd, 0) != 0 || lseek(b->fd, 0, SEEK_SET) != 0) {
        b->write_errno = errno;
        return 0;
      }
      b->off = 0;
      b->pg->done = 0;
      b->pg->start_done = 0;
      hasher_reset(b);
    }
  }
  if (b->status != 200 && b->status != 206) { /* an error page: keep its start for the message */
    if (b->errbody.len < 2048) kiln_strbuf_append(&b->errbody, buf, n < 2048 ? n : 2048);
    return n;
  }
  for (size_t w = 0; w < n;) {
    ssize_t k = write(b->fd, buf + w, n - w);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      b->write_errno = k < 0 ? errno : EIO;
      return 0;
    }
    w += (size_t)k;
  }
  hasher_update(b, buf, n);
  b->off += (int64_t)n;
  b->pg->done = b->off;
  progress_show(b->pg, false);
  return n;
}

/* Checks a 206's Content-Range against where the file ends (before any byte is written). */
static size_t on_blob_header(char *buf, size_t sz, size_t nitems, void *ud) {
  blob_dl_t *b = ud;
  size_t n = sz * nitems;
  if (n > 14 && strncasecmp(buf, "Content-Range:", 14) == 0) {
    const char *p = buf + 14;
    while (*p == ' ') p++;
    long long start = -1;
    if (sscanf(p, "bytes %lld-", &start) != 1 || start != (long long)b->off) b->bad_range = true;
  }
  return n;
}

/* Rehashes what the file already holds (a resumed download). */
static kiln_status_t hash_prefix(blob_dl_t *b, const char *path) {
  hasher_reset(b);
  if (!b->check || b->off == 0) return NULL;
  char *buf = malloc(1 << 20);
  if (!buf) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  int64_t at = 0;
  while (at < b->off) {
    size_t want = (size_t)(b->off - at < (1 << 20) ? b->off - at : (1 << 20));
    ssize_t k = pread(b->fd, buf, want, at);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      free(buf);
      return kiln_status_make(KILN_ERR_IO, "cannot read %s: %s", path,
                              k < 0 ? strerror(errno) : "short file");
    }
    hasher_update(b, buf, (size_t)k);
    at += k;
  }
  free(buf);
  return NULL;
}

static bool retryable(CURLcode rc) {
  return rc == CURLE_PARTIAL_FILE || rc == CURLE_RECV_ERROR || rc == CURLE_SEND_ERROR ||
         rc == CURLE_GOT_NOTHING || rc == CURLE_OPERATION_TIMEDOUT || rc == CURLE_COULDNT_CONNECT ||
         rc == CURLE_HTTP2 || rc == CURLE_HTTP2_STREAM;
}

/* Downloads f into blobs/ETAG (the caller holds its lock). */
static kiln_status_t download_blob(hub_ctx_t *c, hub_file_t *f, const char *blob, progress_t *pg) {
  char part[KILN_HUB_PATH_MAX + 16];
  hub_pathf(part, sizeof(part), "%s.incomplete", blob);
  blob_dl_t b;
  memset(&b, 0, sizeof(b));
  b.expect = f->size;
  b.sha256 = hub_is_hex(f->etag, 64);
  b.check = b.sha256 || (hub_is_hex(f->etag, 40) && f->size >= 0);
  b.pg = pg;
  b.fd = open(part, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (b.fd < 0) return kiln_status_make(KILN_ERR_IO, "cannot create %s: %s", part, strerror(errno));
  kiln_status_t st = NULL;
  struct stat sst;
  if (fstat(b.fd, &sst) != 0) {
    st = kiln_status_make(KILN_ERR_IO, "cannot stat %s: %s", part, strerror(errno));
    goto out;
  }
  b.off = sst.st_size;
  if (f->size >= 0 && b.off > f->size) { /* longer than the file: not a prefix of it */
    if (ftruncate(b.fd, 0) != 0) {
      st = kiln_status_make(KILN_ERR_IO, "cannot truncate %s: %s", part, strerror(errno));
      goto out;
    }
    b.off = 0;
  }
  if (lseek(b.fd, b.off, SEEK_SET) < 0) {
    st = kiln_status_make(KILN_ERR_IO, "cannot seek in %s: %s", part, strerror(errno));
    goto out;
  }
  if ((st = hash_prefix(&b, part))) goto out;
  if (b.off > 0 && c->progress != KILN_HUB_PROGRESS_NONE) {
    char have[32];
    fprintf(stderr, "kiln: hub: %s: resuming a partial download at %s\n", f->name,
            hub_bytes(have, sizeof(have), (double)b.off));
  }
  pg->done = pg->start_done = b.off;
  pg->t0 = now_s();
  int cuts = 0;
  while (!(f->size >= 0 && b.off == f->size)) {
    CURL *e = curl_easy_init();
    if (!e) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "curl_easy_init failed");
      break;
    }
    char errbuf[CURL_ERROR_SIZE] = {0}, range[48];
    struct curl_slist *h = request_headers(c, f->location, true);
    common_opts(c, e, errbuf);
    curl_easy_setopt(e, CURLOPT_URL, f->location);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(e, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_blob);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_blob_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, &b);
    if (b.off > 0) {
      snprintf(range, sizeof(range), "%lld-", (long long)b.off);
      curl_easy_setopt(e, CURLOPT_RANGE, range);
    }
    b.e = e;
    b.started = false;
    b.bad_range = false;
    b.status = 0;
    kiln_strbuf_reset(&b.errbody);
    int64_t before = b.off;
    CURLcode rc = curl_easy_perform(e);
    long status = 0;
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(e);
    curl_slist_free_all(h);
    if (b.write_errno) {
      char have[32];
      hub_bytes(have, sizeof(have), (double)b.off);
      st = kiln_status_make(
          KILN_ERR_IO,
          "%s: %s writing %s (%s written; the partial file is kept and resumes "
          "on the next try)",
          f->name, b.write_errno == ENOSPC ? "disk full" : strerror(b.write_errno), part, have);
      break;
    }
    if (rc == CURLE_OK && status == 416 && b.off > 0 && f->size < 0) break; /* it was complete */
    if (rc == CURLE_OK && status == 206 && b.bad_range) {
      st = kiln_status_make(KILN_ERR_UNAVAILABLE,
                            "%s: the server answered the range request from byte %lld with "
                            "another range",
                            f->name, (long long)b.off);
      break;
    }
    if (rc == CURLE_OK && status != 200 && status != 206) {
      if (status == 416) { /* the partial file is not a prefix the server knows: restart */
        if (ftruncate(b.fd, 0) != 0 || lseek(b.fd, 0, SEEK_SET) != 0) {
          st = kiln_status_make(KILN_ERR_IO, "cannot truncate %s: %s", part, strerror(errno));
          break;
        }
        b.off = 0;
        hasher_reset(&b);
        if (++cuts <= 5) continue;
      }
      hub_resp_t r;
      memset(&r, 0, sizeof(r));
      r.status = status;
      st = http_error(c, &r, f->name);
      break;
    }
    if (rc == CURLE_OK && (f->size < 0 || b.off == f->size)) break;
    /* cut short: resume from where the file ends */
    if (rc == CURLE_OK) rc = CURLE_PARTIAL_FILE;
    if (!retryable(rc) || ++cuts > 5) {
      st = net_error(c, f->location, rc, errbuf);
      break;
    }
    if (b.off > before) cuts = cuts > 1 ? cuts - 1 : cuts; /* progress buys another try */
    if (c->progress != KILN_HUB_PROGRESS_NONE) {
      char have[32], tot[32];
      if (pg->shown && c->progress == KILN_HUB_PROGRESS_BAR) fputc('\n', stderr);
      fprintf(stderr, "kiln: hub: %s: the transfer stopped at %s of %s (%s); resuming\n", f->name,
              hub_bytes(have, sizeof(have), (double)b.off),
              f->size >= 0 ? hub_bytes(tot, sizeof(tot), (double)f->size) : "?",
              curl_easy_strerror(rc));
    }
    struct timespec ts = {0, 200000000L * cuts};
    nanosleep(&ts, NULL);
  }
  if (!st) {
    pg->done = b.off;
    progress_show(pg, true);
  } else if (pg->shown && c->progress == KILN_HUB_PROGRESS_BAR) {
    fputc('\n', stderr);
  }
  if (!st && f->size >= 0 && b.off != f->size)
    st = kiln_status_make(KILN_ERR_IO, "%s: %lld bytes arrived, the Hub said %lld", f->name,
                          (long long)b.off, (long long)f->size);
  if (!st && fsync(b.fd) != 0)
    st = kiln_status_make(KILN_ERR_IO, "%s: %s", part,
                          errno == ENOSPC ? "disk full" : strerror(errno));
  if (!st && !b.check && hub_is_hex(f->etag, 40)) { /* a git blob of unknown size */
    b.expect = b.off;
    b.check = true;
    if ((st = hash_prefix(&b, part))) goto out;
  }
  if (!st && b.check) {
    char got[65];
    if (b.sha256)
      kiln_sha256_final_hex(&b.s256, got);
    else
      kiln_sha1_final_hex(&b.s1, got);
    if (strcmp(got, f->etag) != 0) {
      unlink(part);
      st = kiln_status_make(KILN_ERR_IO,
                            "%s@%s: %s: checksum mismatch: the %s of the downloaded bytes is "
                            "%s, the Hub's etag is %s; the download was removed, try again",
                            c->id->repo, c->id->revision, f->name,
                            b.sha256 ? "SHA-256" : "git blob SHA-1", got, f->etag);
    }
  } else if (!st) {
    KILN_LOG_W("%s: the etag %s is neither a SHA-256 nor a git blob id: not checked", f->name,
               f->etag);
  }
  if (!st && rename(part, blob) != 0)
    st = kiln_status_make(KILN_ERR_IO, "cannot rename %s to %s: %s", part, blob, strerror(errno));
  if (!st) c->out->bytes_downloaded += b.off - pg->start_done;
out:
  close(b.fd);
  kiln_strbuf_free(&b.errbody);
  return st;
}

/* snapshots/COMMIT/NAME -> ../../blobs/ETAG (one ../ more per '/' in NAME), replaced
 * atomically. */
static kiln_status_t link_pointer(hub_ctx_t *c, const char *commit, const hub_file_t *f) {
  char path[KILN_HUB_PATH_MAX + 600], dir[KILN_HUB_PATH_MAX + 600];
  char snap[KILN_HUB_PATH_MAX];
  hub_snapshot_dir(c, commit, snap, sizeof(snap));
  snprintf(path, sizeof(path), "%s/%s", snap, f->name);
  hub_pathf(dir, sizeof(dir), "%s", path);
  *strrchr(dir, '/') = 0;
  kiln_status_t st = hub_mkdirs(dir);
  if (st) return st;
  kiln_strbuf_t target = {0};
  kiln_strbuf_append_str(&target, "../../");
  for (const char *s = f->name; *s; s++)
    if (*s == '/') kiln_strbuf_append_str(&target, "../");
  kiln_strbuf_printf(&target, "blobs/%s", f->etag);
  char tmp[KILN_HUB_PATH_MAX + 700];
  snprintf(tmp, sizeof(tmp), "%s.%ld.lnk", path, (long)getpid());
  unlink(tmp);
  if (!kiln_strbuf_ok(&target))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  else if (symlink(kiln_strbuf_cstr(&target), tmp) != 0 || rename(tmp, path) != 0) {
    st = kiln_status_make(KILN_ERR_IO, "cannot link %s: %s", path, strerror(errno));
    unlink(tmp);
  }
  kiln_strbuf_free(&target);
  return st;
}

/* Brings one file into the snapshot: links an existing blob, else downloads it under the
 * blob's lock (the one huggingface_hub takes: .locks/models--ORG--NAME/ETAG.lock). */
static kiln_status_t fetch_file(hub_ctx_t *c, const hub_plan_t *p, hub_file_t *f, int index,
                                int count) {
  char blob[KILN_HUB_PATH_MAX + 100], lock[KILN_HUB_PATH_MAX + 400];
  snprintf(blob, sizeof(blob), "%s/blobs/%s", c->repo_dir, f->etag);
  struct stat sst;
  kiln_status_t st = NULL;
  if (stat(blob, &sst) != 0) {
    snprintf(lock, sizeof(lock), "%s/.locks/%s", c->cache, c->folder);
    if ((st = hub_mkdirs(lock))) return st;
    snprintf(lock + strlen(lock), sizeof(lock) - strlen(lock), "/%s.lock", f->etag);
    int lfd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lfd < 0)
      return kiln_status_make(KILN_ERR_IO, "cannot create %s: %s", lock, strerror(errno));
    while (flock(lfd, LOCK_EX) != 0 && errno == EINTR) {
    }
    if (stat(blob, &sst) != 0) { /* nobody finished it while we waited */
      progress_t pg = {.c = c, .name = f->name, .index = index, .count = count, .total = f->size};
      if (c->progress == KILN_HUB_PROGRESS_LINES) {
        char sz[32];
        fprintf(stderr, "kiln: hub: [%d/%d] downloading %s/%s (%s)\n", index, count, c->id->repo,
                f->name,
                f->size >= 0 ? hub_bytes(sz, sizeof(sz), (double)f->size) : "size unknown");
        pg.last = now_s();
      }
      st = download_blob(c, f, blob, &pg);
      if (!st) c->out->files_downloaded++;
    }
    flock(lfd, LOCK_UN);
    close(lfd);
    if (st) return st;
  }
  return link_pointer(c, p->commit, f);
}

/* Marks an optional file the repository does not have, as huggingface_hub does. */
static void mark_no_exist(hub_ctx_t *c, const char *commit, const char *name) {
  char path[KILN_HUB_PATH_MAX + 600];
  snprintf(path, sizeof(path), "%s/.no_exist/%s/%s", c->repo_dir, commit, name);
  char *slash = strrchr(path, '/');
  *slash = 0;
  kiln_status_t st = hub_mkdirs(path);
  *slash = '/';
  if (!st) {
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) close(fd);
  }
  kiln_status_free(st);
}

/* What the model needs from the repository: the weights (the named .gguf; the index and its
 * shards; model.safetensors) and config.json, then the optional files it has. */
static kiln_status_t plan_files(hub_ctx_t *c, hub_plan_t *p) {
  kiln_status_t st = NULL;
  const char *repo = c->id->repo;
  if (c->id->file[0]) {
    if (!has_sibling(p, c->id->file)) {
      kiln_strbuf_t g = {0};
      for (size_t i = 0; i < p->n_siblings; i++) {
        size_t l = strlen(p->siblings[i]);
        if (l > 5 && !strcasecmp(p->siblings[i] + l - 5, ".gguf"))
          kiln_strbuf_printf(&g, "%s %s", g.len ? "," : "", p->siblings[i]);
      }
      st = kiln_status_make(KILN_ERR_NOT_FOUND, "%s@%s has no file %s%s%s", repo, c->id->revision,
                            c->id->file, g.len ? "; its .gguf files:" : "",
                            g.len ? kiln_strbuf_cstr(&g) : "");
      kiln_strbuf_free(&g);
      return st;
    }
    if ((st = plan_add(p, c->id->file))) return st;
  } else {
    bool sharded = has_sibling(p, "model.safetensors.index.json");
    if (!sharded && !has_sibling(p, "model.safetensors")) {
      kiln_strbuf_t g = {0};
      for (size_t i = 0; i < p->n_siblings; i++) {
        size_t l = strlen(p->siblings[i]);
        if (l > 5 && !strcasecmp(p->siblings[i] + l - 5, ".gguf"))
          kiln_strbuf_printf(&g, "%s %s/%s", g.len ? "," : "", repo, p->siblings[i]);
      }
      if (g.len)
        st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s@%s has no safetensors weights; name one of its GGUF files:%s",
                              repo, c->id->revision, kiln_strbuf_cstr(&g));
      else
        st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s@%s has no weights Kiln loads (model.safetensors, "
                              "model.safetensors.index.json or a .gguf file)",
                              repo, c->id->revision);
      kiln_strbuf_free(&g);
      return st;
    }
    if (!has_sibling(p, "config.json"))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s@%s has no config.json", repo,
                              c->id->revision);
    if ((st = plan_add(p, "config.json"))) return st;
    if ((st = plan_add(p, sharded ? "model.safetensors.index.json" : "model.safetensors")))
      return st;
  }
  for (int i = 0; hub_optional_files[i]; i++) {
    if (has_sibling(p, hub_optional_files[i]))
      st = plan_add(p, hub_optional_files[i]);
    else
      mark_no_exist(c, p->commit, hub_optional_files[i]);
    if (st) return st;
  }
  /* additional_chat_templates/<name>.jinja (transformers >= 4.50) */
  for (size_t i = 0; !st && i < p->n_siblings; i++) {
    const char *s = p->siblings[i];
    size_t l = strlen(s);
    if (!strncmp(s, "additional_chat_templates/", 26) && l > 32 && !strcmp(s + l - 6, ".jinja") &&
        !strchr(s + 26, '/'))
      st = plan_add(p, s);
  }
  return st;
}

static bool pointer_ok(const hub_ctx_t *c, const char *commit, const char *name) {
  char snap[KILN_HUB_PATH_MAX], path[KILN_HUB_PATH_MAX + 600];
  hub_snapshot_dir(c, commit, snap, sizeof(snap));
  snprintf(path, sizeof(path), "%s/%s", snap, name);
  struct stat st;
  return stat(path, &st) == 0;
}

/* Fetches (or finds) the metadata of the plan's files, checks the disk has room for what is
 * missing, then brings each into the snapshot. */
static kiln_status_t fetch_all(hub_ctx_t *c, hub_plan_t *p) {
  kiln_status_t st = NULL;
  double need = 0;
  int count = 0, index = 0;
  for (size_t i = 0; !st && i < p->n; i++) {
    hub_file_t *f = &p->f[i];
    if ((f->linked = pointer_ok(c, p->commit, f->name))) continue;
    if ((st = fetch_meta(c, p, f))) break;
    char blob[KILN_HUB_PATH_MAX + 100], part[KILN_HUB_PATH_MAX + 120];
    snprintf(blob, sizeof(blob), "%s/blobs/%s", c->repo_dir, f->etag);
    snprintf(part, sizeof(part), "%s.incomplete", blob);
    struct stat sst;
    count++;
    f->have_blob = stat(blob, &sst) == 0;
    if (!f->have_blob && f->size > 0) {
      need += (double)f->size;
      if (stat(part, &sst) == 0 && sst.st_size <= f->size) need -= (double)sst.st_size;
    }
  }
  if (st) return st;
  char blobs[KILN_HUB_PATH_MAX + 8];
  snprintf(blobs, sizeof(blobs), "%s/blobs", c->repo_dir);
  if ((st = hub_mkdirs(blobs))) return st;
  struct statvfs vfs;
  if (need > 0 && statvfs(blobs, &vfs) == 0 && (double)vfs.f_bavail * (double)vfs.f_frsize < need) {
    char a[32], b[32];
    kiln_strbuf_t sb = {0};
    hub_cache_summary(c, &sb);
    st = kiln_status_make(
        KILN_ERR_IO, "not enough disk space (disk full): %s@%s needs %s more in %s, %s is free; %s",
        c->id->repo, c->id->revision, hub_bytes(a, sizeof(a), need), blobs,
        hub_bytes(b, sizeof(b), (double)vfs.f_bavail * (double)vfs.f_frsize),
        kiln_strbuf_ok(&sb) ? kiln_strbuf_cstr(&sb) : "");
    kiln_strbuf_free(&sb);
    return st;
  }
  for (size_t i = 0; !st && i < p->n; i++) {
    hub_file_t *f = &p->f[i];
    if (!f->linked) st = fetch_file(c, p, f, ++index, count);
  }
  return st;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

kiln_status_t hub_fetch(hub_ctx_t *c) {
  pthread_once(&curl_once, curl_init);
  if (curl_init_rc != CURLE_OK)
    return kiln_status_make(KILN_ERR_INTERNAL, "curl_global_init failed: %s",
                            curl_easy_strerror(curl_init_rc));
  hub_plan_t p;
  memset(&p, 0, sizeof(p));
  kiln_status_t st = fetch_info(c, &p);
  char path[KILN_HUB_PATH_MAX + 600];
  if (!st) st = hub_mkdirs(c->repo_dir);
  /* refs/REVISION -> the commit, as soon as it is known (huggingface_hub does the same) */
  if (!st && strcmp(c->id->revision, p.commit) != 0) {
    snprintf(path, sizeof(path), "%s/refs/%s", c->repo_dir, c->id->revision);
    char *slash = strrchr(path, '/');
    *slash = 0;
    st = hub_mkdirs(path);
    *slash = '/';
    if (!st) st = hub_write_file(path, p.commit);
  }
  if (!st) st = plan_files(c, &p);
  /* The shards come from the index: fetch it first, then plan them. */
  if (!st && !c->id->file[0] && has_sibling(&p, "model.safetensors.index.json")) {
    char snap[KILN_HUB_PATH_MAX];
    hub_snapshot_dir(c, p.commit, snap, sizeof(snap));
    hub_plan_t one = p; /* fetch_all over the index entry alone */
    size_t idx = 0;
    while (strcmp(p.f[idx].name, "model.safetensors.index.json") != 0) idx++;
    one.f = &p.f[idx];
    one.n = 1;
    st = fetch_all(c, &one);
    if (!st) {
      char **shards = NULL;
      size_t ns = 0;
      snprintf(path, sizeof(path), "%s/model.safetensors.index.json", snap);
      st = hub_index_shards(path, &shards, &ns);
      if (!st) qsort(shards, ns, sizeof(*shards), cmp_str);
      for (size_t i = 0; i < ns; i++) {
        if (!st && !has_sibling(&p, shards[i]))
          st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s@%s: model.safetensors.index.json names %s, which the "
                                "repository does not have",
                                c->id->repo, c->id->revision, shards[i]);
        if (!st) st = plan_add(&p, shards[i]);
        free(shards[i]);
      }
      free(shards);
    }
  }
  if (!st) st = fetch_all(c, &p);
  if (!st) {
    memcpy(c->out->commit, p.commit, 41);
    c->out->files = (int32_t)p.n;
    if (c->progress != KILN_HUB_PROGRESS_NONE) {
      char b[32];
      fprintf(stderr, "kiln: hub: %s@%s (commit %.12s): %d files, %d downloaded (%s), in %s\n",
              c->id->repo, c->id->revision, p.commit, (int)p.n, (int)c->out->files_downloaded,
              hub_bytes(b, sizeof(b), (double)c->out->bytes_downloaded), c->repo_dir);
    }
  }
  plan_free(&p);
  return st;
}

#endif /* KILN_HUB_CURL */
