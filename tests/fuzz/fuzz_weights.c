/* fuzz_weights.c - libFuzzer target for the weight loaders: the input is written to a file and
 * opened as safetensors and as GGUF; whatever opens has every tensor converted to f32. The
 * tokenizer in GGUF metadata (kiln_gguf_tokenizer) is rebuilt too, and what loads encodes and
 * decodes a little text. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kiln/hal.h"
#include "models/loader/gguf.h"
#include "models/loader/weights.h"
#include "models/template/template.h"
#include "models/tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Converts every tensor (up to 1M elements each, to bound the time per input). */
static void convert_all(const kiln_weights_t *w) {
  float *buf = malloc((1u << 20) * sizeof(float));
  if (!buf) return;
  for (int64_t i = 0; i < kiln_weights_count(w); i++) {
    const kiln_weight_t *t = kiln_weights_at(w, i);
    int64_t n = t->numel < (1 << 20) ? t->numel : (1 << 20);
    n -= n % kiln_wtype_block_elems(t->type);
    kiln_status_free(kiln_weight_convert(t, 0, n, KILN_HAL_F32, buf));
  }
  free(buf);
}

/* The GGUF tokenizer: the rewritten tokenizer.json must load or fail cleanly; a loaded one must
 * encode and decode. */
static void gguf_tokenizer(const char *file) {
  kiln_strbuf_t tj = KILN_STRBUF_INIT, cfg = KILN_STRBUF_INIT;
  kiln_status_t st = kiln_gguf_tokenizer(file, &tj, &cfg);
  if (!st) {
    kiln_tokenizer_t *tok = NULL;
    st = kiln_tokenizer_load_json_config(tj.data, tj.len, cfg.data, cfg.len, "fuzz", &tok);
    if (!st) {
      static const char text[] = "ab ab! <|end|><s> \xe2\x96\x81x";
      kiln_tokens_t ids = KILN_TOKENS_INIT;
      kiln_status_free(kiln_tokenizer_encode(tok, text, sizeof(text) - 1, true, &ids));
      kiln_strbuf_t out = KILN_STRBUF_INIT;
      kiln_status_free(kiln_tokenizer_decode(tok, ids.ids, ids.len, false, &out));
      kiln_strbuf_free(&out);
      kiln_tokens_free(&ids);
      kiln_tokenizer_free(tok);
    }
    kiln_status_free(st);
    kiln_chat_template_t *ct = NULL;
    st = kiln_chat_template_load_config(cfg.data, cfg.len, "fuzz", &ct);
    kiln_chat_template_free(ct);
  }
  kiln_status_free(st);
  kiln_strbuf_free(&tj);
  kiln_strbuf_free(&cfg);
}

/* The file the input is written to: one per process, in $TMPDIR, removed at exit. */
static char path[4096];

static void remove_file(void) { unlink(path); }

/* Properties: neither loader crashes, reads out of bounds or leaks on any input; what they
 * accept converts without touching memory outside the file. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!path[0]) {
    const char *dir = getenv("TMPDIR");
    snprintf(path, sizeof(path), "%s/kiln-fuzz-weights-%d", dir && *dir ? dir : "/tmp",
             (int)getpid());
    atexit(remove_file);
  }
  FILE *f = fopen(path, "wb");
  if (!f) return 0;
  size_t wrote = fwrite(data, 1, size, f);
  fclose(f);
  if (wrote != size) return 0;
  kiln_weights_t *w = NULL;
  kiln_status_t st = kiln_weights_open_safetensors(path, &w);
  if (!st) convert_all(w);
  kiln_status_free(st);
  kiln_weights_free(w);
  w = NULL;
  kiln_model_config_t cfg;
  st = kiln_gguf_open(path, &cfg, &w);
  if (!st) convert_all(w);
  kiln_status_free(st);
  kiln_weights_free(w);
  gguf_tokenizer(path);
  return 0;
}
