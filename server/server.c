/* server.c - the OpenAI-compatible HTTP server (see server.h). */
#define _GNU_SOURCE /* POLLRDHUP */
#include "server/server.h"

#include <curl/curl.h>
#include <errno.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "base/strbuf.h"
#include "server/api.h"
#include "server/tools.h"
#include "server/web_assets.h"

/* How often a waiting request looks at its socket and deadline (ms). */
#define WAIT_SLICE_MS 50

struct kiln_server {
  kiln_server_options_t opt;
  char *host, *api_key, *model_name, *version, *tool_parser;
  struct MHD_Daemon *daemon;
  int port;
  _Atomic(kiln_engine_t *) eng;
  atomic_bool draining;  /* shutdown began: no new API requests */
  atomic_bool abort_all; /* shutdown_timeout passed: cancel what runs */
  atomic_bool stopped;
  int64_t created;
  pthread_mutex_t mu; /* guards the counters below */
  pthread_cond_t idle_cv;
  kiln_server_stats_t stats;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- per-connection state ------------------------------------------------------------------- */

typedef enum route {
  R_NONE = 0,
  R_COMPLETIONS,
  R_CHAT,
  R_MODELS,
  R_HEALTH,
  R_VERSION,
  R_METRICS,
  R_TOKENIZE,
  R_DETOKENIZE,
  R_PAGE, /* the chat page's files (web_assets.h) */
} route_t;

/* One running API request: its engine requests, its choices and (streaming) its unsent bytes. */
typedef struct job {
  kiln_server_t *s;
  kiln_engine_t *eng;
  kiln_api_request_t *req;
  route_t route;
  int fd; /* the client's socket, watched for a hang-up */
  char id[48];
  kiln_api_response_t resp;
  kiln_request_t **kreq; /* [num_prompts] */
  bool *kdone;
  kiln_usage_t *kusage;
  char **echo_text;               /* [num_prompts] the prompt as text (echo), or NULL */
  kiln_api_token_t **echo_tokens; /* [num_prompts] prompt tokens with logprobs (echo+logprobs) */
  int32_t *echo_num;
  bool *echo_ready;
  int32_t nreq, ndone;
  kiln_api_choice_t *choices;
  bool *echo_pending; /* [num_choices] */
  int32_t nchoices;
  /* wake-up from the engine */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool signaled;
  /* progress */
  double t_start, t_first, deadline, t_check;
  bool timed_out, gone, failed, finished;
  kiln_api_error_t err;  /* with failed */
  kiln_strbuf_t pending; /* streaming: bytes not yet handed to the connection */
  size_t pending_off;
  bool stream_closed; /* [DONE] written */
  int status;         /* the HTTP status sent */
  bool counted;       /* counted in stats.in_flight */
} job_t;

typedef struct conn {
  kiln_server_t *s;
  route_t route;
  bool is_post, responded;
  kiln_strbuf_t body;
  /* the body outgrew max_body_bytes, or memory ran out reading it */
  bool too_large, oom;
  job_t *job;                    /* a non-streaming job (freed with the connection) */
  const kiln_web_asset_t *asset; /* R_PAGE: the file */
  double t_start;
} conn_t;

/* ---- small helpers ------------------------------------------------------------------------ */

static void stats_add(kiln_server_t *s, int status) {
  pthread_mutex_lock(&s->mu);
  s->stats.requests++;
  if (status >= 400 && status < 500) s->stats.errors_4xx++;
  if (status >= 500) s->stats.errors_5xx++;
  pthread_mutex_unlock(&s->mu);
}

static enum MHD_Result respond(struct MHD_Connection *c, kiln_server_t *s, int status,
                               const char *ctype, char *body, size_t len, bool retry_after) {
  struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
  if (!r) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  if (retry_after) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, "1");
  if (status == MHD_HTTP_UNAUTHORIZED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
  enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
  MHD_destroy_response(r);
  stats_add(s, status);
  return ret;
}

static enum MHD_Result respond_json(struct MHD_Connection *c, kiln_server_t *s, int status,
                                    kiln_strbuf_t *sb) {
  if (!kiln_strbuf_ok(sb)) {
    kiln_strbuf_free(sb);
    return MHD_NO;
  }
  size_t len;
  char *body = kiln_strbuf_detach(sb, &len);
  if (!body) return MHD_NO;
  return respond(c, s, status, "application/json", body, len, status == 503);
}

static enum MHD_Result respond_error(struct MHD_Connection *c, kiln_server_t *s,
                                     const kiln_api_error_t *err) {
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_api_write_error(&sb, err);
  return respond_json(c, s, err->status, &sb);
}

static enum MHD_Result respond_errorf(struct MHD_Connection *c, kiln_server_t *s, int status,
                                      const char *type, const char *param, const char *msg) {
  kiln_api_error_t e;
  kiln_api_error_set(&e, status, type, param, "%s", msg);
  return respond_error(c, s, &e);
}

/* Compares in time that depends only on the lengths, not on where the strings differ. */
static bool secret_equal(const char *given, const char *want) {
  size_t gl = strlen(given), wl = strlen(want);
  unsigned char diff = gl != wl;
  for (size_t i = 0; i < wl; i++) diff |= (unsigned char)(want[i] ^ (i < gl ? given[i] : 0));
  return diff == 0;
}

static void random_id(char *out, size_t size, const char *prefix) {
  unsigned char b[16];
  if (getrandom(b, sizeof(b), 0) != (ssize_t)sizeof(b)) {
    static atomic_uint_fast64_t ctr;
    uint64_t x = atomic_fetch_add(&ctr, 1) ^ (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull;
    memcpy(b, &x, 8);
    memcpy(b + 8, &x, 8);
  }
  size_t n = (size_t)snprintf(out, size, "%s", prefix);
  for (int i = 0; i < 16 && n + 2 < size; i++, n += 2) snprintf(out + n, size - n, "%02x", b[i]);
}

/* True when the peer closed its end (EOF or an error on the socket). */
static bool peer_gone(int fd) {
  if (fd < 0) return false;
  struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLERR | POLLHUP | POLLNVAL | POLLRDHUP)) return true;
  if (p.revents & POLLIN) {
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true;
  }
  return false;
}

/* ---- jobs ----------------------------------------------------------------------------------- */

static void job_notify(void *user) {
  job_t *j = user;
  pthread_mutex_lock(&j->mu);
  j->signaled = true;
  pthread_cond_signal(&j->cv);
  pthread_mutex_unlock(&j->mu);
}

static void job_log(job_t *j) {
  kiln_usage_t u = j->resp.usage;
  double total = now_s() - j->t_start;
  const char *route = j->route == R_CHAT ? "/v1/chat/completions" : "/v1/completions";
  kiln_log_field_t f[] = {
      {"id", j->id, 0},
      {"route", route, 0},
      {"status", NULL, j->status},
      {"stream", j->req && j->req->stream ? "true" : "false", 0},
      {"prompt_tokens", NULL, u.prompt_tokens},
      {"completion_tokens", NULL, u.completion_tokens},
      {"cached_tokens", NULL, u.cached_tokens},
      {"ttft_ms", NULL, j->t_first > 0 ? round((j->t_first - j->t_start) * 1e4) / 10 : -1},
      {"total_ms", NULL, round(total * 1e4) / 10},
      {"outcome",
       j->gone        ? "client_gone"
       : j->timed_out ? "timeout"
       : j->failed    ? "error"
                      : "ok",
       0},
  };
  kiln_log_fields(j->status >= 500 ? KILN_LOG_WARN : KILN_LOG_INFO, "request", f,
                  (int)(sizeof(f) / sizeof(f[0])));
}

