/* bench_image.c - the host side of one image request, step by step.
 *
 * Usage: kiln-bench-image [--threads N] IMAGE [RUNS]
 * Times, on IMAGE (PNG, JPEG or WebP) with Qwen2-VL's default image processor settings, each
 * step an image request's submission and its vision encode run on the host: decode, the
 * bicubic resize to the smart_resize size, rescale/normalize/patchify, the image hash, the
 * whole kiln_image_preprocess (resize + patchify + hash), then the vision tower's host rows
 * (patch order and 2-D rotary table, kiln_vision_host_rows) with Qwen2-VL's geometry (no
 * windows) and Qwen2.5-VL's (windows of 4 x 4 merge units), and the sum a request pays
 * (decode + preprocess + host rows). Each step runs once to warm up, then RUNS times (default
 * 20); the table shows the median, the fastest run and the first (cold) run in milliseconds.
 * Every run allocates and frees its outputs as the engine does. --threads N is the threads for
 * one image, as [model] image_threads (default 0: auto, min(4, online CPUs)); 1 is one thread. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "models/vision/image.h"
#include "models/vision/preproc.h"
#include "models/vision/vision.h"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static int die(kiln_status_t st) {
  fprintf(stderr, "kiln-bench-image: %s\n", kiln_status_message(st));
  kiln_status_free(st);
  exit(1);
}

/* What one step needs: the inputs, and whatever it allocated in the last run. */
typedef struct bench {
  const uint8_t *file;
  size_t file_len;
  kiln_vision_preproc_t pp;
  kiln_image_t img, resized;
  kiln_image_patches_t patches;
  int32_t rh, rw;
  /* host rows */
  float *pix, *rope;
  int32_t *order;
  int64_t *lens;
  uint64_t hash[2];
} bench_t;

typedef enum step {
  STEP_DECODE,
  STEP_RESIZE,
  STEP_PATCHIFY,
  STEP_HASH,
  STEP_PREPROCESS,
  STEP_ROWS_2VL,
  STEP_ROWS_25VL,
  STEP_TOTAL,
  STEP_COUNT
} step_t;

static const char *const kStepName[STEP_COUNT] = {
    "decode",
    "resize (bicubic)",
    "rescale+normalize+patchify",
    "hash (XXH3-128)",
    "preprocess (resize+patchify+hash)",
    "vision host rows, Qwen2-VL",
    "vision host rows, Qwen2.5-VL",
    "request total (decode+preprocess+rows 2-VL)",
};

static void rows(bench_t *b, const kiln_image_patches_t *p, int32_t vw) {
  kiln_vision_image_t vi = {p->pixels, p->grid_t, p->grid_h, p->grid_w};
  kiln_status_t st = kiln_vision_host_rows(&vi, 1, b->pp.merge_size, vw, p->patch_dim, 80, 10000.0,
                                           b->pix, b->rope, b->order, b->lens);
  if (st) die(st);
}

static void run_step(bench_t *b, step_t s) {
  kiln_status_t st = NULL;
  switch (s) {
    case STEP_DECODE: {
      kiln_image_t img;
      st = kiln_image_decode(b->file, b->file_len, "image", NULL, &img);
      kiln_image_free(&img);
      break;
    }
    case STEP_RESIZE: {
      kiln_image_t out;
      st = kiln_image_resize_bicubic_threads(&b->img, b->rw, b->rh, b->pp.threads, &out);
      kiln_image_free(&out);
      break;
    }
    case STEP_PATCHIFY: {
      kiln_image_patches_t p;
      st = kiln_image_patchify(&b->pp, &b->resized, &p);
      kiln_image_patches_free(&p);
      break;
    }
    case STEP_HASH: kiln_image_hash(&b->img, b->hash); break;
    case STEP_PREPROCESS: {
      kiln_image_patches_t p;
      st = kiln_image_preprocess(&b->pp, &b->img, &p);
      kiln_image_patches_free(&p);
      break;
    }
    case STEP_ROWS_2VL: rows(b, &b->patches, 0); break;
    case STEP_ROWS_25VL: rows(b, &b->patches, 4); break;
    case STEP_TOTAL: {
      kiln_image_t img;
      kiln_image_patches_t p;
      st = kiln_image_decode(b->file, b->file_len, "image", NULL, &img);
      if (!st) st = kiln_image_preprocess(&b->pp, &img, &p);
      kiln_image_free(&img);
      if (!st) rows(b, &p, 0);
      kiln_image_patches_free(&p);
      break;
    }
    default: break;
  }
  if (st) die(st);
}

