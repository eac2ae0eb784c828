/* test_metrics.c - cmocka tests for core/engine/metrics: histogram buckets and quantiles, and the
 * Prometheus text, parsed back line by line. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/engine/metrics.h"

/* ---- histograms ---------------------------------------------------------------------------- */

static void test_observe_edges(void **state) {
  (void)state;
  static const double b[] = {1, 2, 4};
  kiln_histogram_t h;
  kiln_histogram_init(&h, b, 3);
  assert_int_equal(h.num_bounds, 3);
  assert_int_equal(h.count, 0);
  kiln_histogram_observe(&h, 1.0); /* equal to a bound: that bucket */
  kiln_histogram_observe(&h, 0.0);
  kiln_histogram_observe(&h, -3.0);
  kiln_histogram_observe(&h, -INFINITY);
  assert_int_equal(h.counts[0], 4);
  kiln_histogram_observe(&h, nextafter(1.0, 2.0)); /* just above: the next one */
  kiln_histogram_observe(&h, 2.0);
  assert_int_equal(h.counts[1], 2);
  kiln_histogram_observe(&h, 4.0);
  assert_int_equal(h.counts[2], 1);
  kiln_histogram_observe(&h, nextafter(4.0, 5.0)); /* above the last bound: +Inf */
  kiln_histogram_observe(&h, 1e300);
  assert_int_equal(h.counts[3], 2);
  assert_int_equal(h.count, 9);
  double sum = h.sum;
  kiln_histogram_observe(&h, NAN); /* ignored */
  kiln_histogram_observe(&h, -NAN);
  assert_int_equal(h.count, 9);
  assert_true(sum == h.sum);
  uint64_t total = 0;
  for (int i = 0; i <= h.num_bounds; i++) total += h.counts[i];
  assert_int_equal(total, h.count);

  /* No bounds: everything is +Inf. Re-init zeroes. */
  kiln_histogram_init(&h, NULL, 0);
  kiln_histogram_observe(&h, 3);
  assert_int_equal(h.counts[0], 1);
  kiln_histogram_init(&h, b, 3);
  assert_int_equal(h.count, 0);
  assert_true(h.sum == 0);
  for (int i = 0; i <= 3; i++) assert_int_equal(h.counts[i], 0);
}

static void test_sum(void **state) {
  (void)state;
  static const double b[] = {0.5, 1.5};
  kiln_histogram_t h;
  kiln_histogram_init(&h, b, 2);
  kiln_histogram_observe(&h, 0.25);
  kiln_histogram_observe(&h, 1.0);
  kiln_histogram_observe(&h, 10.0);
  assert_true(fabs(h.sum - 11.25) < 1e-12);
}