/* Takes and drops a request's events up to its final one. */
static void request_drain(kiln_request_t *r) {
  for (;;) {
    kiln_output_t *o = NULL;
    kiln_status_t st = kiln_request_poll(r, -1, &o);
    if (st) {
      kiln_status_free(st);
      return;
    }
    if (!o) return; /* closed and empty: the final event was taken already */
    bool last = o->request_finished;
    kiln_output_free(o);
    if (last) return;
  }
}

static void job_free(job_t *j) {
  if (!j) return;
  /* The engine calls job_notify with this job as it queues each event of a request, up to the
   * final one, even after the handle is released: an unfinished request is cancelled and its
   * events taken up to the final one (one engine step away), so that none comes after the free
   * (the engine notifies under the request's lock, so none can follow the poll of the last). */
  for (int32_t i = 0; i < j->nreq; i++)
    if (j->kreq[i]) {
      if (!j->kdone[i]) {
        kiln_request_cancel(j->kreq[i]);
        request_drain(j->kreq[i]);
      }
      kiln_request_release(j->kreq[i]);
    }
  for (int32_t i = 0; i < j->nreq; i++) {
    free(j->echo_text ? j->echo_text[i] : NULL);
    if (j->echo_tokens && j->echo_tokens[i]) {
      for (int32_t k = 0; k < j->echo_num[i]; k++) kiln_api_token_free(&j->echo_tokens[i][k]);
      free(j->echo_tokens[i]);
    }
  }
  free(j->echo_text);
  free(j->echo_tokens);
  free(j->echo_num);
  free(j->echo_ready);
  for (int32_t i = 0; i < j->nchoices; i++) kiln_api_choice_free(&j->choices[i]);
  free(j->choices);
  free(j->echo_pending);
  free(j->kreq);
  free(j->kdone);
  free(j->kusage);
  if (j->counted) {
    pthread_mutex_lock(&j->s->mu);
    j->s->stats.in_flight--;
    if (j->gone) j->s->stats.disconnects++;
    pthread_cond_broadcast(&j->s->idle_cv);
    pthread_mutex_unlock(&j->s->mu);
  }
  kiln_api_request_free(j->req);
  kiln_strbuf_free(&j->pending);
  pthread_mutex_destroy(&j->mu);
  pthread_cond_destroy(&j->cv);
  free(j);
}

/* A token's own text (for logprobs); "" when it cannot be decoded. */
static char *token_text(kiln_engine_t *eng, int32_t id) {
  char *t = NULL;
  kiln_status_t st = kiln_engine_detokenize(eng, &id, 1, false, &t);
  if (st) {
    kiln_status_free(st);
    return strdup("");
  }
  return t;
}

static bool make_token(kiln_engine_t *eng, int32_t id, float lp, const int32_t *top_ids,
                       const float *top_lps, int32_t num_top, kiln_api_token_t *t) {
  memset(t, 0, sizeof(*t));
  t->id = id;
  t->logprob = lp;
  if (!(t->text = token_text(eng, id))) return false;
  if (num_top > 0) {
    t->top_ids = malloc((size_t)num_top * sizeof(int32_t));
    t->top_logprobs = malloc((size_t)num_top * sizeof(float));
    t->top_text = calloc((size_t)num_top, sizeof(char *));
    if (!t->top_ids || !t->top_logprobs || !t->top_text) {
      kiln_api_token_free(t);
      return false;
    }
    t->num_top = num_top;
    for (int32_t k = 0; k < num_top; k++) {
      t->top_ids[k] = top_ids[k];
      t->top_logprobs[k] = top_lps[k];
      if (!(t->top_text[k] = token_text(eng, top_ids[k]))) {
        kiln_api_token_free(t);
        return false;
      }
    }
  }
  return true;
}

static void job_fail(job_t *j, int status, const char *type, const char *msg) {
  if (j->failed) return;
  j->failed = true;
  kiln_api_error_set(&j->err, status, type, NULL, "%s", msg);
}

/* Prompt logprobs from the first event of sequence 0: the echoed prompt's token details. The
 * event gives positions 1 .. P-1; the ids are the prompt's own. */
static void job_take_prompt_logprobs(job_t *j, int32_t ri, const kiln_output_t *o) {
  const kiln_api_prompt_t *p = &j->req->prompts[ri];
  if (j->echo_ready[ri] || o->num_prompt_logprobs != p->num_ids - 1) return;
  int32_t n = p->num_ids;
  kiln_api_token_t *toks = calloc((size_t)n, sizeof(*toks));
  bool ok = toks && make_token(j->eng, p->ids[0], NAN, NULL, NULL, 0, &toks[0]);
  int32_t top = j->req->logprobs < o->prompt_top_n ? j->req->logprobs : o->prompt_top_n;
  for (int32_t k = 0; ok && k < o->num_prompt_logprobs; k++)
    ok = make_token(
        j->eng, p->ids[k + 1], o->prompt_logprobs[k],
        o->prompt_top_ids ? o->prompt_top_ids + (size_t)k * o->prompt_top_n : NULL,
        o->prompt_top_logprobs ? o->prompt_top_logprobs + (size_t)k * o->prompt_top_n : NULL,
        o->prompt_top_ids ? top : 0, &toks[k + 1]);
  if (!ok) {
    for (int32_t k = 0; toks && k < n; k++) kiln_api_token_free(&toks[k]);
    free(toks);
    job_fail(j, 500, "server_error", "out of memory");
    return;
  }
  j->echo_tokens[ri] = toks;
  j->echo_num[ri] = n;
  j->echo_ready[ri] = true;
}

/* Moves the echoed prompt into a choice ahead of its generated text, once it is known. */
static bool job_echo(job_t *j, int32_t ci) {
  if (!j->echo_pending[ci]) return true;
  int32_t ri = ci / j->req->sp.n;
  if (j->req->logprobs >= 0 && !j->echo_ready[ri] && !j->kdone[ri]) return false;
  kiln_api_choice_t *c = &j->choices[ci];
  kiln_strbuf_t t = KILN_STRBUF_INIT;
  kiln_strbuf_append_str(&t, j->echo_text[ri] ? j->echo_text[ri] : "");
  kiln_strbuf_append(&t, kiln_strbuf_cstr(&c->text), c->text.len);
  if (!kiln_strbuf_ok(&t)) {
    kiln_strbuf_free(&t);
    job_fail(j, 500, "server_error", "out of memory");
    return false;
  }
  kiln_strbuf_free(&c->text);
  c->text = t;
  if (j->req->logprobs >= 0 && j->echo_ready[ri]) {
    /* prompt tokens go first: rebuild the list as prompt + generated */
    kiln_api_choice_t tmp;
    memset(&tmp, 0, sizeof(tmp));
    for (int32_t k = 0; k < j->echo_num[ri]; k++) {
      kiln_api_token_t copy;
      const kiln_api_token_t *src = &j->echo_tokens[ri][k];
      if (!make_token(j->eng, src->id, src->logprob, src->top_ids, src->top_logprobs, src->num_top,
                      &copy) ||
          !kiln_api_choice_push_token(&tmp, &copy)) {
        kiln_api_choice_free(&tmp);
        job_fail(j, 500, "server_error", "out of memory");
        return false;
      }
    }
    for (int32_t k = 0; k < c->num_tokens; k++) {
      if (!kiln_api_choice_push_token(&tmp, &c->tokens[k])) {
        kiln_api_choice_free(&tmp);
        job_fail(j, 500, "server_error", "out of memory");
        return false;
      }
    }
    c->num_tokens = 0;
    free(c->tokens);
    c->tokens = tmp.tokens;
    c->num_tokens = tmp.num_tokens;
    c->cap_tokens = tmp.cap_tokens;
  }
  j->echo_pending[ci] = false;
  return true;
}

