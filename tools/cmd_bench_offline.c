/* cmd_bench_offline.c - `kiln bench latency` and `kiln bench throughput`: the engine measured
 * in-process through the public API (no HTTP), like vLLM's benchmark_latency/throughput.
 *
 * latency:    --batch-size B requests of --input-len random tokens each generate exactly
 *             --output-len tokens (ignore_eos, greedy), --num-iters times after --warmup runs.
 *             Each iteration has fresh prompts, so the prefix cache never helps. Reported: the
 *             end-to-end time of an iteration, time to first token (the prefill of the batch)
 *             and time per output token after the first (a decode step), as mean and
 *             percentiles.
 * throughput: --num-prompts requests (random, or --dataset FILE.jsonl with "prompt" or
 *             "prompt_ids" and optional "max_tokens") submitted at once; reported: requests/s,
 *             output tokens/s, total tokens/s over the wall time from the first submission to
 *             the last completion, plus TTFT and end-to-end percentiles.
 * Both print a table and, with --json FILE, the same numbers as a JSON object, including the
 * start-up time (engine creation: load, KV sizing, graph capture when captured at start). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "cli_images.h"
#include "cmd_bench.h"
#include "base/json.h"
#include "base/strbuf.h"
#include "kiln/kiln.h"

typedef struct off_args {
  const char *model, *dtype, *quantization, *dataset, *json, *ids;
  int64_t input_len, output_len, batch, iters, warmup, num_prompts, seed;
  kiln_opt_list_t images;          /* latency: --image paths (borrowed from argv) */
  const char *regex, *json_schema; /* a constraint on every request (--regex, --json-schema) */
} off_args_t;

/* The constraint every request of the run carries (KILN_GUIDE_NONE: none). */
static kiln_guide_kind_t off_guide;
static const char *off_guide_spec;

/* One request's timeline, written by the engine thread's callback. */
typedef struct off_req {
  struct off_run *run;
  double t_submit, t_accepted, t_first, t_end;
  int32_t prompt_len, out_tokens;
  bool failed;
  char error[160];
} off_req_t;

typedef struct off_run {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int64_t pending;
} off_run_t;

static void off_on_output(void *user, const kiln_output_t *o) {
  off_req_t *r = user;
  double t = kiln_cli_now();
  if (o->num_tokens > 0 && r->t_first == 0) r->t_first = t;
  r->out_tokens += o->num_tokens;
  if (o->finish_reason == KILN_FINISH_ERROR || o->finish_reason == KILN_FINISH_ABORT) {
    r->failed = true;
    snprintf(r->error, sizeof(r->error), "%s",
             o->error ? o->error : kiln_finish_reason_name(o->finish_reason));
  }
  if (o->request_finished) {
    r->t_end = t;
    pthread_mutex_lock(&r->run->mu);
    r->run->pending--;
    pthread_cond_broadcast(&r->run->cv);
    pthread_mutex_unlock(&r->run->mu);
  }
}

