/* test_graphs.c - decode graphs (models/model.c, "Decode graphs") on the CPU backend's
 * record/replay (KILN_TEST_BACKEND picks another, e.g. cuda on the GPU machine).
 *
 * Two copies of a model run the same history in lockstep, one eager and one with graphs, and
 * must give the same logits (within TOL; bit for bit on the CPU until a batch is padded to more
 * than 8 rows, see TOL) and leave the same KV cache (the graphs' scratch block untouched):
 *   - every fixture in tests/fixtures/models and the default model (share/models/kiln-tiny):
 *     44 sequences of different lengths, decode batches of 1..44 (crossing every capture size,
 *     the last four above the largest), block tables full-width or cut to the batch's widest,
 *     all logits rows, a reordered subset or some twice, sequences moved to other blocks
 *     between steps;
 *   - custom capture sizes (unsorted, repeated, too large), graphs captured ahead of time,
 *     graphs of a second KV cache;
 *   - a backend that refuses: each call of a capture fails in turn (out of memory), and the
 *     forward must run eagerly with the same logits, close the capture, warn once and stay
 *     eager; a failed replay is an error;
 *   - the CPU backend's capture rules (allocation, sync and nested begin refused);
 *   - the engine end to end: [graph] enabled = true and false give the same greedy tokens for
 *     a batch of requests, on the llama2 fixture and on the default model. */
#define _POSIX_C_SOURCE 200809L /* dup, fileno */
#include <dirent.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/log.h"
#include "hal/loader.h"
#include "kiln/hal_util.h"
#include "kiln/kiln.h"
#include "models/model.h"
#include "models/model_internal.h"

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif
#endif

/* Relative difference allowed between graph and eager logits. The padded batch runs the same
 * ops over more rows, and a GEMM's result may depend on its row count: the CPU backend's own
 * kernels (up to 8 rows) compute each row alone, so batches padded to at most 8 rows match bit
 * for bit, but OpenBLAS's sgemm (above 8) sums in another order for 9 rows than for 16, and a
 * GPU's BLAS may pick another kernel. So: test_parity's kiln-vs-kiln bound. */
#define TOL 2e-5
/* bf16 activations turn such a difference into a bf16 ulp now and then, which the layers
 * amplify (test_parity's BF16_TOL, for the same reason). */
#define TOL_BF16 3e-2

static const kiln_hal_plugin_t *g_plugin;
static const kiln_hal_backend_t *g_real;
static kiln_hal_registry_t *g_reg;
static kiln_hal_device_t *g_dev;
static kiln_hal_stream_t *g_stream;
static bool g_graphs; /* the device has CAP_GRAPHS */
/* The graph model's graph_max_query_len and graph_query_max_seqs (rig_load; 0: decode only). */
static int32_t g_max_q, g_q_seqs;
/* Under valgrind (or with KILN_TEST_QUICK set) the scenarios are cut down to what still runs
 * every code path: a few fixtures, fewer steps, every fourth failure point. */
static bool g_quick;
static char g_src[1024];

static void check_st(kiln_status_t st) {
  if (st) fail_msg("%s", kiln_status_message(st));
}

static void check_hal(kiln_hal_error_t *e) {
  if (e) {
    char msg[512];
    snprintf(msg, sizeof(msg), "%s", e->message);
    kiln_hal_error_free(e);
    fail_msg("%s", msg);
  }
}

/* ---- a backend that fails on demand during capture ---------------------------------------- */

static kiln_hal_backend_t g_wrap;
static struct {
  long fail_at; /* the call of a capture to fail, counted from its graph_begin; -1: none */
  int32_t code;
  long calls; /* calls made by captures so far */
  bool capturing;
  long begins, ends, replays;
  bool fail_replay;
} g_inj;

static void inj_reset(long fail_at, int32_t code) {
  memset(&g_inj, 0, sizeof(g_inj));
  g_inj.fail_at = fail_at;
  g_inj.code = code;
}

static kiln_hal_error_t *inject(const char *what) {
  if (!g_inj.capturing) return NULL;
  long n = g_inj.calls++;
  if (n != g_inj.fail_at) return NULL;
  return kiln_hal_error_new(g_inj.code, "injected: %s (capture call %ld) failed", what, n);
}

#define WRAP(name, type)                                                   \
  static kiln_hal_error_t *w_##name(kiln_hal_stream_t *s, const type *a) { \
    kiln_hal_error_t *e = inject(#name);                                   \
    return e ? e : g_real->name(s, a);                                     \
  }
WRAP(gemm, kiln_hal_gemm_args_t)
WRAP(embedding, kiln_hal_embedding_args_t)
WRAP(rmsnorm, kiln_hal_rmsnorm_args_t)
WRAP(rope, kiln_hal_rope_args_t)
WRAP(silu_mul, kiln_hal_silu_mul_args_t)
WRAP(add, kiln_hal_add_args_t)
WRAP(copy, kiln_hal_copy_args_t)
WRAP(kv_write, kiln_hal_kv_write_args_t)
WRAP(attention, kiln_hal_attention_args_t)
#undef WRAP

static kiln_hal_error_t *w_fill(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t off,
                                uint64_t size, uint8_t value) {
  kiln_hal_error_t *e = inject("fill");
  return e ? e : g_real->fill(s, dst, off, size, value);
}

static kiln_hal_error_t *w_copy_d2d(kiln_hal_stream_t *s, kiln_hal_buffer_t *dst, uint64_t doff,
                                    kiln_hal_buffer_t *src, uint64_t soff, uint64_t size) {
  kiln_hal_error_t *e = inject("copy_d2d");
  return e ? e : g_real->copy_d2d(s, dst, doff, src, soff, size);
}

static kiln_hal_error_t *w_graph_begin(kiln_hal_stream_t *s) {
  if (g_inj.calls++ == g_inj.fail_at)
    return kiln_hal_error_new(g_inj.code, "injected: graph_begin failed");
  kiln_hal_error_t *e = g_real->graph_begin(s);
  if (!e) {
    g_inj.capturing = true;
    g_inj.begins++;
  }
  return e;
}

static kiln_hal_error_t *w_graph_end(kiln_hal_stream_t *s, kiln_hal_graph_t **out) {
  g_inj.capturing = false;
  long n = g_inj.calls++;
  kiln_hal_error_t *e = g_real->graph_end(s, out);
  g_inj.ends++;
  if (!e && n == g_inj.fail_at) {
    g_real->graph_destroy(*out);
    *out = NULL;
    return kiln_hal_error_new(g_inj.code, "injected: graph_end failed");
  }
  return e;
}

static kiln_hal_error_t *w_graph_replay(kiln_hal_graph_t *g, kiln_hal_stream_t *s) {
  if (g_inj.fail_replay) return kiln_hal_error_new(KILN_HAL_ERR_DEVICE, "injected: replay failed");
  g_inj.replays++;
  return g_real->graph_replay(g, s);
}