static void test_quantile(void **state) {
  (void)state;
  static const double b[] = {1, 2, 4};
  kiln_histogram_t h;
  kiln_histogram_init(&h, b, 3);
  assert_true(kiln_histogram_quantile(&h, 0.5) == 0.0); /* empty */
  kiln_histogram_observe(&h, 0.5);
  kiln_histogram_observe(&h, 1.5);
  kiln_histogram_observe(&h, 1.5);
  kiln_histogram_observe(&h, 3.0);
  /* counts [1, 2, 1, 0]: rank q*4, linear inside the bucket, first bucket from 0. */
  assert_true(fabs(kiln_histogram_quantile(&h, 0.25) - 1.0) < 1e-12);
  assert_true(fabs(kiln_histogram_quantile(&h, 0.5) - 1.5) < 1e-12);
  assert_true(fabs(kiln_histogram_quantile(&h, 0.75) - 2.0) < 1e-12);
  assert_true(fabs(kiln_histogram_quantile(&h, 0.875) - 3.0) < 1e-12);
  assert_true(fabs(kiln_histogram_quantile(&h, 1.0) - 4.0) < 1e-12);
  assert_true(fabs(kiln_histogram_quantile(&h, 0.125) - 0.5) < 1e-12);
  assert_true(kiln_histogram_quantile(&h, 0.0) == 0.0); /* start of the first bucket */
  /* Clamped outside [0, 1]; NaN in, NaN out. */
  assert_true(kiln_histogram_quantile(&h, 2.0) == kiln_histogram_quantile(&h, 1.0));
  assert_true(kiln_histogram_quantile(&h, -1.0) == kiln_histogram_quantile(&h, 0.0));
  assert_true(isnan(kiln_histogram_quantile(&h, NAN)));
  /* Monotone in q. */
  double prev = -1;
  for (int i = 0; i <= 100; i++) {
    double v = kiln_histogram_quantile(&h, i / 100.0);
    assert_true(v >= prev);
    prev = v;
  }
  /* Ranks in the +Inf bucket give the highest finite bound. */
  for (int i = 0; i < 4; i++) kiln_histogram_observe(&h, 100.0);
  assert_true(kiln_histogram_quantile(&h, 0.99) == 4.0);
  assert_true(fabs(kiln_histogram_quantile(&h, 0.5) - 4.0) < 1e-12); /* rank 4: end of [2,4] */

  /* Uniform data on a fine grid: the median lands near the true one. */
  static const double fine[] = {10, 20, 30, 40, 50, 60, 70, 80, 90, 100};
  kiln_histogram_init(&h, fine, 10);
  for (int i = 1; i <= 1000; i++) kiln_histogram_observe(&h, i / 10.0);
  assert_true(fabs(kiln_histogram_quantile(&h, 0.5) - 50.0) < 0.2);
  assert_true(fabs(kiln_histogram_quantile(&h, 0.9) - 90.0) < 0.2);

  /* A first bound <= 0 is returned as is. */
  static const double neg[] = {-1, 0, 1};
  kiln_histogram_init(&h, neg, 3);
  kiln_histogram_observe(&h, -5);
  assert_true(kiln_histogram_quantile(&h, 0.5) == -1.0);
}

static void check_bounds(const kiln_histogram_t *h, double first, double last) {
  assert_true(h->num_bounds >= 2 && h->num_bounds <= KILN_HIST_MAX_BUCKETS);
  assert_true(h->bounds[0] == first);
  assert_true(h->bounds[h->num_bounds - 1] == last);
  for (int i = 1; i < h->num_bounds; i++) assert_true(h->bounds[i] > h->bounds[i - 1]);
  assert_int_equal(h->count, 0);
}

static void test_metrics_init(void **state) {
  (void)state;
  kiln_metrics_t m;
  memset(&m, 0xab, sizeof(m));
  kiln_metrics_init(&m);
  assert_int_equal(m.requests_running, 0);
  assert_int_equal(m.steps, 0);
  assert_true(m.kv_usage == 0);
  check_bounds(&m.time_to_first_token, 0.001, 1200.0);
  check_bounds(&m.queue_time, 0.001, 1200.0);
  check_bounds(&m.e2e_latency, 0.001, 1200.0);
  check_bounds(&m.inter_token_latency, 0.001, 80.0);
  check_bounds(&m.tokens_per_step, 1.0, 16384.0);
}

/* ---- Prometheus text, parsed back -------------------------------------------------------- */

#define MAX_FAMILIES 64

typedef struct family {
  char name[128];
  char type[16];
  int help, types, samples;
  /* histograms */
  double last_le;
  double last_bucket;
  double inf_bucket;
  int have_inf, have_sum, have_count;
  double count;
} family_t;

typedef struct parsed {
  family_t fam[MAX_FAMILIES];
  int n;
} parsed_t;

static family_t *find_family(parsed_t *p, const char *name) {
  for (int i = 0; i < p->n; i++)
    if (strcmp(p->fam[i].name, name) == 0) return &p->fam[i];
  return NULL;
}

static family_t *add_family(parsed_t *p, const char *name) {
  family_t *f = find_family(p, name);
  if (f) return f;
  assert_true(p->n < MAX_FAMILIES);
  f = &p->fam[p->n++];
  memset(f, 0, sizeof(*f));
  assert_true(strlen(name) < sizeof(f->name));
  strcpy(f->name, name);
  f->last_le = -INFINITY;
  return f;
}

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), m = strlen(suffix);
  return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* The family a sample name belongs to: itself, or a histogram's base name. */
