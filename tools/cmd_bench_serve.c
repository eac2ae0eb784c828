/* cmd_bench_serve.c - `kiln bench serve`: a client-side benchmark of an OpenAI-compatible HTTP
 * server (kiln serve, vLLM, llama.cpp's server), in the manner of vLLM's benchmark_serving.
 *
 * Every request is streamed (Server-Sent Events). One thread runs a libcurl multi handle as an
 * event loop: requests are launched at their scheduled arrival times (Poisson arrivals at
 * --request-rate, or all at once) while fewer than --max-concurrency are in flight, and each
 * event is timestamped (CLOCK_MONOTONIC) as it is read. Per request: TTFT (launch to the first
 * event with content), the gaps between content events (ITL), TPOT = (e2e - TTFT) / (output
 * tokens - 1), e2e latency, and the token counts from the final usage event (else the number of
 * content events). A request succeeds when the server answers 200 and the stream ends with
 * `data: [DONE]`; a transport error, another status, an error event or an event that is not JSON
 * fails it with a message, and the run goes on. Everything runs on the calling thread (curl's
 * callbacks included), so no state is shared or locked.
 *
 * A request's life:
 *
 *     scheduled --bs_launch()--> in flight --bs_on_data()--> (events parsed as they arrive)
 *                                    |
 *                                    +--bs_finish()--> result (ok, or failed with a message)
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, getline, isatty */
#include <curl/curl.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "cmd_bench.h"
#include "base/base64.h"
#include "base/json.h"
#include "base/status.h"
#include "base/strbuf.h"

#ifndef KILN_VERSION_STRING
#define KILN_VERSION_STRING "dev"
#endif

#define BS_CMD "bench serve"
#define BS_MAX_LINE (16u << 20)   /* a longer SSE line fails the request (a server sending junk) */
#define BS_MAX_ERRBODY 4096       /* bytes of a non-200 body kept for its message */
#define BS_MAX_MESSAGE 300        /* characters of a server's error message kept */
#define BS_MAX_MODELS (64u << 20) /* bytes of a GET /v1/models answer */
#define BS_SHOW_ERRORS 5          /* failed requests listed on stderr */

typedef enum bs_endpoint { BS_COMPLETIONS, BS_CHAT } bs_endpoint_t;

typedef struct bs_args {
  const char *url;           /* the base: http://HOST:PORT (a trailing / or /v1 is dropped) */
  const char *endpoint_name; /* --endpoint: completions or chat */
  bs_endpoint_t endpoint;
  const char *model;     /* NULL = the first id of GET /v1/models */
  const char *api_key;   /* --api-key, $KILN_API_KEY or $OPENAI_API_KEY; NULL = none */
  const char *dataset;   /* JSONL file, or NULL for random prompts */
  const char *image_dir; /* --image-dir: one image of it (cyclically) with each chat request */
  const char *json;      /* --json FILE */
  int64_t num_prompts, max_concurrency, input_len, output_len, random_ids, seed, warmup;
  double request_rate; /* requests/s; INFINITY = all at once */
  double timeout;      /* seconds per request; 0 = none */
  double temperature;
  bool num_prompts_set, ignore_eos, help;
} bs_args_t;

/* One line of --dataset. */
typedef struct bs_item {
  kiln_json_doc_t *doc;
  const kiln_json_t *prompt;   /* a string, or (completions) an array of token ids; or NULL */
  const kiln_json_t *messages; /* (chat) an array of messages, or NULL */
  int64_t max_tokens;          /* 0 = --output-len */
  int64_t prompt_tokens;       /* the number of ids of an id prompt; 0 = unknown */
} bs_item_t;

/* A growable array of doubles. */
typedef struct bs_dvec {
  double *v;
  size_t len, cap;
} bs_dvec_t;

/* One request's outcome. Times in seconds; ttft and tpot are -1 when undefined (no content, or
 * fewer than two output tokens). */
typedef struct bs_result {
  bool ok;
  long http_status; /* 0 when no response came */
  double start;     /* launch time, from the start of the run */
  double ttft, tpot, e2e;
  int64_t input_tokens, output_tokens;
  bs_dvec_t itl; /* the gaps between content events */
  char *error;   /* why it failed (malloc'ed; NULL when ok, or when out of memory) */
} bs_result_t;

struct bs;

/* A request in flight: owns its easy handle, body and stream-parsing state. */
typedef struct bs_req {
  struct bs *b;
  bs_result_t *res;
  CURL *easy;
  kiln_strbuf_t body;    /* the request body; curl reads it in place */
  kiln_strbuf_t line;    /* SSE: the current, incomplete line */
  kiln_strbuf_t data;    /* SSE: the data lines of the current event, joined by \n */
  kiln_strbuf_t errbody; /* the first BS_MAX_ERRBODY bytes of a non-200 answer */
  bool has_data, done_seen, status_known, has_usage, oom;
  long http_status;
  double t_start, t_first, t_last; /* CLOCK_MONOTONIC; t_first = 0 until content comes */
  int64_t events, content_events, usage_in, usage_out;
  int64_t nominal_input; /* prompt tokens as generated, for a server that sends no usage */
  char *error;           /* set by the stream parser (malloc'ed) */
  char errbuf[CURL_ERROR_SIZE];
  struct bs_req *prev, *next; /* the in-flight list */
} bs_req_t;

/* The benchmark: options, URLs, shared headers, the multi handle and the in-flight list. */
typedef struct bs {
  const bs_args_t *a;
  char *url_post;   /* base + /v1/completions or /v1/chat/completions */
  char *url_models; /* base + /v1/models */
  char *model;      /* the model sent with each request (owned) */
  struct curl_slist *headers;
  CURLM *multi;
  bs_item_t *items; /* the dataset's lines */
  size_t num_items;
  char **image_urls; /* --image-dir's files as data: URLs, by name */
  size_t num_images;
  bs_req_t *live; /* requests in flight */
} bs_t;

/* ---- options -------------------------------------------------------------------------------- */

static const char bs_usage[] =
    "usage: kiln bench serve [--url http://HOST:PORT] [--endpoint completions|chat] [options]\n"
    "\n"
    "Drives a running OpenAI-compatible server (kiln serve, vLLM, llama.cpp's server) with\n"
    "streamed requests (stream: true, stream_options.include_usage) and reports, per request,\n"
    "TTFT (time to the first content token), TPOT ((e2e - TTFT) / (output tokens - 1)), ITL\n"
    "(the gaps between streamed content chunks) and end-to-end latency, as mean, p50, p90 and\n"
    "p99 in ms, plus request and token throughput over the run. Token counts come from the\n"
    "server's usage chunk (else output tokens = content chunks). Exit status: 0 when every\n"
    "request succeeded, 1 otherwise (the first failures are listed on stderr).\n";

