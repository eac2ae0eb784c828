/* cmd_chat.c - `kiln chat`: an interactive chat with a model in the terminal. Each turn renders
 * the whole conversation with the model's chat template (the prefix cache keeps the earlier
 * turns' KV blocks, so only the new text is computed) and streams the reply. Input is plain
 * stdin: a line ending in a backslash continues on the next one, a line holding only """
 * opens and closes a multi-line block. SIGINT during a reply cancels the request (the text
 * so far stays in the conversation); at the prompt it clears the line, and a second one in a
 * row exits. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "base/json.h"
#include "base/strbuf.h"
#include "kiln/kiln.h"

typedef struct chat_args {
  const char *model, *dtype, *quantization, *system;
  int64_t max_tokens, top_k, seed;
  double temperature, top_p, min_p, repetition_penalty;
  bool has_seed, ignore_eos;
} chat_args_t;

static const char chat_usage[] =
    "usage: kiln chat [--model DIR|FILE.gguf] [--system TEXT] [--temperature T] [options]\n"
    "An interactive chat with the model (default: the embedded kiln-tiny) in the terminal.\n"
    "Type a message and press Enter; the reply streams back. A line ending in \\ continues on\n"
    "the next line; a line holding only \"\"\" starts a multi-line message, and another ends\n"
    "it. Commands: /reset (forget the conversation), /system TEXT (set the system message\n"
    "and reset), /help, /exit. Ctrl-C stops a reply (what it said so far stays in the\n"
    "conversation); Ctrl-C twice at the prompt, Ctrl-D or /exit quits. Each turn renders\n"
    "the whole conversation with the model's chat template; the prefix cache keeps the\n"
    "earlier turns, so only the new text is computed.\n";

static const kiln_opt_t chat_rows[] = {
    KILN_OPT_STRING("--model", "DIR|FILE.gguf", chat_args_t, model,
                    "the model (default: [model] path)"),
    KILN_OPT_STRING("--dtype", "NAME", chat_args_t, dtype,
                    "auto, float32, float16 or bfloat16 (default: [model] dtype)"),
    KILN_OPT_STRING("--quantization", "NAME", chat_args_t, quantization,
                    "none or fp8: quantize a float checkpoint's Linears to FP8\n"
                    "at load (default: [model] quantization)"),
    KILN_OPT_STRING("--system", "TEXT", chat_args_t, system, "a system message to start with"),
    KILN_OPT_INT("--max-tokens", "N", chat_args_t, max_tokens, -1, 16777216,
                 "most tokens per reply; -1 = the rest of the context (default)"),
    KILN_OPT_FLOAT("--temperature", "T", chat_args_t, temperature, 0, 100,
                   "[0, 100]; 0 = greedy (default 0.7)"),
    KILN_OPT_FLOAT("--top-p", "P", chat_args_t, top_p, 1e-9, 1, "(0, 1] (default 0.95)"),
    KILN_OPT_INT("--top-k", "K", chat_args_t, top_k, 0, INT32_MAX, "0 = off (default 0)"),
    KILN_OPT_FLOAT("--min-p", "P", chat_args_t, min_p, 0, 1, "[0, 1] (default 0)"),
    KILN_OPT_FLOAT("--repetition-penalty", "R", chat_args_t, repetition_penalty, 1e-9, 100,
                   "(0, 100]; 1 = off (default 1)"),
    KILN_OPT_INT_SEEN("--seed", "S", chat_args_t, seed, has_seed, 0, INT64_MAX,
                      "the seed of the first reply, S + 1 of the next... (default: random)"),
    KILN_OPT_FLAG("--ignore-eos", chat_args_t, ignore_eos,
                  "keep going past end-of-sequence tokens (up to --max-tokens)"),
};

static const kiln_opts_t chat_opts = {
    .cmd = "chat",
    .usage = chat_usage,
    .opts = chat_rows,
    .num_opts = KILN_OPTS_COUNT(chat_rows),
    .flags = KILN_OPTS_USAGE_ON_ERROR,
    .width = 24,
    .common = &kiln_cli_common_opts,
};

/* ---- SIGINT ------------------------------------------------------------------------------- */

static volatile sig_atomic_t chat_sigint;

static void chat_on_sigint(int sig) {
  (void)sig;
  chat_sigint = 1;
}

/* ---- the conversation --------------------------------------------------------------------- */

typedef struct chat_turn {
  const char *role; /* "system", "user", "assistant" (static) */
  char *content;
} chat_turn_t;

