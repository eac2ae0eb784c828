/* bench_guide.c - constrained decoding's costs on one thread: the vocabulary index, schema
 * compilation, and the token mask per step, over a corpus of JSON Schemas.
 *
 * Usage: kiln-bench-guide TOKENIZER_DIR SCHEMA_DIR [STEPS] [SEED]
 * Each schema is compiled, then walked for up to STEPS tokens (default 200) twice: the first walk
 * meets every grammar context for the first time (its masks include classifying tokens for
 * contexts no earlier schema had), the second repeats the schema (what a server sees when an
 * application sends the same schema again), with other random choices. The walk picks a random
 * allowed token, one that closes or separates JSON (" } ] , :) one time in three, so walks leave
 * strings and finish. Prints per-step mask times (p50, p90, p99, max) for both passes, the
 * compile times, and the classification cache's size. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/guide/guide.h"

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static uint64_t g_rng;
static uint32_t rnd(uint32_t n) {
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(g_rng >> 33) % (n ? n : 1);
}

typedef struct times {
  double *v;
  size_t n, cap;
} times_t;

static void push(times_t *t, double x) {
  if (t->n == t->cap) {
    t->cap = t->cap ? t->cap * 2 : 4096;
    t->v = realloc(t->v, t->cap * sizeof(double));
    if (!t->v) exit(3);
  }
  t->v[t->n++] = x;
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void report(const char *what, times_t *t, const char *unit) {
  if (!t->n) return;
  qsort(t->v, t->n, sizeof(double), cmpd);
  double sum = 0;
  for (size_t i = 0; i < t->n; i++) sum += t->v[i];
  printf("%-34s n=%-7zu p50 %8.1f  p90 %8.1f  p99 %8.1f  max %9.1f  mean %8.1f %s\n", what, t->n,
         t->v[t->n / 2], t->v[t->n * 9 / 10], t->v[t->n * 99 / 100], t->v[t->n - 1],
         sum / (double)t->n, unit);
}

static char *read_all(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) kiln_strbuf_append(&b, buf, n);
  fclose(f);
  return kiln_strbuf_ok(&b) ? kiln_strbuf_detach(&b, len) : NULL;
}

static bool structural(const uint8_t *b, size_t l) {
  for (size_t i = 0; i < l; i++)
    if (b[i] == '"' || b[i] == '}' || b[i] == ']' || b[i] == ',' || b[i] == ':') return true;
  return false;
}

/* One walk: masks timed into t; returns the tokens taken. */
/* Steps of both walks split by whether they classified a context (a cache miss) or not. */
static times_t g_missed, g_cached;

static int walk(kiln_guide_vocab_t *v, kiln_guide_t *g, int steps, uint32_t *mask, int32_t *cand,
                times_t *t, int *finished) {
  const int32_t V = kiln_guide_vocab_size(v);
  kiln_guide_matcher_t *m = NULL;
  if (kiln_guide_matcher_create(g, &m)) exit(3);
  int s;
  for (s = 0; s < steps; s++) {
    kiln_guide_stats_t s0, s1;
    kiln_guide_vocab_stats(v, &s0);
    double a = now_us();
    kiln_status_t st = kiln_guide_matcher_fill_mask(m, mask);
    double dt = now_us() - a;
    push(t, dt);
    kiln_guide_vocab_stats(v, &s1);
    push(s1.classified > s0.classified ? &g_missed : &g_cached, dt);
    if (st) {
      fprintf(stderr, "kiln-bench-guide: %s\n", kiln_status_message(st));
      exit(1);
    }
    int32_t n = 0, ns = 0;
    for (int32_t w = 0; w * 32 < V; w++)
      for (uint32_t bits = mask[w]; bits; bits &= bits - 1)
        cand[n++] = w * 32 + __builtin_ctz(bits);
    if (kiln_guide_matcher_accepting(m) && (n == 0 || rnd(3) == 0)) {
      (*finished)++;
      break;
    }
    if (!n) break;
    int32_t tok = cand[rnd((uint32_t)n)];
    if (rnd(3) == 0) { /* towards structure */
      for (int32_t i = 0; i < n; i++) {
        size_t l;
        const uint8_t *b = kiln_guide_vocab_token(v, cand[i], &l);
        if (b && structural(b, l)) cand[ns++] = cand[i];
      }
      if (ns) tok = cand[rnd((uint32_t)ns)];
    }
    if (!kiln_guide_matcher_accept_token(m, tok)) {
      fprintf(stderr, "kiln-bench-guide: a token of the mask was refused\n");
      exit(1);
    }
  }
  kiln_guide_matcher_free(m);
  return s;
}

/* KILN_BENCH_PRECOMPUTE=DELAY_MS: after compiling, kiln_guide_precompute runs on a thread
 * (budget KILN_BENCH_PRECOMPUTE_BUDGET_MS, default 200 ms; at most 4096 states) while the
 * bench waits DELAY_MS (the request's prefill) before its first step. */
