/* cmd_generate.c - `kiln generate`: continues one prompt (streamed to stdout, or one JSON object),
 * or runs a JSONL file of requests through the engine's continuous batching and writes one JSON
 * line per request, in input order. Built on the public API (kiln/kiln.h) only.
 *
 * Batch mode keeps a bounded window of requests in the engine (--max-in-flight): lines are read,
 * parsed and submitted while the window has room, results are collected by the requests'
 * callbacks on the engine thread, and the main thread writes every result whose predecessors are
 * all written. A line that cannot run (bad JSON, a bad field, a parameter the engine rejects, a
 * request that fails while running) gets an {"index", "error"} line in its place. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, getline, isatty, strdup */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "cli_images.h"
#include "base/json.h"
#include "base/status.h"
#include "base/strbuf.h"
#include "kiln/kiln.h"
/* Only to echo a --prompt's token ids (and to fit max_tokens into the context) in single-request
 * mode: kiln.h has no tokenize call. */

#define GEN_DEFAULT_WINDOW 512

typedef struct gen_args {
  const char *model; /* --model, else [model] path */
  const char *dtype;
  const char *quantization; /* --quantization, else [model] quantization */
  const char *ids; /* --ids 1,2,3 */
  const char *prompt;
  const char *input; /* --input FILE.jsonl: batch mode */
  const char *output;
  int64_t max_tokens, min_tokens, chunk, seed, top_k, n, logprobs, window;
  double temperature, top_p, min_p;
  int64_t beam_width;          /* --beam-width (0 = off) */
  double length_penalty;       /* --length-penalty */
  const char *early_stopping;  /* --early-stopping true|false|never */
  kiln_early_stopping_t early; /* parsed */
  bool has_seed, ignore_eos, json, help;
  kiln_opt_list_t stop;   /* --stop values (borrowed from argv) */
  kiln_opt_list_t images; /* --image paths (borrowed from argv) */
  const char *messages;   /* --messages FILE.json */
  /* constrained decoding: at most one of these (a value @FILE reads the file) */
  const char *json_schema, *regex, *grammar;
  kiln_opt_list_t choice;
  bool json_object;
  kiln_guide_kind_t guide;
  char *guide_spec; /* owned */
} gen_args_t;

/* A growable token-id list. */
typedef struct gen_ids {
  int32_t *v;
  size_t len, cap;
  bool oom;
} gen_ids_t;

/* One sequence's results. */
typedef struct gen_seq {
  gen_ids_t ids;
  kiln_strbuf_t text;
  kiln_strbuf_t lp; /* the logprobs entries, comma-separated JSON objects */
  kiln_finish_reason_t finish;
  double cum_logprob, beam_score; /* beam search's */
} gen_seq_t;

struct gen_batch;

/* One request (one input line, or the single request). */
typedef struct gen_job {
  struct gen_batch *batch;
  int64_t index; /* 0-based among the non-blank lines */
  int64_t line;  /* 1-based line number in the input */
  int32_t n;
  bool want_logprobs;
  gen_seq_t *seqs; /* [n] */
  kiln_usage_t usage;
  char *error;          /* "line N: ..." (malloc'ed), or NULL */
  bool done;            /* the final event came (or the line never ran); under batch->mu */
  kiln_request_t *req;  /* held until the result is written (main thread) */
  struct gen_job *next; /* the pending list, in input order */
} gen_job_t;

/* ---- options -------------------------------------------------------------------------------- */

static const char gen_usage[] =
    "usage: kiln generate [--model DIR|FILE.gguf] (--ids 1,2,3 | --prompt TEXT) [options]\n"
    "       kiln generate [--model DIR] --image PATH [--image PATH2...] --prompt TEXT "
    "[options]\n"
    "       kiln generate [--model DIR] --messages CHAT.json [options]\n"
    "       kiln generate [--model DIR|FILE.gguf] --input REQUESTS.jsonl [--output "
    "RESULTS.jsonl] [options]\n"
    "\n"
    "One request: prints the prompt, then the continuation as it is generated (token ids\n"
    "when the model has no tokenizer); with --json, one JSON object at the end: prompt_ids,\n"
    "token_ids, text, finish_reason, usage, time_to_first_token_s, total_time_s.\n"
    "\n"
    "Images (vision-language models): --image files with --prompt are one user message, the\n"
    "images then the text, rendered with the model's chat template; --messages takes\n"
    "OpenAI-style messages whose image_url parts hold data: URLs or file paths. With --ids,\n"
    "each --image takes one image placeholder id of the ids. prompt_ids are the rendered\n"
    "prompt's (one placeholder per image); usage.prompt_tokens counts the image tokens.\n"
    "\n"
    "Batch (--input): each non-blank line is one JSON request: \"prompt\" (text) or\n"
    "\"prompt_ids\" (token ids), plus any of max_tokens, min_tokens, temperature, top_p,\n"
    "top_k, min_p, n, seed, stop, stop_token_ids, ignore_eos, logprobs, top_logprobs,\n"
    "presence_penalty, frequency_penalty, repetition_penalty, logit_bias, priority,\n"
    "skip_special_tokens, include_stop_str_in_output, one constraint of guided_json (a\n"
    "JSON Schema, object or string), guided_regex, guided_choice (strings), guided_grammar\n"
    "(GBNF) and response_format ({\"type\": \"json_object\"} or {\"type\": \"json_schema\",\n"
    "\"json_schema\": {\"schema\": ...}}); or \"messages\" (an OpenAI-style chat,\n"
    "image_url parts with data: URLs or paths) instead of a prompt, and \"images\" (data:\n"
    "URLs or paths) with \"prompt\" (one user message: the images, then the text) or with\n"
    "\"prompt_ids\" (one placeholder id per image). Any other field is an error (id,\n"
    "custom_id, model, user and metadata are allowed and ignored). The options\n"
    "below are the defaults for fields a line leaves out. Writes one JSON line per request,\n"
    "in input order, to --output (default: stdout): index, token_ids, text, finish_reason,\n"
    "usage, logprobs; or index and error for a line that failed. Progress and a summary go to\n"
    "stderr. Exit status: 0 when every line succeeded, 1 otherwise.\n";

