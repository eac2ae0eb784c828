/* hub.h - Hugging Face Hub model ids: ORG/NAME[/FILE.gguf][@REVISION] resolved through the
 * huggingface_hub cache, downloading into it what is missing.
 *
 * The cache is the one huggingface_hub, transformers and vLLM share, read and written in its
 * own layout, so that either side reuses what the other fetched:
 *
 *   $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub ([hub] cache_dir first)
 *     models--ORG--NAME/
 *       refs/REVISION            the commit a branch or tag was last seen at (40 hex digits)
 *       snapshots/COMMIT/FILE    a relative symlink to ../../blobs/ETAG (one ../ more per '/'
 *                                in FILE)
 *       blobs/ETAG               the file's bytes, named by its etag: the SHA-256 for LFS
 *                                files, the git blob SHA-1 for the others
 *       blobs/ETAG.incomplete    a download in progress (resumed with a range request)
 *       .no_exist/COMMIT/FILE    an empty file: FILE is not in the repository at COMMIT
 *     .locks/models--ORG--NAME/ETAG.lock   flock()ed while a blob is written
 *
 * Resolution is cache first: when the snapshot of the revision holds what the model needs
 * (config.json, tokenizer.json, the weights: model.safetensors, or every shard the index
 * lists, or the named .gguf), its path is returned and no network is touched. Otherwise,
 * unless offline ($HF_HUB_OFFLINE=1 or [hub] offline), the files the model needs are
 * downloaded over HTTP from the endpoint ($HF_ENDPOINT, default https://huggingface.co) as
 * huggingface_hub does: GET /api/models/REPO/revision/REV for the commit and the file list,
 * HEAD /REPO/resolve/COMMIT/FILE for the etag (X-Linked-Etag, else ETag), the size
 * (X-Linked-Size, else Content-Length) and the download location (a redirect), then a GET,
 * with "Authorization: Bearer $HF_TOKEN" (or the token file) on the endpoint's own URLs.
 * Every blob is checked against its etag before it is renamed into place.
 */
#ifndef KILN_MODELS_HUB_HUB_H
#define KILN_MODELS_HUB_HUB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/config.h"
#include "base/status.h"

#define KILN_HUB_PATH_MAX 4096

typedef struct kiln_hub_id {
  char repo[128];     /* "ORG/NAME" */
  char revision[256]; /* a branch, tag or commit; "main" when none was given */
  char file[512];     /* a .gguf file inside the repository, or "" */
} kiln_hub_id_t;

/* Parses "ORG/NAME[/PATH.gguf][@REVISION]". ORG and NAME: letters, digits, '-', '_', '.',
 * not starting or ending with '-' or '.', without "--" or "..", 96 characters in all at most
 * (the Hub's own rule); PATH: a relative path ending in ".gguf"; REVISION: a branch, tag or
 * commit (may contain '/', as "refs/pr/1" does). Errors: KILN_ERR_INVALID_ARGUMENT saying
 * which part is wrong (nothing is written to *out then). */
kiln_status_t kiln_hub_parse_id(const char *s, kiln_hub_id_t *out);

typedef enum kiln_hub_progress {
  KILN_HUB_PROGRESS_AUTO = 0, /* a bar when stderr is a terminal, else log lines */
  KILN_HUB_PROGRESS_BAR,
  KILN_HUB_PROGRESS_LINES,
  KILN_HUB_PROGRESS_NONE,
} kiln_hub_progress_t;

typedef struct kiln_hub_options {
  const char *cache_dir; /* NULL or "": $HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub */
  const char *endpoint;  /* NULL or "": $HF_ENDPOINT, else https://huggingface.co */
  const char *token;     /* NULL: $HF_TOKEN, else the file $HF_TOKEN_PATH or $HF_HOME/token */
  bool offline;          /* never touch the network (also when $HF_HUB_OFFLINE is 1/true/yes/on) */
  /* Ask the endpoint for the revision's commit even when the cache has a complete snapshot
   * (`kiln download`: bring a branch up to date). Ignored when offline. */
  bool refresh;
  kiln_hub_progress_t progress;
  double timeout_s; /* connect timeout, and how long a transfer may stall; 0 = 30 s */
} kiln_hub_options_t;

typedef struct kiln_hub_result {
  char path[KILN_HUB_PATH_MAX]; /* the snapshot folder, or the .gguf file in it */
  char commit[41];
  int32_t files;            /* files of the model in the snapshot */
  int32_t files_downloaded; /* of which this call downloaded (0 = all from the cache) */
  int64_t bytes_downloaded;
  bool network; /* the endpoint was asked */
} kiln_hub_result_t;

/* The cache folder: o->cache_dir, else the environment's, else the default (see above), into
 * buf. Errors: KILN_ERR_INVALID_ARGUMENT when it does not fit. */
kiln_status_t kiln_hub_cache_dir(const kiln_hub_options_t *o, char *buf, size_t size);

/* Resolves id to a local path (see the top of this file). Errors, each saying what happened
 * and what the cache holds of the model: KILN_ERR_NOT_FOUND (an unknown repository, revision
 * or file; offline without the files), KILN_ERR_INVALID_ARGUMENT (401/403: a gated or private
 * repository without a token or with one it refuses; a repository without weights Kiln loads),
 * KILN_ERR_UNAVAILABLE (the endpoint cannot be reached, a server error), KILN_ERR_IO (disk
 * full, a write failed, a checksum mismatch), KILN_ERR_UNSUPPORTED (a build without libcurl
 * needs to download). */
kiln_status_t kiln_hub_resolve(const kiln_hub_options_t *o, const kiln_hub_id_t *id,
                               kiln_hub_result_t *out);

/* The [hub] keys of cfg as options (cache_dir relative to the INI file that set it). */
kiln_status_t kiln_hub_options_from_config(const kiln_config_t *cfg, kiln_hub_options_t *out,
                                           char *cache_buf, size_t cache_size);

/* ---- what every command loads: a path or a Hub id ------------------------------------------ */

typedef struct kiln_model_location {
  char path[KILN_HUB_PATH_MAX]; /* what to load: a folder or a .gguf file */
  char hub_repo[128];           /* "ORG/NAME" when it came through the Hub cache, else "" */
} kiln_model_location_t;

/* The model to load: `model` (a command's --model, relative to the current folder) when not
 * NULL or "", else [model] path of cfg (relative to its INI file; empty = the embedded default
 * model). A file or folder that exists is taken as it is; otherwise a Hub id is resolved
 * through kiln_hub_resolve() with cfg's [hub] options; anything else is returned as the path
 * (the loader then says it is missing). Errors: those of kiln_hub_resolve(), saying also that
 * no such local path exists; kiln_config_model_path()'s. */
kiln_status_t kiln_model_resolve(const kiln_config_t *cfg, const char *model,
                                 kiln_model_location_t *out);

#endif /* KILN_MODELS_HUB_HUB_H */