int main(int argc, char **argv) {
  int32_t threads = 0;
  int ai = 1;
  if (ai + 1 < argc && !strcmp(argv[ai], "--threads")) {
    threads = atoi(argv[ai + 1]);
    ai += 2;
  }
  if (ai >= argc || !strcmp(argv[ai], "--help") || !strcmp(argv[ai], "-h") || threads < 0) {
    fprintf(stderr,
            "usage: %s [--threads N] IMAGE [RUNS]\n"
            "Times the host steps of one image request (decode, resize, patchify, hash,\n"
            "preprocess, the vision tower's host rows) with Qwen2-VL's default image processor\n"
            "settings: median, fastest and first run of RUNS (default 20) in ms. --threads N:\n"
            "threads for one image, as [model] image_threads (0, the default: auto).\n",
            argv[0]);
    return ai >= argc || threads < 0 ? 2 : 0;
  }
  const char *path = argv[ai];
  int runs = ai + 1 < argc ? atoi(argv[ai + 1]) : 20;
  if (runs < 1) runs = 1;
  bench_t b;
  memset(&b, 0, sizeof b);
  FILE *f = fopen(path, "rb");
  if (!f) {
    perror(path);
    return 1;
  }
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *file = malloc(len > 0 ? (size_t)len : 1);
  if (!file || len <= 0 || fread(file, 1, (size_t)len, f) != (size_t)len) {
    fprintf(stderr, "kiln-bench-image: cannot read %s\n", path);
    return 1;
  }
  fclose(f);
  b.file = file;
  b.file_len = (size_t)len;
  kiln_vision_preproc_default(&b.pp);
  b.pp.threads = threads;
  kiln_status_t st = kiln_image_decode(file, b.file_len, path, NULL, &b.img);
  if (st) die(st);
  const int32_t factor = b.pp.patch_size * b.pp.merge_size;
  if ((st = kiln_vision_smart_resize(b.img.height, b.img.width, factor, b.pp.min_pixels,
                                     b.pp.max_pixels, &b.rh, &b.rw)) ||
      (st = kiln_image_resize_bicubic_threads(&b.img, b.rw, b.rh, threads, &b.resized)) ||
      (st = kiln_image_preprocess(&b.pp, &b.img, &b.patches)))
    die(st);
  const int64_t N = b.patches.num_patches, K = b.patches.patch_dim;
  b.pix = malloc(sizeof(float) * (size_t)(N * K));
  b.rope = malloc(sizeof(float) * (size_t)(N * 80));
  b.order = malloc(sizeof(int32_t) * (size_t)N);
  b.lens = malloc(sizeof(int64_t) * (size_t)(N + 2));
  if (!b.pix || !b.rope || !b.order || !b.lens) {
    fprintf(stderr, "kiln-bench-image: out of memory\n");
    return 1;
  }
  printf("%s: %d x %d -> %d x %d, %lld patches x %lld values (%.1f MB), %d runs, threads %d%s\n",
         path, b.img.width, b.img.height, b.rw, b.rh, (long long)N, (long long)K,
         (double)(N * K * 4) / 1e6, runs, (int)threads, threads ? "" : " (auto)");
  printf("%-44s %9s %9s %9s\n", "step", "median", "min", "first");
  double *t = malloc(sizeof(double) * (size_t)runs);
  if (!t) return 1;
  for (int s = 0; s < STEP_COUNT; s++) {
    double t0 = now_ms();
    run_step(&b, (step_t)s);
    double first = now_ms() - t0;
    for (int r = 0; r < runs; r++) {
      t0 = now_ms();
      run_step(&b, (step_t)s);
      t[r] = now_ms() - t0;
    }
    qsort(t, (size_t)runs, sizeof *t, cmp_double);
    printf("%-44s %9.2f %9.2f %9.2f\n", kStepName[s], t[runs / 2], t[0], first);
  }
  free(t);
  free(b.pix);
  free(b.rope);
  free(b.order);
  free(b.lens);
  kiln_image_patches_free(&b.patches);
  kiln_image_free(&b.resized);
  kiln_image_free(&b.img);
  free(file);
  return 0;
}