static const kiln_opt_t gen_rows[] = {
    KILN_OPT_STRING("--model", "DIR|FILE.gguf|ORG/NAME", gen_args_t, model,
                    "the model: a path or a Hub id ORG/NAME[@REV]\n(default: [model] path)"),
    KILN_OPT_STRING("--dtype", "NAME", gen_args_t, dtype,
                    "auto, float32, float16 or bfloat16 (default: [model] dtype)"),
    KILN_OPT_STRING("--quantization", "NAME", gen_args_t, quantization,
                    "none or fp8: quantize a float checkpoint's Linears to FP8\n"
                    "at load (default: [model] quantization)"),
    KILN_OPT_STRING("--ids", "1,2,3", gen_args_t, ids, "one request: the prompt's token ids"),
    KILN_OPT_STRING("--prompt", "TEXT", gen_args_t, prompt, "one request: the prompt's text"),
    KILN_OPT_STRING("--input", "FILE", gen_args_t, input, "batch: the JSONL requests (- = stdin)"),
    KILN_OPT_STRING("--output", "FILE", gen_args_t, output,
                    "batch: where the JSON lines go (default and -: stdout)"),
    KILN_OPT_INT("--max-tokens", "N", gen_args_t, max_tokens, 1, 1 << 24,
                 "new tokens per sequence, [1, 16777216] (default 64; one request\n"
                 "is cut at the model's context)"),
    KILN_OPT_INT("--min-tokens", "N", gen_args_t, min_tokens, 0, 1 << 24,
                 "stop tokens and strings are ignored before N tokens"),
    KILN_OPT_FLOAT("--temperature", "T", gen_args_t, temperature, 0, 100,
                   "[0, 100]; 0 = greedy (default 0)"),
    KILN_OPT_FLOAT("--top-p", "P", gen_args_t, top_p, 1e-6, 1, "(0, 1] (default 1)"),
    KILN_OPT_INT("--top-k", "K", gen_args_t, top_k, 0, 1 << 30, "0 = off (default 0)"),
    KILN_OPT_FLOAT("--min-p", "P", gen_args_t, min_p, 0, 1, "[0, 1] (default 0)"),
    KILN_OPT_INT_SEEN("--seed", "S", gen_args_t, seed, has_seed, 0, INT64_MAX,
                      "the same tokens whatever else runs (default: [engine] seed)"),
    KILN_OPT_INT("--n", "N", gen_args_t, n, 1, 65536, "sequences per prompt (default 1)"),
    KILN_OPT_INT("--beam-width", "W", gen_args_t, beam_width, 0, 1024,
                 "beam search with W beams; prints the --n best hypotheses, best\n"
                 "first, with their scores (deterministic: sampling options are\n"
                 "ignored; no --logprobs, --stop, --min-tokens or constraints)"),
    KILN_OPT_FLOAT("--length-penalty", "F", gen_args_t, length_penalty, -1e6, 1e6,
                   "beam search: score = logprob sum / length^F (default 1)"),
    KILN_OPT_STRING("--early-stopping", "true|false|never", gen_args_t, early_stopping,
                    "beam search: transformers' early_stopping (default false)"),
    KILN_OPT_LIST("--stop", "STR", gen_args_t, stop,
                  "finish when the text contains STR (repeatable; needs a tokenizer)"),
    KILN_OPT_FLAG("--ignore-eos", gen_args_t, ignore_eos, "keep going past end-of-sequence tokens"),
    KILN_OPT_INT("--logprobs", "K", gen_args_t, logprobs, 0, 20,
                 "the sampled token's logprob and the top K, [0, 20] (JSON output)"),
    KILN_OPT_LIST("--image", "PATH", gen_args_t, images,
                  "one request: an image (PNG, JPEG, WebP) for the prompt (repeatable)"),
    KILN_OPT_STRING("--messages", "FILE.json", gen_args_t, messages,
                    "one request: an OpenAI-style chat (image_url parts: data: URLs or\npaths)"),
    KILN_OPT_FLAG("--json", gen_args_t, json, "one request: print one JSON object"),
    KILN_OPT_STRING("--json-schema", "JSON|@FILE", gen_args_t, json_schema,
                    "constrain the output to JSON valid under this JSON Schema"),
    KILN_OPT_FLAG("--json-object", gen_args_t, json_object,
                  "constrain the output to a JSON object"),
    KILN_OPT_STRING("--regex", "RE|@FILE", gen_args_t, regex,
                    "constrain the output to text that matches this regular expression"),
    KILN_OPT_STRING("--grammar", "GBNF|@FILE", gen_args_t, grammar,
                    "constrain the output to this GBNF grammar (llama.cpp's syntax, rule root)"),
    KILN_OPT_LIST("--choice", "STR", gen_args_t, choice,
                  "constrain the output to one of these strings (repeatable)"),
    KILN_OPT_INT("--chunk", "N", gen_args_t, chunk, 0, 1 << 24,
                 "one request: most prompt tokens per step\n(engine.max_num_batched_tokens)"),
    KILN_OPT_INT("--max-in-flight", "N", gen_args_t, window, 1, 1 << 20,
                 "batch: most requests in the engine at once (default 512)"),
};

static const kiln_opts_t gen_opts = {
    .cmd = "generate",
    .usage = gen_usage,
    .opts = gen_rows,
    .num_opts = KILN_OPTS_COUNT(gen_rows),
    .common = &kiln_cli_common_opts,
};

/* Reads a @FILE value (malloc'ed), or copies the text. */
static kiln_status_t gen_text_arg(const char *opt, const char *v, char **out) {
  *out = NULL;
  if (v[0] != '@') {
    if (!(*out = strdup(v))) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    return NULL;
  }
  FILE *f = fopen(v + 1, "rb");
  if (!f)
    return kiln_status_make(KILN_ERR_IO, "%s: cannot read %s: %s", opt, v + 1, strerror(errno));
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) kiln_strbuf_append(&b, buf, n);
  bool err = ferror(f);
  fclose(f);
  if (err || !kiln_strbuf_ok(&b)) {
    kiln_strbuf_free(&b);
    return kiln_status_make(KILN_ERR_IO, "%s: reading %s failed", opt, v + 1);
  }
  *out = kiln_strbuf_detach(&b, NULL);
  return *out ? NULL : kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
}

/* The constraint options: at most one, resolved into guide / guide_spec. */
static kiln_status_t gen_guide_args(gen_args_t *a) {
  int n = !!a->json_schema + !!a->regex + !!a->grammar + (a->choice.n > 0) + a->json_object;
  if (n > 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "--json-schema, --json-object, --regex, --grammar and --choice "
                            "exclude each other");
  if (a->json_object) a->guide = KILN_GUIDE_JSON_OBJECT;
  if (a->json_schema) {
    a->guide = KILN_GUIDE_JSON_SCHEMA;
    return gen_text_arg("--json-schema", a->json_schema, &a->guide_spec);
  }
  if (a->regex) {
    a->guide = KILN_GUIDE_REGEX;
    return gen_text_arg("--regex", a->regex, &a->guide_spec);
  }
  if (a->grammar) {
    a->guide = KILN_GUIDE_GRAMMAR;
    return gen_text_arg("--grammar", a->grammar, &a->guide_spec);
  }
  if (a->choice.n) {
    kiln_strbuf_t b = KILN_STRBUF_INIT;
    kiln_strbuf_append_char(&b, '[');
    for (int32_t i = 0; i < a->choice.n; i++) {
      if (i) kiln_strbuf_append_str(&b, ", ");
      kiln_json_write_string(&b, a->choice.v[i], strlen(a->choice.v[i]), false);
    }
    kiln_strbuf_append_char(&b, ']');
    a->guide = KILN_GUIDE_CHOICE;
    if (!kiln_strbuf_ok(&b) || !(a->guide_spec = kiln_strbuf_detach(&b, NULL))) {
      kiln_strbuf_free(&b);
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    }
  }
  return NULL;
}

static kiln_status_t gen_parse(kiln_cli_t *cli, gen_args_t *a) {
  const char *cmd = gen_opts.cmd;
  memset(a, 0, sizeof(*a));
  a->max_tokens = 64;
  a->top_p = 1.0;
  a->n = 1;
  a->logprobs = -1;
  a->window = GEN_DEFAULT_WINDOW;
  a->length_penalty = 1.0;
  kiln_status_t st = kiln_opts_parse(&gen_opts, cli->argc, cli->argv, a, &a->help);
  if (st || a->help) return st;
  if (a->early_stopping) {
    if (!strcmp(a->early_stopping, "false"))
      a->early = KILN_EARLY_STOPPING_FALSE;
    else if (!strcmp(a->early_stopping, "true"))
      a->early = KILN_EARLY_STOPPING_TRUE;
    else if (!strcmp(a->early_stopping, "never"))
      a->early = KILN_EARLY_STOPPING_NEVER;
    else
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: --early-stopping must be true, false or never (got \"%s\")",
                              cmd, a->early_stopping);
  }
  if (!a->beam_width && (a->early_stopping || a->length_penalty != 1.0))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: --length-penalty and --early-stopping go with --beam-width", cmd);
  if (a->beam_width && a->n > a->beam_width)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: --n (%lld) must be <= --beam-width (%lld)", cmd, (long long)a->n,
                            (long long)a->beam_width);
  if ((st = gen_guide_args(a))) return kiln_status_annotate(st, "%s", cmd);
  int32_t dtype; /* checked here; the engine takes the name */
  if (a->dtype && (st = kiln_cli_dtype(a->dtype, &dtype)))
    return kiln_status_annotate(st, "%s", cmd);
  int32_t quant;
  if (a->quantization && (st = kiln_cli_quantization(a->quantization, &quant)))
    return kiln_status_annotate(st, "%s", cmd);
  if (a->input) {
    if (a->images.n || a->messages)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: --image and --messages are for one request, not --input", cmd);
    if (a->ids || a->prompt)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: --input runs the requests of a JSONL file; --ids and --prompt "
                              "are for one request",
                              cmd);
    if (a->json)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: --json is for one request (--input always writes JSON lines)",
                              cmd);
    return NULL;
  }
  if (a->output)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: --output goes with --input FILE.jsonl",
                            cmd);
  if (a->messages) {
    if (a->ids || a->prompt || a->images.n)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: --messages holds the whole chat, images included: no --ids, "
                              "--prompt or --image with it",
                              cmd);
    return NULL;
  }
  if ((a->ids != NULL) == (a->prompt != NULL))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: give exactly one of --ids 1,2,3 and --prompt TEXT (or --input "
                            "FILE.jsonl for many requests)",
                            cmd);
  return NULL;
}

/* ---- small helpers -------------------------------------------------------------------------- */

