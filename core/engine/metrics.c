/* engine/metrics.c - histograms and the Prometheus text exposition of kiln_metrics_t.
 *
 * The exposition follows the text format 0.0.4 and vLLM's metric names (prefix "kiln:" for
 * "vllm:"), so dashboards built for one read the other: counters end in _total, durations are
 * in seconds, fractions are 0..1 (kv_cache_usage_perc = 1 means full, as in vLLM). Every sample
 * carries model_name="..." and each family has one # HELP and one # TYPE line.
 */
#include "core/engine/metrics.h"

#include <assert.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/strbuf.h"

/* Upper bounds (the +Inf bucket is implicit). Latencies: 1 ms to 20 min, denser where
 * interactive serving lives (tens of ms to a few s). Inter-token: 1 ms to 80 s. Tokens per
 * step: powers of two, 1 to 16384. */
static const double latency_bounds[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08,  0.1,
                                        0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,   10.0,
                                        20.0,  40.0,  80.0, 160.0, 320.0, 640.0, 1200.0};
static const double itl_bounds[] = {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                                    0.04,  0.05,   0.075, 0.1,    0.15, 0.2,   0.3,  0.5,
                                    0.75,  1.0,    2.5,   5.0,    10.0, 20.0,  40.0, 80.0};
static const double step_token_bounds[] = {1,   2,   4,    8,    16,   32,   64,   128,
                                           256, 512, 1024, 2048, 4096, 8192, 16384};

#define NBOUNDS(a) ((int32_t)(sizeof(a) / sizeof((a)[0])))

_Static_assert(sizeof(latency_bounds) / sizeof(double) <= KILN_HIST_MAX_BUCKETS, "too many");
_Static_assert(sizeof(itl_bounds) / sizeof(double) <= KILN_HIST_MAX_BUCKETS, "too many");
_Static_assert(sizeof(step_token_bounds) / sizeof(double) <= KILN_HIST_MAX_BUCKETS, "too many");

void kiln_histogram_init(kiln_histogram_t *h, const double *bounds, int32_t num_bounds) {
  assert(num_bounds >= 0 && num_bounds <= KILN_HIST_MAX_BUCKETS);
  memset(h, 0, sizeof(*h));
  if (num_bounds < 0) num_bounds = 0;
  if (num_bounds > KILN_HIST_MAX_BUCKETS) num_bounds = KILN_HIST_MAX_BUCKETS;
  for (int32_t i = 0; i < num_bounds; i++) {
    assert(i == 0 || bounds[i] > bounds[i - 1]);
    h->bounds[i] = bounds[i];
  }
  h->num_bounds = num_bounds;
}

void kiln_metrics_init(kiln_metrics_t *m) {
  memset(m, 0, sizeof(*m));
  kiln_histogram_init(&m->time_to_first_token, latency_bounds, NBOUNDS(latency_bounds));
  kiln_histogram_init(&m->queue_time, latency_bounds, NBOUNDS(latency_bounds));
  kiln_histogram_init(&m->e2e_latency, latency_bounds, NBOUNDS(latency_bounds));
  kiln_histogram_init(&m->inter_token_latency, itl_bounds, NBOUNDS(itl_bounds));
  kiln_histogram_init(&m->tokens_per_step, step_token_bounds, NBOUNDS(step_token_bounds));
}

void kiln_histogram_observe(kiln_histogram_t *h, double v) {
  if (isnan(v)) return;
  /* Binary search for the first bound >= v; num_bounds when v is above them all. */
  int32_t lo = 0, hi = h->num_bounds;
  while (lo < hi) {
    int32_t mid = lo + (hi - lo) / 2;
    if (h->bounds[mid] >= v)
      hi = mid;
    else
      lo = mid + 1;
  }
  h->counts[lo]++;
  h->count++;
  h->sum += v;
}