static const kiln_opt_t bs_rows[] = {
    KILN_OPT_STRING("--url", "URL", bs_args_t, url, "the server (default http://127.0.0.1:8000)"),
    KILN_OPT_STRING("--endpoint", "NAME", bs_args_t, endpoint_name,
                    "completions (POST /v1/completions, default) or chat\n"
                    "(POST /v1/chat/completions)"),
    KILN_OPT_STRING("--model", "NAME", bs_args_t, model,
                    "the model to ask for (default: the first id of GET /v1/models)"),
    KILN_OPT_STRING("--api-key", "KEY", bs_args_t, api_key,
                    "sent as Authorization: Bearer KEY (default: $KILN_API_KEY, else\n"
                    "$OPENAI_API_KEY, else none)"),
    KILN_OPT_INT_SEEN("--num-prompts", "N", bs_args_t, num_prompts, num_prompts_set, 1, 10000000,
                      "requests to send (default 100, or the dataset's lines)"),
    KILN_OPT_FLOAT("--request-rate", "R", bs_args_t, request_rate, 1e-6, INFINITY,
                   "requests/s, Poisson arrivals (exponential gaps); inf = all at\n"
                   "once (default inf)"),
    KILN_OPT_INT("--max-concurrency", "C", bs_args_t, max_concurrency, 1, 1000000,
                 "most requests in flight; later arrivals wait (default: no limit)"),
    KILN_OPT_INT("--input-len", "L", bs_args_t, input_len, 1, 1 << 24,
                 "random prompts: L random words, or L token ids with --random-ids\n"
                 "(default 128)"),
    KILN_OPT_INT("--output-len", "O", bs_args_t, output_len, 1, 1 << 24,
                 "max_tokens of each request (default 128)"),
    KILN_OPT_INT("--random-ids", "VOCAB", bs_args_t, random_ids, 1, INT32_MAX,
                 "completions: send prompts as token ids, uniform in [0, VOCAB)"),
    KILN_OPT_STRING("--dataset", "FILE", bs_args_t, dataset,
                    "JSONL requests instead of random ones: each line has \"prompt\"\n"
                    "(text; or token ids for completions) or \"messages\" (chat), and\n"
                    "optionally \"max_tokens\"; lines are used in order, cyclically"),
    KILN_OPT_STRING("--image-dir", "DIR", bs_args_t, image_dir,
                    "chat: the PNG, JPEG and WebP files of DIR, one with each request\n"
                    "(in name order, cyclically) as a data: URL image_url part before\n"
                    "the prompt's text (vision-language models)"),
    KILN_OPT_INT("--seed", "S", bs_args_t, seed, 0, INT64_MAX,
                 "seeds the random prompts and the arrival times (default 0)"),
    KILN_OPT_FLOAT("--temperature", "T", bs_args_t, temperature, 0, 100,
                   "sent with each request (default 0)"),
    KILN_OPT_FLAG("--ignore-eos", bs_args_t, ignore_eos,
                  "send ignore_eos: true, so each request runs to max_tokens\n"
                  "(vLLM and kiln honour it)"),
    KILN_OPT_FLOAT("--timeout", "SEC", bs_args_t, timeout, 0, 1e6,
                   "fail a request that takes longer (default 0 = no limit)"),
    KILN_OPT_INT("--warmup", "N", bs_args_t, warmup, 0, 1000000,
                 "send N requests first and leave them out of the results"),
    KILN_OPT_STRING("--json", "FILE", bs_args_t, json,
                    "also write the results as one JSON object (request_rate null =\n"
                    "inf; per-request details under \"requests\")"),
};

static const kiln_opts_t bs_opts = {
    .cmd = BS_CMD,
    .usage = bs_usage,
    .opts = bs_rows,
    .num_opts = KILN_OPTS_COUNT(bs_rows),
    .common = &kiln_cli_common_opts,
};

static kiln_status_t bs_parse(kiln_cli_t *cli, bs_args_t *a) {
  const char *cmd = BS_CMD;
  memset(a, 0, sizeof(*a));
  a->url = "http://127.0.0.1:8000";
  a->endpoint_name = "completions";
  a->num_prompts = 100;
  a->input_len = 128;
  a->output_len = 128;
  a->request_rate = INFINITY;
  kiln_status_t st = kiln_opts_parse(&bs_opts, cli->argc, cli->argv, a, &a->help);
  if (st || a->help) return st;
  const char *endpoint = a->endpoint_name;
  if (strcmp(endpoint, "completions") == 0)
    a->endpoint = BS_COMPLETIONS;
  else if (strcmp(endpoint, "chat") == 0)
    a->endpoint = BS_CHAT;
  else
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: --endpoint wants completions or chat, got '%s'", cmd, endpoint);
  if (strncmp(a->url, "http://", 7) != 0 && strncmp(a->url, "https://", 8) != 0)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: --url wants http://HOST:PORT or https://..., got '%s'", cmd,
                            a->url);
  if (a->random_ids && a->endpoint == BS_CHAT)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: --random-ids sends token ids, which only --endpoint completions "
                            "takes",
                            cmd);
  if (a->random_ids && a->dataset)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: --random-ids is for random prompts, not --dataset", cmd);
  if (a->image_dir && a->endpoint != BS_CHAT)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: --image-dir sends image_url parts, which only --endpoint chat "
                            "takes",
                            cmd);
  if (!a->api_key) {
    const char *env = getenv("KILN_API_KEY");
    if (!env || !*env) env = getenv("OPENAI_API_KEY");
    if (env && *env) a->api_key = env;
  }
  return NULL;
}

/* ---- small helpers -------------------------------------------------------------------------- */

static bool bs_dvec_push(bs_dvec_t *d, double x) {
  if (d->len == d->cap) {
    size_t cap = d->cap ? 2 * d->cap : 64;
    double *v = realloc(d->v, cap * sizeof(*v));
    if (!v) return false;
    d->v = v;
    d->cap = cap;
  }
  d->v[d->len++] = x;
  return true;
}

/* splitmix64: a small, well-mixed generator; the same seed gives the same prompts and arrival
 * times on every machine. */
static uint64_t bs_rand(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static double bs_rand_unit(uint64_t *s) { return (double)(bs_rand(s) >> 11) * 0x1.0p-53; }

/* Appends s[0..n) on one line: trailing white space is dropped, other control characters
 * become spaces, and at most max bytes are kept ("..." marks a cut). */
static void bs_oneline(kiln_strbuf_t *out, const char *s, size_t n, size_t max) {
  while (n > 0 && (unsigned char)s[n - 1] <= ' ') n--;
  size_t k = n < max ? n : max;
  for (size_t i = 0; i < k; i++) {
    unsigned char c = (unsigned char)s[i];
    kiln_strbuf_append_char(out, c < 0x20 || c == 0x7f ? ' ' : (char)c);
  }
  if (k < n) kiln_strbuf_append_str(out, "...");
}

/* Appends the message of an OpenAI-style error value: {"message": ...}, a string, or the value
 * itself as JSON. */
static void bs_error_text(kiln_strbuf_t *out, const kiln_json_t *v) {
  size_t len;
  const char *s = kiln_json_string(v, &len);
  if (!s && kiln_json_is(v, KILN_JSON_OBJECT)) {
    s = kiln_json_string(kiln_json_get(v, "message"), &len);
    if (!s) s = kiln_json_string(kiln_json_get(v, "detail"), &len);
  }
  if (s) {
    bs_oneline(out, s, len, BS_MAX_MESSAGE);
    return;
  }
  kiln_strbuf_t js = KILN_STRBUF_INIT;
  kiln_json_write(&js, v, false, false);
  bs_oneline(out, kiln_strbuf_cstr(&js), js.len, BS_MAX_MESSAGE);
  kiln_strbuf_free(&js);
}

/* Words for random text prompts: common English words, each one token in the usual BPE
 * vocabularies when preceded by a space, so L words come to about L prompt tokens. */
static const char *const bs_words[] = {
    "the",   "of",    "and",    "to",    "in",      "is",     "was",    "that",    "for",
    "on",    "with",  "as",     "by",    "at",      "from",   "his",    "her",     "an",
    "were",  "are",   "which",  "this",  "be",      "or",     "has",    "had",     "first",
    "one",   "their", "its",    "new",   "after",   "who",    "they",   "have",    "two",
    "been",  "more",  "other",  "also",  "into",    "time",   "year",   "people",  "city",
    "state", "world", "school", "water", "house",   "light",  "night",  "river",   "music",
    "story", "group", "book",   "game",  "line",    "team",   "war",    "film",    "life",
    "work",  "place", "name",   "part",  "long",    "small",  "great",  "old",     "high",
    "early", "last",  "under",  "over",  "between", "during", "before", "through", "where",
    "when",  "while", "would",  "could", "should",  "made",   "found",  "known",   "called",
    "began", "left",  "took",   "came",  "went",    "told",   "asked",  "seen",    "open",
    "green", "blue",  "red",    "white", "black",   "stone",  "road",   "field",   "north",
    "south", "east",  "west",   "paper", "table",   "window", "garden", "market",  "letter",
};
#define BS_NUM_WORDS (sizeof(bs_words) / sizeof(bs_words[0]))

/* ---- the dataset ---------------------------------------------------------------------------- */

static void bs_items_free(bs_t *b) {
  for (size_t i = 0; i < b->num_items; i++) kiln_json_doc_free(b->items[i].doc);
  free(b->items);
  b->items = NULL;
  b->num_items = 0;
}

/* Checks one parsed line and fills *it (which takes the document). */
static kiln_status_t bs_item_check(const bs_args_t *a, const kiln_json_t *root, bs_item_t *it,
                                   const char *where) {
  if (!kiln_json_is(root, KILN_JSON_OBJECT))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: not a JSON object", where);
  it->prompt = kiln_json_get(root, "prompt");
  it->messages = kiln_json_get(root, "messages");
  if (!it->prompt == !it->messages)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: wants exactly one of \"prompt\" and \"messages\"", where);
  if (it->messages && a->image_dir)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: a \"messages\" line carries its own images: no --image-dir with "
                            "it",
                            where);
  if (it->messages) {
    if (a->endpoint != BS_CHAT)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: \"messages\" needs --endpoint chat",
                              where);
    if (!kiln_json_is(it->messages, KILN_JSON_ARRAY) || kiln_json_len(it->messages) == 0)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: \"messages\" is not a non-empty array", where);
  } else if (kiln_json_is(it->prompt, KILN_JSON_ARRAY)) {
    if (a->endpoint != BS_COMPLETIONS)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: a prompt of token ids needs --endpoint completions", where);
    size_t n = kiln_json_len(it->prompt);
    for (size_t i = 0; i < n; i++) {
      int64_t id;
      if (!kiln_json_number_is_int(kiln_json_at(it->prompt, i)) ||
          !kiln_json_int64(kiln_json_at(it->prompt, i), &id) || id < 0)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: \"prompt\"[%zu] is not a token id",
                                where, i);
    }
    if (n == 0)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: \"prompt\" is empty", where);
    it->prompt_tokens = (int64_t)n;
  } else if (!kiln_json_is(it->prompt, KILN_JSON_STRING)) {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: \"prompt\" is neither a string nor token ids", where);
  }
  const kiln_json_t *mt = kiln_json_get(root, "max_tokens");
  if (mt && !kiln_json_is(mt, KILN_JSON_NULL) &&
      (!kiln_json_int64(mt, &it->max_tokens) || it->max_tokens < 1))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: \"max_tokens\" is not a positive integer", where);
  return NULL;
}