static family_t *family_of(parsed_t *p, const char *name, const char **suffix) {
  *suffix = "";
  family_t *f = find_family(p, name);
  if (f) return f;
  static const char *const sfx[] = {"_bucket", "_sum", "_count"};
  for (int i = 0; i < 3; i++) {
    if (!ends_with(name, sfx[i])) continue;
    char base[128];
    size_t n = strlen(name) - strlen(sfx[i]);
    assert_true(n < sizeof(base));
    memcpy(base, name, n);
    base[n] = 0;
    f = find_family(p, base);
    if (f && strcmp(f->type, "histogram") == 0) {
      *suffix = sfx[i];
      return f;
    }
  }
  return NULL;
}

static bool valid_name(const char *s) {
  if (!*s) return false;
  for (const char *c = s; *c; c++) {
    bool ok = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || *c == '_' || *c == ':' ||
              (c > s && *c >= '0' && *c <= '9');
    if (!ok) return false;
  }
  return true;
}

static double parse_value(const char *s) {
  if (strcmp(s, "+Inf") == 0) return INFINITY;
  if (strcmp(s, "-Inf") == 0) return -INFINITY;
  if (strcmp(s, "NaN") == 0) return NAN;
  char *end;
  double v = strtod(s, &end);
  if (*end || end == s) fail_msg("bad value '%s'", s);
  return v;
}

/* Parses one sample line; checks model_name, collects histogram facts. */
static void parse_sample(parsed_t *p, const char *line, const char *model) {
  char name[128], labels[8][2][256];
  int nl = 0;
  const char *c = line;
  size_t n = strcspn(c, "{ ");
  assert_true(n < sizeof(name));
  memcpy(name, c, n);
  name[n] = 0;
  if (!valid_name(name)) fail_msg("bad metric name in: %s", line);
  assert_true(strncmp(name, "kiln:", 5) == 0);
  c += n;
  if (*c == '{') {
    c++;
    while (*c != '}') {
      assert_true(nl < 8);
      size_t k = strcspn(c, "=");
      assert_true(k > 0 && k < 256 && c[k] == '=' && c[k + 1] == '"');
      memcpy(labels[nl][0], c, k);
      labels[nl][0][k] = 0;
      c += k + 2;
      size_t o = 0;
      for (; *c != '"'; c++) {
        if (!*c || *c == '\n') fail_msg("unterminated label value: %s", line);
        char ch = *c;
        if (ch == '\\') {
          c++;
          if (*c == 'n')
            ch = '\n';
          else if (*c == '\\' || *c == '"')
            ch = *c;
          else
            fail_msg("bad escape in: %s", line);
        }
        assert_true(o < 255);
        labels[nl][1][o++] = ch;
      }
      labels[nl][1][o] = 0;
      c++;
      nl++;
      if (*c == ',') c++;
    }
    c++;
  }
  if (*c != ' ') fail_msg("no value in: %s", line);
  double v = parse_value(c + 1);

  const char *suffix;
  family_t *f = family_of(p, name, &suffix);
  if (!f) fail_msg("sample before its # TYPE: %s", line);
  if (!f->types || !f->help) fail_msg("sample before its # HELP/# TYPE: %s", line);
  f->samples++;
  const char *mn = NULL, *le = NULL;
  for (int i = 0; i < nl; i++) {
    if (strcmp(labels[i][0], "model_name") == 0) mn = labels[i][1];
    if (strcmp(labels[i][0], "le") == 0) le = labels[i][1];
  }
  if (!mn) fail_msg("no model_name on: %s", line);
  assert_string_equal(mn, model);
  if (strcmp(f->type, "counter") == 0 || strcmp(f->type, "gauge") == 0) {
    assert_null(le);
    if (strcmp(f->type, "counter") == 0) assert_true(v >= 0);
    return;
  }
  if (strcmp(suffix, "_bucket") == 0) {
    assert_non_null(le);
    assert_false(f->have_inf); /* +Inf is the last bucket */
    double bound = parse_value(le);
    assert_true(bound > f->last_le);  /* ascending bounds */
    assert_true(v >= f->last_bucket); /* cumulative: monotone */
    f->last_le = bound;
    f->last_bucket = v;
    if (isinf(bound)) f->have_inf = 1, f->inf_bucket = v;
  } else if (strcmp(suffix, "_sum") == 0) {
    assert_true(f->have_inf);
    f->have_sum = 1;
  } else if (strcmp(suffix, "_count") == 0) {
    assert_true(f->have_inf);
    f->have_count = 1;
    f->count = v;
    assert_true(f->count == f->inf_bucket);
  } else {
    fail_msg("histogram sample without a suffix: %s", line);
  }
}