/* Applies one engine event to its choice. */
static void job_apply(job_t *j, int32_t ri, const kiln_output_t *o) {
  int32_t ci = ri * j->req->sp.n + o->index;
  if (ci < 0 || ci >= j->nchoices) return;
  kiln_api_choice_t *c = &j->choices[ci];
  if (o->num_tokens > 0 && j->t_first == 0) j->t_first = now_s();
  if (o->num_prompt_logprobs > 0 && j->req->echo) job_take_prompt_logprobs(j, ri, o);
  if (!c->tool)
    kiln_strbuf_append(&c->text, o->text, o->text_len);
  else if (!kiln_api_tool_push(c, o->text, o->text_len, o->finish_reason != KILN_FINISH_NONE))
    job_fail(j, 500, "server_error", "out of memory");
  c->completion_tokens += o->num_tokens;
  if (j->req->logprobs >= 0 && o->logprobs) {
    int32_t nt = j->req->logprobs < o->top_n ? j->req->logprobs : o->top_n;
    for (int32_t k = 0; k < o->num_tokens; k++) {
      kiln_api_token_t t;
      if (!make_token(j->eng, o->token_ids[k], o->logprobs[k],
                      o->top_ids ? o->top_ids + (size_t)k * o->top_n : NULL,
                      o->top_logprobs ? o->top_logprobs + (size_t)k * o->top_n : NULL, nt, &t) ||
          !kiln_api_choice_push_token(c, &t))
        job_fail(j, 500, "server_error", "out of memory");
    }
  }
  if (o->finish_reason != KILN_FINISH_NONE) {
    c->finish = o->finish_reason;
    c->stop_token = o->stop_token;
    if (o->stop_str && !c->stop_str) c->stop_str = strdup(o->stop_str);
    if (o->finish_reason == KILN_FINISH_ERROR)
      job_fail(j, 500, "server_error", o->error ? o->error : "the request failed");
  }
  if (!kiln_strbuf_ok(&c->text)) job_fail(j, 500, "server_error", "out of memory");
  j->kusage[ri] = o->usage;
  if (o->request_finished) {
    j->kdone[ri] = true;
    j->ndone++;
  }
}

static void job_sum_usage(job_t *j) {
  kiln_usage_t u = {0, 0, 0};
  for (int32_t i = 0; i < j->nreq; i++) {
    u.prompt_tokens += j->kusage[i].prompt_tokens;
    u.completion_tokens += j->kusage[i].completion_tokens;
    u.cached_tokens += j->kusage[i].cached_tokens;
  }
  j->resp.usage = u;
}

static void job_cancel_all(job_t *j) {
  for (int32_t i = 0; i < j->nreq; i++)
    if (j->kreq[i] && !j->kdone[i]) kiln_request_cancel(j->kreq[i]);
}

/* Takes every queued event; waits up to wait_ms for one when there was none. Watches the
 * client, the deadline and the server's shutdown meanwhile. Returns the events applied. */
static int job_pump(job_t *j, int wait_ms) {
  int got = 0;
  for (int32_t i = 0; i < j->nreq; i++) {
    while (!j->kdone[i]) {
      kiln_output_t *o = NULL;
      kiln_status_t st = kiln_request_poll(j->kreq[i], 0, &o);
      if (st) {
        job_fail(j, 500, "server_error", kiln_status_message(st));
        kiln_status_free(st);
        j->kdone[i] = true;
        j->ndone++;
        break;
      }
      if (!o) break;
      job_apply(j, i, o);
      kiln_output_free(o);
      got++;
    }
  }
  /* the client, the deadline and shutdown are looked at every slice, busy or not */
  double t = now_s();
  if (t - j->t_check >= WAIT_SLICE_MS * 1e-3 || (!got && j->ndone < j->nreq)) {
    j->t_check = t;
    if (!j->gone && peer_gone(j->fd)) {
      j->gone = true;
      job_cancel_all(j);
    }
    if (!j->timed_out && j->deadline > 0 && t > j->deadline) {
      j->timed_out = true;
      job_cancel_all(j);
    }
    if (atomic_load(&j->s->abort_all)) job_cancel_all(j);
  }
  if (got || j->ndone == j->nreq) return got;
  pthread_mutex_lock(&j->mu);
  if (!j->signaled) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (long)wait_ms * 1000000L;
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(&j->cv, &j->mu, &ts);
  }
  j->signaled = false;
  pthread_mutex_unlock(&j->mu);
  return 0;
}

/* The error a finished job answers with, if any (timeout, failure). */
static bool job_error(job_t *j, kiln_api_error_t *err) {
  if (j->timed_out) {
    kiln_api_error_set(err, 504, "timeout", NULL,
                       "the request ran past the server's request_timeout of %g s and was "
                       "cancelled",
                       j->s->opt.request_timeout);
    return true;
  }
  if (j->failed) {
    *err = j->err;
    return true;
  }
  return false;
}

/* ---- submitting ------------------------------------------------------------------------------ */

/* Maps an engine refusal to an HTTP error. */
static void submit_error(kiln_status_t st, const char *param, kiln_api_error_t *err) {
  int code = kiln_status_code(st);
  if (code == KILN_ERR_UNAVAILABLE_CODE)
    kiln_api_error_set(err, 503, "server_busy", NULL, "%s", kiln_status_message(st));
  else if (code == KILN_ERR_INVALID_ARGUMENT)
    kiln_api_error_set(err, 400, "invalid_request_error", param, "%s", kiln_status_message(st));
  else if (code == KILN_ERR_OUT_OF_MEMORY)
    kiln_api_error_set(err, 503, "server_busy", NULL, "%s", kiln_status_message(st));
  else
    kiln_api_error_set(err, 500, "server_error", NULL, "%s", kiln_status_message(st));
}

/* A constraint the engine could not compile ("json_schema: properties.a: ..."): a 400 naming
 * the request's field ("response_format.json_schema.schema: properties.a: ..."). */
static bool guide_submit_error(kiln_status_t st, const kiln_api_request_t *r,
                               kiln_api_error_t *err) {
  static const char *const kinds[] = {
      "json_object: ", "json_schema: ", "regex: ", "choice: ", "grammar: "};
  const char *m = kiln_status_message(st);
  if (!r->sp.guide || kiln_status_code(st) != KILN_ERR_INVALID_ARGUMENT) return false;
  for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
    size_t n = strlen(kinds[i]);
    if (!strncmp(m, kinds[i], n)) {
      /* a constraint of the request's own, or tool_choice's (the tools' parameter schemas) */
      const char *field = r->guide_field[0] ? r->guide_field : "tools";
      char param[64];
      snprintf(param, sizeof(param), "%.63s", field);
      kiln_api_error_set(err, 400, "invalid_request_error", param, "%s: %s", field, m + n);
      return true;
    }
  }
  return false;
}

/* ---- images ---------------------------------------------------------------------------------- */

typedef struct fetch_buf {
  unsigned char *data;
  size_t len, cap, max;
  bool over;
} fetch_buf_t;