/* Reads --dataset: every non-blank line is one request. */
static kiln_status_t bs_load_dataset(bs_t *b) {
  const char *path = b->a->dataset;
  kiln_status_t st = NULL;
  char *line = NULL, where[64];
  size_t cap = 0, items_cap = 0;
  long long lineno = 0;
  FILE *f = fopen(path, "r");
  if (!f)
    return kiln_status_make(errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO,
                            "%s: --dataset %s: %s", BS_CMD, path, strerror(errno));
  ssize_t n;
  while ((n = getline(&line, &cap, f)) >= 0) {
    lineno++;
    size_t k = 0;
    while (k < (size_t)n &&
           (line[k] == ' ' || line[k] == '\t' || line[k] == '\r' || line[k] == '\n'))
      k++;
    if (k == (size_t)n) continue;
    if (b->num_items == items_cap) {
      size_t ncap = items_cap ? 2 * items_cap : 64;
      bs_item_t *grown = realloc(b->items, ncap * sizeof(*grown));
      if (!grown) goto oom;
      b->items = grown;
      items_cap = ncap;
    }
    bs_item_t *it = &b->items[b->num_items];
    memset(it, 0, sizeof(*it));
    snprintf(where, sizeof(where), "line %lld", lineno);
    if ((st = kiln_json_parse(line, (size_t)n, where, &it->doc))) goto fail;
    b->num_items++; /* owns the document from here on */
    if ((st = bs_item_check(b->a, kiln_json_root(it->doc), it, where))) goto fail;
  }
  if (ferror(f)) {
    st = kiln_status_make(KILN_ERR_IO, "reading: %s", strerror(errno));
    goto fail;
  }
  if (b->num_items == 0) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "no requests in the file");
    goto fail;
  }
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
fail:
  st = kiln_status_annotate(st, "%s: --dataset %s", BS_CMD, path);
done:
  free(line);
  fclose(f);
  return st;
}

/* ---- --image-dir ---------------------------------------------------------------------------- */

static void bs_images_free(bs_t *b) {
  for (size_t i = 0; i < b->num_images; i++) free(b->image_urls[i]);
  free(b->image_urls);
  b->image_urls = NULL;
  b->num_images = 0;
}

static int bs_name_cmp(const void *x, const void *y) {
  return strcmp(*(char *const *)x, *(char *const *)y);
}

/* The media type from a file's first bytes, or NULL for a file that is no PNG, JPEG or WebP. */
static const char *bs_image_type(const unsigned char *p, size_t n) {
  if (n >= 8 && !memcmp(p, "\x89PNG\r\n\x1a\n", 8)) return "image/png";
  if (n >= 3 && p[0] == 0xFF && p[1] == 0xD8 && p[2] == 0xFF) return "image/jpeg";
  if (n >= 12 && !memcmp(p, "RIFF", 4) && !memcmp(p + 8, "WEBP", 4)) return "image/webp";
  return NULL;
}

/* Reads --image-dir: every PNG, JPEG or WebP file of it (by its bytes, not its name), in name
 * order, base64-encoded once into a data: URL. Other files are skipped; none at all is an
 * error. */
static kiln_status_t bs_load_images(bs_t *b) {
  const char *dir = b->a->image_dir;
  DIR *d = opendir(dir);
  if (!d)
    return kiln_status_make(errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO,
                            "%s: --image-dir %s: %s", BS_CMD, dir, strerror(errno));
  char **names = NULL;
  size_t nn = 0, cap = 0;
  kiln_status_t st = NULL;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    if (nn == cap) {
      size_t nc = cap ? 2 * cap : 64;
      char **g = realloc(names, nc * sizeof(*g));
      if (!g) goto oom;
      names = g;
      cap = nc;
    }
    if (!(names[nn] = strdup(e->d_name))) goto oom;
    nn++;
  }
  closedir(d);
  d = NULL;
  if (nn) qsort(names, nn, sizeof(*names), bs_name_cmp);
  if (nn && !(b->image_urls = calloc(nn, sizeof(char *)))) goto oom;
  for (size_t i = 0; i < nn; i++) {
    char *path = kiln_strprintf("%s/%s", dir, names[i]);
    if (!path) goto oom;
    FILE *f = fopen(path, "rb");
    free(path);
    if (!f) continue; /* a folder, or unreadable: not an image of the run */
    kiln_strbuf_t raw = KILN_STRBUF_INIT;
    char buf[65536];
    size_t got;
    while ((got = fread(buf, 1, sizeof(buf), f)) > 0) kiln_strbuf_append(&raw, buf, got);
    fclose(f);
    const unsigned char *p = (const unsigned char *)raw.data;
    const char *type = raw.len ? bs_image_type(p, raw.len) : NULL;
    if (!kiln_strbuf_ok(&raw)) {
      kiln_strbuf_free(&raw);
      goto oom;
    }
    if (!type) {
      kiln_strbuf_free(&raw);
      continue;
    }
    kiln_strbuf_t u = KILN_STRBUF_INIT;
    kiln_strbuf_printf(&u, "data:%s;base64,", type);
    kiln_base64_encode(raw.data, raw.len, &u);
    kiln_strbuf_free(&raw);
    if (!kiln_strbuf_ok(&u)) {
      kiln_strbuf_free(&u);
      goto oom;
    }
    b->image_urls[b->num_images++] = kiln_strbuf_detach(&u, NULL);
    kiln_strbuf_free(&u);
  }
  if (b->num_images == 0)
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: --image-dir %s holds no PNG, JPEG or WebP file", BS_CMD, dir);
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
done:
  if (d) closedir(d);
  for (size_t i = 0; i < nn; i++) free(names[i]);
  free(names);
  return st;
}

/* Appends a user message's content: the text (text_json: a JSON string, as written), or with
 * --image-dir [the request's image part, the text part]. */
static void bs_user_content(const bs_t *b, size_t index, kiln_strbuf_t *out,
                            const kiln_strbuf_t *text_json) {
  if (!b->num_images) {
    kiln_strbuf_append(out, text_json->data, text_json->len);
    return;
  }
  const char *u = b->image_urls[index % b->num_images];
  kiln_strbuf_append_str(out, "[{\"type\": \"image_url\", \"image_url\": {\"url\": ");
  kiln_json_write_string(out, u, strlen(u), false);
  kiln_strbuf_append_str(out, "}}, {\"type\": \"text\", \"text\": ");
  kiln_strbuf_append(out, text_json->data, text_json->len);
  kiln_strbuf_append_str(out, "}]");
}

/* ---- request bodies ------------------------------------------------------------------------- */

/* Appends request `index`'s body (warmup requests draw other random prompts than the measured
 * ones) and sets *out_prompt_tokens to its prompt length where known without a tokenizer (random
 * words count one each). False on out-of-memory. */