static void parse_text(parsed_t *p, const char *text, const char *model) {
  memset(p, 0, sizeof(*p));
  assert_true(*text);
  assert_true(text[strlen(text) - 1] == '\n');
  const char *line = text;
  while (*line) {
    const char *nlp = strchr(line, '\n');
    assert_non_null(nlp);
    size_t len = (size_t)(nlp - line);
    char *l = malloc(len + 1);
    assert_non_null(l);
    memcpy(l, line, len);
    l[len] = 0;
    assert_true(len > 0);
    if (strncmp(l, "# HELP ", 7) == 0 || strncmp(l, "# TYPE ", 7) == 0) {
      char name[128];
      const char *rest = l + 7;
      size_t n = strcspn(rest, " ");
      assert_true(n > 0 && n < sizeof(name) && rest[n] == ' ' && rest[n + 1]);
      memcpy(name, rest, n);
      name[n] = 0;
      assert_true(valid_name(name));
      family_t *f = add_family(p, name);
      if (l[2] == 'H') {
        f->help++;
      } else {
        f->types++;
        assert_true(strlen(rest + n + 1) < sizeof(f->type));
        strcpy(f->type, rest + n + 1);
        assert_true(strcmp(f->type, "counter") == 0 || strcmp(f->type, "gauge") == 0 ||
                    strcmp(f->type, "histogram") == 0);
        if (strcmp(f->type, "counter") == 0) assert_true(ends_with(name, "_total"));
      }
    } else {
      assert_true(l[0] != '#');
      parse_sample(p, l, model);
    }
    free(l);
    line = nlp + 1;
  }
  for (int i = 0; i < p->n; i++) {
    family_t *f = &p->fam[i];
    if (f->types != 1 || f->help != 1)
      fail_msg("%s: %d # TYPE and %d # HELP lines", f->name, f->types, f->help);
    assert_true(f->samples > 0);
    if (strcmp(f->type, "histogram") == 0) assert_true(f->have_inf && f->have_sum && f->have_count);
  }
}

/* The value of the sample whose line starts with prefix (name plus labels up to the value). */
static double sample_value(const char *text, const char *prefix) {
  const char *s = text;
  size_t n = strlen(prefix);
  while ((s = strstr(s, prefix)) != NULL) {
    if ((s == text || s[-1] == '\n')) {
      const char *e = strchr(s, '\n');
      const char *sp = e;
      while (sp > s && sp[-1] != ' ') sp--;
      char buf[64];
      size_t m = (size_t)(e - sp);
      assert_true(m < sizeof(buf));
      memcpy(buf, sp, m);
      buf[m] = 0;
      return parse_value(buf);
    }
    s += n;
  }
  fail_msg("no sample starting with %s", prefix);
  return 0;
}

