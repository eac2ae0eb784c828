/* fuzz_config.c - libFuzzer target for the INI loader: load, and if that works, write + reload. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Writes cfg to a new string (NULL if that fails; the fuzzer then checks nothing more). */
static char *fuzz_write(const kiln_config_t *cfg) {
  FILE *f = tmpfile();
  char *text = NULL;
  if (!f) return NULL;
  kiln_config_write(cfg, f);
  long len = ftell(f);
  if (len >= 0 && fflush(f) == 0 && fseek(f, 0, SEEK_SET) == 0) {
    text = malloc((size_t)len + 1);
    if (text && fread(text, 1, (size_t)len, f) != (size_t)len) {
      free(text);
      text = NULL;
    }
    if (text) text[len] = '\0';
  }
  fclose(f);
  return text;
}

/* Properties: loading never crashes or leaks; a config that loaded writes out as a file that
 * loads again; a failed load leaves the config as it was. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  kiln_config_t *cfg = NULL, *again = NULL;
  char *text = malloc(size + 1);
  char *before = NULL, *written = NULL;
  if (!text || kiln_config_create(&cfg)) goto done;
  memcpy(text, data, size);
  text[size] = '\0'; /* the loader takes C strings: input stops at the first NUL */
  before = fuzz_write(cfg);
  kiln_status_t st = kiln_config_load_string(cfg, text, "fuzz.ini");
  if (st) {
    written = fuzz_write(cfg);
    if (before && written && strcmp(before, written) != 0) {
      fprintf(stderr, "failed load changed the config: %s\n", kiln_status_message(st));
      abort();
    }
    kiln_status_free(st);
    goto done;
  }
  written = fuzz_write(cfg);
  if (!written || kiln_config_create(&again)) goto done;
  st = kiln_config_load_string(again, written, "written.ini");
  if (st) {
    fprintf(stderr, "written config does not load: %s\n%s", kiln_status_message(st), written);
    abort();
  }
done:
  kiln_config_free(again);
  kiln_config_free(cfg);
  free(written);
  free(before);
  free(text);
  return 0;
}