static size_t fetch_write(char *ptr, size_t size, size_t nmemb, void *user) {
  fetch_buf_t *b = user;
  size_t n = size * nmemb;
  if (b->len + n > b->max) {
    b->over = true;
    return 0; /* aborts the transfer */
  }
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 65536;
    while (cap < b->len + n) cap *= 2;
    if (cap > b->max) cap = b->max;
    unsigned char *g = realloc(b->data, cap);
    if (!g) return 0;
    b->data = g;
    b->cap = cap;
  }
  memcpy(b->data + b->len, ptr, n);
  b->len += n;
  return n;
}

/* Fetches an http(s) image URL into im->data under the server's size and time limits. */
static bool fetch_image(kiln_server_t *s, kiln_api_image_t *im, kiln_api_error_t *err) {
  CURL *c = curl_easy_init();
  if (!c) {
    kiln_api_error_set(err, 500, "server_error", NULL, "out of memory");
    return false;
  }
  fetch_buf_t b = {.max = s->opt.max_image_bytes};
  char eb[CURL_ERROR_SIZE] = "";
  curl_easy_setopt(c, CURLOPT_URL, im->url);
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
  curl_easy_setopt(c, CURLOPT_MAXREDIRS, 3L);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_FAILONERROR, 1L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(s->opt.image_fetch_timeout * 1000.0));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, fetch_write);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, eb);
  CURLcode rc = curl_easy_perform(c);
  curl_easy_cleanup(c);
  if (b.over) {
    free(b.data);
    kiln_api_error_set(err, 400, "invalid_request_error", "messages",
                       "messages[%d].content[%d]: the image at the URL is over the limit of %zu "
                       "bytes ([server] max_image_bytes)",
                       im->message, im->part, s->opt.max_image_bytes);
    return false;
  }
  if (rc != CURLE_OK || b.len == 0) {
    free(b.data);
    kiln_api_error_set(err, 400, "invalid_request_error", "messages",
                       "messages[%d].content[%d]: fetching the image URL failed: %s", im->message,
                       im->part,
                       rc != CURLE_OK ? (eb[0] ? eb : curl_easy_strerror(rc)) : "an empty body");
    return false;
  }
  im->data = b.data;
  im->size = b.len;
  return true;
}

/* An engine refusal of a chat request with images: one that names an image ("image I: ...")
 * names the message part it came from instead. */
static void image_submit_error(kiln_status_t st, const kiln_api_request_t *r,
                               kiln_api_error_t *err) {
  const char *msg = kiln_status_message(st);
  int idx = -1, used = 0;
  if (sscanf(msg, "image %d: %n", &idx, &used) == 1 && used > 0 && idx >= 0 &&
      idx < r->num_images) {
    int code = kiln_status_code(st);
    bool client = code == KILN_ERR_INVALID_ARGUMENT || code == KILN_ERR_UNSUPPORTED;
    kiln_api_error_set(err, client ? 400 : 500, client ? "invalid_request_error" : "server_error",
                       "messages", "messages[%d].content[%d]: %s", r->images[idx].message,
                       r->images[idx].part, msg + used);
    return;
  }
  submit_error(st, "messages", err);
}

/* Readies a chat (or tokenize) request's tools and tool calls for the model's template. */
static bool tools_prepare(kiln_server_t *s, kiln_engine_t *eng, kiln_api_request_t *r,
                          kiln_api_error_t *err) {
  const char *src = NULL;
  size_t len = 0;
  bool renders = false;
  kiln_engine_chat_template_source(eng, r->tools_json != NULL, &src, &len, &renders);
  return kiln_api_tools_prepare(r, src, len, renders, s->tool_parser, err);
}

/* Tokenizes the prompts (or renders and tokenizes the chat) into prompt ids, checks the
 * context, and submits one engine request per prompt. */
static bool job_submit(job_t *j, kiln_api_error_t *err) {
  kiln_api_request_t *r = j->req;
  kiln_engine_info_t info;
  kiln_engine_get_info(j->eng, &info);
  const char *param = r->kind == KILN_API_CHAT ? "messages" : "prompt";
  if (r->kind == KILN_API_CHAT) {
    if (!tools_prepare(j->s, j->eng, r, err)) return false;
    kiln_chat_args_t a = {
        r->messages_json,        r->messages_len,        r->tools_json,           r->tools_len,
        r->template_kwargs_json, r->template_kwargs_len, r->add_generation_prompt};
    char *prompt = NULL;
    size_t plen = 0;
    kiln_status_t st = kiln_engine_apply_chat_template(j->eng, &a, &prompt, &plen);
    if (st) {
      kiln_api_error_set(err, kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY ? 500 : 400,
                         "invalid_request_error", "messages", "%s", kiln_status_message(st));
      kiln_status_free(st);
      return false;
    }
    if (!(r->prompts = calloc(1, sizeof(*r->prompts)))) {
      free(prompt);
      kiln_api_error_set(err, 500, "server_error", NULL, "out of memory");
      return false;
    }
    r->prompts[0].text = prompt;
    r->prompts[0].text_len = plen;
    r->num_prompts = 1;
  }
  const int32_t np = r->num_prompts, n = r->sp.n;
  j->nreq = np;
  j->nchoices = np * n;
  if (!(j->kreq = calloc((size_t)np, sizeof(*j->kreq))) ||
      !(j->kdone = calloc((size_t)np, sizeof(bool))) ||
      !(j->kusage = calloc((size_t)np, sizeof(kiln_usage_t))) ||
      !(j->echo_text = calloc((size_t)np, sizeof(char *))) ||
      !(j->echo_tokens = calloc((size_t)np, sizeof(kiln_api_token_t *))) ||
      !(j->echo_num = calloc((size_t)np, sizeof(int32_t))) ||
      !(j->echo_ready = calloc((size_t)np, sizeof(bool))) ||
      !(j->choices = calloc((size_t)j->nchoices, sizeof(kiln_api_choice_t))) ||
      !(j->echo_pending = calloc((size_t)j->nchoices, sizeof(bool)))) {
    kiln_api_error_set(err, 500, "server_error", NULL, "out of memory");
    return false;
  }
  for (int32_t i = 0; i < j->nchoices; i++) {
    j->choices[i].index = i;
    j->choices[i].stop_token = -1;
    j->echo_pending[i] = r->echo;
    if (!kiln_api_tool_state_init(&j->choices[i], r)) {
      kiln_api_error_set(err, 500, "server_error", NULL, "out of memory");
      return false;
    }
  }
  /* tokenize every prompt first, so a bad one refuses the request before anything runs */
  for (int32_t i = 0; i < np; i++) {
    kiln_api_prompt_t *p = &r->prompts[i];
    if (p->text) {
      if (!info.has_tokenizer) {
        kiln_api_error_set(err, 400, "invalid_request_error", param,
                           "this model has no tokenizer: give the prompt as token ids");
        return false;
      }
      kiln_status_t st = kiln_engine_tokenize(j->eng, p->text, p->text_len, r->add_special_tokens,
                                              &p->ids, &p->num_ids);
      if (st) {
        submit_error(st, param, err);
        kiln_status_free(st);
        return false;
      }
      if (r->echo && !(j->echo_text[i] = strdup(r->kind == KILN_API_CHAT ? "" : p->text))) {
        kiln_api_error_set(err, 500, "server_error", NULL, "out of memory");
        return false;
      }
    } else if (r->echo) {
      kiln_status_t st =
          kiln_engine_detokenize(j->eng, p->ids, (size_t)p->num_ids, false, &j->echo_text[i]);
      if (st) {
        submit_error(st, param, err);
        kiln_status_free(st);
        return false;
      }
    }
    for (int32_t k = 0; k < p->num_ids; k++)
      if (p->ids[k] < 0 || p->ids[k] >= info.vocab_size) {
        kiln_api_error_set(err, 400, "invalid_request_error", param,
                           "%s token %d is %d, outside the vocabulary [0, %d)", param, k, p->ids[k],
                           info.vocab_size);
        return false;
      }
    if (p->num_ids == 0) {
      kiln_api_error_set(err, 400, "invalid_request_error", param, "the %s is empty", param);
      return false;
    }
    int64_t want = (int64_t)p->num_ids + (r->sp.max_tokens > 0 ? r->sp.max_tokens : 1);
    if ((int64_t)p->num_ids >= info.max_model_len || want > info.max_model_len) {
      kiln_api_error_set(err, 400, "invalid_request_error", param,
                         "This model's maximum context length is %lld tokens. However, you "
                         "requested %lld tokens (%d in the %s, %d in the completion). Please "
                         "reduce the length of the %s or completion.",
                         (long long)info.max_model_len, (long long)want, p->num_ids,
                         r->kind == KILN_API_CHAT ? "messages" : "prompt",
                         r->sp.max_tokens > 0 ? r->sp.max_tokens : 1,
                         r->kind == KILN_API_CHAT ? "messages" : "prompt");
      return false;
    }
  }
  kiln_image_input_t *imgs = NULL;
  if (r->num_images > 0) {
    if (kiln_engine_max_images(j->eng) <= 0) { /* the parser knew; this is a safety net */
      kiln_api_error_set(err, 400, "invalid_request_error", "messages",
                         "messages[%d].content[%d]: content of type 'image_url' is not supported "
                         "by this model (text only)",
                         r->images[0].message, r->images[0].part);
      return false;
    }
    for (int32_t k = 0; k < r->num_images; k++)
      if (!r->images[k].data && r->images[k].url && !fetch_image(j->s, &r->images[k], err))
        return false;
    if (!(imgs = calloc((size_t)(uint32_t)r->num_images, sizeof(*imgs)))) {
      kiln_api_error_set(err, 500, "server_error", NULL, "out of memory");
      return false;
    }
    for (int32_t k = 0; k < r->num_images; k++) {
      imgs[k].data = r->images[k].data;
      imgs[k].size = r->images[k].size;
    }
  }
  for (int32_t i = 0; i < np; i++) {
    kiln_request_desc_t d;
    memset(&d, 0, sizeof(d));
    d.struct_size = sizeof(d);
    d.prompt_ids = r->prompts[i].ids;
    d.num_prompt_ids = r->prompts[i].num_ids;
    d.params = &r->sp;
    d.user = j;
    d.on_queued = job_notify;
    d.images = imgs;
    d.num_images = imgs ? r->num_images : 0;
    kiln_status_t st = kiln_engine_submit(j->eng, &d, &j->kreq[i]);
    if (st) {
      free(imgs);
      if (kiln_api_tools_submit_error(r, st, err))
        ; /* tool_choice needs what the engine lacks */
      else if (guide_submit_error(st, r, err))
        ;
      else if (d.num_images)
        image_submit_error(st, r, err);
      else
        submit_error(st, param, err);
      kiln_status_free(st);
      job_cancel_all(j); /* job_free releases what was submitted */
      return false;
    }
  }
  free(imgs); /* the engine copied the images */
  return true;
}