static void wrap_init(void) {
  memcpy(&g_wrap, g_real, sizeof(g_wrap));
  g_wrap.gemm = w_gemm;
  g_wrap.embedding = w_embedding;
  g_wrap.rmsnorm = w_rmsnorm;
  g_wrap.rope = w_rope;
  g_wrap.silu_mul = w_silu_mul;
  g_wrap.add = w_add;
  g_wrap.copy = w_copy;
  g_wrap.kv_write = w_kv_write;
  g_wrap.attention = w_attention;
  g_wrap.fill = w_fill;
  g_wrap.copy_d2d = w_copy_d2d;
  g_wrap.graph_begin = w_graph_begin;
  g_wrap.graph_end = w_graph_end;
  g_wrap.graph_replay = w_graph_replay;
}

/* ---- stderr, captured to check what was logged -------------------------------------------- */

typedef struct errcap {
  int saved;
  FILE *f;
} errcap_t;

static void errcap_begin(errcap_t *c) {
  fflush(stderr);
  c->f = tmpfile();
  assert_non_null(c->f);
  c->saved = dup(2);
  assert_true(c->saved >= 0);
  assert_true(dup2(fileno(c->f), 2) >= 0);
}

/* Restores stderr and returns what was written meanwhile (malloc'ed). */
static char *errcap_end(errcap_t *c) {
  fflush(stderr);
  assert_true(dup2(c->saved, 2) >= 0);
  close(c->saved);
  long n = ftell(c->f);
  assert_true(n >= 0);
  char *text = malloc((size_t)n + 1);
  assert_non_null(text);
  rewind(c->f);
  size_t got = fread(text, 1, (size_t)n, c->f);
  text[got] = 0;
  fclose(c->f);
  return text;
}

static int count_of(const char *text, const char *what) {
  int n = 0;
  for (const char *p = text; (p = strstr(p, what)); p += strlen(what)) n++;
  return n;
}

/* ---- two models in lockstep ---------------------------------------------------------------- */

#define MAXS 48

typedef struct rig {
  char name[64];
  kiln_model_t *m[2]; /* 0: eager, 1: graphs */
  kiln_kv_cache_t *kv[2];
  int64_t V, max_len;
  int32_t dtype, bs, W, nb, nseq;
  int32_t len[MAXS], nblk[MAXS];
  int32_t *bt;  /* [nseq, W] */
  int32_t *ids; /* free block ids (a stack) */
  int32_t nfree;
  float *lg[2]; /* [MAXS, V] */
  double tol, worst;
  long rows, exact;   /* logits rows compared, and how many were bit-identical */
  long rows8, exact8; /* the same, before the first batch of more than 8 rows */
  bool past8;
  long graph_steps, eager_steps;
} rig_t;

static kiln_model_t *rig_load(const char *path, const kiln_hal_backend_t *be, int32_t dtype,
                              int32_t max_blocks, bool graphs, const int64_t *sizes,
                              int32_t nsizes) {
  kiln_model_options_t o = {0};
  o.dtype = dtype;
  o.max_tokens = 64;
  o.max_seqs = MAXS;
  o.max_logits = MAXS;
  o.max_blocks_per_seq = max_blocks;
  o.graphs = graphs;
  if (graphs) {
    o.graph_max_query_len = g_max_q;
    o.graph_query_max_seqs = g_q_seqs;
  }
  o.capture_sizes = sizes;
  o.num_capture_sizes = nsizes;
  kiln_model_t *m = NULL;
  check_st(kiln_model_load(path, be, g_dev, g_stream, &o, &m));
  return m;
}

/* Loads path twice (eager, and with graphs on backend be) with nseq sequences' worth of
 * blocks of bs tokens. */
static void rig_open(rig_t *r, const char *name, const char *path, int32_t dtype, int32_t bs,
                     int32_t nseq, const kiln_hal_backend_t *be, const int64_t *sizes,
                     int32_t nsizes) {
  memset(r, 0, sizeof(*r));
  snprintf(r->name, sizeof(r->name), "%s", name);
  /* The context first, for the block-table width. */
  kiln_model_t *probe = rig_load(path, g_real, dtype, 1, false, NULL, 0);
  r->max_len = kiln_model_max_len(probe);
  r->V = kiln_model_get_config(probe)->vocab_size;
  r->dtype = kiln_model_dtype(probe);
  kiln_model_free(probe);
  r->bs = bs;
  r->W = (int32_t)((r->max_len + bs - 1) / bs);
  r->nseq = nseq;
  r->m[0] = rig_load(path, g_real, dtype, r->W, false, NULL, 0);
  r->m[1] = rig_load(path, be, dtype, r->W, true, sizes, nsizes);
  /* Room for 8 prompt tokens and one decode per step, plus blocks to move sequences to. */
  const int32_t per_seq = (8 + MAXS + bs - 1) / bs + 1;
  r->nb = nseq * per_seq + 4 * per_seq;
  for (int k = 0; k < 2; k++) check_st(kiln_model_kv_create(r->m[k], r->nb, bs, &r->kv[k]));
  r->bt = calloc((size_t)nseq * (size_t)r->W, sizeof(int32_t));
  r->ids = malloc((size_t)r->nb * sizeof(int32_t));
  for (int k = 0; k < 2; k++) r->lg[k] = malloc((size_t)MAXS * (size_t)r->V * sizeof(float));
  assert_true(r->bt && r->ids && r->lg[0] && r->lg[1]);
  /* Free blocks in a shuffled order, so that block tables are not the identity. */
  for (int32_t i = 0; i < r->nb; i++) r->ids[i] = i;
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int32_t i = r->nb - 1; i > 0; i--) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    int32_t j = (int32_t)((x >> 33) % (uint64_t)(i + 1)), t = r->ids[i];
    r->ids[i] = r->ids[j];
    r->ids[j] = t;
  }
  r->nfree = r->nb;
  r->tol = r->dtype == KILN_HAL_F32 ? TOL : TOL_BF16;
}

static void rig_close(rig_t *r) {
  for (int k = 0; k < 2; k++) {
    kiln_kv_cache_free(r->kv[k]);
    kiln_model_free(r->m[k]);
    free(r->lg[k]);
  }
  free(r->bt);
  free(r->ids);
}

static int32_t rig_block(rig_t *r) {
  assert_true(r->nfree > 0);
  return r->ids[--r->nfree];
}

static int32_t tok(const rig_t *r, int32_t s, int32_t pos) {
  return (int32_t)((3 + s * 31 + pos * 17) % r->V);
}