/* As PromQL's histogram_quantile (bucketQuantile): the rank q*count falls in the first bucket
 * whose cumulative count reaches it, and the value is interpolated linearly between that
 * bucket's lower and upper bound; the lowest bucket starts at 0 (unless its bound is <= 0,
 * then that bound is the answer), and a rank in the +Inf bucket gives the highest finite
 * bound. Empty buckets are skipped so that q = 0 lands on the first observation's bucket.
 * q outside [0, 1] is clamped; a NaN q gives NaN. */
double kiln_histogram_quantile(const kiln_histogram_t *h, double q) {
  if (h->count == 0) return 0.0;
  if (isnan(q)) return q;
  if (q < 0) q = 0;
  if (q > 1) q = 1;
  double rank = q * (double)h->count;
  uint64_t below = 0; /* observations in the buckets before b */
  int32_t b = 0;
  for (; b < h->num_bounds; b++) {
    if (h->counts[b] > 0 && (double)(below + h->counts[b]) >= rank) break;
    below += h->counts[b];
  }
  if (b == h->num_bounds) return h->num_bounds ? h->bounds[h->num_bounds - 1] : 0.0;
  if (b == 0 && h->bounds[0] <= 0) return h->bounds[0];
  double start = b > 0 ? h->bounds[b - 1] : 0.0;
  double end = h->bounds[b];
  return start + (end - start) * ((rank - (double)below) / (double)h->counts[b]);
}

/* ---- Prometheus text format ------------------------------------------------------------ */

/* A float as Prometheus writes it: the shortest %g that reads back exactly, or NaN, +Inf,
 * -Inf. */
static void put_double(kiln_strbuf_t *b, double v) {
  if (isnan(v)) {
    kiln_strbuf_append_str(b, "NaN");
    return;
  }
  if (isinf(v)) {
    kiln_strbuf_append_str(b, v > 0 ? "+Inf" : "-Inf");
    return;
  }
  char s[32];
  for (int prec = 6; prec <= 17; prec++) {
    snprintf(s, sizeof(s), "%.*g", prec, v);
    if (strtod(s, NULL) == v) break;
  }
  kiln_strbuf_append_str(b, s);
}

/* A label value with \, " and newline escaped (the only escapes the format has). */
static void put_label_value(kiln_strbuf_t *b, const char *s) {
  for (; *s; s++) {
    switch (*s) {
      case '\\': kiln_strbuf_append_str(b, "\\\\"); break;
      case '"': kiln_strbuf_append_str(b, "\\\""); break;
      case '\n': kiln_strbuf_append_str(b, "\\n"); break;
      default: kiln_strbuf_append_char(b, *s);
    }
  }
}

typedef struct prom {
  kiln_strbuf_t buf;
  const char *model; /* model_name label value, unescaped */
} prom_t;

static void family(prom_t *p, const char *name, const char *type, const char *help) {
  kiln_strbuf_printf(&p->buf, "# HELP kiln:%s %s\n# TYPE kiln:%s %s\n", name, help, name, type);
}

/* Starts a sample line: "kiln:NAME{model_name="..."" (the caller closes the braces). */
static void sample_start(prom_t *p, const char *name) {
  kiln_strbuf_printf(&p->buf, "kiln:%s{model_name=\"", name);
  put_label_value(&p->buf, p->model);
  kiln_strbuf_append_char(&p->buf, '"');
}

static void gauge(prom_t *p, const char *name, const char *help, double v) {
  family(p, name, "gauge", help);
  sample_start(p, name);
  kiln_strbuf_append_str(&p->buf, "} ");
  put_double(&p->buf, v);
  kiln_strbuf_append_char(&p->buf, '\n');
}

static void counter(prom_t *p, const char *name, const char *help, uint64_t v) {
  family(p, name, "counter", help);
  sample_start(p, name);
  kiln_strbuf_printf(&p->buf, "} %" PRIu64 "\n", v);
}

static void counter_f(prom_t *p, const char *name, const char *help, double v) {
  family(p, name, "counter", help);
  sample_start(p, name);
  kiln_strbuf_append_str(&p->buf, "} ");
  put_double(&p->buf, v);
  kiln_strbuf_append_char(&p->buf, '\n');
}