typedef struct chat_hist {
  chat_turn_t *v;
  size_t len, cap;
} chat_hist_t;

static void hist_clear(chat_hist_t *h) {
  for (size_t i = 0; i < h->len; i++) free(h->v[i].content);
  h->len = 0;
}

static bool hist_push(chat_hist_t *h, const char *role, const char *text, size_t len) {
  if (h->len == h->cap) {
    size_t cap = h->cap ? 2 * h->cap : 16;
    chat_turn_t *v = realloc(h->v, cap * sizeof(*v));
    if (!v) return false;
    h->v = v;
    h->cap = cap;
  }
  char *c = malloc(len + 1);
  if (!c) return false;
  memcpy(c, text, len);
  c[len] = 0;
  h->v[h->len++] = (chat_turn_t){role, c};
  return true;
}

static void hist_pop(chat_hist_t *h) {
  if (h->len) free(h->v[--h->len].content);
}

/* The conversation's prompt ids: the chat template's rendering, tokenized as it is (the
 * template writes its own special tokens). */
static kiln_status_t hist_prompt(kiln_engine_t *eng, const chat_hist_t *h, int32_t **ids,
                                 int32_t *n) {
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_strbuf_append_char(&sb, '[');
  for (size_t i = 0; i < h->len; i++) {
    kiln_strbuf_append_str(&sb, i ? ", {\"role\": \"" : "{\"role\": \"");
    kiln_strbuf_append_str(&sb, h->v[i].role);
    kiln_strbuf_append_str(&sb, "\", \"content\": ");
    kiln_json_write_string(&sb, h->v[i].content, strlen(h->v[i].content), false);
    kiln_strbuf_append_char(&sb, '}');
  }
  kiln_strbuf_append_char(&sb, ']');
  if (!kiln_strbuf_ok(&sb)) {
    kiln_strbuf_free(&sb);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  }
  kiln_chat_args_t a = {.messages_json = kiln_strbuf_cstr(&sb),
                        .messages_len = sb.len,
                        .add_generation_prompt = true};
  char *text = NULL;
  size_t tl = 0;
  kiln_status_t st = kiln_engine_apply_chat_template(eng, &a, &text, &tl);
  if (!st) st = kiln_engine_tokenize(eng, text, tl, false, ids, n);
  free(text);
  kiln_strbuf_free(&sb);
  return st;
}

/* ---- input -------------------------------------------------------------------------------- */

typedef enum { IN_MESSAGE, IN_EOF, IN_INTERRUPT } chat_input_t;

/* Reads one message into msg (without its final newline): lines joined by a trailing
 * backslash, or a """ block. IN_INTERRUPT when SIGINT came while reading. */
static chat_input_t read_message(kiln_strbuf_t *msg, bool tty) {
  char *line = NULL;
  size_t cap = 0;
  bool block = false;
  chat_input_t r = IN_MESSAGE;
  kiln_strbuf_reset(msg);
  if (tty) fputs(">>> ", stdout);
  fflush(stdout);
  for (;;) {
    errno = 0;
    ssize_t n = getline(&line, &cap, stdin);
    if (n < 0) {
      bool intr = errno == EINTR || chat_sigint;
      clearerr(stdin);
      r = intr ? IN_INTERRUPT : (msg->len || block ? IN_MESSAGE : IN_EOF);
      break;
    }
    if (n > 0 && line[n - 1] == '\n') line[--n] = 0;
    if (n > 0 && line[n - 1] == '\r') line[--n] = 0;
    if (!strcmp(line, "\"\"\"")) {
      if (block) break;
      if (msg->len == 0) {
        block = true;
        if (tty) fputs("... ", stdout), fflush(stdout);
        continue;
      }
    }
    if (block) {
      if (msg->len) kiln_strbuf_append_char(msg, '\n');
      kiln_strbuf_append(msg, line, (size_t)n);
    } else if (n > 0 && line[n - 1] == '\\') {
      kiln_strbuf_append(msg, line, (size_t)n - 1);
      kiln_strbuf_append_char(msg, '\n');
    } else {
      kiln_strbuf_append(msg, line, (size_t)n);
      break;
    }
    if (tty) fputs("... ", stdout), fflush(stdout);
  }
  free(line);
  return r;
}

/* ---- one reply ---------------------------------------------------------------------------- */