/* Compares the R logits rows both models left. */
static void rig_compare(rig_t *r, int32_t R, const char *what) {
  for (int k = 0; k < 2; k++) check_st(kiln_model_read_logits(r->m[k], R, r->lg[k]));
  for (int32_t i = 0; i < R; i++) {
    const float *a = r->lg[0] + (size_t)i * r->V, *b = r->lg[1] + (size_t)i * r->V;
    double num = 0, den = 0;
    for (int64_t v = 0; v < r->V; v++) {
      double d = fabs((double)a[v] - (double)b[v]);
      if (!(d <= num)) num = d; /* NaN fails */
      if (fabs((double)a[v]) > den) den = fabs((double)a[v]);
    }
    double e = den > 0 ? num / den : num;
    if (!(e <= r->worst)) r->worst = e;
    r->rows++;
    r->exact += memcmp(a, b, (size_t)r->V * sizeof(float)) == 0;
    if (!(e <= r->tol))
      fail_msg("%s: %s: logits row %d: graph vs eager relative difference %.3g > %.0e", r->name,
               what, i, e, r->tol);
  }
}

/* Prefills every sequence (1..8 tokens, in its own forward) on both models. */
static void rig_prefill(rig_t *r) {
  for (int32_t s = 0; s < r->nseq; s++) {
    int32_t n = 1 + (s * 5) % 8, ids[8];
    for (int32_t p = 0; p < n; p++) {
      if (p / r->bs >= r->nblk[s]) r->bt[(size_t)s * r->W + r->nblk[s]++] = rig_block(r);
      ids[p] = tok(r, s, p);
    }
    for (int k = 0; k < 2; k++)
      check_st(kiln_model_forward_seq(r->m[k], r->kv[k], r->bt + (size_t)s * r->W, r->nblk[s], ids,
                                      0, n, 1));
    rig_compare(r, 1, "prefill");
    r->len[s] = n;
    if (n == 1) r->graph_steps++; /* one token: a decode batch of one */
  }
}

/* Token p of sequence s as batch row t (a block for it first, when it starts one). */
static void rig_token(rig_t *r, int32_t s, int32_t p, int32_t t, int32_t *ids, int32_t *pos,
                      int32_t *slots) {
  assert_true(p < r->max_len);
  if (p / r->bs >= r->nblk[s]) r->bt[(size_t)s * r->W + r->nblk[s]++] = rig_block(r);
  ids[t] = tok(r, s, p);
  pos[t] = p;
  slots[t] = r->bt[(size_t)s * r->W + p / r->bs] * r->bs + p % r->bs;
}

/* Runs a batch of T tokens of the S sequences seqs[] (their new lengths lens[]) on both models,
 * with block tables of the model's width (full) or of the batch's widest, and compares the R
 * logits rows; the sequences are lens[] long afterwards. */
static void rig_forward(rig_t *r, const int32_t *seqs, int32_t S, int32_t T, int32_t *ids,
                        int32_t *pos, int32_t *slots, int32_t *lens, int32_t *qsl, bool full,
                        int32_t R, int32_t *rows, const char *what) {
  int32_t width = 1;
  for (int32_t i = 0; i < S; i++)
    if (r->nblk[seqs[i]] > width) width = r->nblk[seqs[i]];
  if (full) width = r->W;
  assert_true(S > 0 && width > 0);
  int32_t *tables = malloc((size_t)(uint32_t)S * (size_t)(uint32_t)width * sizeof(int32_t));
  assert_non_null(tables);
  for (int32_t i = 0; i < S; i++)
    memcpy(tables + (size_t)i * width, r->bt + (size_t)seqs[i] * r->W, (size_t)width * 4);
  kiln_batch_t b = {.num_tokens = T,
                    .num_seqs = S,
                    .token_ids = ids,
                    .positions = pos,
                    .slot_mapping = slots,
                    .seq_lens = lens,
                    .query_start_loc = qsl,
                    .block_tables = tables,
                    .max_blocks_per_seq = width,
                    .num_logits = R,
                    .logits_rows = rows};
  for (int k = 0; k < 2; k++) check_st(kiln_model_forward(r->m[k], r->kv[k], &b));
  rig_compare(r, R, what);
  free(tables);
  for (int32_t i = 0; i < S; i++) r->len[seqs[i]] = lens[i];
}

enum { ROWS_ALL, ROWS_SUBSET, ROWS_REPEATED };

/* Logits rows a decode of S asks for in a rows mode. */
static int32_t rows_of(int32_t S, int mode) {
  return mode == ROWS_SUBSET ? S - 1 : mode == ROWS_REPEATED ? S + 2 : S;
}

/* One decode step of the S sequences seqs[] on both models. full: block tables of the model's
 * width (else of the batch's widest). Logits rows: all in order, a reordered subset (all but
 * the first, last first), or all and then rows 0 and S - 1 again. */
static void rig_decode(rig_t *r, const int32_t *seqs, int32_t S, bool full, int mode) {
  int32_t ids[MAXS], pos[MAXS], slots[MAXS], lens[MAXS], qsl[MAXS + 1], rows[MAXS + 2];
  for (int32_t i = 0; i < S; i++) {
    rig_token(r, seqs[i], r->len[seqs[i]], i, ids, pos, slots);
    lens[i] = r->len[seqs[i]] + 1;
    qsl[i] = i;
  }
  qsl[S] = S;
  const int32_t R = rows_of(S, mode);
  assert_true(R >= 0 && R <= MAXS);
  for (int32_t i = 0; i < S; i++) rows[i] = mode == ROWS_SUBSET ? S - 1 - i : i;
  if (mode == ROWS_REPEATED) {
    rows[S] = 0;
    rows[S + 1] = S - 1;
  }
  char what[64];
  snprintf(what, sizeof(what), "decode of %d%s%s", S, full ? ", full tables" : "",
           mode == ROWS_SUBSET     ? ", subset"
           : mode == ROWS_REPEATED ? ", repeated rows"
                                   : "");
  rig_forward(r, seqs, S, S, ids, pos, slots, lens, qsl, full, R, rows, what);
}

/* One multi-token decode step: each of the S sequences seqs[] gets q[i] new tokens (contiguous
 * rows, as speculation's verification lays them out). Logits rows: every row (verification),
 * each sequence's last (a draft's catch-up), or every second row in reverse. */