static uint64_t off_rand(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Random ids from the middle of the vocabulary (clear of special tokens at either end). */
static void off_prompt(int32_t *ids, int64_t n, int32_t vocab, uint64_t *rng) {
  int32_t lo = vocab / 10, span = vocab - 2 * (vocab / 10);
  if (span < 1) {
    lo = 0;
    span = vocab;
  }
  for (int64_t i = 0; i < n; i++) ids[i] = lo + (int32_t)(off_rand(rng) % (uint64_t)span);
}

typedef kiln_cli_stats_t off_stat_t;

/* Sorts v in place. */
static off_stat_t off_stats(double *v, int64_t n) {
  return kiln_cli_stats(v, (size_t)(n > 0 ? n : 0));
}

static void off_print_stat(const char *name, off_stat_t s, double scale, const char *unit) {
  printf("  %-24s mean %9.3f  p50 %9.3f  p90 %9.3f  p99 %9.3f  (%s)\n", name, s.mean * scale,
         s.p50 * scale, s.p90 * scale, s.p99 * scale, unit);
}

static void off_json_stat(kiln_strbuf_t *j, const char *name, off_stat_t s, double scale) {
  kiln_strbuf_printf(j, ", \"%s\": {\"mean\": %.6g, \"p50\": %.6g, \"p90\": %.6g, \"p99\": %.6g}",
                     name, s.mean * scale, s.p50 * scale, s.p90 * scale, s.p99 * scale);
}

static kiln_status_t off_write_json(const char *path, kiln_strbuf_t *j) {
  if (!path) return NULL;
  if (!kiln_strbuf_ok(j)) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  FILE *f = fopen(path, "w");
  if (!f) return kiln_status_make(KILN_ERR_IO, "bench: cannot write %s", path);
  fwrite(j->data, 1, j->len, f);
  fputc('\n', f);
  if (fclose(f)) return kiln_status_make(KILN_ERR_IO, "bench: cannot write %s", path);
  return NULL;
}

/* Speculative decoding between two metrics snapshots ([speculative] method = ngram): a line of
 * the table and fields of the JSON object; nothing when nothing was proposed. */
static void off_spec_report(const kiln_metrics_t *m0, const kiln_metrics_t *m1, kiln_strbuf_t *j) {
  uint64_t d = m1->spec_drafts - m0->spec_drafts, t = m1->spec_draft_tokens - m0->spec_draft_tokens,
           a = m1->spec_accepted_tokens - m0->spec_accepted_tokens;
  if (!d) return;
  double rate = t ? (double)a / (double)t : 0, len = 1.0 + (double)a / (double)d;
  printf("  speculative decoding     %llu verifications, %llu tokens proposed, %llu accepted "
         "(%.1f%%), mean accepted length %.2f\n",
         (unsigned long long)d, (unsigned long long)t, (unsigned long long)a, 100.0 * rate, len);
  kiln_strbuf_printf(j,
                     ", \"spec_drafts\": %llu, \"spec_draft_tokens\": %llu, "
                     "\"spec_accepted_tokens\": %llu, \"spec_acceptance_rate\": %.4f, "
                     "\"spec_mean_accepted_length\": %.4f",
                     (unsigned long long)d, (unsigned long long)t, (unsigned long long)a, rate, len);
  const double ds = m1->spec_draft_seconds - m0->spec_draft_seconds;
  if (ds > 0) {
    printf("  draft model              %.3f s, %.3f ms per verification\n", ds,
           1e3 * ds / (double)d);
    kiln_strbuf_printf(j, ", \"spec_draft_seconds\": %.6f", ds);
  }
}

/* How the forwards between two metrics snapshots ran (kiln_metrics_t graph_replays...): a line
 * of the table and a "forwards" object in the JSON. */
static void off_forwards_report(const kiln_metrics_t *m0, const kiln_metrics_t *m1,
                                kiln_strbuf_t *j) {
  const uint64_t g = m1->graph_replays - m0->graph_replays,
                 gm = m1->graph_multi_replays - m0->graph_multi_replays,
                 ea = m1->eager_forwards - m0->eager_forwards,
                 dg = m1->draft_graph_replays - m0->draft_graph_replays,
                 de = m1->draft_eager_forwards - m0->draft_eager_forwards;
  if (!g && !gm && !ea && !dg && !de) return;
  printf("  forwards                 %llu decode graphs, %llu multi-token graphs, %llu eager",
         (unsigned long long)g, (unsigned long long)gm, (unsigned long long)ea);
  if (dg || de)
    printf("; draft: %llu graphs, %llu eager", (unsigned long long)dg, (unsigned long long)de);
  printf("\n");
  kiln_strbuf_printf(j,
                     ", \"forwards\": {\"graph\": %llu, \"graph_multi\": %llu, \"eager\": %llu, "
                     "\"draft_graph\": %llu, \"draft_eager\": %llu}",
                     (unsigned long long)g, (unsigned long long)gm, (unsigned long long)ea,
                     (unsigned long long)dg, (unsigned long long)de);
}

/* ---- options: the rows both modes have, then each mode's table ------------------------------- */

#define OFF_ROWS_MODEL                                                      \
  KILN_OPT_STRING("--model", "DIR|ORG/NAME", off_args_t, model,             \
                  "the model: a path or a Hub id (default: [model] path)"), \
      KILN_OPT_STRING("--dtype", "D", off_args_t, dtype,                    \
                      "auto, float32, float16 or bfloat16 (default: [model] dtype)"), \
      KILN_OPT_STRING("--quantization", "Q", off_args_t, quantization,      \
                      "none or fp8: FP8 weights made at load (default:\n"   \
                      "[model] quantization)")
#define OFF_ROWS_SEED_JSON                                                  \
  KILN_OPT_INT("--seed", "S", off_args_t, seed, 0, INT64_MAX,               \
               "seeds the random prompts (default 0)"),                     \
      KILN_OPT_STRING("--json", "FILE", off_args_t, json,                   \
                      "also write the results as one JSON object"),         \
      KILN_OPT_STRING("--regex", "RE", off_args_t, regex,                   \
                      "constrain every output to this regular expression"), \
      KILN_OPT_STRING("--json-schema", "JSON", off_args_t, json_schema,     \
                      "constrain every output to this JSON Schema")

static const char latency_usage[] =
    "usage: kiln bench latency [--model DIR] [--dtype D] [--quantization Q] [--input-len 128]\n"
    "                          [--output-len 256]\n"
    "                          [--batch-size 1] [--num-iters 10] [--warmup 2] [--seed S]\n"
    "                          [--json FILE] [--set section.key=value]...\n"
    "Times --batch-size requests of random prompts generating exactly --output-len tokens\n"
    "(greedy, ignore_eos): end to end, time to first token (the batch's prefill) and time per\n"
    "output token after the first (one decode step). --output-len 1 times a prefill alone.\n"
    "--ids gives the prompt instead (the same for every request; prefix caching is then off\n"
    "unless --set cache.enable_prefix_caching=true), and --image the images its placeholder\n"
    "ids take (vision-language models; one placeholder id per image, as kiln generate --ids).\n"
    "Submission (tokenizing; image decoding and preprocessing) is timed apart and is part of\n"
    "the time to first token. --regex or --json-schema constrains every output (one that can\n"
    "always go on, such as --regex '[a-z ]*', keeps every request running --output-len tokens).\n";

static const kiln_opt_t latency_rows[] = {
    OFF_ROWS_MODEL,
    KILN_OPT_INT("--input-len", "N", off_args_t, input_len, 1, 1 << 30,
                 "prompt tokens per request (default 128)"),
    KILN_OPT_INT("--output-len", "N", off_args_t, output_len, 1, 1 << 30,
                 "tokens each request generates (default 256)"),
    KILN_OPT_INT("--batch-size", "N", off_args_t, batch, 1, 1 << 30,
                 "requests run together (default 1)"),
    KILN_OPT_INT("--num-iters", "N", off_args_t, iters, 1, 1 << 30, "timed runs (default 10)"),
    KILN_OPT_INT("--warmup", "N", off_args_t, warmup, 0, 1 << 30, "untimed runs first (default 2)"),
    KILN_OPT_STRING("--ids", "1,2,3", off_args_t, ids,
                    "the prompt's token ids (instead of --input-len random ones)"),
    KILN_OPT_LIST("--image", "PATH", off_args_t, images,
                  "an image for the prompt's placeholder ids (repeatable; needs --ids)"),
    OFF_ROWS_SEED_JSON,
};

static const kiln_opts_t latency_opts = {
    .cmd = "bench latency",
    .usage = latency_usage,
    .opts = latency_rows,
    .num_opts = KILN_OPTS_COUNT(latency_rows),
    .flags = KILN_OPTS_USAGE_ON_ERROR,
    .common = &kiln_cli_common_opts,
};

static const char throughput_usage[] =
    "usage: kiln bench throughput [--model DIR] [--dtype D] [--quantization Q]\n"
    "                             [--num-prompts 1000] [--input-len 512]\n"
    "                             [--output-len 256] [--dataset FILE.jsonl] [--seed S]\n"
    "                             [--json FILE] [--set section.key=value]...\n"
    "Submits every request at once (random prompts, or --dataset lines with \"prompt\" or\n"
    "\"prompt_ids\" and optional \"max_tokens\") and reports requests/s and tokens/s from the\n"
    "first submission to the last completion. Generation is greedy with ignore_eos.\n";

static const kiln_opt_t throughput_rows[] = {
    OFF_ROWS_MODEL,
    KILN_OPT_INT("--num-prompts", "N", off_args_t, num_prompts, 1, 1 << 30,
                 "random prompts: requests (default 1000; --dataset: a line each)"),
    KILN_OPT_INT("--input-len", "N", off_args_t, input_len, 1, 1 << 30,
                 "random prompts: tokens per prompt (default 512)"),
    KILN_OPT_INT("--output-len", "N", off_args_t, output_len, 1, 1 << 30,
                 "tokens each request generates (default 256; a dataset\n"
                 "line's max_tokens wins)"),
    KILN_OPT_STRING("--dataset", "FILE.jsonl", off_args_t, dataset,
                    "the prompts: \"prompt\" or \"prompt_ids\" per line"),
    KILN_OPT_INT("--warmup", "N", off_args_t, warmup, 0, 1 << 30,
                 "accepted as in latency mode; a throughput run has no warm-up"),
    OFF_ROWS_SEED_JSON,
};

static const kiln_opts_t throughput_opts = {
    .cmd = "bench throughput",
    .usage = throughput_usage,
    .opts = throughput_rows,
    .num_opts = KILN_OPTS_COUNT(throughput_rows),
    .flags = KILN_OPTS_USAGE_ON_ERROR,
    .common = &kiln_cli_common_opts,
};

/* --regex / --json-schema: at most one. */
static kiln_status_t off_guide_args(const off_args_t *a) {
  if (a->regex && a->json_schema)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "bench: --regex and --json-schema exclude each other");
  off_guide = a->regex         ? KILN_GUIDE_REGEX
              : a->json_schema ? KILN_GUIDE_JSON_SCHEMA
                               : KILN_GUIDE_NONE;
  off_guide_spec = a->regex ? a->regex : a->json_schema;
  return NULL;
}