/* Streams the reply to the conversation to stdout and appends it (cut where it was stopped)
 * as the assistant's turn. An error that refuses the request leaves the conversation as it
 * was (the caller drops the user's turn). */
static kiln_status_t chat_reply(kiln_engine_t *eng, chat_hist_t *h, const chat_args_t *a,
                                int64_t max_len, uint64_t seed, bool *out_stopped) {
  int32_t *ids = NULL, n = 0;
  kiln_request_t *req = NULL;
  kiln_strbuf_t reply = KILN_STRBUF_INIT;
  *out_stopped = false;
  kiln_status_t st = hist_prompt(eng, h, &ids, &n);
  if (st) return st;
  if (n >= max_len) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "the conversation is %d tokens, the model's context %lld: /reset to "
                          "start over",
                          n, (long long)max_len);
    goto done;
  }
  kiln_sampling_params_t p;
  kiln_sampling_params_init(&p);
  p.max_tokens =
      (int32_t)(a->max_tokens < 0 || n + a->max_tokens > max_len ? max_len - n : a->max_tokens);
  p.temperature = (float)a->temperature;
  p.top_p = (float)a->top_p;
  p.top_k = (int32_t)a->top_k;
  p.min_p = (float)a->min_p;
  p.repetition_penalty = (float)a->repetition_penalty;
  p.has_seed = true;
  p.seed = seed;
  p.ignore_eos = a->ignore_eos;
  kiln_request_desc_t d = {
      .struct_size = sizeof(d), .prompt_ids = ids, .num_prompt_ids = n, .params = &p};
  chat_sigint = 0;
  if ((st = kiln_engine_submit(eng, &d, &req))) goto done;
  bool cancelled = false;
  for (;;) {
    if (chat_sigint && !cancelled) {
      kiln_request_cancel(req);
      cancelled = true;
    }
    kiln_output_t *o = NULL;
    if ((st = kiln_request_poll(req, 50, &o))) break;
    if (!o) continue;
    if (o->text_len) {
      fwrite(o->text, 1, o->text_len, stdout);
      fflush(stdout);
      kiln_strbuf_append(&reply, o->text, o->text_len);
    }
    bool last = o->request_finished;
    if (o->finish_reason == KILN_FINISH_ERROR)
      st = kiln_status_make(KILN_ERR_INTERNAL, "the reply failed: %s",
                            o->error ? o->error : "unknown error");
    if (o->finish_reason == KILN_FINISH_ABORT) *out_stopped = true;
    kiln_output_free(o);
    if (last) break;
  }
  fputs(*out_stopped ? "\n[stopped]\n" : "\n", stdout);
  fflush(stdout);
  if (!kiln_strbuf_ok(&reply))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  else if (!hist_push(h, "assistant", kiln_strbuf_cstr(&reply), reply.len))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
done:
  chat_sigint = 0;
  if (req) kiln_request_release(req);
  kiln_strbuf_free(&reply);
  free(ids);
  return st;
}

/* ---- the command -------------------------------------------------------------------------- */