static bool bs_body(const bs_t *b, size_t index, bool warmup, kiln_strbuf_t *out,
                    int64_t *out_prompt_tokens) {
  const bs_args_t *a = b->a;
  bool chat = a->endpoint == BS_CHAT;
  int64_t max_tokens = a->output_len;
  *out_prompt_tokens = 0;
  kiln_strbuf_append_str(out, "{\"model\": ");
  kiln_json_write_string(out, b->model, strlen(b->model), false);
  if (b->num_items) {
    const bs_item_t *it = &b->items[index % b->num_items];
    if (it->max_tokens) max_tokens = it->max_tokens;
    *out_prompt_tokens = it->prompt_tokens;
    if (it->messages) {
      kiln_strbuf_append_str(out, ", \"messages\": ");
      kiln_json_write(out, it->messages, false, false);
    } else if (chat) {
      kiln_strbuf_t tj = KILN_STRBUF_INIT;
      kiln_json_write(&tj, it->prompt, false, false);
      kiln_strbuf_append_str(out, ", \"messages\": [{\"role\": \"user\", \"content\": ");
      bs_user_content(b, index, out, &tj);
      kiln_strbuf_append_str(out, "}]");
      bool ok = kiln_strbuf_ok(&tj);
      kiln_strbuf_free(&tj);
      if (!ok) return false;
    } else {
      kiln_strbuf_append_str(out, ", \"prompt\": ");
      kiln_json_write(out, it->prompt, false, false);
    }
  } else {
    uint64_t s = (uint64_t)a->seed * 0xd1342543de82ef95ull + index + (warmup ? 1ull << 62 : 0);
    bs_rand(&s);
    *out_prompt_tokens = a->input_len;
    if (a->random_ids) {
      kiln_strbuf_append_str(out, ", \"prompt\": [");
      for (int64_t i = 0; i < a->input_len; i++)
        kiln_strbuf_printf(out, i ? ", %llu" : "%llu",
                           (unsigned long long)(bs_rand(&s) % (uint64_t)a->random_ids));
      kiln_strbuf_append_char(out, ']');
    } else if (chat && b->num_images) {
      kiln_strbuf_t words = KILN_STRBUF_INIT, tj = KILN_STRBUF_INIT;
      for (int64_t i = 0; i < a->input_len; i++) {
        if (i) kiln_strbuf_append_char(&words, ' ');
        kiln_strbuf_append_str(&words, bs_words[bs_rand(&s) % BS_NUM_WORDS]);
      }
      kiln_json_write_string(&tj, words.data ? words.data : "", words.len, false);
      kiln_strbuf_append_str(out, ", \"messages\": [{\"role\": \"user\", \"content\": ");
      bs_user_content(b, index, out, &tj);
      kiln_strbuf_append_str(out, "}]");
      bool ok = kiln_strbuf_ok(&words) && kiln_strbuf_ok(&tj);
      kiln_strbuf_free(&words);
      kiln_strbuf_free(&tj);
      if (!ok) return false;
    } else {
      kiln_strbuf_append_str(
          out, chat ? ", \"messages\": [{\"role\": \"user\", \"content\": \"" : ", \"prompt\": \"");
      for (int64_t i = 0; i < a->input_len; i++) {
        if (i) kiln_strbuf_append_char(out, ' ');
        kiln_strbuf_append_str(out, bs_words[bs_rand(&s) % BS_NUM_WORDS]);
      }
      kiln_strbuf_append_str(out, chat ? "\"}]" : "\"");
    }
  }
  kiln_strbuf_printf(out, ", \"max_tokens\": %lld, \"temperature\": ", (long long)max_tokens);
  kiln_json_write_number(out, a->temperature);
  kiln_strbuf_append_str(out, ", \"stream\": true, \"stream_options\": {\"include_usage\": true}");
  if (a->ignore_eos) kiln_strbuf_append_str(out, ", \"ignore_eos\": true");
  kiln_strbuf_append_char(out, '}');
  return kiln_strbuf_ok(out);
}

/* ---- one request: the stream ---------------------------------------------------------------- */

/* Fails the request with a message (the first one wins); returns false so parsers can
 * `return bs_req_fail(...)`. */
static bool bs_req_fail(bs_req_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool bs_req_fail(bs_req_t *r, const char *fmt, ...) {
  if (r->error || r->oom) return false;
  kiln_strbuf_t m = KILN_STRBUF_INIT;
  va_list ap;
  va_start(ap, fmt);
  kiln_strbuf_vprintf(&m, fmt, ap);
  va_end(ap);
  if (kiln_strbuf_ok(&m))
    r->error = kiln_strbuf_detach(&m, NULL);
  else
    r->oom = true;
  kiln_strbuf_free(&m);
  return false;
}

/* One SSE event's data: [DONE], an error, or a chunk with content and/or usage. */
static bool bs_event(bs_req_t *r, const char *p, size_t n, double t) {
  r->events++;
  if (r->done_seen) return true; /* anything after [DONE] is ignored */
  if (n == 6 && memcmp(p, "[DONE]", 6) == 0) {
    r->done_seen = true;
    return true;
  }
  kiln_json_doc_t *doc = NULL;
  kiln_strbuf_t msg = KILN_STRBUF_INIT;
  bool ok = false;
  kiln_status_t st = kiln_json_parse(p, n, "event", &doc);
  if (st) {
    if (kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY) {
      r->oom = true;
    } else {
      bs_oneline(&msg, p, n, 80);
      bs_req_fail(r, "the stream sent an event that is not JSON (%s): '%s'",
                  kiln_status_message(st), kiln_strbuf_cstr(&msg));
    }
    kiln_status_free(st);
    goto done;
  }
  const kiln_json_t *root = kiln_json_root(doc);
  if (!kiln_json_is(root, KILN_JSON_OBJECT)) {
    bs_oneline(&msg, p, n, 80);
    bs_req_fail(r, "the stream sent an event that is not a JSON object: '%s'",
                kiln_strbuf_cstr(&msg));
    goto done;
  }
  const kiln_json_t *err = kiln_json_get(root, "error");
  if (err && !kiln_json_is(err, KILN_JSON_NULL)) {
    bs_error_text(&msg, err);
    bs_req_fail(r, "error in the stream: %s", kiln_strbuf_cstr(&msg));
    goto done;
  }
  const kiln_json_t *c0 = kiln_json_at(kiln_json_get(root, "choices"), 0);
  if (c0) {
    size_t len = 0;
    if (r->b->a->endpoint == BS_CHAT) {
      const kiln_json_t *delta = kiln_json_get(c0, "delta");
      /* Reasoning models stream their thoughts first; those are generated tokens too. */
      if (!kiln_json_string(kiln_json_get(delta, "content"), &len) || len == 0)
        kiln_json_string(kiln_json_get(delta, "reasoning_content"), &len);
    } else {
      kiln_json_string(kiln_json_get(c0, "text"), &len);
    }
    if (len > 0) {
      if (r->content_events == 0) {
        r->t_first = t;
      } else if (!bs_dvec_push(&r->res->itl, t - r->t_last)) {
        r->oom = true;
        goto done;
      }
      r->t_last = t;
      r->content_events++;
    }
  }
  const kiln_json_t *usage = kiln_json_get(root, "usage");
  if (kiln_json_is(usage, KILN_JSON_OBJECT)) {
    int64_t x;
    if (kiln_json_int64(kiln_json_get(usage, "completion_tokens"), &x) && x >= 0) {
      r->usage_out = x;
      r->has_usage = true;
    }
    if (kiln_json_int64(kiln_json_get(usage, "prompt_tokens"), &x) && x >= 0) r->usage_in = x;
  }
  ok = true;
done:
  kiln_strbuf_free(&msg);
  kiln_json_doc_free(doc);
  return ok && !r->oom;
}

/* One complete SSE line (without its \n): a field of the current event, a comment, or the blank
 * line that dispatches the event. */
static bool bs_sse_line(bs_req_t *r, double t) {
  const char *s = kiln_strbuf_cstr(&r->line);
  size_t n = r->line.len;
  if (n && s[n - 1] == '\r') n--;
  if (n == 0) {
    bool ok = !r->has_data || bs_event(r, kiln_strbuf_cstr(&r->data), r->data.len, t);
    kiln_strbuf_reset(&r->data);
    r->has_data = false;
    return ok;
  }
  if (s[0] == ':') return true; /* a comment (keep-alive) */
  const char *colon = memchr(s, ':', n);
  size_t flen = colon ? (size_t)(colon - s) : n;
  if (flen != 4 || memcmp(s, "data", 4) != 0) return true; /* event:, id:, retry: */
  const char *v = colon ? colon + 1 : s + n;
  if (v < s + n && *v == ' ') v++;
  if (r->has_data) kiln_strbuf_append_char(&r->data, '\n');
  kiln_strbuf_append(&r->data, v, (size_t)(s + n - v));
  r->has_data = true;
  if (!kiln_strbuf_ok(&r->data)) r->oom = true;
  return !r->oom;
}

/* Feeds received bytes to the SSE parser. False when the request has failed. */
static bool bs_sse_feed(bs_req_t *r, const char *p, size_t n, double t) {
  while (n) {
    const char *nl = memchr(p, '\n', n);
    size_t take = nl ? (size_t)(nl - p) : n;
    if (r->line.len + take > BS_MAX_LINE)
      return bs_req_fail(r, "the stream sent a line longer than %u MiB", BS_MAX_LINE >> 20);
    if (!kiln_strbuf_append(&r->line, p, take)) {
      r->oom = true;
      return false;
    }
    if (!nl) break;
    p += take + 1;
    n -= take + 1;
    bool ok = bs_sse_line(r, t);
    kiln_strbuf_reset(&r->line);
    if (!ok) return false;
  }
  return true;
}

/* curl's write callback: the response body as it arrives. Returning less than given aborts the
 * transfer (CURLE_WRITE_ERROR), which is how a request that sent junk is stopped. */
static size_t bs_on_data(char *ptr, size_t size, size_t nmemb, void *ud) {
  bs_req_t *r = ud;
  size_t n = size * nmemb;
  double t = kiln_cli_now();
  if (!r->status_known) {
    curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &r->http_status);
    r->status_known = true;
  }
  if (r->http_status != 200) {
    size_t room = BS_MAX_ERRBODY - r->errbody.len;
    kiln_strbuf_append(&r->errbody, ptr, n < room ? n : room);
    return n;
  }
  return bs_sse_feed(r, ptr, n, t) ? n : 0;
}