/* Makes a job for a parsed request; on failure the error is in *err and NULL is returned. */
static job_t *job_create(kiln_server_t *s, kiln_engine_t *eng, route_t route,
                         kiln_api_request_t *req, int fd, kiln_api_error_t *err) {
  job_t *j = calloc(1, sizeof(*j));
  if (!j) {
    kiln_api_request_free(req);
    kiln_api_error_set(err, 500, "server_error", NULL, "out of memory");
    return NULL;
  }
  j->s = s;
  j->eng = eng;
  j->req = req;
  j->route = route;
  j->fd = fd;
  pthread_mutex_init(&j->mu, NULL);
  pthread_cond_init(&j->cv, NULL);
  j->t_start = now_s();
  j->deadline = s->opt.request_timeout > 0 ? j->t_start + s->opt.request_timeout : 0;
  random_id(j->id, sizeof(j->id), route == R_CHAT ? "chatcmpl-" : "cmpl-");
  j->resp.req = req;
  j->resp.id = j->id;
  j->resp.model = s->model_name;
  j->resp.created = (int64_t)time(NULL);
  pthread_mutex_lock(&s->mu);
  s->stats.in_flight++;
  pthread_mutex_unlock(&s->mu);
  j->counted = true;
  if (!job_submit(j, err)) {
    j->status = err->status;
    job_log(j);
    job_free(j);
    return NULL;
  }
  return j;
}

/* ---- streaming ------------------------------------------------------------------------------ */

/* Appends the stream events for whatever the choices hold now. */
static void job_stream_emit(job_t *j) {
  const kiln_api_request_t *r = j->req;
  job_sum_usage(j);
  for (int32_t ci = 0; ci < j->nchoices; ci++) {
    kiln_api_choice_t *c = &j->choices[ci];
    if (!job_echo(j, ci)) continue;
    bool finished_now =
        c->finish != KILN_FINISH_NONE && c->finish != KILN_FINISH_ERROR && !c->finish_sent;
    bool role_first = r->kind == KILN_API_CHAT && !c->started;
    bool tool_delta = kiln_api_tool_delta_pending(c);
    if (!c->text.len && !c->num_tokens && !role_first && !finished_now && !tool_delta) continue;
    /* the text, then each tool-call delta in an event of its own; the finish reason in the
     * last event, on its own, as OpenAI sends them */
    kiln_finish_reason_t f = c->finish;
    c->finish = KILN_FINISH_NONE;
    if (c->text.len || c->num_tokens || role_first || tool_delta) {
      do {
        kiln_api_write_chunk(&j->pending, &j->resp, c, r->continuous_usage);
      } while (kiln_api_tool_delta_pending(c));
    }
    c->finish = f;
    if (finished_now) {
      kiln_api_write_chunk(&j->pending, &j->resp, c, r->continuous_usage);
      c->finish_sent = true;
    }
  }
}

static void job_stream_close(job_t *j) {
  kiln_api_error_t err;
  if (job_error(j, &err)) {
    kiln_api_write_stream_error(&j->pending, &err);
  } else {
    job_stream_emit(j);
    if (j->req->include_usage) {
      job_sum_usage(j);
      kiln_api_write_usage_chunk(&j->pending, &j->resp);
    }
  }
  kiln_strbuf_append_str(&j->pending, "data: [DONE]\n\n");
  j->stream_closed = true;
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
  job_t *j = cls;
  (void)pos;
  for (;;) {
    if (j->pending_off < j->pending.len) {
      size_t n = j->pending.len - j->pending_off;
      if (n > max) n = max;
      memcpy(buf, j->pending.data + j->pending_off, n);
      j->pending_off += n;
      if (j->pending_off == j->pending.len) {
        kiln_strbuf_reset(&j->pending);
        j->pending_off = 0;
      }
      return (ssize_t)n;
    }
    if (!kiln_strbuf_ok(&j->pending)) return MHD_CONTENT_READER_END_WITH_ERROR;
    if (j->stream_closed) {
      j->finished = true;
      return MHD_CONTENT_READER_END_OF_STREAM;
    }
    if (j->gone) return MHD_CONTENT_READER_END_WITH_ERROR;
    if (j->ndone == j->nreq) {
      job_sum_usage(j);
      job_stream_close(j);
      continue;
    }
    if (job_pump(j, WAIT_SLICE_MS) > 0 && !j->failed && !j->timed_out) job_stream_emit(j);
  }
}

