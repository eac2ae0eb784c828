/* cmd_serve.c - `kiln serve`: the OpenAI-compatible HTTP server over one engine. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "base/log.h"
#include "base/strbuf.h"
#include "kiln/kiln.h"
#include "models/hub/hub.h"
#include "server/server.h"

static const char serve_usage[] =
    "usage: kiln serve [--model DIR|FILE.gguf|ORG/NAME] [--host ADDR] [--port N] [--api-key KEY]\n"
    "                  [--served-model-name NAME] [--dtype auto|float32|float16|bfloat16]\n"
    "                  [--quantization none|fp8] [--config FILE] [--set section.key=value]...\n"
    "Serves the configured model over HTTP: POST /v1/completions, /v1/chat/completions,\n"
    "/tokenize, /detokenize; GET /v1/models, /health, /version, /metrics, and a chat page at /\n"
    "(open http://HOST:PORT/ in a browser). [server] in the INI file holds the address, the\n"
    "API key (or $KILN_API_KEY), limits and timeouts. SIGINT or SIGTERM drains running\n"
    "requests (up to server.shutdown_timeout) and exits 0.\n";

/* The options: each one sets a config key, after the --set overrides (so it wins). */
enum {
  SERVE_MODEL,
  SERVE_HOST,
  SERVE_PORT,
  SERVE_API_KEY,
  SERVE_NAME,
  SERVE_DTYPE,
  SERVE_QUANT,
  SERVE_NUM
};

typedef struct serve_args {
  const char *v[SERVE_NUM]; /* the values given, by option; NULL = not given */
} serve_args_t;

static const char *const serve_keys[SERVE_NUM] = {
    [SERVE_MODEL] = "model.path",
    [SERVE_HOST] = "server.host",
    [SERVE_PORT] = "server.port",
    [SERVE_API_KEY] = "server.api_key",
    [SERVE_NAME] = "server.served_model_name",
    [SERVE_DTYPE] = "model.dtype",
    [SERVE_QUANT] = "model.quantization",
};

#define SERVE_OPT(nm, mv, i, hl) KILN_OPT_STRING(nm, mv, serve_args_t, v[i], hl)
static const kiln_opt_t serve_rows[] = {
    SERVE_OPT("--model", "DIR|FILE.gguf|ORG/NAME", SERVE_MODEL,
              "the model: a path or a Hugging Face Hub id ORG/NAME[@REV]\n"
              "(model.path; default: [model] path)"),
    SERVE_OPT("--host", "ADDR", SERVE_HOST, "the address to listen on (server.host)"),
    SERVE_OPT("--port", "N", SERVE_PORT, "the port; 0 = any free one (server.port)"),
    SERVE_OPT("--api-key", "KEY", SERVE_API_KEY,
              "required as Authorization: Bearer KEY on /v1 routes\n"
              "(server.api_key; default: $KILN_API_KEY, else none)"),
    SERVE_OPT("--served-model-name", "NAME", SERVE_NAME,
              "the model's id in the API (server.served_model_name;\n"
              "default: the Hub id, or the model's file or directory name)"),
    SERVE_OPT("--dtype", "NAME", SERVE_DTYPE, "auto, float32, float16 or bfloat16 (model.dtype)"),
    SERVE_OPT("--quantization", "NAME", SERVE_QUANT,
              "none or fp8: quantize a float checkpoint's Linears to FP8\n"
              "at load (model.quantization)"),
};
#undef SERVE_OPT

static const kiln_opts_t serve_opts = {
    .cmd = "serve",
    .usage = serve_usage,
    .opts = serve_rows,
    .num_opts = KILN_OPTS_COUNT(serve_rows),
    .flags = KILN_OPTS_USAGE_ON_ERROR,
    .common = &kiln_cli_common_opts,
};

/* The served name: the configured one, else the Hub id, else the model's file or directory
 * name. */
static char *served_name(const char *configured, const char *model_path, bool hub) {
  if (configured && configured[0]) return strdup(configured);
  if (hub) return strdup(model_path);
  const char *p = model_path ? model_path : "model";
  size_t n = strlen(p);
  while (n > 1 && p[n - 1] == '/') n--;
  size_t b = n;
  while (b > 0 && p[b - 1] != '/') b--;
  if (n - b == 0) return strdup("model");
  char *s = malloc(n - b + 1);
  if (s) {
    memcpy(s, p + b, n - b);
    s[n - b] = 0;
  }
  return s;
}