static void histogram(prom_t *p, const char *name, const char *help, const kiln_histogram_t *h) {
  char sub[128];
  family(p, name, "histogram", help);
  snprintf(sub, sizeof(sub), "%s_bucket", name);
  uint64_t cum = 0;
  for (int32_t i = 0; i <= h->num_bounds; i++) {
    cum += h->counts[i];
    sample_start(p, sub);
    kiln_strbuf_append_str(&p->buf, ",le=\"");
    if (i < h->num_bounds)
      put_double(&p->buf, h->bounds[i]);
    else
      kiln_strbuf_append_str(&p->buf, "+Inf");
    kiln_strbuf_printf(&p->buf, "\"} %" PRIu64 "\n", cum);
  }
  snprintf(sub, sizeof(sub), "%s_sum", name);
  sample_start(p, sub);
  kiln_strbuf_append_str(&p->buf, "} ");
  put_double(&p->buf, h->sum);
  kiln_strbuf_append_char(&p->buf, '\n');
  /* _count is the +Inf bucket by construction (h->count could only differ if a caller edited
   * the counts by hand; the format requires them equal). */
  snprintf(sub, sizeof(sub), "%s_count", name);
  sample_start(p, sub);
  kiln_strbuf_printf(&p->buf, "} %" PRIu64 "\n", cum);
}

