/* hub_internal.h - what hub.c (ids, the cache, resolution) and hub_fetch.c (HTTP) share. */
#ifndef KILN_MODELS_HUB_HUB_INTERNAL_H
#define KILN_MODELS_HUB_HUB_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "base/strbuf.h"
#include "models/hub/hub.h"

/* One resolution in progress. */
typedef struct hub_ctx {
  const kiln_hub_id_t *id;
  char cache[KILN_HUB_PATH_MAX];    /* the cache root */
  char repo_dir[KILN_HUB_PATH_MAX]; /* cache/models--ORG--NAME */
  char folder[300];                 /* models--ORG--NAME */
  char endpoint[1024];              /* without a trailing '/' */
  char *token;                      /* owned; NULL = none */
  kiln_hub_progress_t progress;     /* BAR, LINES or NONE (AUTO resolved) */
  double timeout_s;
  kiln_hub_result_t *out;
} hub_ctx_t;

/* The optional files fetched beside the weights when the repository has them: tokenizer,
 * generation config, chat templates, processor configs. NULL-terminated. */
extern const char *const hub_optional_files[];

/* snprintf into a path buffer; false when it did not fit (buf then holds a cut path, which
 * names no file the cache has). */
bool hub_pathf(char *buf, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* True for 40 lowercase hex digits (a commit id, or a git blob id). */
bool hub_is_hex(const char *s, size_t n);

/* mkdir -p. Errors: KILN_ERR_IO naming the folder. */
kiln_status_t hub_mkdirs(const char *path);

/* Writes text to path atomically (a temporary file beside it, then rename). */
kiln_status_t hub_write_file(const char *path, const char *text);

/* The snapshot folder of commit, into buf. */
void hub_snapshot_dir(const hub_ctx_t *c, const char *commit, char *buf, size_t size);

/* Whether the snapshot of commit holds what the model needs; when missing is not NULL, the
 * names of what it lacks are appended to it (", "-separated). *present = files there. */
bool hub_snapshot_complete(const hub_ctx_t *c, const char *commit, kiln_strbuf_t *missing,
                           int32_t *present);

/* Appends what the cache holds of the model ("nothing", or the commit, the files there and
 * missing, partial downloads) to sb, for error messages. */
void hub_cache_summary(const hub_ctx_t *c, kiln_strbuf_t *sb);

/* Downloads what the model needs at id->revision into the cache (hub_fetch.c); sets
 * c->out->commit and the counts. */
kiln_status_t hub_fetch(hub_ctx_t *c);

/* "1.23 GiB" into buf. */
const char *hub_bytes(char *buf, size_t size, double bytes);

#endif /* KILN_MODELS_HUB_HUB_INTERNAL_H */