/* Creates the engine: the caller's --set overrides go last, so they win over ours. */
static kiln_status_t off_engine(kiln_cli_t *cli, const off_args_t *a, kiln_engine_t **out,
                                double *out_startup) {
  const char *ov[64];
  char *own[5] = {NULL, NULL, NULL, NULL, NULL};
  int n = 0, no = 0;
  kiln_status_t st = NULL;
  ov[n++] = "server.max_queued_requests=0"; /* an offline batch queues everything at once */
  if (a->model && !(ov[n++] = own[no++] = kiln_strprintf("model.path=%s", a->model))) goto oom;
  if (a->dtype && !(ov[n++] = own[no++] = kiln_strprintf("model.dtype=%s", a->dtype))) goto oom;
  if (a->quantization &&
      !(ov[n++] = own[no++] = kiln_strprintf("model.quantization=%s", a->quantization)))
    goto oom;
  if (a->ids) ov[n++] = "cache.enable_prefix_caching=false"; /* the same prompt every time */
  for (int i = 0; i < cli->num_sets && n < 64; i++) ov[n++] = cli->sets[i];
  double t0 = kiln_cli_now();
  st = kiln_engine_create(cli->config_path, ov, n, out);
  *out_startup = kiln_cli_now() - t0;
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
done:
  for (int i = 0; i < no; i++) free(own[i]);
  return st;
}