enum { MROWS_ALL, MROWS_LAST, MROWS_SOME };
static void rig_decode_multi(rig_t *r, const int32_t *seqs, int32_t S, const int32_t *q, bool full,
                             int mode) {
  int32_t ids[64], pos[64], slots[64], lens[MAXS], qsl[MAXS + 1], rows[MAXS];
  int32_t T = 0;
  for (int32_t i = 0; i < S; i++) {
    qsl[i] = T;
    for (int32_t j = 0; j < q[i]; j++, T++) {
      assert_true(T < 64);
      rig_token(r, seqs[i], r->len[seqs[i]] + j, T, ids, pos, slots);
    }
    lens[i] = r->len[seqs[i]] + q[i];
  }
  qsl[S] = T;
  int32_t R = 0;
  if (mode == MROWS_ALL)
    for (int32_t t = 0; t < T && R < MAXS; t++) rows[R++] = t;
  else if (mode == MROWS_LAST)
    for (int32_t i = 0; i < S; i++) rows[R++] = qsl[i + 1] - 1;
  else
    for (int32_t t = T - 1; t >= 0 && R < MAXS; t -= 2) rows[R++] = t;
  char what[96];
  snprintf(what, sizeof(what), "multi-token decode of %d sequences (first q %d), %d rows%s", S,
           q[0], R, full ? ", full tables" : "");
  rig_forward(r, seqs, S, T, ids, pos, slots, lens, qsl, full, R, rows, what);
}

/* Moves sequence s to fresh blocks (copy-on-write style) on both models; its old blocks go back
 * to the free list, so that other sequences reuse them with stale contents. */
static void rig_move(rig_t *r, int32_t s) {
  int32_t *row = r->bt + (size_t)s * r->W, old[MAXS], fresh[MAXS];
  int32_t n = r->nblk[s];
  for (int32_t j = 0; j < n; j++) {
    old[j] = row[j];
    fresh[j] = rig_block(r);
  }
  for (int k = 0; k < 2; k++) check_st(kiln_kv_cache_copy_blocks(r->kv[k], old, fresh, n));
  for (int32_t j = 0; j < n; j++) {
    row[j] = fresh[j];
    r->ids[r->nfree++] = old[j];
  }
  /* Stale entries past the last block: never read. */
  for (int32_t j = n; j < r->W && j < n + 2; j++) row[j] = old[0];
}

/* Steps 1..steps: a decode batch of S = step sequences (rotating, so that lengths mix), each
 * sequence that is not at the end of the context. Returns after checking every step. */
static void rig_run(rig_t *r, int32_t steps, int32_t max_graph) {
  for (int32_t k = 1; k <= steps; k++) {
    int32_t seqs[MAXS], S = 0;
    for (int32_t i = 0; i < r->nseq && S < k; i++) {
      int32_t s = (i + k * 7) % r->nseq;
      if (r->len[s] < r->max_len) seqs[S++] = s;
    }
    if (S == 0) break;
    int mode = k % 5 == 0 && S > 1 ? ROWS_SUBSET : k % 7 == 0 ? ROWS_REPEATED : ROWS_ALL;
    if (rows_of(S, mode) > MAXS) mode = ROWS_ALL;
    rig_decode(r, seqs, S, k % 3 != 0, mode);
    if (rows_of(S, mode) > 8) r->past8 = true;
    if (!r->past8) {
      r->rows8 = r->rows;
      r->exact8 = r->exact;
    }
    if (rows_of(S, mode) <= max_graph)
      r->graph_steps++;
    else
      r->eager_steps++;
    if (k % 10 == 0)
      for (int32_t j = 0; j < 3; j++) rig_move(r, (k + 11 * j) % r->nseq);
  }
}

/* Bytes of kv's buffer. */
static uint8_t *kv_read(kiln_kv_cache_t *kv, uint64_t *out_bytes) {
  const kiln_model_config_t *c = kiln_model_get_config(kv->m);
  uint64_t bytes = kv->cache_bytes * 2 * (uint64_t)c->num_layers;
  uint8_t *p = malloc((size_t)bytes);
  assert_non_null(p);
  check_hal(g_real->copy_d2h(g_stream, p, kv->buf, 0, bytes));
  check_hal(g_real->stream_sync(g_stream));
  *out_bytes = bytes;
  return p;
}

/* Both KV caches hold the same keys and values in the pool's blocks (bit for bit when every
 * logits row was), and the graphs' scratch block is still zero. */
static void rig_check_kv(rig_t *r) {
  const kiln_model_config_t *c = kiln_model_get_config(r->m[0]);
  uint64_t n0, n1;
  uint8_t *a = kv_read(r->kv[0], &n0), *b = kv_read(r->kv[1], &n1);
  assert_int_equal(r->kv[1]->pool_blocks, r->nb + 1);
  const uint64_t es = kiln_hal_dtype_size(r->dtype);
  const uint64_t block = (uint64_t)c->num_kv_heads * (uint64_t)r->bs * (uint64_t)c->head_dim * es;
  const bool exact = r->exact == r->rows;
  for (int64_t l = 0; l < 2 * c->num_layers; l++) {
    const uint8_t *x = a + (uint64_t)l * r->kv[0]->cache_bytes;
    const uint8_t *y = b + (uint64_t)l * r->kv[1]->cache_bytes;
    const uint64_t pool = (uint64_t)r->nb * block;
    if (exact) {
      if (memcmp(x, y, (size_t)pool) != 0)
        fail_msg("%s: K/V cache %lld differs between graph and eager runs", r->name, (long long)l);
    } else if (r->dtype == KILN_HAL_F32) {
      const float *fx = (const float *)x, *fy = (const float *)y;
      for (uint64_t i = 0; i < pool / 4; i++)
        if (!(fabsf(fx[i] - fy[i]) <= 1e-4f * (1.0f + fabsf(fx[i]))))
          fail_msg("%s: K/V cache %lld element %llu: %g vs %g", r->name, (long long)l,
                   (unsigned long long)i, (double)fx[i], (double)fy[i]);
    }
    for (uint64_t i = 0; i < block; i++)
      if (y[pool + i])
        fail_msg("%s: the scratch block of K/V cache %lld was written (byte %llu)", r->name,
                 (long long)l, (unsigned long long)i);
  }
  free(a);
  free(b);
}

static void rig_report(const rig_t *r) {
  kiln_model_graph_stats_t st;
  kiln_model_graph_stats(r->m[1], &st);
  printf(
      "  %-16s %s: %ld rows, %ld bit-identical, worst %.2g; %lld captures, %lld replays "
      "(%lld padding rows), %lld eager\n",
      r->name, kiln_hal_dtype_name(r->dtype), r->rows, r->exact, r->worst, (long long)st.captures,
      (long long)st.replays, (long long)st.padded_rows, (long long)st.eager_forwards);
}

/* The whole scenario on one model: 44 sequences, decode batches of 1..44 over the capture
 * sizes 1..40 (so 41..44 run eagerly), then the KV caches compared. Quick: 12 sequences,
 * batches of 1..12 over the sizes 1..8. */