static void gen_ids_push(gen_ids_t *l, int32_t x) {
  if (l->len == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 16;
    int32_t *v = realloc(l->v, cap * sizeof(*v));
    if (!v) {
      l->oom = true;
      return;
    }
    l->v = v;
    l->cap = cap;
  }
  l->v[l->len++] = x;
}

/* The sampling parameters the options give (a batch line's defaults). */
static void gen_base_params(const gen_args_t *a, kiln_sampling_params_t *p) {
  kiln_sampling_params_init(p);
  p->n = (int32_t)a->n;
  p->max_tokens = (int32_t)a->max_tokens;
  p->min_tokens = (int32_t)a->min_tokens;
  p->temperature = (float)a->temperature;
  p->top_p = (float)a->top_p;
  p->top_k = (int32_t)a->top_k;
  p->min_p = (float)a->min_p;
  p->has_seed = a->has_seed;
  p->seed = (uint64_t)a->seed;
  p->ignore_eos = a->ignore_eos;
  p->stop = a->stop.n ? a->stop.v : NULL;
  p->num_stop = a->stop.n;
  p->logprobs = (int32_t)a->logprobs;
  p->guide = a->guide;
  p->guide_spec = a->guide_spec;
  p->beam_width = (int32_t)a->beam_width;
  p->length_penalty = (float)a->length_penalty;
  p->early_stopping = a->early;
}

/* Creates the engine from the config file, the --set overrides and the options that map onto
 * config keys (--model, --dtype; for one request also --chunk and a max_num_seqs of n, so the KV
 * pool is sized for this request alone unless --set says otherwise). */
static kiln_status_t gen_engine(kiln_cli_t *cli, const gen_args_t *a, bool single,
                                kiln_engine_t **out) {
  kiln_status_t st = NULL;
  char seqs[64], chunk[64];
  char *path = NULL, *dtype = NULL, *quant = NULL;
  const char **ov = calloc((size_t)cli->num_sets + 5, sizeof(*ov));
  int32_t n = 0;
  if (!ov) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  if (single) {
    snprintf(seqs, sizeof(seqs), "engine.max_num_seqs=%lld",
             (long long)(a->beam_width > a->n ? a->beam_width : a->n));
    ov[n++] = seqs;
  }
  for (int i = 0; i < cli->num_sets; i++) ov[n++] = cli->sets[i];
  if (single && a->chunk > 0) {
    snprintf(chunk, sizeof(chunk), "engine.max_num_batched_tokens=%lld", (long long)a->chunk);
    ov[n++] = chunk;
  }
  if (a->model && a->model[0]) {
    if (!(path = kiln_strprintf("model.path=%s", a->model))) goto oom;
    ov[n++] = path;
  }
  if (a->dtype) {
    if (!(dtype = kiln_strprintf("model.dtype=%s", a->dtype))) goto oom;
    ov[n++] = dtype;
  }
  if (a->quantization) {
    if (!(quant = kiln_strprintf("model.quantization=%s", a->quantization))) goto oom;
    ov[n++] = quant;
  }
  st = kiln_engine_create(cli->config_path, ov, n, out);
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
done:
  free(path);
  free(dtype);
  free(quant);
  free(ov);
  return st;
}

/* ---- results -------------------------------------------------------------------------------- */

static gen_job_t *gen_job_new(int32_t n, bool want_logprobs) {
  gen_job_t *j = calloc(1, sizeof(*j));
  if (!j) return NULL;
  j->n = n;
  j->want_logprobs = want_logprobs;
  if (!(j->seqs = calloc((size_t)n, sizeof(*j->seqs)))) {
    free(j);
    return NULL;
  }
  return j;
}

static void gen_job_free(gen_job_t *j) {
  if (!j) return;
  for (int32_t i = 0; j->seqs && i < j->n; i++) {
    free(j->seqs[i].ids.v);
    kiln_strbuf_free(&j->seqs[i].text);
    kiln_strbuf_free(&j->seqs[i].lp);
  }
  free(j->seqs);
  free(j->error);
  free(j);
}

/* Sets the job's error to "line N: msg" (one request: msg alone); keeps the first. */
static void gen_job_fail(gen_job_t *j, const char *msg) {
  if (j->error) return;
  j->error = j->line > 0 ? kiln_strprintf("line %lld: %s", (long long)j->line, msg) : strdup(msg);
  if (!j->error) j->error = strdup("out of memory");
}

static void gen_write_logprob(kiln_strbuf_t *b, float x) {
  if (isfinite(x))
    kiln_strbuf_printf(b, "%.7g", (double)x);
  else
    kiln_strbuf_append_str(b, "null");
}

/* Adds one event to the job. Runs on the engine thread (callbacks) or the main thread (polling);
 * either way one thread at a time per job. */
static void gen_job_take(gen_job_t *j, const kiln_output_t *o) {
  if (o->error) gen_job_fail(j, o->error);
  if (o->index < 0 || o->index >= j->n) return;
  gen_seq_t *s = &j->seqs[o->index];
  for (int32_t t = 0; t < o->num_tokens; t++) gen_ids_push(&s->ids, o->token_ids[t]);
  if (o->text && o->text_len) kiln_strbuf_append(&s->text, o->text, o->text_len);
  if (j->want_logprobs && o->logprobs) {
    for (int32_t t = 0; t < o->num_tokens; t++) {
      kiln_strbuf_t *b = &s->lp;
      kiln_strbuf_printf(b, "%s{\"token_id\": %d, \"logprob\": ", b->len ? ", " : "",
                         o->token_ids[t]);
      gen_write_logprob(b, o->logprobs[t]);
      if (o->top_n > 0 && o->top_ids && o->top_logprobs) {
        kiln_strbuf_append_str(b, ", \"top_logprobs\": [");
        for (int32_t k = 0; k < o->top_n; k++) {
          size_t at = (size_t)t * (size_t)o->top_n + (size_t)k;
          kiln_strbuf_printf(b, "%s[%d, ", k ? ", " : "", o->top_ids[at]);
          gen_write_logprob(b, o->top_logprobs[at]);
          kiln_strbuf_append_char(b, ']');
        }
        kiln_strbuf_append_char(b, ']');
      }
      kiln_strbuf_append_char(b, '}');
    }
  }
  if (o->finish_reason != KILN_FINISH_NONE) s->finish = o->finish_reason;
  s->cum_logprob = o->cumulative_logprob;
  s->beam_score = o->beam_score;
  j->usage = o->usage;
}

static bool gen_job_oom(const gen_job_t *j) {
  for (int32_t i = 0; i < j->n; i++)
    if (j->seqs[i].ids.oom || !kiln_strbuf_ok(&j->seqs[i].text) || !kiln_strbuf_ok(&j->seqs[i].lp))
      return true;
  return false;
}

/* Appends `"key": X` for every sequence: X itself when n = 1, else [X0, X1, ...]. */
static void gen_write_per_seq(kiln_strbuf_t *b, const gen_job_t *j, const char *key,
                              void (*one)(kiln_strbuf_t *, const gen_seq_t *)) {
  kiln_strbuf_printf(b, ", \"%s\": ", key);
  if (j->n > 1) kiln_strbuf_append_char(b, '[');
  for (int32_t i = 0; i < j->n; i++) {
    if (i) kiln_strbuf_append_str(b, ", ");
    one(b, &j->seqs[i]);
  }
  if (j->n > 1) kiln_strbuf_append_char(b, ']');
}

static void gen_write_ids(kiln_strbuf_t *b, const gen_seq_t *s) {
  kiln_strbuf_append_char(b, '[');
  for (size_t i = 0; i < s->ids.len; i++) kiln_strbuf_printf(b, "%s%d", i ? ", " : "", s->ids.v[i]);
  kiln_strbuf_append_char(b, ']');
}

static void gen_write_text(kiln_strbuf_t *b, const gen_seq_t *s) {
  kiln_json_write_string(b, kiln_strbuf_cstr(&s->text), s->text.len, false);
}

static void gen_write_finish(kiln_strbuf_t *b, const gen_seq_t *s) {
  const char *name = kiln_finish_reason_name(s->finish);
  if (name)
    kiln_strbuf_printf(b, "\"%s\"", name);
  else
    kiln_strbuf_append_str(b, "null");
}

static void gen_write_lp(kiln_strbuf_t *b, const gen_seq_t *s) {
  kiln_strbuf_printf(b, "[%s]", kiln_strbuf_cstr(&s->lp));
}

/* ---- one request ---------------------------------------------------------------------------- */