static void test_prometheus(void **state) {
  (void)state;
  kiln_metrics_t m;
  kiln_metrics_init(&m);
  m.requests_running = 3;
  m.requests_waiting = 7;
  m.kv_blocks_total = 1000;
  m.kv_blocks_used = 250;
  m.kv_usage = 0.25;
  m.kv_waste = 0.0625;
  m.requests_submitted = 20;
  m.requests_rejected = 2;
  m.requests_finished[KILN_FINISH_STOP] = 5;
  m.requests_finished[KILN_FINISH_LENGTH] = 4;
  m.requests_finished[KILN_FINISH_ABORT] = 1;
  m.requests_finished[KILN_FINISH_ERROR] = 6;
  m.prompt_tokens = 12345;
  m.generation_tokens = 678;
  m.prefix_cache_queries = 1000;
  m.prefix_cache_hits = 300;
  m.preemptions = 9;
  m.steps = 4242;
  m.spec_drafts = 10;
  m.spec_draft_tokens = 40;
  m.spec_accepted_tokens = 30;
  m.spec_draft_seconds = 1.5;
  m.warmup_requests = 6;
  m.warmup_seconds = 0.5;
  m.guide_precompute_jobs = 3;
  m.guide_precompute_states = 777;
  m.graph_replays = 50;
  m.graph_multi_replays = 51;
  m.eager_forwards = 52;
  m.draft_graph_replays = 53;
  m.draft_eager_forwards = 54;
  for (int i = 0; i < 100; i++) {
    kiln_histogram_observe(&m.time_to_first_token, 0.003 * i);
    kiln_histogram_observe(&m.inter_token_latency, 0.0007 * i);
    kiln_histogram_observe(&m.e2e_latency, 0.5 * i);
    kiln_histogram_observe(&m.queue_time, 0.0001 * i);
    kiln_histogram_observe(&m.tokens_per_step, i * 100);
  }
  kiln_histogram_observe(&m.e2e_latency, 5000); /* above the last bound */

  const char *model = "we\"ird\\name\nline two";
  char *text = kiln_metrics_prometheus(&m, model);
  assert_non_null(text);
  parsed_t *p = malloc(sizeof(*p));
  assert_non_null(p);
  parse_text(p, text, model);

  static const struct {
    const char *name, *type;
  } want[] = {
      {"kiln:num_requests_running", "gauge"},
      {"kiln:num_requests_waiting", "gauge"},
      {"kiln:kv_cache_usage_perc", "gauge"},
      {"kiln:kv_cache_waste_perc", "gauge"},
      {"kiln:prefix_cache_queries_total", "counter"},
      {"kiln:prefix_cache_hits_total", "counter"},
      {"kiln:num_preemptions_total", "counter"},
      {"kiln:prompt_tokens_total", "counter"},
      {"kiln:generation_tokens_total", "counter"},
      {"kiln:request_success_total", "counter"},
      {"kiln:requests_rejected_total", "counter"},
      {"kiln:engine_steps_total", "counter"},
      {"kiln:spec_decode_num_drafts_total", "counter"},
      {"kiln:spec_decode_num_draft_tokens_total", "counter"},
      {"kiln:spec_decode_num_accepted_tokens_total", "counter"},
      {"kiln:spec_decode_draft_seconds_total", "counter"},
      {"kiln:spec_decode_draft_acceptance_rate", "gauge"},
      {"kiln:spec_decode_mean_acceptance_length", "gauge"},
      {"kiln:warmup_requests", "gauge"},
      {"kiln:warmup_seconds", "gauge"},
      {"kiln:guide_precompute_jobs_total", "counter"},
      {"kiln:guide_precompute_states_total", "counter"},
      {"kiln:model_forwards_total", "counter"},
      {"kiln:time_to_first_token_seconds", "histogram"},
      {"kiln:inter_token_latency_seconds", "histogram"},
      {"kiln:e2e_request_latency_seconds", "histogram"},
      {"kiln:request_queue_time_seconds", "histogram"},
      {"kiln:iteration_tokens_total", "histogram"},
  };
  for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
    family_t *f = find_family(p, want[i].name);
    if (!f) fail_msg("missing %s", want[i].name);
    assert_string_equal(f->type, want[i].type);
  }
  assert_int_equal(find_family(p, "kiln:request_success_total")->samples, 4);
  assert_true(find_family(p, "kiln:e2e_request_latency_seconds")->count == 101);
  assert_true(find_family(p, "kiln:iteration_tokens_total")->count == 100);

  /* The values, read back. */
  const char *lbl = "{model_name=\"we\\\"ird\\\\name\\nline two\"";
  char key[256];