char *kiln_metrics_prometheus(const kiln_metrics_t *m, const char *model_name) {
  /* By kiln_finish_reason_t, STOP..ERROR. */
  static const char *const reasons[] = {NULL, "stop", "length", "abort", "error"};
  prom_t p = {KILN_STRBUF_INIT, model_name ? model_name : ""};
  if (!kiln_strbuf_reserve(&p.buf, 8192)) return NULL;

  gauge(&p, "num_requests_running", "Number of requests in the running set.",
        (double)m->requests_running);
  gauge(&p, "num_requests_waiting", "Number of requests waiting to run (queued or preempted).",
        (double)m->requests_waiting);
  gauge(&p, "kv_cache_usage_perc", "KV-cache usage: used blocks / total blocks (1 = full).",
        m->kv_usage);
  gauge(&p, "kv_cache_waste_perc",
        "Allocated but unused KV-cache token slots / allocated slots (0..1).", m->kv_waste);
  gauge(&p, "kv_cache_num_blocks", "KV-cache blocks in the pool.", (double)m->kv_blocks_total);
  gauge(&p, "kv_cache_used_blocks", "KV-cache blocks referenced by a sequence.",
        (double)m->kv_blocks_used);
  if (m->kv_block_size > 0) { /* set by an engine (0 in a hand-made struct) */
    gauge(&p, "kv_cache_capacity_tokens", "Tokens the KV-cache pool holds (blocks x block size).",
          (double)(m->kv_blocks_total * m->kv_block_size));
    gauge(&p, "kv_cache_bytes_per_token", "Bytes of KV cache one token takes over all layers.",
          (double)m->kv_bytes_per_token);
    family(&p, "cache_config_info", "gauge", "The KV cache's configuration, in the labels.");
    sample_start(&p, "cache_config_info");
    kiln_strbuf_printf(&p.buf, ",block_size=\"%lld\",cache_dtype=\"", (long long)m->kv_block_size);
    put_label_value(&p.buf, m->kv_cache_dtype ? m->kv_cache_dtype : "");
    kiln_strbuf_append_str(&p.buf, "\"} 1\n");
  }

  counter(&p, "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
          m->prefix_cache_queries);
  counter(&p, "prefix_cache_hits_total", "Prompt tokens served from the prefix cache.",
          m->prefix_cache_hits);
  counter(&p, "num_preemptions_total", "Cumulative number of preemptions.", m->preemptions);
  counter(&p, "prompt_tokens_total", "Number of prompt tokens processed.", m->prompt_tokens);
  counter(&p, "generation_tokens_total", "Number of generated tokens.", m->generation_tokens);
  counter(&p, "requests_submitted_total", "Requests accepted by the engine.",
          m->requests_submitted);
  counter(&p, "requests_rejected_total", "Requests refused at submission.", m->requests_rejected);

  family(&p, "request_success_total", "counter", "Finished requests, by finish reason.");
  for (int r = 1; r <= 4; r++) {
    sample_start(&p, "request_success_total");
    kiln_strbuf_printf(&p.buf, ",finished_reason=\"%s\"} %" PRIu64 "\n", reasons[r],
                       m->requests_finished[r]);
  }

  counter(&p, "engine_steps_total", "Engine steps (model forward passes).", m->steps);

  /* speculative decoding (vLLM's spec_decode_* names) */
  counter(&p, "spec_decode_num_drafts_total",
          "Speculative verifications: a sequence's step that checked proposed tokens.",
          m->spec_drafts);
  counter(&p, "spec_decode_num_draft_tokens_total", "Tokens proposed by speculative decoding.",
          m->spec_draft_tokens);
  counter(&p, "spec_decode_num_accepted_tokens_total",
          "Proposed tokens accepted (the tokens the model itself chose).", m->spec_accepted_tokens);
  counter_f(&p, "spec_decode_draft_seconds_total",
            "Seconds spent running the draft model (speculative method = draft).",
            m->spec_draft_seconds);
  gauge(&p, "spec_decode_draft_acceptance_rate",
        "Accepted / proposed tokens since start (0 when nothing was proposed).",
        m->spec_draft_tokens ? (double)m->spec_accepted_tokens / (double)m->spec_draft_tokens
                             : 0.0);
  gauge(&p, "spec_decode_mean_acceptance_length",
        "Tokens per speculative verification, the model's own next token included: 1 + "
        "accepted / verifications (0 when none).",
        m->spec_drafts ? 1.0 + (double)m->spec_accepted_tokens / (double)m->spec_drafts : 0.0);

  gauge(&p, "warmup_requests",
        "Dummy requests run at start-up so that the first real one does not pay for kernel "
        "loading and GEMM algorithm choice ([engine] warmup).",
        (double)m->warmup_requests);
  gauge(&p, "warmup_seconds", "Seconds the start-up warm-up took.", m->warmup_seconds);

  counter(&p, "guide_precompute_jobs_total",
          "Compiled constraints whose first contexts were classified ahead of their first step "
          "([engine] guide_precompute_ms).",
          m->guide_precompute_jobs);
  counter(&p, "guide_precompute_states_total", "Matcher states those precomputations covered.",
          m->guide_precompute_states);

  family(&p, "model_forwards_total", "counter",
         "Forward passes by model (target, draft) and launch: a decode graph (one token per "
         "sequence), a multi-token decode graph (speculative verification) or eager.");
  const struct {
    const char *model, *launch;
    uint64_t v;
  } fw[] = {{"target", "graph", m->graph_replays},
            {"target", "graph_multi", m->graph_multi_replays},
            {"target", "eager", m->eager_forwards},
            {"draft", "graph", m->draft_graph_replays},
            {"draft", "eager", m->draft_eager_forwards}};
  for (size_t i = 0; i < sizeof(fw) / sizeof(fw[0]); i++) {
    sample_start(&p, "model_forwards_total");
    kiln_strbuf_printf(&p.buf, ",model=\"%s\",launch=\"%s\"} %" PRIu64 "\n", fw[i].model,
                       fw[i].launch, fw[i].v);
  }

  histogram(&p, "time_to_first_token_seconds", "Time to first token in seconds.",
            &m->time_to_first_token);
  histogram(&p, "inter_token_latency_seconds", "Time between successive output tokens in seconds.",
            &m->inter_token_latency);
  histogram(&p, "e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            &m->e2e_latency);
  histogram(&p, "request_queue_time_seconds", "Time spent waiting before the first schedule.",
            &m->queue_time);
  histogram(&p, "iteration_tokens_total", "Tokens processed per engine step.", &m->tokens_per_step);

  if (!kiln_strbuf_ok(&p.buf)) {
    kiln_strbuf_free(&p.buf);
    return NULL;
  }
  return kiln_strbuf_detach(&p.buf, NULL);
}