/* Tokenizes a --prompt the way the engine does, for the prompt_ids of the JSON output and to
 * fit max_tokens into the context. */
static void gen_write_cum(kiln_strbuf_t *b, const gen_seq_t *s) {
  kiln_json_write_number(b, s->cum_logprob);
}

static void gen_write_score(kiln_strbuf_t *b, const gen_seq_t *s) {
  kiln_json_write_number(b, s->beam_score);
}

static kiln_status_t gen_tokenize(kiln_engine_t *eng, const char *prompt, gen_ids_t *out) {
  int32_t *ids = NULL, n = 0;
  kiln_status_t st = kiln_engine_tokenize(eng, prompt, strlen(prompt), true, &ids, &n);
  for (int32_t i = 0; !st && i < n; i++) gen_ids_push(out, ids[i]);
  if (!st && out->oom) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  free(ids);
  return st;
}

/* Prints the single request's output: the JSON object, or (n > 1, not streamed) each
 * sequence. */
static kiln_status_t gen_single_print(const gen_args_t *a, const kiln_engine_info_t *info,
                                      const gen_ids_t *pids, const gen_job_t *j, double ttft,
                                      double all) {
  kiln_status_t st = NULL;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  if (a->json) {
    kiln_strbuf_append_str(&b, "{\"prompt_ids\": [");
    for (size_t i = 0; i < pids->len; i++)
      kiln_strbuf_printf(&b, "%s%d", i ? ", " : "", pids->v[i]);
    kiln_strbuf_append_char(&b, ']');
    gen_write_per_seq(&b, j, "token_ids", gen_write_ids);
    if (info->has_tokenizer) gen_write_per_seq(&b, j, "text", gen_write_text);
    gen_write_per_seq(&b, j, "finish_reason", gen_write_finish);
    kiln_strbuf_printf(&b, ", \"usage\": {\"prompt_tokens\": %d, \"completion_tokens\": %d}",
                       j->usage.prompt_tokens, j->usage.completion_tokens);
    if (j->want_logprobs) gen_write_per_seq(&b, j, "logprobs", gen_write_lp);
    if (a->beam_width) {
      gen_write_per_seq(&b, j, "cumulative_logprob", gen_write_cum);
      gen_write_per_seq(&b, j, "beam_score", gen_write_score);
    }
    kiln_strbuf_printf(&b, ", \"time_to_first_token_s\": %.6f, \"total_time_s\": %.6f}\n", ttft,
                       all);
  } else if (j->n > 1 || a->beam_width) {
    for (int32_t i = 0; i < j->n; i++) {
      const char *fin = kiln_finish_reason_name(j->seqs[i].finish);
      if (a->beam_width)
        kiln_strbuf_printf(&b, "--- hypothesis %d (%s, score %.6f, logprob %.6f) ---\n", i,
                           fin ? fin : "?", j->seqs[i].beam_score, j->seqs[i].cum_logprob);
      else
        kiln_strbuf_printf(&b, "--- sequence %d (%s) ---\n", i, fin ? fin : "?");
      if (info->has_tokenizer) {
        kiln_strbuf_printf(&b, "%s%s\n", a->prompt ? a->prompt : "",
                           kiln_strbuf_cstr(&j->seqs[i].text));
      } else {
        for (size_t t = 0; t < j->seqs[i].ids.len; t++)
          kiln_strbuf_printf(&b, "%s%d", t ? "," : "", j->seqs[i].ids.v[t]);
        kiln_strbuf_append_char(&b, '\n');
      }
    }
  }
  if (!kiln_strbuf_ok(&b) || gen_job_oom(j))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  else
    fwrite(b.data ? b.data : "", 1, b.len, stdout);
  kiln_strbuf_free(&b);
  return st;
}

static int gen_single(kiln_cli_t *cli, const gen_args_t *a) {
  const char *cmd = cli->argv[0];
  kiln_engine_t *eng = NULL;
  kiln_request_t *req = NULL;
  gen_ids_t pids = {0};
  gen_job_t *j = NULL;
  kiln_engine_info_t info;
  memset(&info, 0, sizeof(info));
  kiln_cli_images_t imgs;
  memset(&imgs, 0, sizeof(imgs));
  kiln_status_t st = NULL;
  if (a->ids) st = kiln_cli_parse_ids(cmd, a->ids, &pids.v, &pids.len);
  pids.cap = pids.len;
  if (!st && (st = kiln_cli_images_read(a->images.v, a->images.n, &imgs)))
    st = kiln_status_annotate(st, "%s", cmd);
  if (!st) st = gen_engine(cli, a, true, &eng);
  if (!st && a->images.n && kiln_engine_max_images(eng) == 0) {
    kiln_engine_get_info(eng, &info);
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: --image: model %s takes text only (it has no vision tower)", cmd,
                          info.model_name);
  }
  /* a chat: images with a text prompt, or a messages file */
  const bool chat = a->messages || (a->prompt && a->images.n);
  if (!st) {
    kiln_engine_get_info(eng, &info);
    if ((a->prompt || chat) && !info.has_tokenizer)
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: --prompt and --messages need a tokenizer.json beside the model "
                            "(%s); give --ids instead",
                            cmd, info.model_path);
  }
  if (!st && chat) {
    int32_t *ids = NULL, n = 0;
    st = kiln_cli_chat_ids(eng, a->messages, a->prompt, &imgs, &ids, &n);
    for (int32_t i = 0; !st && i < n; i++) gen_ids_push(&pids, ids[i]);
    if (!st && pids.oom) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    free(ids);
    if (st) st = kiln_status_annotate(st, "%s", cmd);
  } else if (!st && a->prompt) {
    st = gen_tokenize(eng, a->prompt, &pids);
  }
  if (!st && pids.len == 0)
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: the prompt encodes to no tokens", cmd);
  if (!st && !(j = gen_job_new((int32_t)a->n, a->logprobs >= 0)))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kiln_sampling_params_t p;
  gen_base_params(a, &p);
  /* Generation stops at the model's context (the engine refuses a request that cannot fit). */
  if (!st && (int64_t)pids.len < info.max_model_len &&
      (int64_t)pids.len + p.max_tokens > info.max_model_len)
    p.max_tokens = (int32_t)(info.max_model_len - (int64_t)pids.len);
  kiln_request_desc_t d = {.struct_size = sizeof(d), .params = &p};
  if (a->prompt && !chat)
    d.prompt = a->prompt;
  else
    d.prompt_ids = pids.v, d.num_prompt_ids = (int32_t)pids.len;
  d.images = imgs.images;
  d.num_images = imgs.num;
  double t0 = kiln_cli_now(), t1 = 0, t2;
  if (!st && (st = kiln_engine_submit(eng, &d, &req)))
    st = kiln_status_annotate(kiln_cli_images_error(&imgs, st), "%s", cmd);
  /* Stream one sequence as it comes (text, or ids without a tokenizer); n > 1 prints at the
   * end. */
  bool stream = !st && !a->json && a->n == 1 && !a->beam_width;
  size_t streamed = 0;
  if (stream && a->prompt && !chat) fputs(a->prompt, stdout), fflush(stdout);
  while (!st) {
    kiln_output_t *o = NULL;
    if ((st = kiln_request_poll(req, -1, &o)) || !o) break;
    if (o->num_tokens > 0 && t1 == 0) t1 = kiln_cli_now();
    gen_job_take(j, o);
    if (stream && info.has_tokenizer && o->text_len) {
      fwrite(o->text, 1, o->text_len, stdout);
    } else if (stream && !info.has_tokenizer) {
      for (int32_t t = 0; t < o->num_tokens; t++)
        printf("%s%d", streamed++ ? "," : "", o->token_ids[t]);
    }
    if (stream) fflush(stdout);
    bool last = o->request_finished;
    kiln_output_free(o);
    if (last) break;
  }
  t2 = kiln_cli_now();
  if (t1 == 0) t1 = t2;
  if (stream) {
    printf("\n");
    fflush(stdout);
  }
  if (!st && j->error) st = kiln_status_make(KILN_ERR_INTERNAL, "%s: %s", cmd, j->error);
  double ttft = t1 - t0, all = t2 - t0;
  if (!st) st = gen_single_print(a, &info, &pids, j, ttft, all);
  if (!st && !a->json) {
    int32_t gen = j->usage.completion_tokens;
    fprintf(stderr, "kiln: %zu prompt + %d generated tokens, first token %.1f ms, %.1f tokens/s\n",
            pids.len, gen, 1e3 * ttft,
            !a->beam_width && gen > a->n && all > ttft ? (double)(gen - a->n) / (all - ttft)
                                                       : 0.0);
  }
  if (req) kiln_request_release(req);
  kiln_engine_destroy(eng);
  gen_job_free(j);
  free(pids.v);
  kiln_cli_images_free(&imgs);
  if (st) return kiln_cli_fail(st);
  return 0;
}