/* ---- one request: launch and finish --------------------------------------------------------- */

static void bs_req_free(bs_req_t *r) {
  if (!r) return;
  if (r->easy) {
    curl_multi_remove_handle(r->b->multi, r->easy);
    curl_easy_cleanup(r->easy);
  }
  kiln_strbuf_free(&r->body);
  kiln_strbuf_free(&r->line);
  kiln_strbuf_free(&r->data);
  kiln_strbuf_free(&r->errbody);
  free(r->error);
  free(r);
}

static void bs_live_unlink(bs_t *b, bs_req_t *r) {
  if (r->prev)
    r->prev->next = r->next;
  else
    b->live = r->next;
  if (r->next) r->next->prev = r->prev;
  r->prev = r->next = NULL;
}

/* Sets the options every request shares: URL, headers, timeout, no signals. */
static CURLcode bs_easy_common(const bs_t *b, CURL *e, const char *url, char *errbuf) {
  CURLcode c = curl_easy_setopt(e, CURLOPT_URL, url);
  if (!c) c = curl_easy_setopt(e, CURLOPT_HTTPHEADER, b->headers);
  if (!c) c = curl_easy_setopt(e, CURLOPT_USERAGENT, "kiln-bench/" KILN_VERSION_STRING);
  if (!c) c = curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  if (!c) c = curl_easy_setopt(e, CURLOPT_ERRORBUFFER, errbuf);
  if (!c && b->a->timeout > 0)
    c = curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)ceil(b->a->timeout * 1000.0));
  return c;
}

/* Starts request `index`, whose outcome goes to *res. Errors (out of memory, a curl set-up
 * failure) abort the run. */
static kiln_status_t bs_launch(bs_t *b, size_t index, bool warmup, bs_result_t *res, double t0) {
  bs_req_t *r = calloc(1, sizeof(*r));
  if (!r) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  r->b = b;
  r->res = res;
  if (!bs_body(b, index, warmup, &r->body, &r->nominal_input)) {
    bs_req_free(r);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  }
  if (!(r->easy = curl_easy_init())) {
    bs_req_free(r);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "curl_easy_init failed");
  }
  CURLcode c = bs_easy_common(b, r->easy, b->url_post, r->errbuf);
  if (!c) c = curl_easy_setopt(r->easy, CURLOPT_POSTFIELDS, r->body.data);
  if (!c) c = curl_easy_setopt(r->easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)r->body.len);
  if (!c) c = curl_easy_setopt(r->easy, CURLOPT_WRITEFUNCTION, bs_on_data);
  if (!c) c = curl_easy_setopt(r->easy, CURLOPT_WRITEDATA, r);
  if (!c) c = curl_easy_setopt(r->easy, CURLOPT_PRIVATE, r);
  if (c) {
    kiln_status_t st = kiln_status_make(KILN_ERR_INTERNAL, "%s: setting up a request: %s", BS_CMD,
                                        curl_easy_strerror(c));
    bs_req_free(r);
    return st;
  }
  CURLMcode mc = curl_multi_add_handle(b->multi, r->easy);
  if (mc) {
    CURL *e = r->easy;
    r->easy = NULL; /* not in the multi handle: only clean it up */
    curl_easy_cleanup(e);
    bs_req_free(r);
    return kiln_status_make(KILN_ERR_INTERNAL, "%s: curl_multi_add_handle: %s", BS_CMD,
                            curl_multi_strerror(mc));
  }
  r->t_start = kiln_cli_now();
  res->start = r->t_start - t0;
  r->next = b->live;
  if (b->live) b->live->prev = r;
  b->live = r;
  return NULL;
}

/* The message of a non-200 answer: the server's error message when the body is JSON, else the
 * body's first bytes. */
static void bs_http_error(bs_req_t *r, kiln_strbuf_t *out) {
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(kiln_strbuf_cstr(&r->errbody), r->errbody.len, "body", &doc);
  kiln_strbuf_printf(out, "HTTP %ld", r->http_status);
  if (!st && kiln_json_is(kiln_json_root(doc), KILN_JSON_OBJECT)) {
    const kiln_json_t *root = kiln_json_root(doc);
    const kiln_json_t *e = kiln_json_get(root, "error");
    kiln_strbuf_append_str(out, ": ");
    bs_error_text(out, e ? e : root);
  } else if (r->errbody.len) {
    kiln_strbuf_append_str(out, ": ");
    bs_oneline(out, kiln_strbuf_cstr(&r->errbody), r->errbody.len, BS_MAX_MESSAGE);
  }
  kiln_status_free(st);
  kiln_json_doc_free(doc);
}

/* A transfer ended (cc says how): fills the result and frees the request. */
static void bs_finish(bs_t *b, bs_req_t *r, CURLcode cc) {
  bs_result_t *res = r->res;
  double t_end = kiln_cli_now();
  kiln_strbuf_t msg = KILN_STRBUF_INIT;
  curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &r->http_status);
  res->http_status = r->http_status;
  res->e2e = t_end - r->t_start;
  res->ttft = res->tpot = -1;
  /* A stream that ends without a final blank line still dispatches its last event. */
  if (cc == CURLE_OK && r->http_status == 200 && !r->error && !r->oom) {
    if (r->line.len && bs_sse_line(r, t_end)) kiln_strbuf_reset(&r->line);
    if (!r->error && !r->oom && r->has_data)
      bs_event(r, kiln_strbuf_cstr(&r->data), r->data.len, t_end);
  }
  if (r->oom) {
    kiln_strbuf_append_str(&msg, "out of memory");
  } else if (r->error) {
    kiln_strbuf_append_str(&msg, r->error);
  } else if (cc == CURLE_OPERATION_TIMEDOUT) {
    kiln_strbuf_printf(&msg, "timed out after %g s (--timeout)", b->a->timeout);
  } else if (cc != CURLE_OK) {
    kiln_strbuf_append_str(&msg, r->errbuf[0] ? r->errbuf : curl_easy_strerror(cc));
  } else if (r->http_status != 200) {
    bs_http_error(r, &msg);
  } else if (!r->done_seen && r->events == 0) {
    kiln_strbuf_append_str(&msg,
                           "the answer has no Server-Sent Events (was stream: true ignored?)");
  } else if (!r->done_seen) {
    kiln_strbuf_append_str(&msg, "the stream ended without data: [DONE]");
  } else {
    res->ok = true;
  }
  if (res->ok) {
    res->output_tokens = r->has_usage ? r->usage_out : r->content_events;
    res->input_tokens = r->usage_in > 0 ? r->usage_in : r->nominal_input;
    if (r->content_events > 0) {
      res->ttft = r->t_first - r->t_start;
      if (res->output_tokens > 1)
        res->tpot = (res->e2e - res->ttft) / (double)(res->output_tokens - 1);
    }
  } else {
    res->error = kiln_strbuf_ok(&msg) ? kiln_strbuf_detach(&msg, NULL) : NULL;
    free(res->itl.v);
    memset(&res->itl, 0, sizeof(res->itl));
  }
  kiln_strbuf_free(&msg);
  bs_live_unlink(b, r);
  bs_req_free(r);
}