/* Submits reqs[i] for prompts[i] with its max_tokens; every request is a greedy ignore_eos run. */
static kiln_status_t off_submit(kiln_engine_t *eng, off_run_t *run, off_req_t *req,
                                int32_t *const *prompts, const int32_t *lens,
                                const int32_t *max_tokens, int64_t n,
                                const kiln_cli_images_t *images) {
  run->pending = n;
  for (int64_t i = 0; i < n; i++) {
    kiln_sampling_params_t sp;
    kiln_sampling_params_init(&sp);
    sp.max_tokens = max_tokens[i];
    sp.temperature = 0;
    sp.ignore_eos = true;
    sp.detokenize = false;
    sp.guide = off_guide;
    sp.guide_spec = off_guide_spec;
    memset(&req[i], 0, sizeof(req[i]));
    req[i].run = run;
    req[i].prompt_len = lens[i];
    kiln_request_desc_t d;
    memset(&d, 0, sizeof(d));
    d.struct_size = sizeof(d);
    d.prompt_ids = prompts[i];
    d.num_prompt_ids = lens[i];
    d.params = &sp;
    d.on_output = off_on_output;
    d.user = &req[i];
    if (images && images->num) {
      d.images = images->images;
      d.num_images = images->num;
    }
    req[i].t_submit = kiln_cli_now();
    kiln_request_t *h = NULL;
    kiln_status_t st = kiln_engine_submit(eng, &d, &h);
    req[i].t_accepted = kiln_cli_now();
    if (st) {
      if (images) st = kiln_cli_images_error(images, st);
      /* the ones already in flight still finish: wait for them before returning */
      pthread_mutex_lock(&run->mu);
      run->pending -= n - i;
      while (run->pending > 0) pthread_cond_wait(&run->cv, &run->mu);
      pthread_mutex_unlock(&run->mu);
      return st;
    }
    kiln_request_release(h);
  }
  pthread_mutex_lock(&run->mu);
  while (run->pending > 0) pthread_cond_wait(&run->cv, &run->mu);
  pthread_mutex_unlock(&run->mu);
  for (int64_t i = 0; i < n; i++)
    if (req[i].failed)
      return kiln_status_make(KILN_ERR_INTERNAL, "bench: request %lld failed: %s", (long long)i,
                              req[i].error);
  return NULL;
}