static kiln_status_t chat_engine(kiln_cli_t *cli, const chat_args_t *a, kiln_engine_t **out) {
  const char **ov = calloc((size_t)cli->num_sets + 4, sizeof(*ov));
  char *path = NULL, *dtype = NULL, *quant = NULL;
  int32_t n = 0;
  kiln_status_t st = NULL;
  if (!ov) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  ov[n++] = "engine.max_num_seqs=1"; /* one conversation: a small KV pool (--set wins) */
  for (int i = 0; i < cli->num_sets; i++) ov[n++] = cli->sets[i];
  if (a->model && a->model[0] && !(path = kiln_strprintf("model.path=%s", a->model))) goto oom;
  if (path) ov[n++] = path;
  if (a->dtype && !(dtype = kiln_strprintf("model.dtype=%s", a->dtype))) goto oom;
  if (dtype) ov[n++] = dtype;
  if (a->quantization && !(quant = kiln_strprintf("model.quantization=%s", a->quantization)))
    goto oom;
  if (quant) ov[n++] = quant;
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

static void chat_help(void) {
  fputs(
      "  /reset        forget the conversation (the system message stays)\n"
      "  /system TEXT  set the system message (empty: none) and reset\n"
      "  /exit         quit (also Ctrl-D, or Ctrl-C twice at the prompt)\n"
      "  a line ending in \\ continues on the next; \"\"\" opens and closes a block\n"
      "  Ctrl-C during a reply stops it\n",
      stdout);
}

int kiln_cmd_chat(kiln_cli_t *cli) {
  chat_args_t a = {.max_tokens = -1, .temperature = 0.7, .top_p = 0.95, .repetition_penalty = 1};
  bool help = false;
  kiln_engine_t *eng = NULL;
  chat_hist_t hist = {0};
  kiln_strbuf_t msg = KILN_STRBUF_INIT;
  char *system = NULL;
  kiln_status_t st = kiln_opts_parse(&chat_opts, cli->argc, cli->argv, &a, &help);
  if (st || help) goto done;
  if (a.system && a.system[0] && !(system = strdup(a.system))) goto oom;

  /* SIGINT goes to this thread only: the engine's threads start with it blocked, so that it
   * interrupts the read at the prompt. */
  sigset_t sigs, old;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, &old);
  st = chat_engine(cli, &a, &eng);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (st) goto done;
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = chat_on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0; /* no SA_RESTART: a read at the prompt returns EINTR */
  sigaction(SIGINT, &sa, NULL);

  kiln_engine_info_t info;
  kiln_engine_get_info(eng, &info);
  if (!info.has_tokenizer) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "chat: the model has no tokenizer (use kiln generate --ids)");
    goto done;
  }
  uint64_t seed = a.has_seed ? (uint64_t)a.seed : ((uint64_t)getpid() << 32) ^ (uint64_t)time(0);
  bool tty = isatty(0) && isatty(1);
  fprintf(stderr, "kiln chat: %s (%s on %s, context %lld); /help for commands, Ctrl-D quits\n",
          info.model_path, info.backend, info.device, (long long)info.max_model_len);
  if (system && !hist_push(&hist, "system", system, strlen(system))) goto oom;
  int interrupts = 0;
  for (;;) {
    chat_input_t in = read_message(&msg, tty);
    if (in == IN_EOF) break;
    if (in == IN_INTERRUPT) {
      chat_sigint = 0;
      if (++interrupts >= 2) break;
      fputs(tty ? "\n(Ctrl-C again, Ctrl-D or /exit to quit)\n"
                : "(Ctrl-C again, Ctrl-D or /exit to quit)\n",
            stdout);
      continue;
    }
    interrupts = 0;
    if (!kiln_strbuf_ok(&msg)) goto oom;
    const char *m = kiln_strbuf_cstr(&msg);
    if (m[0] == '/') {
      if (!strcmp(m, "/exit") || !strcmp(m, "/quit") || !strcmp(m, "/bye")) break;
      if (!strcmp(m, "/help") || !strcmp(m, "/?")) {
        chat_help();
      } else if (!strcmp(m, "/reset") || !strcmp(m, "/clear")) {
        hist_clear(&hist);
        if (system && !hist_push(&hist, "system", system, strlen(system))) goto oom;
        fputs("[the conversation is reset]\n", stdout);
      } else if (!strncmp(m, "/system", 7) && (m[7] == ' ' || m[7] == 0)) {
        const char *t = m[7] ? m + 8 : "";
        free(system);
        system = t[0] ? strdup(t) : NULL;
        if (t[0] && !system) goto oom;
        hist_clear(&hist);
        if (system && !hist_push(&hist, "system", system, strlen(system))) goto oom;
        fputs(system ? "[system message set; the conversation is reset]\n"
                     : "[no system message; the conversation is reset]\n",
              stdout);
      } else {
        fprintf(stdout, "[unknown command %s: /help lists them]\n", m);
      }
      fflush(stdout);
      continue;
    }
    if (!msg.len) continue;
    if (!hist_push(&hist, "user", m, msg.len)) goto oom;
    bool stopped = false;
    kiln_status_t rs = chat_reply(eng, &hist, &a, info.max_model_len, seed++, &stopped);
    if (rs) {
      if (hist.len && hist.v[hist.len - 1].role[0] == 'u') hist_pop(&hist); /* not answered */
      fflush(stdout);
      fprintf(stderr, "kiln: %s\n", kiln_status_message(rs));
      if (kiln_status_code(rs) == KILN_ERR_OUT_OF_MEMORY) {
        st = rs;
        goto done;
      }
      kiln_status_free(rs);
    }
  }
  if (tty) fputc('\n', stdout);
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
done:
  kiln_engine_destroy(eng);
  hist_clear(&hist);
  free(hist.v);
  free(system);
  kiln_strbuf_free(&msg);
  if (st) return kiln_cli_fail(st);
  return 0;
}
