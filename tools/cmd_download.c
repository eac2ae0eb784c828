/* cmd_download.c - `kiln download ORG/NAME[/FILE.gguf][@REVISION]`: brings a model from the
 * Hugging Face Hub into the Hub cache without loading it, and prints where it is. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "base/strbuf.h"
#include "models/hub/hub.h"

typedef struct dl_args {
  const char *model;     /* --model, or the one positional argument */
  const char *cache_dir; /* --cache-dir: hub.cache_dir */
  const char *endpoint;  /* --endpoint: hub.endpoint */
} dl_args_t;

static const kiln_opt_t dl_rows[] = {
    KILN_OPT_STRING("--model", "ORG/NAME", dl_args_t, model,
                    "the Hub id, if not given as the argument"),
    KILN_OPT_STRING("--cache-dir", "DIR", dl_args_t, cache_dir,
                    "the Hub cache (hub.cache_dir; default: $HF_HUB_CACHE,\n"
                    "else $HF_HOME/hub, else ~/.cache/huggingface/hub)"),
    KILN_OPT_STRING("--endpoint", "URL", dl_args_t, endpoint,
                    "the Hub server (hub.endpoint; default: $HF_ENDPOINT,\n"
                    "else https://huggingface.co)"),
};

static const kiln_opts_t dl_opts = {
    .cmd = "download",
    .usage =
        "usage: kiln download ORG/NAME[/FILE.gguf][@REVISION] [--cache-dir DIR] [--endpoint URL]\n"
        "Downloads what Kiln needs of a Hugging Face Hub model (config, tokenizer, generation\n"
        "config, chat template, processor config, and the safetensors shards the index lists,\n"
        "or the named GGUF file) into the huggingface_hub cache, in its layout, without loading\n"
        "it; then prints the snapshot's path. The revision (default main) is looked up on the\n"
        "server, so a branch is brought up to date; files already cached are not fetched again,\n"
        "and partial downloads resume. The token is $HF_TOKEN, else $HF_HOME/token\n"
        "(~/.cache/huggingface/token); HF_HUB_OFFLINE=1 (or hub.offline) only checks the cache.\n"
        "Every other command takes the same ids as --model (docs/hub.md).\n",
    .opts = dl_rows,
    .num_opts = KILN_OPTS_COUNT(dl_rows),
    .common = &kiln_cli_common_opts,
};

int kiln_cmd_download(kiln_cli_t *cli) {
  dl_args_t a = {0};
  char **rest = calloc((size_t)cli->argc + 1, sizeof(char *));
  char **opt_argv = calloc((size_t)cli->argc + 1, sizeof(char *));
  kiln_hub_result_t *r = malloc(sizeof(*r));
  char *sets[2] = {NULL, NULL};
  kiln_status_t st = NULL;
  bool help = false;
  if (!rest || !opt_argv || !r) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    goto done;
  }
  /* The options first (wherever they are), then the id among what is left. */
  int n_rest = 0, n_opt = 0;
  if ((st = kiln_opts_extract(&dl_opts, cli->argc, cli->argv, &a, rest, &n_rest))) goto done;
  const char *pos = NULL;
  opt_argv[n_opt++] = rest[0];
  for (int i = 1; i < n_rest; i++) {
    if (rest[i][0] == '-' || pos)
      opt_argv[n_opt++] = rest[i];
    else
      pos = rest[i];
  }
  if ((st = kiln_opts_parse(&dl_opts, n_opt, opt_argv, &a, &help)) || help) goto done;
  for (int i = 1; i < n_rest; i++)
    if (rest[i] != pos && rest[i][0] != '-') {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "download: one Hub id at a time ('%s' is a second one)", rest[i]);
      goto done;
    }
  if (pos && a.model) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "download: the id is given twice ('%s' and --model %s)", pos, a.model);
    goto done;
  }
  const char *model = pos ? pos : a.model;
  if (!model) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "download: give a Hub id (ORG/NAME)\n%s",
                          dl_opts.usage);
    goto done;
  }
  struct stat sst;
  if (stat(model, &sst) == 0) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "download: %s is a local file or folder, not a Hub id (use it as "
                          "--model of the other commands as it is)",
                          model);
    goto done;
  }
  if (a.cache_dir && !(sets[0] = kiln_strprintf("hub.cache_dir=%s", a.cache_dir))) goto oom;
  if (a.endpoint && !(sets[1] = kiln_strprintf("hub.endpoint=%s", a.endpoint))) goto oom;
  for (int i = 0; i < 2; i++)
    if (sets[i] && (st = kiln_config_set(cli->config, sets[i]))) goto done;
  kiln_hub_id_t id;
  if ((st = kiln_hub_parse_id(model, &id))) goto done;
  char cache[KILN_HUB_PATH_MAX];
  kiln_hub_options_t o;
  if ((st = kiln_hub_options_from_config(cli->config, &o, cache, sizeof(cache)))) goto done;
  o.refresh = true;
  if ((st = kiln_hub_resolve(&o, &id, r))) goto done;
  if (!r->network && o.progress != KILN_HUB_PROGRESS_NONE)
    fprintf(stderr, "kiln: hub: %s@%s (commit %.12s): in the cache, offline: %d files\n", id.repo,
            id.revision, r->commit, (int)r->files);
  printf("%s\n", r->path);
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
done:
  free(rest);
  free(opt_argv);
  free(r);
  free(sets[0]);
  free(sets[1]);
  if (st) return kiln_cli_fail(st);
  return 0;
}