int kiln_cmd_bench_latency(kiln_cli_t *cli) {
  off_args_t a = {NULL, NULL, NULL, NULL, NULL, NULL, 128, 256, 1, 10, 2, 0, 0, {NULL, 0}, NULL, NULL};
  bool help;
  kiln_status_t st = kiln_opts_parse(&latency_opts, cli->argc, cli->argv, &a, &help);
  if (st) return kiln_cli_fail(st);
  if (help) {
    kiln_opts_free(&latency_opts, &a);
    return 0;
  }
  if ((st = off_guide_args(&a))) {
    kiln_opts_free(&latency_opts, &a);
    return kiln_cli_fail(st);
  }
  kiln_engine_t *eng = NULL;
  double startup = 0;
  int32_t *fixed = NULL; /* --ids */
  size_t nfixed = 0;
  kiln_cli_images_t imgs;
  memset(&imgs, 0, sizeof(imgs));
  if (a.images.n && !a.ids)
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "bench latency: --image needs --ids (a prompt with one image "
                          "placeholder id per image)");
  if (!st && a.ids) st = kiln_cli_parse_ids("bench latency", a.ids, &fixed, &nfixed);
  if (!st) st = kiln_cli_images_read(a.images.v, (int32_t)a.images.n, &imgs);
  if (!st && (st = off_engine(cli, &a, &eng, &startup))) eng = NULL;
  if (!st && a.images.n && kiln_engine_max_images(eng) == 0)
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "bench latency: --image: the model takes text only (it has no vision "
                          "tower)");
  if (st) {
    kiln_engine_destroy(eng);
    free(fixed);
    kiln_cli_images_free(&imgs);
    kiln_opts_free(&latency_opts, &a);
    return kiln_cli_fail(st);
  }
  if (fixed) a.input_len = (int64_t)nfixed;
  kiln_engine_info_t info;
  kiln_engine_get_info(eng, &info);
  const int64_t B = a.batch, runs = a.warmup + a.iters;
  int32_t **prompts = calloc((size_t)B, sizeof(int32_t *));
  int32_t *lens = calloc((size_t)B, sizeof(int32_t)), *mt = calloc((size_t)B, sizeof(int32_t));
  off_req_t *req = calloc((size_t)B, sizeof(off_req_t));
  double *e2e = calloc((size_t)a.iters, sizeof(double)),
         *ttft = calloc((size_t)a.iters, sizeof(double));
  double *tpot = calloc((size_t)a.iters, sizeof(double)),
         *sub = calloc((size_t)a.iters, sizeof(double));
  off_run_t run = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  uint64_t rng = (uint64_t)a.seed * 0x9E3779B97F4A7C15ull + 1;
  kiln_strbuf_t j = KILN_STRBUF_INIT;
  if (!prompts || !lens || !mt || !req || !e2e || !ttft || !tpot || !sub) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    goto done;
  }
  for (int64_t i = 0; i < B; i++) {
    if (!(prompts[i] = malloc((size_t)a.input_len * sizeof(int32_t)))) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
      goto done;
    }
    lens[i] = (int32_t)a.input_len;
    mt[i] = (int32_t)a.output_len;
  }
  fprintf(stderr,
          "bench latency: %s on %s (%s), batch %lld, %lld + %lld tokens, %lld iterations "
          "after %lld warm-up%s%s; start-up %.2f s\n",
          info.model_name, info.backend, info.device, (long long)B, (long long)a.input_len,
          (long long)a.output_len, (long long)a.iters, (long long)a.warmup,
          fixed ? ", the --ids prompt" : "", imgs.num ? " with images" : "", startup);
  kiln_metrics_t m0, m1;
  kiln_engine_get_metrics(eng, &m0);
  for (int64_t it = 0; it < runs; it++) {
    if (it == a.warmup) kiln_engine_get_metrics(eng, &m0); /* the timed runs' counters */
    for (int64_t i = 0; i < B; i++) {
      if (fixed)
        memcpy(prompts[i], fixed, nfixed * sizeof(int32_t));
      else
        off_prompt(prompts[i], a.input_len, info.vocab_size, &rng);
    }
    double t0 = kiln_cli_now();
    if ((st = off_submit(eng, &run, req, prompts, lens, mt, B, &imgs))) goto done;
    double t_end = 0, t_first = 0, t_acc = 0;
    for (int64_t i = 0; i < B; i++) {
      if (req[i].t_end > t_end) t_end = req[i].t_end;
      if (req[i].t_first > t_first) t_first = req[i].t_first; /* the whole batch's prefill */
      t_acc += req[i].t_accepted - req[i].t_submit;
    }
    if (it < a.warmup) continue;
    int64_t k = it - a.warmup;
    e2e[k] = t_end - t0;
    ttft[k] = t_first - t0;
    sub[k] = t_acc / (double)B;
    tpot[k] = a.output_len > 1 ? (t_end - t_first) / (double)(a.output_len - 1) : 0;
  }
  off_stat_t se = off_stats(e2e, a.iters), sf = off_stats(ttft, a.iters),
             sp = off_stats(tpot, a.iters), ss = off_stats(sub, a.iters);
  printf("latency: batch %lld, %lld prompt + %lld output tokens, %lld iterations\n", (long long)B,
         (long long)a.input_len, (long long)a.output_len, (long long)a.iters);
  off_print_stat("end to end", se, 1e3, "ms");
  off_print_stat("time to first token", sf, 1e3, "ms");
  off_print_stat("  of it, submission", ss, 1e3, "ms, per request");
  if (a.output_len > 1) off_print_stat("time per output token", sp, 1e3, "ms");
  printf("  decode throughput        %.1f tokens/s (batch x output / end to end)\n",
         (double)(B * a.output_len) / se.mean);
  kiln_strbuf_printf(
      &j,
      "{\"mode\": \"latency\", \"model\": \"%s\", \"backend\": \"%s\", \"batch_size\": "
      "%lld, \"input_len\": %lld, \"output_len\": %lld, \"iterations\": %lld, "
      "\"startup_s\": %.4f",
      info.model_name, info.backend, (long long)B, (long long)a.input_len, (long long)a.output_len,
      (long long)a.iters, startup);
  off_json_stat(&j, "e2e_ms", se, 1e3);
  off_json_stat(&j, "ttft_ms", sf, 1e3);
  off_json_stat(&j, "tpot_ms", sp, 1e3);
  off_json_stat(&j, "submit_ms", ss, 1e3);
  kiln_strbuf_printf(&j, ", \"images\": %d", imgs.num);
  kiln_engine_get_metrics(eng, &m1);
  off_spec_report(&m0, &m1, &j);
  off_forwards_report(&m0, &m1, &j);
  kiln_strbuf_append_str(&j, "}");
  st = off_write_json(a.json, &j);