/* ---- one JSONL line ------------------------------------------------------------------------- */

/* A parsed line: sampling parameters whose pointers lead into the document and the arrays
 * here. */
typedef struct gen_line {
  kiln_json_doc_t *doc;
  kiln_sampling_params_t p;
  const char *prompt;
  gen_ids_t ids, stop_ids, bias_ids;
  float *bias_values;
  const char **stop;
  const kiln_json_t *messages, *images; /* "messages" (a chat), "images" (URLs or paths) */
  kiln_cli_images_t imgs;               /* the images, read (gen_line_prepare) */
  kiln_strbuf_t guide_spec;             /* a constraint given as a JSON value, written out */
} gen_line_t;

static void gen_line_free(gen_line_t *l) {
  kiln_cli_images_free(&l->imgs);
  kiln_json_doc_free(l->doc);
  free(l->ids.v);
  free(l->stop_ids.v);
  free(l->bias_ids.v);
  free(l->bias_values);
  free(l->stop);
  kiln_strbuf_free(&l->guide_spec);
  memset(l, 0, sizeof(*l));
}

static kiln_status_t gen_bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static kiln_status_t gen_bad(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_status_t st = kiln_status_makev(KILN_ERR_INVALID_ARGUMENT, fmt, ap);
  va_end(ap);
  return st;
}

static const kiln_json_t *gen_field(const kiln_json_t *o, const char *key) {
  const kiln_json_t *v = kiln_json_get(o, key);
  return kiln_json_type(v) == KILN_JSON_NULL ? NULL : v;
}

static kiln_status_t gen_field_int(const kiln_json_t *o, const char *key, int64_t lo, int64_t hi,
                                   int64_t *out) {
  const kiln_json_t *v = gen_field(o, key);
  int64_t x;
  if (!v) return NULL;
  if (!kiln_json_int64(v, &x))
    return gen_bad(
        "%s must be an integer, got %s", key,
        kiln_json_is(v, KILN_JSON_NUMBER) ? "a fraction" : kiln_json_type_name(kiln_json_type(v)));
  if (x < lo || x > hi)
    return gen_bad("%s must be in [%lld, %lld], got %lld", key, (long long)lo, (long long)hi,
                   (long long)x);
  *out = x;
  return NULL;
}

static kiln_status_t gen_field_i32(const kiln_json_t *o, const char *key, int32_t *out) {
  int64_t x = *out;
  kiln_status_t st = gen_field_int(o, key, INT32_MIN, INT32_MAX, &x);
  *out = (int32_t)x;
  return st;
}

static kiln_status_t gen_field_float(const kiln_json_t *o, const char *key, float *out) {
  const kiln_json_t *v = gen_field(o, key);
  if (!v) return NULL;
  if (!kiln_json_is(v, KILN_JSON_NUMBER))
    return gen_bad("%s must be a number, got %s", key, kiln_json_type_name(kiln_json_type(v)));
  *out = (float)kiln_json_number(v);
  return NULL;
}

static kiln_status_t gen_field_bool(const kiln_json_t *o, const char *key, bool *out) {
  const kiln_json_t *v = gen_field(o, key);
  if (!v) return NULL;
  if (!kiln_json_is(v, KILN_JSON_BOOL))
    return gen_bad("%s must be true or false, got %s", key, kiln_json_type_name(kiln_json_type(v)));
  *out = kiln_json_bool(v);
  return NULL;
}

/* An array of integers (token ids) into out. */
static kiln_status_t gen_field_ids(const kiln_json_t *v, const char *key, gen_ids_t *out) {
  if (!kiln_json_is(v, KILN_JSON_ARRAY))
    return gen_bad("%s must be an array of token ids, got %s", key,
                   kiln_json_type_name(kiln_json_type(v)));
  for (size_t i = 0; i < kiln_json_len(v); i++) {
    int64_t x;
    if (!kiln_json_int64(kiln_json_at(v, i), &x) || x < INT32_MIN || x > INT32_MAX)
      return gen_bad("%s[%zu] is not a token id (an integer)", key, i);
    gen_ids_push(out, (int32_t)x);
  }
  return out->oom ? kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory") : NULL;
}

/* "invalid JSON: column 5: expected ..." from the parser's "JSON: line 1, column 5: ...". */
static kiln_status_t gen_json_error(kiln_status_t st) {
  const char *m = kiln_status_message(st);
  const char *c = strstr(m, "column ");
  kiln_status_t out = kiln_status_make(kiln_status_code(st), "invalid JSON: %s", c ? c : m);
  kiln_status_free(st);
  return out;
}

/* A line's constraint: guided_json / guided_regex / guided_choice / guided_grammar (vLLM) or
 * response_format (OpenAI); at most one. */
static kiln_status_t gen_line_guide(const kiln_json_t *r, gen_line_t *l) {
  static const char *const keys[] = {"guided_json", "guided_regex", "guided_choice",
                                     "guided_grammar", "response_format"};
  const kiln_json_t *v = NULL;
  int which = -1, n = 0;
  for (int i = 0; i < 5; i++) {
    const kiln_json_t *f = gen_field(r, keys[i]);
    if (f) {
      v = f;
      which = i;
      n++;
    }
  }
  if (n > 1)
    return gen_bad(
        "give at most one of guided_json, guided_regex, guided_choice, "
        "guided_grammar and response_format");
  if (which < 0) return NULL;
  kiln_sampling_params_t *p = &l->p;
  const kiln_json_t *spec = v;
  if (which == 4) { /* response_format */
    const char *t = kiln_json_string(kiln_json_get(v, "type"), NULL);
    if (!t) return gen_bad("response_format.type must be a string");
    if (!strcmp(t, "text")) return NULL;
    if (!strcmp(t, "json_object")) {
      p->guide = KILN_GUIDE_JSON_OBJECT;
      return NULL;
    }
    if (strcmp(t, "json_schema"))
      return gen_bad("response_format.type '%s' is not one of text, json_object, json_schema", t);
    spec = kiln_json_get(kiln_json_get(v, "json_schema"), "schema");
    if (!spec) return gen_bad("response_format.json_schema.schema is missing");
    which = 0;
  }
  p->guide = which == 0   ? KILN_GUIDE_JSON_SCHEMA
             : which == 1 ? KILN_GUIDE_REGEX
             : which == 2 ? KILN_GUIDE_CHOICE
                          : KILN_GUIDE_GRAMMAR;
  if ((which == 1 || which == 3) && !kiln_json_is(spec, KILN_JSON_STRING))
    return gen_bad("%s must be a string", keys[which]);
  if (which == 2 && !kiln_json_is(spec, KILN_JSON_ARRAY))
    return gen_bad("guided_choice must be an array of strings");
  size_t sl;
  const char *str = kiln_json_string(spec, &sl);
  if (str && which != 0) {
    kiln_strbuf_append(&l->guide_spec, str, sl);
  } else if (str) { /* guided_json given as a JSON text */
    kiln_strbuf_append(&l->guide_spec, str, sl);
  } else {
    kiln_json_write(&l->guide_spec, spec, false, false);
  }
  if (!kiln_strbuf_ok(&l->guide_spec))
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  p->guide_spec = l->guide_spec.data ? l->guide_spec.data : "";
  p->guide_spec_len = l->guide_spec.len;
  return NULL;
}