int kiln_cmd_serve(kiln_cli_t *cli) {
  serve_args_t a = {{NULL}};
  char *extra[SERVE_NUM] = {NULL}; /* "key=value" for each option given */
  const char **ov = calloc((size_t)cli->num_sets + SERVE_NUM, sizeof(char *));
  int n_extra = 0, n_ov = 0, rc = 1;
  kiln_server_t *server = NULL;
  kiln_engine_t *eng = NULL;
  char *name = NULL;
  bool help = false;
  kiln_status_t st = kiln_opts_parse(&serve_opts, cli->argc, cli->argv, &a, &help);
  if (st || help) goto done;
  if (!ov) goto oom;
  for (int i = 0; i < cli->num_sets; i++) ov[n_ov++] = cli->sets[i];
  for (int i = 0; i < SERVE_NUM; i++) {
    if (!a.v[i]) continue;
    if (!(extra[n_extra] = kiln_strprintf("%s=%s", serve_keys[i], a.v[i]))) goto oom;
    ov[n_ov++] = extra[n_extra++];
  }
  /* the command's own options go through the config too, so they are checked the same way */
  for (int i = cli->num_sets; i < n_ov; i++)
    if ((st = kiln_config_set(cli->config, ov[i]))) goto done;
  /* A server logs one line per request, at info: warn (the default) is raised to info; set
   * [log] level = error to silence them. */
  if (kiln_log_get_level() == KILN_LOG_WARN) kiln_log_set_level(KILN_LOG_INFO);

  const char *key = kiln_config_get_string(cli->config, "server", "api_key");
  if (!key[0] && getenv("KILN_API_KEY")) key = getenv("KILN_API_KEY");
  kiln_server_options_t so;
  memset(&so, 0, sizeof(so));
  so.host = kiln_config_get_string(cli->config, "server", "host");
  so.port = (int)kiln_config_get_int(cli->config, "server", "port");
  so.api_key = key;
  so.max_body_bytes = (size_t)kiln_config_get_int(cli->config, "server", "max_body_bytes");
  so.request_timeout = kiln_config_get_float(cli->config, "server", "request_timeout");
  so.shutdown_timeout = kiln_config_get_float(cli->config, "server", "shutdown_timeout");
  so.max_image_bytes = (size_t)kiln_config_get_int(cli->config, "server", "max_image_bytes");
  so.allow_remote_images = kiln_config_get_bool(cli->config, "server", "allow_remote_images");
  so.image_fetch_timeout = kiln_config_get_float(cli->config, "server", "image_fetch_timeout");
  so.tool_parser = kiln_config_get_string(cli->config, "server", "tool_parser");
  so.version = KILN_VERSION_STRING;
  /* A Hub id is downloaded (or found in the Hub cache) here, before the port opens; the
   * engine then finds it in the cache. Its served name is the id, as vLLM's is. */
  kiln_model_location_t *loc = malloc(sizeof(*loc));
  if (!loc) goto oom;
  if ((st = kiln_model_resolve(cli->config, NULL, loc))) {
    free(loc);
    goto done;
  }
  char model_path[4096];
  memcpy(model_path, loc->path, sizeof(model_path));
  name = served_name(kiln_config_get_string(cli->config, "server", "served_model_name"),
                     loc->hub_repo[0] ? loc->hub_repo : model_path, loc->hub_repo[0] != 0);
  free(loc);
  if (!name) goto oom;
  so.model_name = name;

  /* Signals are taken by sigwait below: block them before any thread starts. */
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL);
  signal(SIGPIPE, SIG_IGN);

  if ((st = kiln_server_start(&so, &server))) goto done;
  KILN_LOG_I("listening on http://%s:%d; loading %s", so.host, kiln_server_port(server),
             model_path);
  if ((st = kiln_engine_create(cli->config_path, ov, n_ov, &eng))) goto done;
  kiln_engine_info_t info;
  kiln_engine_get_info(eng, &info);
  kiln_server_attach(server, eng);
  const char *host = so.host;
  printf(
      "kiln: serving %s on http://%s%s%s:%d (backend %s, %s; context %lld, %d KV blocks of %d, "
      "%s; quantization %s)\n",
      name, strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "",
      kiln_server_port(server), info.backend, info.device, (long long)info.max_model_len,
      info.num_blocks, info.block_size, info.kv_cache_dtype, info.quantization);
  fflush(stdout);
  KILN_LOG_I("chat page: http://%s%s%s:%d/", strchr(host, ':') ? "[" : "", host,
             strchr(host, ':') ? "]" : "", kiln_server_port(server));
  if (key && key[0]) KILN_LOG_I("API key required on /v1 routes");
  int sig = 0;
  sigwait(&sigs, &sig);
  KILN_LOG_I("%s: draining requests (up to %g s), then exiting",
             sig == SIGINT ? "SIGINT" : "SIGTERM", so.shutdown_timeout);
  kiln_server_shutdown(server);
  rc = 0;
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
done:
  kiln_server_free(server); /* before the engine: no request may outlive it */
  kiln_engine_destroy(eng);
  for (int i = 0; i < n_extra; i++) free(extra[i]);
  free(ov);
  free(name);
  if (st) return kiln_cli_fail(st);
  return help ? 0 : rc;
}