static void stream_free(void *cls) {
  job_t *j = cls;
  if (!j->finished) j->gone = j->gone || !j->stream_closed;
  job_sum_usage(j);
  job_log(j);
  job_free(j);
}

/* ---- routes -----------------------------------------------------------------------------------
 */

/* The chat page's file at url ("/index.html" is "/"), or NULL. */
static const kiln_web_asset_t *page_of(const char *url) {
  if (!strcmp(url, "/index.html")) url = "/";
  for (size_t i = 0; i < kiln_web_num_assets; i++)
    if (!strcmp(kiln_web_assets[i].path, url)) return &kiln_web_assets[i];
  return NULL;
}

/* A file of the chat page: static bytes, never cached stale (a new build may change them), and
 * a content security policy that lets it load only from this server (images it shows may be
 * the data: and blob: URLs of uploads). */
static enum MHD_Result serve_page(struct MHD_Connection *c, kiln_server_t *s,
                                  const kiln_web_asset_t *a) {
  struct MHD_Response *r =
      MHD_create_response_from_buffer(a->size, (void *)a->data, MHD_RESPMEM_PERSISTENT);
  if (!r) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, a->content_type);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
  MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
  MHD_add_response_header(r, "Content-Security-Policy",
                          "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
                          "base-uri 'none'; frame-ancestors 'none'");
  enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, r);
  MHD_destroy_response(r);
  stats_add(s, 200);
  return ret;
}

static route_t route_of(const char *url, bool *known_get, bool *known_post) {
  static const struct {
    const char *path;
    route_t r;
    bool post;
  } routes[] = {
      {"/v1/completions", R_COMPLETIONS, true}, {"/v1/chat/completions", R_CHAT, true},
      {"/v1/models", R_MODELS, false},          {"/health", R_HEALTH, false},
      {"/version", R_VERSION, false},           {"/metrics", R_METRICS, false},
      {"/tokenize", R_TOKENIZE, true},          {"/detokenize", R_DETOKENIZE, true},
  };
  *known_get = *known_post = false;
  size_t n = strlen(url);
  while (n > 1 && url[n - 1] == '/') n--; /* "/v1/models/" is "/v1/models" */
  for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
    if (strlen(routes[i].path) == n && !memcmp(routes[i].path, url, n)) {
      *known_post = routes[i].post;
      *known_get = !routes[i].post;
      return routes[i].r;
    }
  return R_NONE;
}

static enum MHD_Result serve_get(struct MHD_Connection *c, kiln_server_t *s, route_t route,
                                 kiln_engine_t *eng) {
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  switch (route) {
    case R_HEALTH:
      if (!eng || atomic_load(&s->draining)) {
        kiln_strbuf_append_str(
            &sb, eng ? "{\"status\": \"shutting_down\"}" : "{\"status\": \"loading\"}");
        return respond_json(c, s, 503, &sb);
      }
      kiln_strbuf_append_str(&sb, "{\"status\": \"ok\"}");
      return respond_json(c, s, 200, &sb);
    case R_VERSION:
      kiln_strbuf_append_str(&sb, "{\"version\": ");
      kiln_json_write_string(&sb, s->version, strlen(s->version), false);
      kiln_strbuf_append_str(&sb, "}");
      return respond_json(c, s, 200, &sb);
    case R_MODELS: {
      kiln_engine_info_t info;
      memset(&info, 0, sizeof(info));
      if (eng) kiln_engine_get_info(eng, &info);
      kiln_strbuf_append_str(&sb, "{\"object\": \"list\", \"data\": [{\"id\": ");
      kiln_json_write_string(&sb, s->model_name, strlen(s->model_name), false);
      kiln_strbuf_printf(&sb,
                         ", \"object\": \"model\", \"created\": %lld, \"owned_by\": \"kiln\", "
                         "\"root\": ",
                         (long long)s->created);
      const char *root = info.model_path ? info.model_path : s->model_name;
      kiln_json_write_string(&sb, root, strlen(root), false);
      int32_t mi = eng ? kiln_engine_max_images(eng) : 0;
      kiln_strbuf_printf(&sb,
                         ", \"parent\": null, \"max_model_len\": %lld, \"input_modalities\": "
                         "%s, \"max_images_per_prompt\": %d, \"quantization\": ",
                         (long long)info.max_model_len,
                         mi > 0 ? "[\"text\", \"image\"]" : "[\"text\"]", mi);
      const char *qz = info.quantization ? info.quantization : "none";
      kiln_json_write_string(&sb, qz, strlen(qz), false);
      kiln_strbuf_append_str(&sb, ", \"kv_cache_dtype\": ");
      const char *kvd = info.kv_cache_dtype ? info.kv_cache_dtype : "";
      kiln_json_write_string(&sb, kvd, strlen(kvd), false);
      kiln_strbuf_append_str(&sb, "}]}");
      return respond_json(c, s, 200, &sb);
    }
    case R_METRICS: {
      if (!eng) return respond_errorf(c, s, 503, "server_busy", NULL, "the model is loading");
      kiln_metrics_t m;
      kiln_engine_get_metrics(eng, &m);
      char *text = kiln_metrics_prometheus(&m, s->model_name);
      if (!text) return MHD_NO;
      return respond(c, s, 200, "text/plain; version=0.0.4; charset=utf-8", text, strlen(text),
                     false);
    }
    default: return respond_errorf(c, s, 404, "not_found_error", NULL, "not found");
  }
}

static enum MHD_Result serve_tokenize(struct MHD_Connection *c, kiln_server_t *s, route_t route,
                                      kiln_engine_t *eng, const kiln_strbuf_t *body) {
  kiln_api_limits_t lim;
  kiln_api_limits_default(&lim);
  kiln_engine_info_t info;
  kiln_engine_get_info(eng, &info);
  lim.vocab_size = info.vocab_size;
  /* image parts as chat takes them (the count is of the rendered prompt: one placeholder per
   * image) */
  lim.max_images = kiln_engine_max_images(eng);
  lim.max_image_bytes = s->opt.max_image_bytes;
  lim.allow_remote_images = s->opt.allow_remote_images; /* accepted, not fetched */
  kiln_api_request_t *r = NULL;
  kiln_api_error_t err;
  if (!kiln_api_parse(route == R_TOKENIZE ? KILN_API_TOKENIZE : KILN_API_DETOKENIZE,
                      kiln_strbuf_cstr(body), body->len, &lim, &r, &err))
    return respond_error(c, s, &err);
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_status_t st = NULL;
  enum MHD_Result ret;
  if (route == R_DETOKENIZE) {
    char *text = NULL;
    st = kiln_engine_detokenize(eng, r->tokens, (size_t)r->num_tokens, false, &text);
    if (!st) {
      kiln_strbuf_append_str(&sb, "{\"prompt\": ");
      kiln_json_write_string(&sb, text, strlen(text), false);
      kiln_strbuf_append_str(&sb, "}");
    }
    free(text);
  } else {
    char *prompt = NULL;
    size_t plen = 0;
    if (r->messages_json && !tools_prepare(s, eng, r, &err)) {
      kiln_api_request_free(r);
      return respond_error(c, s, &err);
    }
    if (r->messages_json) {
      kiln_chat_args_t a = {
          r->messages_json,        r->messages_len,        r->tools_json,           r->tools_len,
          r->template_kwargs_json, r->template_kwargs_len, r->add_generation_prompt};
      st = kiln_engine_apply_chat_template(eng, &a, &prompt, &plen);
    }
    int32_t *ids = NULL, nids = 0;
    if (!st)
      st = kiln_engine_tokenize(eng, prompt ? prompt : r->prompts[0].text,
                                prompt ? plen : r->prompts[0].text_len, r->add_special_tokens, &ids,
                                &nids);
    if (!st) {
      kiln_strbuf_printf(&sb, "{\"count\": %d, \"max_model_len\": %lld, \"tokens\": [", nids,
                         (long long)info.max_model_len);
      for (int32_t i = 0; i < nids; i++) kiln_strbuf_printf(&sb, i ? ", %d" : "%d", ids[i]);
      kiln_strbuf_append_str(&sb, "]}");
    }
    free(ids);
    free(prompt);
  }
  if (st) {
    kiln_api_error_set(&err, kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY ? 500 : 400,
                       "invalid_request_error", route == R_DETOKENIZE ? "tokens" : NULL, "%s",
                       kiln_status_message(st));
    kiln_status_free(st);
    kiln_strbuf_free(&sb);
    ret = respond_error(c, s, &err);
  } else {
    ret = respond_json(c, s, 200, &sb);
  }
  kiln_api_request_free(r);
  return ret;
}