done:
  kiln_engine_destroy(eng);
  for (int64_t i = 0; prompts && i < B; i++) free(prompts[i]);
  free(prompts);
  free(lens);
  free(mt);
  free(req);
  free(e2e);
  free(ttft);
  free(tpot);
  free(sub);
  free(fixed);
  kiln_cli_images_free(&imgs);
  kiln_opts_free(&latency_opts, &a);
  kiln_strbuf_free(&j);
  return st ? kiln_cli_fail(st) : 0;
}

/* Reads a dataset: one JSON object per line with "prompt" (text) or "prompt_ids". */
static kiln_status_t off_dataset(kiln_engine_t *eng, const char *path, int64_t default_out,
                                 int32_t ***out_p, int32_t **out_lens, int32_t **out_mt,
                                 int64_t *out_n) {
  FILE *f = fopen(path, "r");
  if (!f) return kiln_status_make(KILN_ERR_NOT_FOUND, "bench: cannot open %s", path);
  char *line = NULL;
  size_t cap = 0;
  int64_t n = 0, alloc = 0, lineno = 0;
  int32_t **p = NULL, *lens = NULL, *mt = NULL;
  kiln_status_t st = NULL;
  ssize_t got;
  while ((got = getline(&line, &cap, f)) >= 0) {
    lineno++;
    if (got <= 1) continue;
    if (n == alloc) {
      alloc = alloc ? 2 * alloc : 256;
      int32_t **np = realloc(p, (size_t)alloc * sizeof(*np));
      if (np) p = np;
      int32_t *nl = realloc(lens, (size_t)alloc * sizeof(*nl));
      if (nl) lens = nl;
      int32_t *nm = realloc(mt, (size_t)alloc * sizeof(*nm));
      if (nm) mt = nm;
      if (!np || !nl || !nm) {
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
        break;
      }
    }
    kiln_json_doc_t *doc = NULL;
    if ((st = kiln_json_parse(line, (size_t)got, path, &doc))) break;
    const kiln_json_t *root = kiln_json_root(doc);
    const kiln_json_t *ids = kiln_json_get(root, "prompt_ids");
    size_t tl;
    const char *text = kiln_json_string(kiln_json_get(root, "prompt"), &tl);
    int64_t m = default_out;
    if (kiln_json_get(root, "max_tokens") &&
        !kiln_json_int64(kiln_json_get(root, "max_tokens"), &m))
      m = -2;
    p[n] = NULL;
    if (kiln_json_is(ids, KILN_JSON_ARRAY) && kiln_json_len(ids) > 0) {
      size_t k = kiln_json_len(ids);
      if ((p[n] = malloc(k * sizeof(int32_t)))) {
        for (size_t i = 0; i < k; i++) {
          int64_t x = -1;
          kiln_json_int64(kiln_json_at(ids, i), &x);
          p[n][i] = (int32_t)x;
        }
        lens[n] = (int32_t)k;
      }
    } else if (text) {
      st = kiln_engine_tokenize(eng, text, tl, true, &p[n], &lens[n]);
    } else {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "bench: %s:%lld: needs \"prompt\" or \"prompt_ids\"", path,
                            (long long)lineno);
    }
    kiln_json_doc_free(doc);
    if (!st && !p[n]) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    if (!st && (m < 1 || m > INT32_MAX))
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "bench: %s:%lld: bad max_tokens", path,
                            (long long)lineno);
    if (st) {
      free(p[n]);
      break;
    }
    mt[n] = (int32_t)m;
    n++;
  }
  free(line);
  fclose(f);
  if (!st && n == 0) st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "bench: %s is empty", path);
  if (st) {
    for (int64_t i = 0; i < n; i++) free(p[i]);
    free(p);
    free(lens);
    free(mt);
    return st;
  }
  *out_p = p;
  *out_lens = lens;
  *out_mt = mt;
  *out_n = n;
  return NULL;
}