/* ---- the event loop ------------------------------------------------------------------------- */

/* Progress on a terminal: "bench serve: 37/100 done, 2 failed". */
static void bs_progress(const char *what, size_t done, size_t failed, size_t n, bool last) {
  fprintf(stderr, "\r%s: %zu/%zu done, %zu failed%s", what, done, n, failed, last ? "\n" : "");
  fflush(stderr);
}

/* Runs n requests: request i is launched at arrivals[i] seconds after the start (NULL = all at
 * once) or, when --max-concurrency requests are in flight, as soon as one finishes; results[i]
 * gets its outcome. *out_duration is the time from the start to the last finish. A failed request
 * is a result, not an error: errors are only what stops the run (out of memory, curl failures). */
static kiln_status_t bs_run(bs_t *b, size_t n, bool warmup, const double *arrivals,
                            bs_result_t *results, double *out_duration) {
  const bs_args_t *a = b->a;
  size_t cap = a->max_concurrency ? (size_t)a->max_concurrency : n;
  size_t next = 0, done = 0, failed = 0, in_flight = 0;
  bool tty = isatty(STDERR_FILENO);
  const char *what = warmup ? "warmup" : BS_CMD;
  kiln_status_t st = NULL;
  double t0 = kiln_cli_now(), shown = 0;
  while (done < n) {
    double t = kiln_cli_now() - t0;
    while (next < n && in_flight < cap && (!arrivals || arrivals[next] <= t)) {
      if ((st = bs_launch(b, next, warmup, &results[next], t0))) goto fail;
      next++;
      in_flight++;
    }
    int running;
    CURLMcode mc = curl_multi_perform(b->multi, &running);
    if (mc) {
      st = kiln_status_make(KILN_ERR_INTERNAL, "%s: curl_multi_perform: %s", BS_CMD,
                            curl_multi_strerror(mc));
      goto fail;
    }
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(b->multi, &left))) {
      if (m->msg != CURLMSG_DONE) continue;
      char *priv = NULL;
      curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, &priv);
      bs_req_t *r = (bs_req_t *)priv;
      CURLcode cc = m->data.result; /* m dies with the handle's removal */
      bs_result_t *res = r->res;
      bs_finish(b, r, cc);
      failed += !res->ok;
      done++;
      in_flight--;
    }
    if (tty && (kiln_cli_now() - shown > 0.25 || done == n)) {
      shown = kiln_cli_now();
      bs_progress(what, done, failed, n, done == n);
    }
    if (done == n) break;
    /* Sleep until the network has news, the next arrival is due, or 1 s has passed. */
    int wait_ms = 1000;
    if (next < n && in_flight < cap) {
      double dt = arrivals ? arrivals[next] - (kiln_cli_now() - t0) : 0;
      wait_ms = dt <= 0 ? 0 : dt >= 1 ? 1000 : (int)ceil(dt * 1000.0);
    }
    if (wait_ms > 0 && (mc = curl_multi_poll(b->multi, NULL, 0, wait_ms, NULL))) {
      st = kiln_status_make(KILN_ERR_INTERNAL, "%s: curl_multi_poll: %s", BS_CMD,
                            curl_multi_strerror(mc));
      goto fail;
    }
  }
  *out_duration = kiln_cli_now() - t0;
  return NULL;
fail:
  while (b->live) {
    bs_req_t *r = b->live;
    b->live = r->next;
    bs_req_free(r);
  }
  return st;
}

/* ---- set-up --------------------------------------------------------------------------------- */

static size_t bs_on_models(char *ptr, size_t size, size_t nmemb, void *ud) {
  kiln_strbuf_t *body = ud;
  size_t n = size * nmemb;
  if (body->len + n > BS_MAX_MODELS || !kiln_strbuf_append(body, ptr, n)) return 0;
  return n;
}

/* The first model id of GET /v1/models, into *out_model (malloc'ed). */
static kiln_status_t bs_default_model(const bs_t *b, char **out_model) {
  *out_model = NULL;
  kiln_status_t st = NULL;
  kiln_strbuf_t body = KILN_STRBUF_INIT;
  kiln_json_doc_t *doc = NULL;
  char errbuf[CURL_ERROR_SIZE] = "";
  long code = 0;
  CURL *e = curl_easy_init();
  if (!e) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "curl_easy_init failed");
    goto done;
  }
  CURLcode c = bs_easy_common(b, e, b->url_models, errbuf);
  if (!c && b->a->timeout <= 0) c = curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 30000L);
  if (!c) c = curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, bs_on_models);
  if (!c) c = curl_easy_setopt(e, CURLOPT_WRITEDATA, &body);
  if (!c) c = curl_easy_perform(e);
  if (c) {
    st = kiln_status_make(KILN_ERR_UNAVAILABLE, "%s", errbuf[0] ? errbuf : curl_easy_strerror(c));
    goto done;
  }
  curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code);
  if (code != 200) {
    kiln_strbuf_t m = KILN_STRBUF_INIT;
    bs_oneline(&m, kiln_strbuf_cstr(&body), body.len, BS_MAX_MESSAGE);
    st = kiln_status_make(KILN_ERR_UNAVAILABLE, "HTTP %ld: %s", code, kiln_strbuf_cstr(&m));
    kiln_strbuf_free(&m);
    goto done;
  }
  if ((st = kiln_json_parse(kiln_strbuf_cstr(&body), body.len, "the answer", &doc))) goto done;
  const kiln_json_t *data = kiln_json_get(kiln_json_root(doc), "data");
  const char *id = kiln_json_string(kiln_json_get(kiln_json_at(data, 0), "id"), NULL);
  if (!id || !*id) {
    st = kiln_status_make(KILN_ERR_NOT_FOUND, "no model listed under data[0].id");
    goto done;
  }
  if (!(*out_model = kiln_strprintf("%s", id)))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
done:
  if (e) curl_easy_cleanup(e);
  kiln_json_doc_free(doc);
  kiln_strbuf_free(&body);
  return kiln_status_annotate(st, "%s: no --model, and GET %s failed", BS_CMD, b->url_models);
}

/* URLs, headers and the multi handle. */
static kiln_status_t bs_setup(bs_t *b) {
  const bs_args_t *a = b->a;
  size_t n = strlen(a->url);
  while (n > 0 && a->url[n - 1] == '/') n--;
  if (n >= 3 && memcmp(a->url + n - 3, "/v1", 3) == 0) n -= 3;
  int len = n > 4096 ? 4096 : (int)n;
  b->url_post = kiln_strprintf("%.*s%s", len, a->url,
                               a->endpoint == BS_CHAT ? "/v1/chat/completions" : "/v1/completions");
  b->url_models = kiln_strprintf("%.*s/v1/models", len, a->url);
  if (!b->url_post || !b->url_models) goto oom;
  /* "Expect:" stops curl from waiting for a 100-continue on a large body. */
  const char *fixed[] = {"Content-Type: application/json", "Expect:"};
  for (size_t i = 0; i < 2; i++) {
    struct curl_slist *l = curl_slist_append(b->headers, fixed[i]);
    if (!l) goto oom;
    b->headers = l;
  }
  if (a->api_key) {
    char *h = kiln_strprintf("Authorization: Bearer %s", a->api_key);
    struct curl_slist *l = h ? curl_slist_append(b->headers, h) : NULL;
    free(h);
    if (!l) goto oom;
    b->headers = l;
  }
  if (!(b->multi = curl_multi_init())) goto oom;
  return NULL;
oom:
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
}

/* Lets up to `want` sockets be open at once (the soft limit is often 1024). */
static void bs_raise_nofile(size_t want) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
      rl.rlim_cur >= (rlim_t)want)
    return;
  rl.rlim_cur =
      rl.rlim_max != RLIM_INFINITY && rl.rlim_max < (rlim_t)want ? rl.rlim_max : (rlim_t)want;
  setrlimit(RLIMIT_NOFILE, &rl);
}