static int conn_fd(struct MHD_Connection *c) {
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
  return ci ? ci->connect_fd : -1;
}

static enum MHD_Result serve_generate(struct MHD_Connection *c, kiln_server_t *s, conn_t *cn,
                                      kiln_engine_t *eng) {
  kiln_api_limits_t lim;
  kiln_api_limits_default(&lim);
  kiln_engine_info_t info;
  kiln_engine_get_info(eng, &info);
  lim.vocab_size = info.vocab_size;
  lim.max_n = info.max_num_seqs;
  lim.max_images = kiln_engine_max_images(eng);
  lim.max_image_bytes = s->opt.max_image_bytes;
  lim.allow_remote_images = s->opt.allow_remote_images;
  kiln_api_request_t *r = NULL;
  kiln_api_error_t err;
  const kiln_api_kind_t kind = cn->route == R_CHAT ? KILN_API_CHAT : KILN_API_COMPLETIONS;
  if (!kiln_api_parse(kind, kiln_strbuf_cstr(&cn->body), cn->body.len, &lim, &r, &err))
    return respond_error(c, s, &err);
  if (r->model && strcmp(r->model, s->model_name) != 0) {
    kiln_api_error_set(&err, 404, "not_found_error", "model",
                       "The model `%.200s` does not exist. This server serves `%.200s`.", r->model,
                       s->model_name);
    kiln_api_request_free(r);
    return respond_error(c, s, &err);
  }
  job_t *j = job_create(s, eng, cn->route, r, conn_fd(c), &err);
  if (!j) return respond_error(c, s, &err);
  if (j->req->stream) {
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024,
                                                                  stream_reader, j, stream_free);
    if (!resp) {
      job_free(j);
      return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    j->status = 200;
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp); /* stream_free runs when the connection is done with it */
    stats_add(s, 200);
    return ret;
  }
  /* not streaming: wait here (this is the connection's own thread) */
  while (j->ndone < j->nreq) job_pump(j, WAIT_SLICE_MS);
  job_sum_usage(j);
  enum MHD_Result ret;
  if (j->gone) {
    j->status = 499; /* the client closed the connection; nothing to send */
    ret = MHD_NO;
  } else if (job_error(j, &err)) {
    j->status = err.status;
    ret = respond_error(c, s, &err);
  } else {
    for (int32_t ci = 0; ci < j->nchoices; ci++) job_echo(j, ci);
    kiln_strbuf_t sb = KILN_STRBUF_INIT;
    if (job_error(j, &err)) {
      j->status = err.status;
      ret = respond_error(c, s, &err);
    } else {
      kiln_api_write_response(&sb, &j->resp, j->choices, j->nchoices);
      j->status = 200;
      ret = respond_json(c, s, 200, &sb);
    }
  }
  job_log(j);
  cn->job = j; /* freed when the connection completes */
  return ret;
}

/* ---- libmicrohttpd callbacks ------------------------------------------------------------------
 */

static bool authorized(struct MHD_Connection *c, kiln_server_t *s) {
  if (!s->api_key || !s->api_key[0]) return true;
  const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
  if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
  h += 7;
  while (*h == ' ') h++;
  return secret_equal(h, s->api_key);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *data,
                                  size_t *data_size, void **con_cls) {
  kiln_server_t *s = cls;
  (void)version;
  conn_t *cn = *con_cls;
  if (!cn) {
    if (!(cn = calloc(1, sizeof(*cn)))) return MHD_NO;
    cn->s = s;
    cn->t_start = now_s();
    *con_cls = cn;
    bool get_ok, post_ok;
    cn->route = route_of(url, &get_ok, &post_ok);
    if (cn->route == R_NONE && (cn->asset = page_of(url))) {
      cn->route = R_PAGE;
      get_ok = true;
    }
    bool is_get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    cn->is_post = !strcmp(method, "POST");
    cn->responded = true;
    if (cn->route == R_NONE)
      return respond_errorf(c, s, 404, "not_found_error", NULL, "no route for this path");
    if ((get_ok && !is_get) || (post_ok && !cn->is_post)) {
      kiln_api_error_t e;
      kiln_api_error_set(&e, 405, "invalid_request_error", NULL,
                         "method %s is not allowed here; use %s", method, get_ok ? "GET" : "POST");
      kiln_strbuf_t sb = KILN_STRBUF_INIT;
      kiln_api_write_error(&sb, &e);
      size_t len;
      char *body = kiln_strbuf_detach(&sb, &len);
      if (!body) return MHD_NO;
      struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
      if (!r) {
        free(body);
        return MHD_NO;
      }
      MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
      MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, get_ok ? "GET, HEAD" : "POST");
      enum MHD_Result ret = MHD_queue_response(c, 405, r);
      MHD_destroy_response(r);
      stats_add(s, 405);
      return ret;
    }
    /* the page itself is public: it asks for the key when the API refuses it */
    bool needs_key = cn->route != R_HEALTH && cn->route != R_VERSION && cn->route != R_METRICS &&
                     cn->route != R_PAGE;
    if (needs_key && !authorized(c, s))
      return respond_errorf(c, s, 401, "authentication_error", NULL,
                            "invalid or missing API key: send 'Authorization: Bearer <key>'");
    if (cn->is_post) {
      const char *cl =
          MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
      if (cl && strtoull(cl, NULL, 10) > s->opt.max_body_bytes) {
        kiln_api_error_t e;
        kiln_api_error_set(&e, 413, "invalid_request_error", NULL,
                           "the request body has %s bytes, more than the server's limit of %zu", cl,
                           s->opt.max_body_bytes);
        return respond_error(c, s, &e);
      }
    }
    cn->responded = false;
    return MHD_YES;
  }
  if (cn->responded) {
    *data_size = 0; /* a response is queued already: drop the rest of the body */
    return MHD_YES;
  }
  if (*data_size) {
    /* libmicrohttpd takes a response only before the body (the first call) or after all of it
     * (the last call): one queued in between is refused and the client gets no answer at all.
     * So a body that outgrows the limit with no Content-Length (chunked) is read on and
     * dropped, and its 413 goes out once the body is in; the same for out-of-memory. */
    if (!cn->too_large && !cn->oom) {
      if (cn->body.len + *data_size > s->opt.max_body_bytes) {
        cn->too_large = true;
        kiln_strbuf_free(&cn->body);
      } else if (!kiln_strbuf_append(&cn->body, data, *data_size)) {
        cn->oom = true;
        kiln_strbuf_free(&cn->body);
      }
    }
    *data_size = 0;
    return MHD_YES;
  }
  /* the whole body is in */
  cn->responded = true;
  if (cn->oom)
    return respond_errorf(c, s, 500, "server_error", NULL, "out of memory reading the body");
  if (cn->too_large) {
    kiln_api_error_t e;
    kiln_api_error_set(&e, 413, "invalid_request_error", NULL,
                       "the request body is larger than the server's limit of %zu bytes",
                       s->opt.max_body_bytes);
    return respond_error(c, s, &e);
  }
  if (cn->route == R_PAGE) return serve_page(c, s, cn->asset);
  kiln_engine_t *eng = atomic_load(&s->eng);
  if (!cn->is_post) return serve_get(c, s, cn->route, eng);
  if (!eng)
    return respond_errorf(c, s, 503, "server_busy", NULL,
                          "the model is loading; try again shortly");
  if (atomic_load(&s->draining))
    return respond_errorf(c, s, 503, "server_busy", NULL, "the server is shutting down");
  if (cn->route == R_TOKENIZE || cn->route == R_DETOKENIZE)
    return serve_tokenize(c, s, cn->route, eng, &cn->body);
  return serve_generate(c, s, cn, eng);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode why) {
  (void)cls;
  (void)c;
  (void)why;
  conn_t *cn = *con_cls;
  if (!cn) return;
  job_free(cn->job);
  kiln_strbuf_free(&cn->body);
  free(cn);
  *con_cls = NULL;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));