static void check_model(const char *name, const char *path, int32_t dtype, int32_t bs) {
  static const int64_t sizes[] = {1, 2, 4, 8, 16, 24, 32, 40};
  const int32_t nsizes = g_quick ? 4 : 8, nseq = g_quick ? 12 : 44;
  const int32_t largest = (int32_t)sizes[nsizes - 1];
  rig_t r;
  rig_open(&r, name, path, dtype, bs, nseq, g_real, sizes, nsizes);
  kiln_model_graph_stats_t st;
  kiln_model_graph_stats(r.m[1], &st);
  assert_int_equal(st.num_sizes, nsizes);
  assert_int_equal(st.max_size, largest);
  assert_true(st.active);
  kiln_model_graph_stats(r.m[0], &st);
  assert_int_equal(st.num_sizes, 0);
  assert_false(st.active);
  assert_int_equal(r.kv[0]->pool_blocks, r.nb); /* no scratch block without graphs */

  rig_prefill(&r);
  rig_run(&r, nseq, largest);
  rig_report(&r);
  kiln_model_graph_stats(r.m[1], &st);
  assert_false(st.failed);
  assert_int_equal(st.replays, r.graph_steps);
  assert_true(st.replays > (g_quick ? 6 : 30));
  assert_true(st.captures >= nsizes - 2 && st.captures <= nsizes);
  assert_true(st.padded_rows > 0);
  if (r.eager_steps == 0) fail_msg("%s: no batch above the largest capture size", name);
  rig_check_kv(&r);
  /* On the CPU, batches padded to at most 8 rows run kernels that compute each row alone: bit
   * for bit (see TOL). The first 8 steps are such batches, after prefills. */
  if (!strcmp(g_real->name, "cpu") && r.exact8 != r.rows8)
    fail_msg("%s: %ld of the first %ld logits rows differ from eager in the last bits", name,
             r.rows8 - r.exact8, r.rows8);
  rig_close(&r);
}

/* ---- the tests ------------------------------------------------------------------------------ */

static int setup(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(g_src, sizeof(g_src), "%s", src ? src : "..");
  kiln_hal_registry_options_t o = {0};
  kiln_status_t st = kiln_hal_registry_create(&o, &g_reg);
  const char *want = getenv("KILN_TEST_BACKEND");
  if (!st) st = kiln_hal_registry_open(g_reg, want && *want ? want : "cpu", &g_plugin);
  if (st) {
    fprintf(stderr, "%s\n", kiln_status_message(st));
    kiln_status_free(st);
    return -1;
  }
  g_real = &g_plugin->table;
  if (g_real->device_open(0, &g_dev) || g_real->stream_create(g_dev, &g_stream)) return -1;
  kiln_hal_device_info_t di;
  memset(&di, 0, sizeof(di));
  di.struct_size = sizeof(di);
  if (g_real->device_info(0, &di)) return -1;
  g_graphs = (di.caps & KILN_HAL_CAP_GRAPHS) != 0;
  if (!g_graphs) printf("test_graphs: backend %s has no CAP_GRAPHS: skipping\n", g_real->name);
  wrap_init();
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (g_stream) g_real->stream_destroy(g_stream);
  if (g_dev) g_real->device_close(g_dev);
  kiln_hal_registry_free(g_reg);
  return 0;
}

/* Every fixture, through the whole scenario with blocks of 4 tokens (many per sequence). */
static void test_fixtures(void **state) {
  (void)state;
  if (!g_graphs) skip();
  char root[1100];
  snprintf(root, sizeof(root), "%s/tests/fixtures/models", g_src);
  DIR *d = opendir(root);
  assert_non_null(d);
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char path[1400], gguf[1500];
    snprintf(path, sizeof(path), "%s/%s", root, e->d_name);
    snprintf(gguf, sizeof(gguf), "%s/model.gguf", path);
    n++;
    /* Quick: the plain, the split-QKV (q/k norms), the sliding-window and the f16 GGUF paths. */
    if (g_quick && strcmp(e->d_name, "llama2") && strcmp(e->d_name, "qwen3") &&
        strcmp(e->d_name, "mistral_swa") && strcmp(e->d_name, "llama3_gguf"))
      continue;
    FILE *f = fopen(gguf, "rb");
    if (f) fclose(f);
    check_model(e->d_name, f ? gguf : path, -1, 4);
  }
  closedir(d);
  assert_true(n >= 10);
}

/* The default model (8 layers, a 4096-token vocabulary, bf16), blocks of 16: in float32 and
 * in its own dtype. */
static void test_default_model(void **state) {
  (void)state;
  if (!g_graphs) skip();
  char path[1100];
  snprintf(path, sizeof(path), "%s/share/models/kiln-tiny", g_src);
  check_model("kiln-tiny", path, KILN_HAL_F32, 16);
  if (!g_quick) check_model("kiln-tiny", path, -1, 16);
}

/* Capture sizes as a user might write them: unsorted, repeated, one beyond max_num_seqs.
 * Batches of 8 and 9..12 share the graph of 12, whose GEMMs may take another path than the
 * batch's own row count: within TOL. */
static void test_custom_sizes(void **state) {
  (void)state;
  if (!g_graphs) skip();
  static const int64_t sizes[] = {12, 3, 7, 5, 3, 1000};
  char path[1100];
  snprintf(path, sizeof(path), "%s/tests/fixtures/models/llama2", g_src);
  rig_t r;
  rig_open(&r, "llama2 sizes", path, KILN_HAL_F32, 8, 16, g_real, sizes, 6);
  kiln_model_graph_stats_t st;
  kiln_model_graph_stats(r.m[1], &st);
  assert_int_equal(st.num_sizes, 4); /* 3 5 7 12 */
  assert_int_equal(st.max_size, 12);
  assert_int_equal(r.m[1]->graph_sizes[0], 3);
  assert_int_equal(r.m[1]->graph_sizes[3], 12);
  rig_prefill(&r);
  rig_run(&r, 16, 12);
  rig_report(&r);
  kiln_model_graph_stats(r.m[1], &st);
  assert_int_equal(st.captures, 4);
  assert_int_equal(st.replays, r.graph_steps);
  rig_check_kv(&r);
  rig_close(&r);

  /* No size fits the model's batch limits: no graphs, no scratch block. */
  static const int64_t big[] = {100, 200};
  kiln_model_t *m = rig_load(path, g_real, KILN_HAL_F32, 16, true, big, 2);
  kiln_model_graph_stats(m, &st);
  assert_int_equal(st.num_sizes, 0);
  assert_false(st.active);
  kiln_kv_cache_t *kv = NULL;
  check_st(kiln_model_kv_create(m, 4, 16, &kv));
  assert_int_equal(kv->pool_blocks, 4);
  assert_null(kv->graphs);
  kiln_kv_cache_free(kv);
  kiln_model_free(m);

  /* The default list: 1, 2, 4, then multiples of 8 up to the batch limit (48 here). */
  m = rig_load(path, g_real, KILN_HAL_F32, 16, true, NULL, 0);
  kiln_model_graph_stats(m, &st);
  assert_int_equal(st.num_sizes, 9);
  assert_int_equal(st.max_size, 48);
  kiln_model_free(m);
}