#define VALUE(metric, extra) \
  (snprintf(key, sizeof(key), "kiln:%s%s%s}", metric, lbl, extra), sample_value(text, key))
  assert_true(VALUE("num_requests_running", "") == 3);
  assert_true(VALUE("num_requests_waiting", "") == 7);
  assert_true(VALUE("kv_cache_usage_perc", "") == 0.25);
  assert_true(VALUE("kv_cache_waste_perc", "") == 0.0625);
  assert_true(VALUE("prompt_tokens_total", "") == 12345);
  assert_true(VALUE("warmup_requests", "") == 6);
  assert_true(VALUE("warmup_seconds", "") == 0.5);
  assert_true(VALUE("guide_precompute_jobs_total", "") == 3);
  assert_true(VALUE("guide_precompute_states_total", "") == 777);
  assert_int_equal(find_family(p, "kiln:model_forwards_total")->samples, 5);
  assert_true(VALUE("model_forwards_total", ",model=\"target\",launch=\"graph\"") == 50);
  assert_true(VALUE("model_forwards_total", ",model=\"target\",launch=\"graph_multi\"") == 51);
  assert_true(VALUE("model_forwards_total", ",model=\"target\",launch=\"eager\"") == 52);
  assert_true(VALUE("model_forwards_total", ",model=\"draft\",launch=\"graph\"") == 53);
  assert_true(VALUE("model_forwards_total", ",model=\"draft\",launch=\"eager\"") == 54);
  assert_true(VALUE("generation_tokens_total", "") == 678);
  assert_true(VALUE("prefix_cache_queries_total", "") == 1000);
  assert_true(VALUE("prefix_cache_hits_total", "") == 300);
  assert_true(VALUE("num_preemptions_total", "") == 9);
  assert_true(VALUE("requests_rejected_total", "") == 2);
  assert_true(VALUE("engine_steps_total", "") == 4242);
  assert_true(VALUE("spec_decode_num_drafts_total", "") == 10);
  assert_true(VALUE("spec_decode_num_draft_tokens_total", "") == 40);
  assert_true(VALUE("spec_decode_num_accepted_tokens_total", "") == 30);
  assert_true(VALUE("spec_decode_draft_seconds_total", "") == 1.5);
  assert_true(VALUE("spec_decode_draft_acceptance_rate", "") == 0.75);
  assert_true(VALUE("spec_decode_mean_acceptance_length", "") == 4.0);
  assert_true(VALUE("request_success_total", ",finished_reason=\"stop\"") == 5);
  assert_true(VALUE("request_success_total", ",finished_reason=\"length\"") == 4);
  assert_true(VALUE("request_success_total", ",finished_reason=\"abort\"") == 1);
  assert_true(VALUE("request_success_total", ",finished_reason=\"error\"") == 6);
  assert_true(VALUE("e2e_request_latency_seconds_count", "") == 101);
  assert_true(VALUE("e2e_request_latency_seconds_bucket", ",le=\"+Inf\"") == 101);
  assert_true(VALUE("e2e_request_latency_seconds_bucket", ",le=\"1200\"") == 100);
  assert_true(VALUE("time_to_first_token_seconds_bucket", ",le=\"0.001\"") == 1);
  assert_true(VALUE("iteration_tokens_total_bucket", ",le=\"16384\"") == 100);
  assert_true(fabs(VALUE("e2e_request_latency_seconds_sum", "") - (0.5 * 4950 + 5000)) < 1e-9);
  assert_true(fabs(VALUE("time_to_first_token_seconds_sum", "") - 0.003 * 4950) < 1e-9);
#undef VALUE
  /* Bounds print as the shortest exact decimal. */
  assert_non_null(strstr(text, "le=\"0.0025\""));
  assert_null(strstr(text, "0.0010000"));
  free(text);

  /* NULL and empty model names give model_name="". */
  text = kiln_metrics_prometheus(&m, NULL);
  assert_non_null(text);
  parse_text(p, text, "");
  assert_non_null(strstr(text, "kiln:num_requests_running{model_name=\"\"} 3\n"));
  free(text);

  /* All-zero metrics are valid too. */
  kiln_metrics_init(&m);
  text = kiln_metrics_prometheus(&m, "m");
  assert_non_null(text);
  parse_text(p, text, "m");
  assert_non_null(strstr(text, "kiln:engine_steps_total{model_name=\"m\"} 0\n"));
  assert_non_null(strstr(text, "kiln:spec_decode_draft_acceptance_rate{model_name=\"m\"} 0\n"));
  free(text);
  free(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_observe_edges), cmocka_unit_test(test_sum),
      cmocka_unit_test(test_quantile),      cmocka_unit_test(test_metrics_init),
      cmocka_unit_test(test_prometheus),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