/* ---- the report ----------------------------------------------------------------------------- */

typedef struct bs_stat {
  size_t count;
  double mean, p50, p90, p99; /* ms */
} bs_stat_t;

/* Statistics of v[n] (seconds; sorted in place) in ms. */
static bs_stat_t bs_stat(double *v, size_t n) {
  kiln_cli_stats_t c = kiln_cli_stats(v, n);
  bs_stat_t s = {n, 1e3 * c.mean, 1e3 * c.p50, 1e3 * c.p90, 1e3 * c.p99};
  return s;
}

/* The run's figures. */
typedef struct bs_summary {
  size_t completed, failed;
  double duration;
  int64_t input_tokens, output_tokens;
  bs_stat_t ttft, tpot, itl, e2e;
} bs_summary_t;

static kiln_status_t bs_summarize(const bs_result_t *res, size_t n, double duration,
                                  bs_summary_t *out) {
  memset(out, 0, sizeof(*out));
  out->duration = duration;
  size_t num_itl = 0;
  for (size_t i = 0; i < n; i++) num_itl += res[i].ok ? res[i].itl.len : 0;
  double *ttft = malloc((n + 1) * sizeof(double)), *tpot = malloc((n + 1) * sizeof(double));
  double *e2e = malloc((n + 1) * sizeof(double)), *itl = malloc((num_itl + 1) * sizeof(double));
  size_t nt = 0, np = 0, ne = 0, ni = 0;
  kiln_status_t st = NULL;
  if (!ttft || !tpot || !e2e || !itl) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    goto done;
  }
  for (size_t i = 0; i < n; i++) {
    const bs_result_t *r = &res[i];
    if (!r->ok) {
      out->failed++;
      continue;
    }
    out->completed++;
    out->input_tokens += r->input_tokens;
    out->output_tokens += r->output_tokens;
    e2e[ne++] = r->e2e;
    if (r->ttft >= 0) ttft[nt++] = r->ttft;
    if (r->tpot >= 0) tpot[np++] = r->tpot;
    if (r->itl.len) memcpy(itl + ni, r->itl.v, r->itl.len * sizeof(double));
    ni += r->itl.len;
  }
  out->ttft = bs_stat(ttft, nt);
  out->tpot = bs_stat(tpot, np);
  out->itl = bs_stat(itl, ni);
  out->e2e = bs_stat(e2e, ne);
done:
  free(ttft);
  free(tpot);
  free(e2e);
  free(itl);
  return st;
}

static double bs_per_s(double x, double duration) { return duration > 0 ? x / duration : 0; }

static void bs_print_stat(FILE *f, const char *name, const bs_stat_t *s) {
  if (!s->count) {
    fprintf(f, "  %-6s %10s %10s %10s %10s %8d\n", name, "-", "-", "-", "-", 0);
    return;
  }
  fprintf(f, "  %-6s %10.2f %10.2f %10.2f %10.2f %8zu\n", name, s->mean, s->p50, s->p90, s->p99,
          s->count);
}

static void bs_print(FILE *f, const bs_t *b, const bs_summary_t *s) {
  const bs_args_t *a = b->a;
  double d = s->duration;
  fprintf(f, "============ kiln bench serve ============\n");
  fprintf(f, "%-32s %s\n", "Endpoint:", b->url_post);
  fprintf(f, "%-32s %s\n", "Model:", b->model);
  if (isinf(a->request_rate))
    fprintf(f, "%-32s %s\n", "Request rate (req/s):", "inf");
  else
    fprintf(f, "%-32s %g\n", "Request rate (req/s):", a->request_rate);
  if (a->max_concurrency)
    fprintf(f, "%-32s %lld\n", "Max concurrency:", (long long)a->max_concurrency);
  else
    fprintf(f, "%-32s %s\n", "Max concurrency:", "none");
  fprintf(f, "%-32s %zu\n", "Successful requests:", s->completed);
  fprintf(f, "%-32s %zu\n", "Failed requests:", s->failed);
  fprintf(f, "%-32s %.3f\n", "Benchmark duration (s):", d);
  fprintf(f, "%-32s %lld\n", "Total input tokens:", (long long)s->input_tokens);
  fprintf(f, "%-32s %lld\n", "Total output tokens:", (long long)s->output_tokens);
  fprintf(f, "%-32s %.3f\n", "Request throughput (req/s):", bs_per_s((double)s->completed, d));
  fprintf(f, "%-32s %.2f\n",
          "Input token throughput (tok/s):", bs_per_s((double)s->input_tokens, d));
  fprintf(f, "%-32s %.2f\n",
          "Output token throughput (tok/s):", bs_per_s((double)s->output_tokens, d));
  fprintf(f, "%-32s %.2f\n", "Total token throughput (tok/s):",
          bs_per_s((double)(s->input_tokens + s->output_tokens), d));
  fprintf(f, "------------------------------------------\n");
  fprintf(f, "  %-6s %10s %10s %10s %10s %8s\n", "(ms)", "mean", "p50", "p90", "p99", "count");
  bs_print_stat(f, "TTFT", &s->ttft);
  bs_print_stat(f, "TPOT", &s->tpot);
  bs_print_stat(f, "ITL", &s->itl);
  bs_print_stat(f, "E2E", &s->e2e);
  fprintf(f, "==========================================\n");
}

/* A number, or null when it is undefined (x < 0) or not finite. */
static void bs_json_num(kiln_strbuf_t *o, double x) {
  if (x < 0 || !isfinite(x))
    kiln_strbuf_append_str(o, "null");
  else
    kiln_strbuf_printf(o, "%.6g", x);
}

static void bs_json_stat(kiln_strbuf_t *o, const char *key, const bs_stat_t *s) {
  kiln_strbuf_printf(o, ",\n\"%s\": {\"count\": %zu, \"mean\": ", key, s->count);
  bs_json_num(o, s->count ? s->mean : -1);
  kiln_strbuf_append_str(o, ", \"p50\": ");
  bs_json_num(o, s->count ? s->p50 : -1);
  kiln_strbuf_append_str(o, ", \"p90\": ");
  bs_json_num(o, s->count ? s->p90 : -1);
  kiln_strbuf_append_str(o, ", \"p99\": ");
  bs_json_num(o, s->count ? s->p99 : -1);
  kiln_strbuf_append_char(o, '}');
}

static void bs_json_str(kiln_strbuf_t *o, const char *s) {
  if (s)
    kiln_json_write_string(o, s, strlen(s), false);
  else
    kiln_strbuf_append_str(o, "null");
}