typedef struct pc_job {
  kiln_guide_t *g;
  int64_t budget_us;
  atomic_bool stop;
} pc_job_t;
static void *pc_run(void *p) {
  pc_job_t *j = p;
  kiln_status_t st = kiln_guide_precompute(j->g, 4096, j->budget_us, &j->stop, NULL);
  if (st) {
    fprintf(stderr, "kiln-bench-guide: %s\n", kiln_status_message(st));
    exit(1);
  }
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s TOKENIZER_DIR SCHEMA_DIR [STEPS] [SEED]\n", argv[0]);
    return 2;
  }
  int steps = argc > 3 ? atoi(argv[3]) : 200;
  g_rng = argc > 4 ? strtoull(argv[4], NULL, 10) : 1;
  kiln_tokenizer_t *tok = NULL;
  kiln_status_t st = kiln_tokenizer_load(argv[1], &tok);
  if (st) {
    fprintf(stderr, "kiln-bench-guide: %s\n", kiln_status_message(st));
    return 1;
  }
  const int32_t V = (int32_t)kiln_tokenizer_vocab_size(tok);
  double a = now_us();
  kiln_guide_vocab_t *v = NULL;
  if ((st = kiln_guide_vocab_create(tok, V, &v))) {
    fprintf(stderr, "kiln-bench-guide: %s\n", kiln_status_message(st));
    return 1;
  }
  printf("vocabulary: %d tokens indexed in %.1f ms\n", (int)V, (now_us() - a) / 1e3);
  DIR *d = opendir(argv[2]);
  if (!d) {
    fprintf(stderr, "kiln-bench-guide: cannot open %s\n", argv[2]);
    return 1;
  }
  char **files = NULL;
  size_t nf = 0;
  for (struct dirent *de; (de = readdir(d));) {
    size_t l = strlen(de->d_name);
    if (l < 6 || strcmp(de->d_name + l - 5, ".json")) continue;
    files = realloc(files, (nf + 1) * sizeof(char *));
    files[nf] = malloc(strlen(argv[2]) + l + 2);
    sprintf(files[nf++], "%s/%s", argv[2], de->d_name);
  }
  closedir(d);
  uint32_t *mask = malloc((size_t)kiln_guide_mask_words(v) * 4);
  int32_t *cand = malloc((size_t)V * sizeof(int32_t));
  times_t compile = {0}, cold = {0}, warm = {0}, first = {0};
  int fin1 = 0, fin2 = 0;
  long tokens = 0;
  for (int pass = 0; pass < 2; pass++)
    for (size_t i = 0; i < nf; i++) {
      size_t len;
      char *text = read_all(files[i], &len);
      if (!text) continue;
      a = now_us();
      kiln_guide_t *g = NULL;
      st = kiln_guide_compile(v, KILN_GUIDE_JSON_SCHEMA, text, len, &g);
      if (pass == 0) push(&compile, now_us() - a);
      free(text);
      if (st) {
        fprintf(stderr, "%s: %s\n", files[i], kiln_status_message(st));
        kiln_status_free(st);
        continue;
      }
      times_t *t = pass ? &warm : &cold;
      size_t before = t->n;
      const char *pcs = getenv("KILN_BENCH_PRECOMPUTE");
      const char *pcb = getenv("KILN_BENCH_PRECOMPUTE_BUDGET_MS");
      pc_job_t job = {.g = g, .budget_us = (int64_t)((pcb ? atof(pcb) : 200.0) * 1e3)};
      atomic_init(&job.stop, false);
      pthread_t th;
      if (pcs) {
        if (pthread_create(&th, NULL, pc_run, &job)) exit(3);
        double delay = atof(pcs) * 1e3;
        struct timespec ts = {(time_t)(delay / 1e6), (long)((long long)delay % 1000000) * 1000};
        nanosleep(&ts, NULL);
      }
      tokens += walk(v, g, steps, mask, cand, t, pass ? &fin2 : &fin1);
      if (pcs) {
        atomic_store(&job.stop, true);
        pthread_join(th, NULL);
      }
      if (pass == 0 && t->n > before) push(&first, t->v[before]);
      kiln_guide_release(g);
    }
  printf("%zu schemas, %ld tokens; walks that reached the end: %d + %d of %zu + %zu\n", nf, tokens,
         fin1, fin2, nf, nf);
  report("compile (schema to grammar)", &compile, "us");
  report("mask, first walk of each schema", &cold, "us");
  report("  of which the first step", &first, "us");
  report("mask, the schema again", &warm, "us");
  times_t all = {0};
  for (size_t i = 0; i < cold.n; i++) push(&all, cold.v[i]);
  for (size_t i = 0; i < warm.n; i++) push(&all, warm.v[i]);
  report("mask, both walks", &all, "us");
  report("  steps that classified a context", &g_missed, "us");
  report("  steps served by the cache", &g_cached, "us");
  kiln_guide_stats_t s;
  kiln_guide_vocab_stats(v, &s);
  printf("classification cache: %llu contexts classified (%llu of them bounded-repetition links "
         "walked over their longer tokens only), %llu found cached (%llu links taken whole from "
         "the unbounded rule), %.1f MiB\n",
         (unsigned long long)s.classified, (unsigned long long)s.derived,
         (unsigned long long)s.class_hits, (unsigned long long)s.derived_same,
         (double)s.class_bytes / 1048576.0);
  kiln_guide_vocab_free(v);
  kiln_tokenizer_free(tok);
  for (size_t i = 0; i < nf; i++) free(files[i]);
  free(files);
  free(mask);
  free(cand);
  free(compile.v);
  free(cold.v);
  free(warm.v);
  free(first.v);
  free(all.v);
  return 0;
}