/* Multi-token decode graphs (graph_max_query_len 5, sizes 1, 2, 4, 8): batches of 1..8
 * sequences with 2..5 new tokens each replay the graph of (q, P) with the same logits as eager
 * (every row, each sequence's last, a reordered subset); a batch whose sequences have different
 * query lengths, one longer than 5 and one of 9 sequences run eagerly; the KV caches agree. Then
 * graph_query_max_seqs = 3 keeps multi-token graphs for the sizes 1, 2, 4 only. */
static void test_multi_query(void **state) {
  (void)state;
  if (!g_graphs) skip();
  static const int64_t sizes[] = {1, 2, 4, 8};
  const char *names[] = {"llama2", "qwen3", "mistral_swa"};
  for (int f = 0; f < (g_quick ? 1 : 3); f++) {
    char path[1100];
    snprintf(path, sizeof(path), "%s/tests/fixtures/models/%s", g_src, names[f]);
    g_max_q = 5;
    rig_t r;
    rig_open(&r, names[f], path, KILN_HAL_F32, 4, 16, g_real, sizes, 4);
    g_max_q = 0;
    kiln_model_graph_stats_t st;
    kiln_model_graph_stats(r.m[1], &st);
    assert_int_equal(st.max_query_len, 5);
    /* 4 sizes x 5 query lengths, of which q * P <= max_tokens (64): all 20. */
    assert_int_equal(kiln_model_graphs_capture(r.m[1], r.kv[1], 600), 20);
    rig_prefill(&r);
    kiln_model_graph_stats(r.m[1], &st);
    /* (prompts of 2..5 tokens were multi-token decodes of one sequence already) */
    const int64_t replays0 = st.replays, eager0 = st.eager_forwards, multi0 = st.multi_replays;
    assert_true(multi0 > 0);
    long uniform = 0, mixed = 0;
    const int32_t steps = g_quick ? 10 : 24;
    for (int32_t k = 0; k < steps; k++) {
      int32_t seqs[MAXS], q[MAXS], S = 0;
      const int32_t want = 1 + (k * 5) % 8, qk = 2 + k % 4;
      for (int32_t i = 0; i < r.nseq && S < want; i++) {
        int32_t s = (i + k * 3) % r.nseq;
        if (r.len[s] + 6 <= 8 + MAXS) {
          seqs[S] = s;
          q[S++] = qk;
        }
      }
      assert_true(S > 0);
      const bool mix = k % 6 == 5 && S > 1;
      if (mix) q[S - 1] = qk == 2 ? 3 : 2;
      rig_decode_multi(&r, seqs, S, q, k % 3 != 0, k % 3);
      mixed += mix;
      uniform += !mix;
      if (k % 8 == 7) rig_move(&r, k % r.nseq);
    }
    /* A query of 6 (above 5): eager; 8 sequences of 2: a graph; 9 of 2 (above 8): eager. */
    const int32_t one[1] = {0}, six[1] = {6};
    const int32_t nine[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, twos[9] = {2, 2, 2, 2, 2, 2, 2, 2, 2};
    rig_decode_multi(&r, one, 1, six, true, MROWS_ALL);
    rig_decode_multi(&r, nine, 8, twos, false, MROWS_LAST);
    uniform++;
    rig_decode_multi(&r, nine, 9, twos, true, MROWS_LAST);
    kiln_model_graph_stats(r.m[1], &st);
    rig_report(&r);
    assert_false(st.failed);
    assert_int_equal(st.replays - replays0, uniform);
    assert_int_equal(st.multi_replays - multi0, uniform);
    assert_int_equal(st.eager_forwards - eager0, mixed + 2);
    assert_int_equal(st.captures, 20);
    rig_check_kv(&r);
    rig_close(&r);
  }

  /* graph_query_max_seqs = 3: multi-token graphs of 1, 2 and 4 sequences (4 holds 3), none of
   * 8; decode graphs of every size. */
  char path[1100];
  snprintf(path, sizeof(path), "%s/tests/fixtures/models/llama2", g_src);
  g_max_q = 3;
  g_q_seqs = 3;
  rig_t r;
  rig_open(&r, "llama2 q-seqs", path, KILN_HAL_F32, 4, 8, g_real, sizes, 4);
  g_max_q = g_q_seqs = 0;
  assert_int_equal(kiln_model_graphs_capture(r.m[1], r.kv[1], 600), 4 + 2 * 3);
  rig_prefill(&r);
  kiln_model_graph_stats_t st;
  kiln_model_graph_stats(r.m[1], &st);
  const int64_t e0 = st.eager_forwards, m0 = st.multi_replays;
  int32_t seqs[8] = {0, 1, 2, 3, 4, 5, 6, 7}, q[8] = {2, 2, 2, 2, 2, 2, 2, 2};
  rig_decode_multi(&r, seqs, 4, q, true, MROWS_ALL); /* P = 4: a graph */
  rig_decode_multi(&r, seqs, 5, q, true, MROWS_ALL); /* P = 8: eager */
  kiln_model_graph_stats(r.m[1], &st);
  assert_int_equal(st.multi_replays - m0, 1);
  assert_int_equal(st.eager_forwards - e0, 1);
  rig_check_kv(&r);
  rig_close(&r);
}

/* Graphs captured ahead of time are used as they are (no capture at run time); a second KV
 * cache gets its own graphs; a fresh cache per kiln_model_score (decode-only chunks of one
 * token) captures and frees its own. */
static void test_capture_ahead(void **state) {
  (void)state;
  if (!g_graphs) skip();
  char path[1100];
  snprintf(path, sizeof(path), "%s/tests/fixtures/models/qwen3", g_src);
  rig_t r;
  rig_open(&r, "qwen3 ahead", path, KILN_HAL_F32, 16, 20, g_real, NULL, 0);
  kiln_model_graph_stats_t st;
  kiln_model_graph_stats(r.m[1], &st);
  assert_int_equal(kiln_model_graphs_capture(r.m[1], r.kv[1], 0), 0);  /* no time: none */
  assert_int_equal(kiln_model_graphs_capture(r.m[0], r.kv[0], 60), 0); /* no graphs */
  assert_int_equal(kiln_model_graphs_capture(r.m[1], r.kv[1], 600), st.num_sizes);
  assert_int_equal(kiln_model_graphs_capture(r.m[1], r.kv[1], 600), st.num_sizes); /* idempotent */
  kiln_model_graph_stats(r.m[1], &st);
  assert_int_equal(st.captures, st.num_sizes);
  rig_prefill(&r);
  rig_run(&r, 20, 48);
  rig_report(&r);
  kiln_model_graph_stats(r.m[1], &st);
  assert_int_equal(st.captures, st.num_sizes);
  assert_int_equal(st.replays, r.graph_steps);
  rig_check_kv(&r);

  /* Scoring token by token: every forward is a decode of one. */
  const int32_t n = 20;
  int32_t ids[20];
  for (int32_t i = 0; i < n; i++) ids[i] = tok(&r, 3, i);
  float *a = malloc((size_t)n * (size_t)r.V * sizeof(float));
  float *b = malloc((size_t)n * (size_t)r.V * sizeof(float));
  assert_true(a && b);
  check_st(kiln_model_score(r.m[0], ids, n, 1, 4, a));
  int64_t before = st.replays;
  check_st(kiln_model_score(r.m[1], ids, n, 1, 4, b));
  kiln_model_graph_stats(r.m[1], &st);
  assert_int_equal(st.replays - before, n);
  assert_int_equal(st.captures, st.num_sizes + 1); /* the size-1 graph of the scoring cache */
  assert_memory_equal(a, b, (size_t)n * (size_t)r.V * sizeof(float));
  free(a);
  free(b);
  rig_close(&r);
}

/* Runs prefill + 4 decode steps (batches of 3, 2, 3, 5) on a rig whose graph model uses the
 * failing backend (graphs of 2, 4 and 8 rows); returns the number of capture calls made. */
static long refused_run(const char *path, long fail_at, int32_t code, bool expect_fallback,
                        char **out_log) {
  inj_reset(fail_at, code);
  static const int64_t sizes[] = {2, 4, 8};
  rig_t r;
  errcap_t cap;
  errcap_begin(&cap);
  rig_open(&r, "refused", path, KILN_HAL_F32, 8, 5, &g_wrap, sizes, 3);
  rig_prefill(&r); /* prompts of 1..8 tokens: sequence 0's one token is a decode of one */
  static const int32_t a[] = {0, 1, 2}, b[] = {3, 4}, c[] = {4, 0, 2}, d[] = {0, 1, 2, 3, 4};
  rig_decode(&r, a, 3, true, ROWS_ALL);
  rig_decode(&r, b, 2, false, ROWS_REPEATED);
  rig_decode(&r, c, 3, true, ROWS_SUBSET);
  rig_decode(&r, d, 5, true, ROWS_ALL);
  kiln_model_graph_stats_t st;
  kiln_model_graph_stats(r.m[1], &st);
  *out_log = errcap_end(&cap);
  /* The logits of a refused capture's batch come from the same eager ops: bit for bit on the
   * CPU. A GPU's GEMM may pick another algorithm for the padded shape of the batches that did
   * replay before the refusal, so there rig_decode's tolerance is the check. */
  if (strcmp(g_real->name, "cpu") == 0) assert_int_equal(r.exact, r.rows);
  rig_check_kv(&r);
  assert_int_equal(g_inj.begins, g_inj.ends); /* every capture was closed */
  assert_int_equal(st.failed, expect_fallback);
  assert_int_equal(st.active, !expect_fallback);
  assert_int_equal(st.replays, g_inj.replays);
  if (!expect_fallback) {
    assert_int_equal(st.replays, r.graph_steps + 4); /* the 1-token prefill, 4 decodes */
    assert_int_equal(st.captures, 3);
  }
  assert_int_equal(st.replays + st.eager_forwards, 4 + r.nseq);
  rig_close(&r);
  return g_inj.calls;
}

/* Each call of each capture fails in turn: the forward falls back to eager with the same
 * logits, closes the capture, warns once and stays eager. A failed replay is an error. */
static void test_capture_refused(void **state) {
  (void)state;
  if (!g_graphs) skip();
  char path[1100];
  snprintf(path, sizeof(path), "%s/tests/fixtures/models/llama2", g_src);
  kiln_log_level_t level = kiln_log_get_level();
  kiln_log_set_level(KILN_LOG_WARN);
  char *log = NULL;
  const long calls = refused_run(path, -1, 0, false, &log);
  assert_int_equal(count_of(log, "graphs:"), 0);
  free(log);
  assert_true(calls > 20);
  for (long n = 0; n < calls; n += g_quick ? 4 : 1) {
    refused_run(path, n, n % 2 ? KILN_HAL_ERR_OUT_OF_MEMORY : KILN_HAL_ERR_UNSUPPORTED, true, &log);
    if (count_of(log, "graphs:") != 1 || !strstr(log, "injected"))
      fail_msg("failing capture call %ld: want one warning naming the failure, got:\n%s", n, log);
    free(log);
  }
  printf("  capture refused at %s of its %ld calls: eager, same logits, one warning\n",
         g_quick ? "every fourth" : "each", calls);

  /* A failed replay is the forward's error, not a silent fallback. */
  inj_reset(-1, 0);
  static const int64_t sizes[] = {4};
  kiln_model_t *m = rig_load(path, &g_wrap, KILN_HAL_F32, 16, true, sizes, 1);
  kiln_kv_cache_t *kv = NULL;
  check_st(kiln_model_kv_create(m, 4, 8, &kv));
  const int32_t bt[1] = {2}, id[1] = {5};
  g_inj.fail_replay = true;
  kiln_status_t st = kiln_model_forward_seq(m, kv, bt, 1, id, 0, 1, 1);
  assert_non_null(st);
  assert_non_null(strstr(kiln_status_message(st), "replay failed"));
  kiln_status_free(st);
  g_inj.fail_replay = false;
  check_st(kiln_model_forward_seq(m, kv, bt, 1, id, 0, 1, 1));
  kiln_kv_cache_free(kv);
  kiln_model_free(m);
  kiln_log_set_level(level);
}

/* The CPU backend's capture rules (hal.h): allocation, synchronisation and a nested begin are
 * refused, the refusal ends the capture, and the stream runs eagerly afterwards. */
static void test_cpu_capture_rules(void **state) {
  (void)state;
  if (strcmp(g_real->name, "cpu") != 0) skip();
  kiln_hal_buffer_t *buf = NULL, *other = NULL;
  check_hal(g_real->buffer_alloc(g_dev, 64, 0, &buf));
  kiln_hal_graph_t *g = (kiln_hal_graph_t *)1;
  uint8_t back[64];

  /* Allocation during a capture. */
  check_hal(g_real->graph_begin(g_stream));
  check_hal(g_real->fill(g_stream, buf, 0, 64, 7)); /* recorded, not run */
  kiln_hal_error_t *e = g_real->buffer_alloc(g_dev, 64, 0, &other);
  assert_non_null(e);
  assert_int_equal(e->code, KILN_HAL_ERR_INVALID_ARGUMENT);
  assert_null(other);
  kiln_hal_error_free(e);
  e = g_real->graph_end(g_stream, &g);
  assert_non_null(e);
  assert_null(g);
  kiln_hal_error_free(e);
  check_hal(g_real->buffer_alloc(g_dev, 64, 0, &other)); /* fine again */
  g_real->buffer_free(other);

  /* A nested begin is refused; a sync ends the capture. */
  check_hal(g_real->graph_begin(g_stream));
  e = g_real->graph_begin(g_stream);
  assert_non_null(e);
  kiln_hal_error_free(e);
  e = g_real->stream_sync(g_stream);
  assert_non_null(e);
  kiln_hal_error_free(e);
  g = (kiln_hal_graph_t *)1;
  e = g_real->graph_end(g_stream, &g);
  assert_non_null(e);
  assert_null(g);
  kiln_hal_error_free(e);

  /* Eager again, and a good capture replays with the buffers' current contents. */
  check_hal(g_real->fill(g_stream, buf, 0, 64, 1));
  check_hal(g_real->graph_begin(g_stream));
  check_hal(g_real->fill(g_stream, buf, 0, 32, 9));
  check_hal(g_real->graph_end(g_stream, &g));
  assert_non_null(g);
  check_hal(g_real->copy_d2h(g_stream, back, buf, 0, 64));
  check_hal(g_real->stream_sync(g_stream));
  assert_int_equal(back[0], 1); /* recorded, not run */
  check_hal(g_real->graph_replay(g, g_stream));
  check_hal(g_real->copy_d2h(g_stream, back, buf, 0, 64));
  check_hal(g_real->stream_sync(g_stream));
  assert_int_equal(back[0], 9);
  assert_int_equal(back[63], 1);
  g_real->graph_destroy(g);
  g_real->buffer_free(buf);
}

/* ---- the engine ------------------------------------------------------------------------------ */

#define NREQ 30
#define MAXTOK 24

typedef struct job {
  int32_t prompt[48];
  int32_t np;
  int32_t out[MAXTOK];
  int32_t n;
} job_t;

static kiln_engine_t *engine_make(const char *model, bool graphs, char **out_log) {
  char mp[1200];
  snprintf(mp, sizeof(mp), "model.path=%s", model);
  static char be[64];
  const char *want = getenv("KILN_TEST_BACKEND");
  snprintf(be, sizeof(be), "backend.name=%s", want && want[0] ? want : "cpu");
  const char *ov[] = {mp,
                      be,
                      "backend.threads=2",
                      "model.dtype=float32",
                      graphs ? "graph.enabled=true" : "graph.enabled=false",
                      "graph.capture_sizes=1,2,4,8,16,24",
                      "cache.num_blocks=160"};
  kiln_log_level_t level = kiln_log_get_level();
  kiln_log_set_level(KILN_LOG_INFO);
  errcap_t cap;
  errcap_begin(&cap);
  kiln_engine_t *e = NULL;
  kiln_status_t st = kiln_engine_create(NULL, ov, (int32_t)(sizeof(ov) / sizeof(ov[0])), &e);
  *out_log = errcap_end(&cap);
  kiln_log_set_level(level);
  check_st(st);
  return e;
}

/* NREQ greedy requests submitted together: 30 decodes at first (above the largest size, 24:
 * eager), fewer and fewer as they finish (graphs of 24, 16, 8, 4, 2, 1). */
static void engine_run(kiln_engine_t *e, job_t *jobs, int32_t vocab) {
  kiln_request_t *reqs[NREQ];
  uint64_t x = 12345;
  for (int32_t j = 0; j < NREQ; j++) {
    job_t *b = &jobs[j];
    b->n = 0;
    b->np = 3 + (j * 7) % 40;
    for (int32_t i = 0; i < b->np; i++) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      b->prompt[i] = 3 + (int32_t)((x >> 33) % (uint64_t)(vocab - 3));
    }
    kiln_sampling_params_t p;
    kiln_sampling_params_init(&p);
    p.max_tokens = 4 + j % 17;
    p.ignore_eos = true;
    p.temperature = 0.0f;
    kiln_request_desc_t d = {
        .struct_size = sizeof(d), .prompt_ids = b->prompt, .num_prompt_ids = b->np, .params = &p};
    check_st(kiln_engine_submit(e, &d, &reqs[j]));
  }
  for (int32_t j = 0; j < NREQ; j++) {
    for (;;) {
      kiln_output_t *o = NULL;
      check_st(kiln_request_poll(reqs[j], -1, &o));
      assert_non_null(o);
      if (o->error) fail_msg("request %d: %s", j, o->error);
      for (int32_t k = 0; k < o->num_tokens; k++) {
        assert_true(jobs[j].n < MAXTOK);
        jobs[j].out[jobs[j].n++] = o->token_ids[k];
      }
      bool last = o->request_finished;
      kiln_output_free(o);
      if (last) break;
    }
    kiln_request_release(reqs[j]);
    assert_int_equal(jobs[j].n, 4 + j % 17);
  }
}