static kiln_status_t gen_line_parse(const char *text, size_t len,
                                    const kiln_sampling_params_t *base, gen_line_t *l) {
  kiln_status_t st = kiln_json_parse(text, len, "JSON", &l->doc);
  if (st) return gen_json_error(st);
  const kiln_json_t *r = kiln_json_root(l->doc);
  if (!kiln_json_is(r, KILN_JSON_OBJECT))
    return gen_bad("a request is a JSON object, got %s", kiln_json_type_name(kiln_json_type(r)));
  kiln_sampling_params_t *p = &l->p;
  *p = *base;
  /* Every field is one this command knows: one it left out would change what the caller gets
   * back without a word (a "response_format", "tools", "suffix"...). */
  static const char *const known[] = {
      "prompt", "prompt_ids", "messages", "images", "max_tokens", "min_tokens", "n", "top_k",
      "priority", "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
      "repetition_penalty", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
      "seed", "logprobs", "top_logprobs", "stop", "stop_token_ids", "logit_bias", "guided_json",
      "guided_regex", "guided_choice", "guided_grammar", "response_format",
      /* metadata that changes nothing */
      "id", "custom_id", "model", "user", "metadata"};
  for (size_t i = 0; i < kiln_json_len(r); i++) {
    const char *key = kiln_json_key_at(r, i, NULL);
    bool ok = false;
    for (size_t k = 0; k < sizeof(known) / sizeof(known[0]) && !ok; k++)
      ok = !strcmp(key, known[k]);
    if (!ok)
      return gen_bad("unknown field \"%s\" (kiln generate --help lists the fields a line may have)",
                     key);
  }
  /* The prompt: text, or token ids (also accepted as an array under "prompt"); or a chat. */
  const kiln_json_t *pt = gen_field(r, "prompt"), *pi = gen_field(r, "prompt_ids");
  const kiln_json_t *msgs = gen_field(r, "messages"), *imgs = gen_field(r, "images");
  if (imgs) {
    if (!kiln_json_is(imgs, KILN_JSON_ARRAY))
      return gen_bad("images must be an array of image URLs or paths, got %s",
                     kiln_json_type_name(kiln_json_type(imgs)));
    for (size_t i = 0; i < kiln_json_len(imgs); i++)
      if (!kiln_json_is(kiln_json_at(imgs, i), KILN_JSON_STRING))
        return gen_bad("images[%zu] must be a string (a data: URL, a file:// URL or a path)", i);
    l->images = imgs;
  }
  if (msgs) {
    if (pt || pi || imgs)
      return gen_bad(
          "\"messages\" holds the whole chat, images included: no \"prompt\", "
          "\"prompt_ids\" or \"images\" with it");
    if (!kiln_json_is(msgs, KILN_JSON_ARRAY))
      return gen_bad("messages must be an array of chat messages, got %s",
                     kiln_json_type_name(kiln_json_type(msgs)));
    l->messages = msgs;
  } else if (pt && pi) {
    return gen_bad("give \"prompt\" or \"prompt_ids\", not both");
  }
  if (msgs) {
    /* rendered by gen_line_prepare */
  } else if (pt && kiln_json_is(pt, KILN_JSON_STRING)) {
    size_t n;
    l->prompt = kiln_json_string(pt, &n);
    if (strlen(l->prompt) != n) return gen_bad("prompt contains a NUL character");
  } else if (pt && kiln_json_is(pt, KILN_JSON_ARRAY)) {
    st = gen_field_ids(pt, "prompt", &l->ids);
  } else if (pt) {
    return gen_bad("prompt must be a string (or an array of token ids), got %s",
                   kiln_json_type_name(kiln_json_type(pt)));
  } else if (pi) {
    st = gen_field_ids(pi, "prompt_ids", &l->ids);
  } else {
    return gen_bad(
        "no prompt: give \"prompt\" (text), \"prompt_ids\" (token ids) or "
        "\"messages\" (a chat)");
  }
  if (st) return st;
  int64_t x = p->max_tokens;
  if (!st) st = gen_field_int(r, "max_tokens", 1, INT32_MAX, &x);
  p->max_tokens = (int32_t)x;
  if (!st) st = gen_field_i32(r, "min_tokens", &p->min_tokens);
  if (!st) st = gen_field_i32(r, "n", &p->n);
  if (!st) st = gen_field_i32(r, "top_k", &p->top_k);
  if (p->top_k == -1) p->top_k = 0; /* vLLM's "off" */
  if (!st) st = gen_field_i32(r, "priority", &p->priority);
  if (!st) st = gen_field_float(r, "temperature", &p->temperature);
  if (!st) st = gen_field_float(r, "top_p", &p->top_p);
  if (!st) st = gen_field_float(r, "min_p", &p->min_p);
  if (!st) st = gen_field_float(r, "presence_penalty", &p->presence_penalty);
  if (!st) st = gen_field_float(r, "frequency_penalty", &p->frequency_penalty);
  if (!st) st = gen_field_float(r, "repetition_penalty", &p->repetition_penalty);
  if (!st) st = gen_field_bool(r, "ignore_eos", &p->ignore_eos);
  if (!st) st = gen_field_bool(r, "skip_special_tokens", &p->skip_special_tokens);
  if (!st) st = gen_field_bool(r, "include_stop_str_in_output", &p->include_stop_str_in_output);
  if (!st) st = gen_line_guide(r, l);
  if (st) return st;
  if (gen_field(r, "seed")) {
    int64_t seed = 0;
    if ((st = gen_field_int(r, "seed", INT64_MIN, INT64_MAX, &seed))) return st;
    p->has_seed = true;
    p->seed = (uint64_t)seed;
  }
  /* logprobs: an integer k (completions), or true/false (chat, with top_logprobs). */
  const kiln_json_t *lp = gen_field(r, "logprobs");
  if (lp && kiln_json_is(lp, KILN_JSON_BOOL)) {
    int32_t top = 0;
    if ((st = gen_field_i32(r, "top_logprobs", &top))) return st;
    p->logprobs = kiln_json_bool(lp) ? top : -1;
  } else if (lp && (st = gen_field_i32(r, "logprobs", &p->logprobs))) {
    return st;
  }
  const kiln_json_t *stop = gen_field(r, "stop");
  if (stop) {
    size_t n = kiln_json_is(stop, KILN_JSON_ARRAY) ? kiln_json_len(stop) : 1;
    if (!(l->stop = calloc(n + 1, sizeof(*l->stop))))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    if (kiln_json_is(stop, KILN_JSON_STRING)) {
      l->stop[0] = kiln_json_string(stop, NULL);
    } else if (kiln_json_is(stop, KILN_JSON_ARRAY)) {
      for (size_t i = 0; i < n; i++)
        if (!(l->stop[i] = kiln_json_string(kiln_json_at(stop, i), NULL)))
          return gen_bad("stop[%zu] is not a string", i);
    } else {
      return gen_bad("stop must be a string or an array of strings, got %s",
                     kiln_json_type_name(kiln_json_type(stop)));
    }
    p->stop = l->stop;
    p->num_stop = (int32_t)n;
  }
  const kiln_json_t *sti = gen_field(r, "stop_token_ids");
  if (sti) {
    if ((st = gen_field_ids(sti, "stop_token_ids", &l->stop_ids))) return st;
    p->stop_token_ids = l->stop_ids.v;
    p->num_stop_token_ids = (int32_t)l->stop_ids.len;
  }
  const kiln_json_t *lb = gen_field(r, "logit_bias");
  if (lb) {
    if (!kiln_json_is(lb, KILN_JSON_OBJECT))
      return gen_bad("logit_bias must be an object of \"token id\": bias, got %s",
                     kiln_json_type_name(kiln_json_type(lb)));
    size_t n = kiln_json_len(lb);
    if (n && !(l->bias_values = calloc(n, sizeof(float))))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    for (size_t i = 0; i < n; i++) {
      const char *key = kiln_json_key_at(lb, i, NULL);
      const kiln_json_t *v = kiln_json_value_at(lb, i);
      char *end;
      errno = 0;
      long long id = strtoll(key, &end, 10);
      if (errno || end == key || *end || id < INT32_MIN || id > INT32_MAX)
        return gen_bad("logit_bias: key \"%s\" is not a token id", key);
      if (!kiln_json_is(v, KILN_JSON_NUMBER))
        return gen_bad("logit_bias[\"%s\"] must be a number, got %s", key,
                       kiln_json_type_name(kiln_json_type(v)));
      gen_ids_push(&l->bias_ids, (int32_t)id);
      l->bias_values[i] = (float)kiln_json_number(v);
    }
    if (l->bias_ids.oom) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    p->logit_bias_ids = l->bias_ids.v;
    p->logit_bias_values = l->bias_values;
    p->num_logit_bias = (int32_t)n;
  }
  return NULL;
}

/* A line's images and chat: reads "images", renders "messages" (or "prompt" with "images", one
 * user message of the images then the text, as --image with --prompt) with the chat template
 * into token ids. "prompt_ids" with "images" stay as given: one placeholder id per image. */