/* Writes the summary and every request's figures to --json as one JSON object. */
static kiln_status_t bs_write_json(const bs_t *b, const bs_summary_t *s, const bs_result_t *res,
                                   size_t n) {
  const bs_args_t *a = b->a;
  kiln_strbuf_t o = KILN_STRBUF_INIT;
  double d = s->duration;
  kiln_strbuf_append_str(&o, "{\"url\": ");
  bs_json_str(&o, b->url_post);
  kiln_strbuf_append_str(&o, ",\n\"endpoint\": ");
  bs_json_str(&o, a->endpoint == BS_CHAT ? "chat" : "completions");
  kiln_strbuf_append_str(&o, ",\n\"model\": ");
  bs_json_str(&o, b->model);
  kiln_strbuf_printf(&o, ",\n\"num_prompts\": %zu,\n\"request_rate\": ", n);
  bs_json_num(&o, a->request_rate);
  kiln_strbuf_append_str(&o, ",\n\"max_concurrency\": ");
  if (a->max_concurrency)
    kiln_strbuf_printf(&o, "%lld", (long long)a->max_concurrency);
  else
    kiln_strbuf_append_str(&o, "null");
  kiln_strbuf_append_str(&o, ",\n\"dataset\": ");
  bs_json_str(&o, a->dataset);
  kiln_strbuf_append_str(&o, ",\n\"image_dir\": ");
  bs_json_str(&o, a->image_dir);
  kiln_strbuf_printf(&o,
                     ",\n\"input_len\": %lld,\n\"output_len\": %lld,\n\"seed\": %lld,\n"
                     "\"warmup\": %lld,\n\"completed\": %zu,\n\"failed\": %zu,\n\"duration_s\": ",
                     (long long)a->input_len, (long long)a->output_len, (long long)a->seed,
                     (long long)a->warmup, s->completed, s->failed);
  bs_json_num(&o, d);
  kiln_strbuf_printf(&o, ",\n\"input_tokens\": %lld,\n\"output_tokens\": %lld",
                     (long long)s->input_tokens, (long long)s->output_tokens);
  kiln_strbuf_append_str(&o, ",\n\"request_throughput\": ");
  bs_json_num(&o, bs_per_s((double)s->completed, d));
  kiln_strbuf_append_str(&o, ",\n\"input_throughput\": ");
  bs_json_num(&o, bs_per_s((double)s->input_tokens, d));
  kiln_strbuf_append_str(&o, ",\n\"output_throughput\": ");
  bs_json_num(&o, bs_per_s((double)s->output_tokens, d));
  kiln_strbuf_append_str(&o, ",\n\"total_token_throughput\": ");
  bs_json_num(&o, bs_per_s((double)(s->input_tokens + s->output_tokens), d));
  bs_json_stat(&o, "ttft_ms", &s->ttft);
  bs_json_stat(&o, "tpot_ms", &s->tpot);
  bs_json_stat(&o, "itl_ms", &s->itl);
  bs_json_stat(&o, "e2e_ms", &s->e2e);
  kiln_strbuf_append_str(&o, ",\n\"errors\": [");
  size_t shown = 0;
  for (size_t i = 0; i < n && shown < 10; i++) {
    if (res[i].ok) continue;
    kiln_strbuf_append_str(&o, shown++ ? ", " : "");
    bs_json_str(&o, res[i].error ? res[i].error : "out of memory");
  }
  kiln_strbuf_append_str(&o, "],\n\"requests\": [");
  for (size_t i = 0; i < n; i++) {
    const bs_result_t *r = &res[i];
    kiln_strbuf_printf(&o, "%s\n{\"ok\": %s, \"http_status\": %ld, \"start_s\": ", i ? "," : "",
                       r->ok ? "true" : "false", r->http_status);
    bs_json_num(&o, r->start);
    kiln_strbuf_append_str(&o, ", \"ttft_ms\": ");
    bs_json_num(&o, r->ok && r->ttft >= 0 ? 1e3 * r->ttft : -1);
    kiln_strbuf_append_str(&o, ", \"tpot_ms\": ");
    bs_json_num(&o, r->ok && r->tpot >= 0 ? 1e3 * r->tpot : -1);
    kiln_strbuf_append_str(&o, ", \"e2e_ms\": ");
    bs_json_num(&o, 1e3 * r->e2e);
    kiln_strbuf_printf(&o, ", \"input_tokens\": %lld, \"output_tokens\": %lld, \"error\": ",
                       (long long)r->input_tokens, (long long)r->output_tokens);
    bs_json_str(&o, r->ok ? NULL : r->error ? r->error : "out of memory");
    kiln_strbuf_append_char(&o, '}');
  }
  kiln_strbuf_append_str(&o, "]}\n");
  kiln_status_t st = NULL;
  FILE *f = NULL;
  if (!kiln_strbuf_ok(&o)) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  } else if (!(f = fopen(a->json, "w")) || fwrite(o.data, 1, o.len, f) != o.len) {
    st = kiln_status_make(KILN_ERR_IO, "%s: --json %s: %s", BS_CMD, a->json, strerror(errno));
  }
  if (f && fclose(f) != 0 && !st)
    st = kiln_status_make(KILN_ERR_IO, "%s: --json %s: %s", BS_CMD, a->json, strerror(errno));
  kiln_strbuf_free(&o);
  return st;
}

/* Lists the first failures on stderr. */
static void bs_print_failures(const bs_result_t *res, size_t n, size_t failed, const char *what) {
  fprintf(stderr, "kiln: %s: %zu of %zu requests failed; the first:\n", what, failed, n);
  size_t shown = 0;
  for (size_t i = 0; i < n && shown < BS_SHOW_ERRORS; i++) {
    if (res[i].ok) continue;
    fprintf(stderr, "  request %zu: %s\n", i, res[i].error ? res[i].error : "out of memory");
    shown++;
  }
}

static void bs_results_free(bs_result_t *res, size_t n) {
  for (size_t i = 0; res && i < n; i++) {
    free(res[i].itl.v);
    free(res[i].error);
  }
  free(res);
}

/* ---- the command ---------------------------------------------------------------------------- */

/* Everything after option parsing; returns the exit status. */
static int bs_main(const bs_args_t *a) {
  bs_t b = {0};
  b.a = a;
  kiln_status_t st = NULL;
  bs_result_t *res = NULL, *wres = NULL;
  double *arrivals = NULL;
  size_t n = (size_t)a->num_prompts, nw = (size_t)a->warmup;
  bs_summary_t sum;
  int rc = 1;
  /* curl does not raise SIGPIPE itself with CURLOPT_NOSIGNAL, but a TLS library writing to a
   * socket the server closed can; a dropped connection must fail one request, not the run. */
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &sa, NULL);
  if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
    return kiln_cli_fail(
        kiln_status_make(KILN_ERR_INTERNAL, "%s: curl_global_init failed", BS_CMD));
  if ((st = bs_setup(&b))) goto done;
  if (a->dataset) {
    if ((st = bs_load_dataset(&b))) goto done;
    if (!a->num_prompts_set) n = b.num_items;
  }
  if (a->image_dir && (st = bs_load_images(&b))) goto done;
  if (a->model) {
    if (!(b.model = kiln_strprintf("%s", a->model))) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
      goto done;
    }
  } else if ((st = bs_default_model(&b, &b.model))) {
    goto done;
  }
  res = calloc(n + 1, sizeof(*res));
  wres = calloc(nw + 1, sizeof(*wres));
  arrivals = malloc((n + 1) * sizeof(*arrivals));
  if (!res || !wres || !arrivals) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    goto done;
  }
  /* Poisson arrivals: exponential gaps with mean 1/rate; the first request goes at once. */
  uint64_t rng = (uint64_t)a->seed ^ 0x5851f42d4c957f2dull;
  double at = 0;
  for (size_t i = 0; i < n; i++) {
    arrivals[i] = at;
    if (!isinf(a->request_rate)) at += -log(1.0 - bs_rand_unit(&rng)) / a->request_rate;
  }
  size_t most = a->max_concurrency ? (size_t)a->max_concurrency : (n > nw ? n : nw);
  bs_raise_nofile(most + 64);
  char rate[32] = "inf", conc[32] = "none";
  if (!isinf(a->request_rate)) snprintf(rate, sizeof(rate), "%g", a->request_rate);
  if (a->max_concurrency) snprintf(conc, sizeof(conc), "%lld", (long long)a->max_concurrency);
  fprintf(stderr, "%s: %zu requests to %s (model %s), %s req/s, max concurrency %s\n", BS_CMD, n,
          b.url_post, b.model, rate, conc);
  double duration = 0;
  if (nw) {
    if ((st = bs_run(&b, nw, true, NULL, wres, &duration))) goto done;
    size_t wfailed = 0;
    for (size_t i = 0; i < nw; i++) wfailed += !wres[i].ok;
    if (wfailed) bs_print_failures(wres, nw, wfailed, "warmup");
  }
  if ((st = bs_run(&b, n, false, isinf(a->request_rate) ? NULL : arrivals, res, &duration)))
    goto done;
  if ((st = bs_summarize(res, n, duration, &sum))) goto done;
  bs_print(stdout, &b, &sum);
  fflush(stdout);
  if (a->json && (st = bs_write_json(&b, &sum, res, n))) goto done;
  if (sum.failed) {
    bs_print_failures(res, n, sum.failed, BS_CMD);
  } else {
    rc = 0;
  }
done:
  if (st) rc = kiln_cli_fail(st);
  bs_results_free(res, n);
  bs_results_free(wres, nw);
  free(arrivals);
  bs_items_free(&b);
  bs_images_free(&b);
  if (b.multi) curl_multi_cleanup(b.multi);
  curl_slist_free_all(b.headers);
  free(b.url_post);
  free(b.url_models);
  free(b.model);
  curl_global_cleanup();
  return rc;
}

int kiln_cmd_bench_serve(kiln_cli_t *cli) {
  bs_args_t a;
  kiln_status_t st = bs_parse(cli, &a);
  if (st) return kiln_cli_fail(st);
  if (a.help) return 0; /* printed by kiln_opts_parse */
  return bs_main(&a);
}