static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  char msg[512];
  vsnprintf(msg, sizeof(msg), fmt, ap);
  size_t n = strlen(msg);
  while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = 0;
  KILN_LOG_D("http: %s", msg);
}

/* ---- the server -------------------------------------------------------------------------------
 */

kiln_status_t kiln_server_start(const kiln_server_options_t *opt, kiln_server_t **out_server) {
  *out_server = NULL;
  kiln_server_t *s = calloc(1, sizeof(*s));
  if (!s) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "server: out of memory");
  s->opt = *opt;
  s->host = strdup(opt->host && opt->host[0] ? opt->host : "127.0.0.1");
  s->api_key = strdup(opt->api_key ? opt->api_key : "");
  s->model_name = strdup(opt->model_name ? opt->model_name : "model");
  s->version = strdup(opt->version ? opt->version : "0");
  s->tool_parser = strdup(opt->tool_parser && opt->tool_parser[0] ? opt->tool_parser : "auto");
  s->created = (int64_t)time(NULL);
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->idle_cv, NULL);
  atomic_init(&s->eng, NULL);
  atomic_init(&s->draining, false);
  atomic_init(&s->abort_all, false);
  atomic_init(&s->stopped, false);
  if (!s->host || !s->api_key || !s->model_name || !s->version || !s->tool_parser) {
    kiln_server_free(s);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "server: out of memory");
  }
  if (!s->opt.max_body_bytes) s->opt.max_body_bytes = 32u << 20;
  if (!s->opt.max_image_bytes) s->opt.max_image_bytes = (size_t)20 << 20;
  if (!(s->opt.image_fetch_timeout > 0)) s->opt.image_fetch_timeout = 10;
  if (s->opt.allow_remote_images) curl_global_init(CURL_GLOBAL_DEFAULT); /* before any thread */

  char port[16];
  snprintf(port, sizeof(port), "%d", opt->port);
  struct addrinfo hints, *ai = NULL;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  int gai = getaddrinfo(s->host, port, &hints, &ai);
  if (gai) {
    kiln_status_t st = kiln_status_make(KILN_ERR_IO, "server: cannot resolve host '%s': %s",
                                        s->host, gai_strerror(gai));
    kiln_server_free(s);
    return st;
  }
  unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                   MHD_USE_ITC | MHD_USE_ERROR_LOG;
  if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
  unsigned max_conn = opt->max_connections > 0 ? (unsigned)opt->max_connections : 1024;
  s->daemon = MHD_start_daemon(
      flags, (uint16_t)opt->port, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
      MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_CONNECTION_LIMIT, max_conn,
      MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120, MHD_OPTION_LISTENING_ADDRESS_REUSE, (unsigned)1,
      MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, NULL, MHD_OPTION_THREAD_STACK_SIZE,
      (size_t)(1u << 20), MHD_OPTION_END);
  freeaddrinfo(ai);
  if (!s->daemon) {
    int e = errno;
    kiln_status_t st =
        kiln_status_make(KILN_ERR_IO, "server: cannot listen on %s:%d: %s", s->host, opt->port,
                         e ? strerror(e) : "libmicrohttpd failed to start");
    kiln_server_free(s);
    return st;
  }
  const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_LISTEN_FD);
  s->port = opt->port;
  if (di) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getsockname(di->listen_fd, (struct sockaddr *)&ss, &sl) == 0) {
      if (ss.ss_family == AF_INET) s->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
      if (ss.ss_family == AF_INET6) s->port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
  }
  *out_server = s;
  return NULL;
}

int kiln_server_port(const kiln_server_t *s) { return s->port; }

void kiln_server_attach(kiln_server_t *s, kiln_engine_t *eng) { atomic_store(&s->eng, eng); }

void kiln_server_get_stats(kiln_server_t *s, kiln_server_stats_t *out) {
  pthread_mutex_lock(&s->mu);
  *out = s->stats;
  pthread_mutex_unlock(&s->mu);
}

/* Waits until no API request runs or the time passes; true when idle. */
static bool wait_idle(kiln_server_t *s, double seconds) {
  double end = now_s() + seconds;
  pthread_mutex_lock(&s->mu);
  while (s->stats.in_flight > 0 && now_s() < end) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 50 * 1000000L;
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(&s->idle_cv, &s->mu, &ts);
  }
  bool idle = s->stats.in_flight == 0;
  pthread_mutex_unlock(&s->mu);
  return idle;
}

void kiln_server_shutdown(kiln_server_t *s) {
  if (!s || atomic_exchange(&s->stopped, true)) return;
  atomic_store(&s->draining, true);
  if (!s->daemon) return;
  /* stop accepting: in-flight connections keep running */
  MHD_socket lfd = MHD_quiesce_daemon(s->daemon);
  if (lfd != MHD_INVALID_SOCKET) close(lfd);
  if (!wait_idle(s, s->opt.shutdown_timeout)) {
    KILN_LOG_W("shutdown: %lld request(s) still running after %g s; cancelling them",
               (long long)s->stats.in_flight, s->opt.shutdown_timeout);
    atomic_store(&s->abort_all, true);
    wait_idle(s, 5.0);
  }
  MHD_stop_daemon(s->daemon);
  s->daemon = NULL;
}

void kiln_server_free(kiln_server_t *s) {
  if (!s) return;
  kiln_server_shutdown(s);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->idle_cv);
  free(s->host);
  free(s->api_key);
  free(s->model_name);
  free(s->version);
  free(s->tool_parser);
  free(s);
}
