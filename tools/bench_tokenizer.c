/* bench_tokenizer.c - encode throughput of models/tokenizer on one thread.
 *
 * Usage: kiln-bench-tokenizer TOKENIZER_DIR TEXT_FILE [REPEATS]
 * Encodes the whole file in one call (REPEATS times, default 3: the first run starts with a
 * cold word cache) and then line by line, and prints MB/s and tokens/s for each. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "models/tokenizer/tokenizer.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static char *read_all(const char *path, size_t *out_len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  char chunk[1 << 16];
  size_t n;
  while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) kiln_strbuf_append(&b, chunk, n);
  fclose(f);
  if (!kiln_strbuf_ok(&b)) {
    kiln_strbuf_free(&b);
    return NULL;
  }
  return kiln_strbuf_detach(&b, out_len);
}

static int fail(kiln_status_t st) {
  fprintf(stderr, "kiln-bench-tokenizer: %s\n", kiln_status_message(st));
  kiln_status_free(st);
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s TOKENIZER_DIR TEXT_FILE [REPEATS]\n", argv[0]);
    return 2;
  }
  int repeats = argc > 3 ? atoi(argv[3]) : 3;
  if (repeats < 1) repeats = 1;
  double t0 = now_s();
  kiln_tokenizer_t *tok = NULL;
  kiln_status_t st = kiln_tokenizer_load(argv[1], &tok);
  if (st) return fail(st);
  double load_s = now_s() - t0;
  size_t len = 0;
  char *text = read_all(argv[2], &len);
  if (!text) {
    fprintf(stderr, "kiln-bench-tokenizer: cannot read %s\n", argv[2]);
    kiln_tokenizer_free(tok);
    return 1;
  }
  double mb = (double)len / 1e6;
  printf("tokenizer %s: loaded in %.0f ms; text %s: %.2f MB\n", argv[1], load_s * 1e3, argv[2], mb);
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  double best = 1e30;
  for (int r = 0; r < repeats; r++) {
    ids.len = 0;
    t0 = now_s();
    if ((st = kiln_tokenizer_encode(tok, text, len, false, &ids))) return fail(st);
    double dt = now_s() - t0;
    printf("  one call, run %d%s: %8.2f MB/s  %10.0f tokens/s  (%zu tokens, %.3f s)\n", r + 1,
           r == 0 ? " (cold cache)" : "", mb / dt, (double)ids.len / dt, ids.len, dt);
    if (dt < best) best = dt;
  }
  /* Line by line, as a server sees many short prompts. */
  size_t total = 0;
  t0 = now_s();
  for (char *p = text, *end; p < text + len; p = end + 1) {
    end = memchr(p, '\n', (size_t)(text + len - p));
    if (!end) end = text + len;
    ids.len = 0;
    if ((st = kiln_tokenizer_encode(tok, p, (size_t)(end - p), false, &ids))) return fail(st);
    total += ids.len;
  }
  double dt = now_s() - t0;
  printf("  per line:              %8.2f MB/s  %10.0f tokens/s  (%zu tokens, %.3f s)\n", mb / dt,
         (double)total / dt, total, dt);
  printf("best one-call: %.2f MB/s\n", mb / best);
  kiln_tokens_free(&ids);
  free(text);
  kiln_tokenizer_free(tok);
  return 0;
}