static void check_engine(const char *model, int32_t vocab) {
  static job_t eager[NREQ], graphs[NREQ];
  char *log = NULL;
  kiln_engine_t *e = engine_make(model, false, &log);
  assert_null(strstr(log, "graphs: captured"));
  free(log);
  engine_run(e, eager, vocab);
  kiln_engine_destroy(e);
  e = engine_make(model, true, &log);
  if (!strstr(log, "graphs: captured 6 decode graphs"))
    fail_msg("the engine did not capture its 6 graphs at start-up:\n%s", log);
  free(log);
  engine_run(e, graphs, vocab);
  kiln_engine_destroy(e);
  for (int32_t j = 0; j < NREQ; j++)
    if (memcmp(eager[j].out, graphs[j].out, (size_t)eager[j].n * 4) != 0)
      fail_msg("%s: request %d: greedy tokens differ with graphs", model, j);
}

static void test_engine_fixture(void **state) {
  (void)state;
  if (!g_graphs) skip();
  char path[1100];
  snprintf(path, sizeof(path), "%s/tests/fixtures/models/llama2", g_src);
  check_engine(path, 320);
}

static void test_engine_default_model(void **state) {
  (void)state;
  if (!g_graphs || g_quick) skip();
  char path[1100];
  snprintf(path, sizeof(path), "%s/share/models/kiln-tiny", g_src);
  check_engine(path, 4096);
}

int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]); /* e.g. test_graphs 'test_engine*' */
  const char *quick = getenv("KILN_TEST_QUICK");
  g_quick = quick && *quick && strcmp(quick, "0") != 0;
#ifdef RUNNING_ON_VALGRIND
  if (RUNNING_ON_VALGRIND) g_quick = true;
#endif
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fixtures),
      cmocka_unit_test(test_default_model),
      cmocka_unit_test(test_custom_sizes),
      cmocka_unit_test(test_multi_query),
      cmocka_unit_test(test_capture_ahead),
      cmocka_unit_test(test_capture_refused),
      cmocka_unit_test(test_cpu_capture_rules),
      cmocka_unit_test(test_engine_fixture),
      cmocka_unit_test(test_engine_default_model),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