int kiln_cmd_bench_throughput(kiln_cli_t *cli) {
  off_args_t a = {NULL, NULL, NULL, NULL, NULL, NULL, 512, 256, 1, 1, 0, 1000, 0, {NULL, 0}, NULL, NULL};
  bool help;
  kiln_status_t st = kiln_opts_parse(&throughput_opts, cli->argc, cli->argv, &a, &help);
  if (st) return kiln_cli_fail(st);
  if (help) return 0;
  if ((st = off_guide_args(&a))) return kiln_cli_fail(st);
  kiln_engine_t *eng = NULL;
  double startup = 0;
  if ((st = off_engine(cli, &a, &eng, &startup))) return kiln_cli_fail(st);
  kiln_engine_info_t info;
  kiln_engine_get_info(eng, &info);
  int32_t **prompts = NULL, *lens = NULL, *mt = NULL;
  off_req_t *req = NULL;
  double *e2e = NULL, *ttft = NULL;
  int64_t N = a.num_prompts;
  off_run_t run = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  kiln_strbuf_t j = KILN_STRBUF_INIT;
  if (a.dataset) {
    if ((st = off_dataset(eng, a.dataset, a.output_len, &prompts, &lens, &mt, &N))) goto done;
  } else {
    prompts = calloc((size_t)N, sizeof(int32_t *));
    lens = calloc((size_t)N, sizeof(int32_t));
    mt = calloc((size_t)N, sizeof(int32_t));
    uint64_t rng = (uint64_t)a.seed * 0x9E3779B97F4A7C15ull + 7;
    for (int64_t i = 0; prompts && lens && mt && i < N; i++) {
      if (!(prompts[i] = malloc((size_t)a.input_len * sizeof(int32_t)))) break;
      off_prompt(prompts[i], a.input_len, info.vocab_size, &rng);
      lens[i] = (int32_t)a.input_len;
      mt[i] = (int32_t)a.output_len;
    }
    if (!prompts || !lens || !mt || !prompts[N - 1]) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
      goto done;
    }
  }
  req = calloc((size_t)N, sizeof(off_req_t));
  e2e = calloc((size_t)N, sizeof(double));
  ttft = calloc((size_t)N, sizeof(double));
  if (!req || !e2e || !ttft) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    goto done;
  }
  fprintf(stderr, "bench throughput: %s on %s (%s), %lld requests; start-up %.2f s\n",
          info.model_name, info.backend, info.device, (long long)N, startup);
  kiln_metrics_t m0, m1;
  kiln_engine_get_metrics(eng, &m0);
  double t0 = kiln_cli_now();
  if ((st = off_submit(eng, &run, req, prompts, lens, mt, N, NULL))) goto done;
  double t_end = 0;
  int64_t in_tok = 0, out_tok = 0;
  for (int64_t i = 0; i < N; i++) {
    if (req[i].t_end > t_end) t_end = req[i].t_end;
    in_tok += req[i].prompt_len;
    out_tok += req[i].out_tokens;
    e2e[i] = req[i].t_end - req[i].t_submit;
    ttft[i] = req[i].t_first > 0 ? req[i].t_first - req[i].t_submit : e2e[i];
  }
  double wall = t_end - t0;
  off_stat_t se = off_stats(e2e, N), sf = off_stats(ttft, N);
  printf("throughput: %lld requests, %lld prompt + %lld output tokens in %.3f s\n", (long long)N,
         (long long)in_tok, (long long)out_tok, wall);
  printf("  %.2f requests/s, %.1f output tokens/s, %.1f total tokens/s\n", (double)N / wall,
         (double)out_tok / wall, (double)(in_tok + out_tok) / wall);
  off_print_stat("time to first token", sf, 1e3, "ms");
  off_print_stat("end to end", se, 1e3, "ms");
  kiln_strbuf_printf(&j,
                     "{\"mode\": \"throughput\", \"model\": \"%s\", \"backend\": \"%s\", "
                     "\"requests\": %lld, \"prompt_tokens\": %lld, \"output_tokens\": %lld, "
                     "\"duration_s\": %.4f, \"requests_per_s\": %.4f, \"output_tokens_per_s\": "
                     "%.2f, \"total_tokens_per_s\": %.2f, \"startup_s\": %.4f",
                     info.model_name, info.backend, (long long)N, (long long)in_tok,
                     (long long)out_tok, wall, (double)N / wall, (double)out_tok / wall,
                     (double)(in_tok + out_tok) / wall, startup);
  off_json_stat(&j, "ttft_ms", sf, 1e3);
  off_json_stat(&j, "e2e_ms", se, 1e3);
  kiln_engine_get_metrics(eng, &m1);
  off_spec_report(&m0, &m1, &j);
  off_forwards_report(&m0, &m1, &j);
  kiln_strbuf_append_str(&j, "}");
  st = off_write_json(a.json, &j);
done:
  kiln_engine_destroy(eng);
  for (int64_t i = 0; prompts && i < N; i++) free(prompts[i]);
  free(prompts);
  free(lens);
  free(mt);
  free(req);
  free(e2e);
  free(ttft);
  kiln_strbuf_free(&j);
  return st ? kiln_cli_fail(st) : 0;
}