static kiln_status_t gen_line_prepare(kiln_engine_t *eng, bool has_tokenizer, gen_line_t *l) {
  if (!l->messages && !l->images) return NULL;
  if (l->images && kiln_json_len(l->images) && kiln_engine_max_images(eng) == 0)
    return gen_bad("images: the model takes text only (it has no vision tower)");
  if ((l->messages || l->prompt) && !has_tokenizer)
    return gen_bad("%s needs a tokenizer.json beside the model (or give \"prompt_ids\")",
                   l->messages ? "messages" : "prompt with images");
  kiln_status_t st = NULL;
  for (size_t i = 0; l->images && i < kiln_json_len(l->images) && !st; i++) {
    size_t n;
    const char *u = kiln_json_string(kiln_json_at(l->images, i), &n);
    char where[32];
    snprintf(where, sizeof(where), "images[%zu]", i);
    st = kiln_cli_image_add_url(u, n, where, &l->imgs);
  }
  if (st || (!l->messages && !l->prompt)) return st;
  int32_t *ids = NULL, n = 0;
  st = l->messages ? kiln_cli_chat_ids_json(eng, l->messages, "request", &l->imgs, &ids, &n)
                   : kiln_cli_chat_ids(eng, NULL, l->prompt, &l->imgs, &ids, &n);
  if (st) return st;
  free(l->ids.v);
  l->ids.v = ids;
  l->ids.len = l->ids.cap = (size_t)n;
  l->prompt = NULL;
  return NULL;
}

/* ---- batch ---------------------------------------------------------------------------------- */

typedef struct gen_batch {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int64_t in_flight;  /* submitted, final event not yet come */
  int64_t finished;   /* requests done (run or failed) */
  int64_t gen_tokens; /* tokens delivered so far */
  /* main thread only: */
  gen_job_t *head, *tail; /* not yet written, in input order */
  int64_t pending;
  int64_t total; /* non-blank input lines, or -1 when unknown (a pipe) */
  int64_t ok, failed, prompt_tokens, completion_tokens;
  bool tty;
  int last_decile;
  double t0, last_draw;
  const char *input_name;
  kiln_engine_t *held; /* the engine whose intake this burst holds, or NULL */
} gen_batch_t;

/* Ends the hold on the engine's intake, if any (before waiting: held requests do not run). */
static void gen_release(gen_batch_t *b) {
  if (b->held) kiln_engine_hold_intake(b->held, false);
  b->held = NULL;
}

static void gen_on_output(void *user, const kiln_output_t *o) {
  gen_job_t *j = user;
  gen_batch_t *b = j->batch;
  gen_job_take(j, o);
  pthread_mutex_lock(&b->mu);
  b->gen_tokens += o->num_tokens;
  if (o->request_finished) {
    j->done = true;
    b->in_flight--;
    b->finished++;
    pthread_cond_broadcast(&b->cv);
  }
  pthread_mutex_unlock(&b->mu);
}

/* Draws the progress: a bar redrawn in place on a terminal, else a line per 10%. */
static void gen_progress(gen_batch_t *b, bool final) {
  pthread_mutex_lock(&b->mu);
  int64_t done = b->finished, toks = b->gen_tokens;
  pthread_mutex_unlock(&b->mu);
  double now = kiln_cli_now(), el = now - b->t0;
  double tps = el > 0 ? (double)toks / el : 0;
  if (b->tty) {
    if (!final && now - b->last_draw < 0.1) return;
    b->last_draw = now;
    if (b->total > 0) {
      int width = 30, fill = (int)(width * done / b->total);
      char bar[32];
      for (int i = 0; i < width; i++) bar[i] = i < fill ? '=' : ' ';
      bar[width] = 0;
      fprintf(stderr, "\r[%s] %lld/%lld requests, %.0f tokens/s\033[K", bar, (long long)done,
              (long long)b->total, tps);
    } else {
      fprintf(stderr, "\r%lld requests, %.0f tokens/s\033[K", (long long)done, tps);
    }
    if (final) fputc('\n', stderr);
    fflush(stderr);
  } else if (b->total > 0 && !final && el >= 1.0) {
    /* A few lines for a log file; none for a batch that takes under a second. */
    int decile = (int)(10 * done / b->total);
    if (decile > b->last_decile && decile < 10) {
      b->last_decile = decile;
      fprintf(stderr, "kiln: %d%% (%lld/%lld requests), %.0f tokens/s\n", 10 * decile,
              (long long)done, (long long)b->total, tps);
    }
  }
}

static void gen_report_error(gen_batch_t *b, const gen_job_t *j) {
  if (b->tty) fputs("\r\033[K", stderr);
  fprintf(stderr, "kiln: %s: %s\n", b->input_name, j->error);
}

/* Writes one job's result line. */
static kiln_status_t gen_write_job(gen_batch_t *b, const gen_job_t *j, bool has_tokenizer,
                                   FILE *out) {
  kiln_status_t st = NULL;
  kiln_strbuf_t s = KILN_STRBUF_INIT;
  kiln_strbuf_printf(&s, "{\"index\": %lld", (long long)j->index);
  bool failed = j->error || gen_job_oom(j);
  if (failed) {
    kiln_strbuf_append_str(&s, ", \"error\": ");
    const char *msg = j->error ? j->error : "out of memory";
    kiln_json_write_string(&s, msg, strlen(msg), false);
  } else {
    gen_write_per_seq(&s, j, "token_ids", gen_write_ids);
    if (has_tokenizer) gen_write_per_seq(&s, j, "text", gen_write_text);
    gen_write_per_seq(&s, j, "finish_reason", gen_write_finish);
    kiln_strbuf_printf(&s,
                       ", \"usage\": {\"prompt_tokens\": %d, \"completion_tokens\": %d, "
                       "\"cached_tokens\": %d}",
                       j->usage.prompt_tokens, j->usage.completion_tokens, j->usage.cached_tokens);
    if (j->want_logprobs) gen_write_per_seq(&s, j, "logprobs", gen_write_lp);
  }
  kiln_strbuf_append_str(&s, "}\n");
  if (!kiln_strbuf_ok(&s))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory writing result %lld",
                          (long long)j->index);
  else if (fwrite(s.data, 1, s.len, out) != s.len)
    st = kiln_status_make(KILN_ERR_IO, "writing the results: %s", strerror(errno));
  kiln_strbuf_free(&s);
  if (failed) {
    b->failed++;
    if (!j->error) {
      gen_job_t tmp = *j;
      tmp.error = (char *)"out of memory";
      gen_report_error(b, &tmp);
    }
  } else {
    b->ok++;
    b->prompt_tokens += j->usage.prompt_tokens;
    b->completion_tokens += j->usage.completion_tokens;
  }
  return st;
}

/* Writes every finished job at the head of the pending list. */
static kiln_status_t gen_flush(gen_batch_t *b, bool has_tokenizer, FILE *out) {
  kiln_status_t st = NULL;
  for (;;) {
    gen_job_t *j = b->head;
    if (!j) break;
    pthread_mutex_lock(&b->mu);
    bool done = j->done;
    pthread_mutex_unlock(&b->mu);
    if (!done) break;
    if (j->error && j->req) gen_report_error(b, j); /* failed while running */
    if (!st) st = gen_write_job(b, j, has_tokenizer, out);
    b->head = j->next;
    if (!b->head) b->tail = NULL;
    b->pending--;
    if (j->req) kiln_request_release(j->req);
    gen_job_free(j);
  }
  return st;
}

/* Counts the non-blank lines of a regular file and rewinds it; -1 for anything else. */
static int64_t gen_count_lines(FILE *f) {
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) return -1;
  char *line = NULL;
  size_t cap = 0;
  ssize_t n;
  int64_t count = 0;
  while ((n = getline(&line, &cap, f)) >= 0) {
    for (ssize_t i = 0; i < n; i++)
      if (line[i] != ' ' && line[i] != '\t' && line[i] != '\r' && line[i] != '\n') {
        count++;
        break;
      }
  }
  free(line);
  rewind(f);
  return count;
}

static bool gen_blank(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n') return false;
  return true;
}

