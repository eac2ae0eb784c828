/* npy.c - float32 .npy read and write (see npy.h). */
#include "base/npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The header dict is padded with spaces and ends in '\n' so that magic + header is a multiple
 * of 64 bytes (the format's alignment promise). */
kiln_status_t kiln_npy_write_f32(const char *path, const float *data, int64_t rows, int64_t cols) {
  char dict[128];
  int n = snprintf(dict, sizeof(dict),
                   "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld, %lld), }",
                   (long long)rows, (long long)cols);
  size_t total = 10 + (size_t)n + 1;
  size_t pad = (64 - total % 64) % 64;
  size_t hlen = (size_t)n + pad + 1;
  unsigned char pre[10] = {0x93,
                           'N',
                           'U',
                           'M',
                           'P',
                           'Y',
                           1,
                           0,
                           (unsigned char)(hlen & 0xff),
                           (unsigned char)(hlen >> 8)};
  FILE *f = fopen(path, "wb");
  if (!f) return kiln_status_make(KILN_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
  int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)n, f) == (size_t)n;
  for (size_t i = 0; ok && i < pad; i++) ok = fputc(' ', f) != EOF;
  ok = ok && fputc('\n', f) != EOF;
  size_t count = (size_t)(rows * cols);
  ok = ok && (count == 0 || fwrite(data, sizeof(float), count, f) == count);
  if (fclose(f) != 0) ok = 0;
  if (!ok) return kiln_status_make(KILN_ERR_IO, "%s: write failed: %s", path, strerror(errno));
  return NULL;
}

static kiln_status_t npy_bad(const char *path, const char *what, const char *header) {
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s (header: %s)", path, what,
                          header ? header : "none");
}

kiln_status_t kiln_npy_read_f32(const char *path, float **out_data, int64_t *out_rows,
                                int64_t *out_cols) {
  *out_data = NULL;
  *out_rows = *out_cols = 0;
  kiln_status_t st = NULL;
  char *header = NULL;
  float *data = NULL;
  FILE *f = fopen(path, "rb");
  if (!f)
    return kiln_status_make(errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO, "%s: %s", path,
                            strerror(errno));
  unsigned char pre[12];
  if (fread(pre, 1, 8, f) != 8 || memcmp(pre, "\x93NUMPY", 6) != 0) {
    st = npy_bad(path, "not a .npy file", NULL);
    goto done;
  }
  size_t hlen;
  if (pre[6] == 1) {
    if (fread(pre + 8, 1, 2, f) != 2) goto truncated;
    hlen = pre[8] | (size_t)pre[9] << 8;
  } else if (pre[6] == 2 || pre[6] == 3) {
    if (fread(pre + 8, 1, 4, f) != 4) goto truncated;
    hlen = pre[8] | (size_t)pre[9] << 8 | (size_t)pre[10] << 16 | (size_t)pre[11] << 24;
    if (hlen > (1u << 20)) {
      st = npy_bad(path, "header is implausibly long", NULL);
      goto done;
    }
  } else {
    st = npy_bad(path, "unknown .npy format version", NULL);
    goto done;
  }
  header = malloc(hlen + 1);
  if (!header) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    goto done;
  }
  if (fread(header, 1, hlen, f) != hlen) goto truncated;
  header[hlen] = '\0';
  if (!strstr(header, "'descr': '<f4'")) {
    st = npy_bad(path, "want dtype '<f4' (float32, little-endian)", header);
    goto done;
  }
  if (!strstr(header, "'fortran_order': False")) {
    st = npy_bad(path, "want C order", header);
    goto done;
  }
  const char *sh = strstr(header, "'shape': (");
  if (!sh) {
    st = npy_bad(path, "no shape", header);
    goto done;
  }
  sh += strlen("'shape': (");
  long long d[3];
  int nd = 0;
  while (nd < 3) {
    char *end;
    while (*sh == ' ') sh++;
    if (*sh == ')') break;
    d[nd] = strtoll(sh, &end, 10);
    if (end == sh || d[nd] < 0) {
      st = npy_bad(path, "bad shape", header);
      goto done;
    }
    nd++;
    sh = end;
    while (*sh == ' ') sh++;
    if (*sh == ',') sh++;
  }
  if (nd < 1 || nd > 2) {
    st = npy_bad(path, "want a 1-D or 2-D array", header);
    goto done;
  }
  int64_t rows = nd == 2 ? d[0] : 1, cols = nd == 2 ? d[1] : d[0];
  if (cols != 0 && rows > (INT64_MAX / 4) / cols) {
    st = npy_bad(path, "shape too large", header);
    goto done;
  }
  size_t count = (size_t)(rows * cols);
  data = malloc(count ? count * sizeof(float) : 1);
  if (!data) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    goto done;
  }
  if (count && fread(data, sizeof(float), count, f) != count) goto truncated;
  *out_data = data;
  *out_rows = rows;
  *out_cols = cols;
  data = NULL;
  goto done;
truncated:
  st = npy_bad(path, "the file is truncated", header);
done:
  fclose(f);
  free(header);
  free(data);
  return st;
}