/* Submits a parsed line; waits for room while the engine's queue is full. */
static kiln_status_t gen_submit(gen_batch_t *b, kiln_engine_t *eng, gen_line_t *l, gen_job_t *j,
                                bool has_tokenizer, FILE *out, kiln_status_t *write_st) {
  kiln_request_desc_t d = {.struct_size = sizeof(d),
                           .prompt = l->prompt,
                           .prompt_ids = l->prompt ? NULL : l->ids.v,
                           .num_prompt_ids = l->prompt ? 0 : (int32_t)l->ids.len,
                           .params = &l->p,
                           .on_output = gen_on_output,
                           .user = j,
                           .images = l->imgs.num ? l->imgs.images : NULL,
                           .num_images = l->imgs.num};
  for (int idle_waits = 0;;) {
    kiln_request_t *req = NULL;
    pthread_mutex_lock(&b->mu);
    b->in_flight++;
    pthread_mutex_unlock(&b->mu);
    kiln_status_t st = kiln_engine_submit(eng, &d, &req);
    if (!st) {
      j->req = req; /* released once done: the callback tells when */
      return NULL;
    }
    if (kiln_status_code(st) == KILN_ERR_UNAVAILABLE) gen_release(b);
    pthread_mutex_lock(&b->mu);
    b->in_flight--;
    bool busy = b->in_flight > 0;
    if (kiln_status_code(st) == KILN_ERR_UNAVAILABLE && (busy || idle_waits++ < 100)) {
      /* The queue is full: wait for a request to finish, then try again. */
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_nsec += 50 * 1000 * 1000;
      if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
      int64_t seen = b->finished;
      while (b->finished == seen && pthread_cond_timedwait(&b->cv, &b->mu, &until) == 0) {
      }
      pthread_mutex_unlock(&b->mu);
      kiln_status_free(st);
      kiln_status_t ws = gen_flush(b, has_tokenizer, out);
      if (ws && !*write_st)
        *write_st = ws;
      else
        kiln_status_free(ws);
      gen_progress(b, false);
      continue;
    }
    pthread_mutex_unlock(&b->mu);
    return st;
  }
}

static int gen_batch(kiln_cli_t *cli, const gen_args_t *a) {
  const char *cmd = cli->argv[0];
  kiln_status_t st = NULL, wst = NULL;
  kiln_engine_t *eng = NULL;
  FILE *in = NULL, *out = NULL;
  char *line = NULL;
  size_t cap = 0;
  double wall = 0;
  gen_batch_t b;
  memset(&b, 0, sizeof(b));
  pthread_mutex_init(&b.mu, NULL);
  pthread_cond_init(&b.cv, NULL);
  bool use_stdin = !strcmp(a->input, "-"), use_stdout = !a->output || !strcmp(a->output, "-");
  b.input_name = use_stdin ? "<stdin>" : a->input;
  in = use_stdin ? stdin : fopen(a->input, "rb");
  if (!in) {
    st = kiln_status_make(KILN_ERR_NOT_FOUND, "%s: cannot open --input %s: %s", cmd, a->input,
                          strerror(errno));
    goto done;
  }
  out = use_stdout ? stdout : fopen(a->output, "wb");
  if (!out) {
    st = kiln_status_make(KILN_ERR_IO, "%s: cannot create --output %s: %s", cmd, a->output,
                          strerror(errno));
    goto done;
  }
  b.total = gen_count_lines(in);
  b.tty = isatty(fileno(stderr));
  if ((st = gen_engine(cli, a, false, &eng))) goto done;
  kiln_engine_info_t info;
  kiln_engine_get_info(eng, &info);
  kiln_sampling_params_t base;
  gen_base_params(a, &base);
  b.t0 = kiln_cli_now();
  int64_t line_no = 0, index = 0;
  bool eof = false;
  while (!st) {
    /* Read and submit while the window has room; the burst is admitted at once (the intake
     * is held until it ends), so the batches do not depend on how fast lines are read. */
    kiln_engine_hold_intake(eng, true);
    b.held = eng;
    for (;;) {
      pthread_mutex_lock(&b.mu);
      bool room = b.in_flight < a->window && b.pending < 4 * a->window;
      pthread_mutex_unlock(&b.mu);
      if (eof || !room) break;
      errno = 0;
      ssize_t n = getline(&line, &cap, in);
      if (n < 0) {
        if (ferror(in))
          st = kiln_status_make(KILN_ERR_IO, "%s: reading %s: %s", cmd, b.input_name,
                                strerror(errno));
        eof = true;
        break;
      }
      line_no++;
      while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) n--; /* errors say line 1 */
      if (gen_blank(line, (size_t)n)) continue;
      gen_line_t l;
      memset(&l, 0, sizeof(l));
      kiln_status_t lst = gen_line_parse(line, (size_t)n, &base, &l);
      int32_t nseq = lst || l.p.n < 1 || l.p.n > 65536 ? 1 : l.p.n;
      gen_job_t *j = gen_job_new(nseq, !lst && l.p.logprobs >= 0);
      if (!j) {
        kiln_status_free(lst);
        gen_line_free(&l);
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
        break;
      }
      j->batch = &b;
      j->index = index++;
      j->line = line_no;
      if (b.tail)
        b.tail->next = j;
      else
        b.head = j;
      b.tail = j;
      b.pending++;
      if (!lst) lst = gen_line_prepare(eng, info.has_tokenizer, &l);
      if (!lst) {
        lst = gen_submit(&b, eng, &l, j, info.has_tokenizer, out, &wst);
        if (lst) lst = kiln_cli_images_error(&l.imgs, lst);
      }
      gen_line_free(&l);
      if (lst) {
        gen_job_fail(j, kiln_status_message(lst));
        kiln_status_free(lst);
        gen_report_error(&b, j);
        pthread_mutex_lock(&b.mu);
        j->done = true;
        b.finished++;
        pthread_mutex_unlock(&b.mu);
      }
    }
    gen_release(&b);
    kiln_status_t ws = gen_flush(&b, info.has_tokenizer, out);
    if (ws && !wst)
      wst = ws;
    else
      kiln_status_free(ws);
    gen_progress(&b, false);
    if (st || wst || (eof && !b.head)) break;
    /* Wait for a request to finish (or 100 ms, to keep the progress moving). */
    pthread_mutex_lock(&b.mu);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 100 * 1000 * 1000;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    int64_t seen = b.finished;
    while (b.finished == seen && pthread_cond_timedwait(&b.cv, &b.mu, &until) == 0) {
    }
    pthread_mutex_unlock(&b.mu);
  }
  if (!st && wst) st = wst, wst = NULL;
  wall = kiln_cli_now() - b.t0;
  gen_progress(&b, true);
done:
  /* After an error: cancel what still runs; destroy delivers every final event (to jobs still
   * alive), so the jobs are freed after it. */
  for (gen_job_t *j = b.head; j; j = j->next)
    if (j->req) {
      kiln_request_cancel(j->req);
      kiln_request_release(j->req);
      j->req = NULL;
    }
  kiln_engine_destroy(eng);
  if (!st) {
    int64_t total = b.prompt_tokens + b.completion_tokens;
    fprintf(stderr,
            "kiln: %lld requests (%lld ok, %lld failed), %lld prompt + %lld generated tokens in "
            "%.2f s: %.2f requests/s, %.1f output tokens/s, %.1f total tokens/s\n",
            (long long)(b.ok + b.failed), (long long)b.ok, (long long)b.failed,
            (long long)b.prompt_tokens, (long long)b.completion_tokens, wall,
            wall > 0 ? (double)(b.ok + b.failed) / wall : 0.0,
            wall > 0 ? (double)b.completion_tokens / wall : 0.0,
            wall > 0 ? (double)total / wall : 0.0);
  }
  kiln_status_free(wst);
  while (b.head) {
    gen_job_t *j = b.head;
    b.head = j->next;
    gen_job_free(j);
  }
  free(line);
  if (in && in != stdin) fclose(in);
  if (out && (use_stdout ? fflush(out) : fclose(out)) != 0 && !st)
    st = kiln_status_make(KILN_ERR_IO, "%s: writing %s: %s", cmd,
                          use_stdout ? "the results" : a->output, strerror(errno));
  pthread_cond_destroy(&b.cv);
  pthread_mutex_destroy(&b.mu);
  if (st) return kiln_cli_fail(st);
  return b.failed ? 1 : 0;
}

/* ---- the command ---------------------------------------------------------------------------- */

int kiln_cmd_generate(kiln_cli_t *cli) {
  gen_args_t a;
  kiln_status_t st = gen_parse(cli, &a);
  int rc;
  if (st) {
    rc = kiln_cli_fail(st);
  } else if (a.help) {
    rc = 0; /* kiln_opts_parse printed it */
  } else {
    rc = a.input ? gen_batch(cli, &a) : gen_single(cli, &a);
  }
  kiln_opts_free(&gen_opts, &a);
  free(a.guide_spec);
  return rc;
}
