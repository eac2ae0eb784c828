/* cmd_selftest.c - `kiln selftest`: one Llama-style decoder layer plus the LM head, run through
 * the HAL ops on the configured backend over two engine steps (a batch of prefills, then a
 * mixed batch of a chunked prefill and a decode over the paged KV cache), checked against an
 * fp64 host reference built from the conformance suite's reference ops. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "kiln/hal_util.h"
#include "hal/ref/ops_ref.h"

/* Model and batch shape: small, but with GQA, a partial block and odd token counts. */
enum { V = 509, H = 256, NH = 4, NKV = 2, D = 64, I = 384, BS = 16, NB = 8, MB = 4, S = 2 };
enum { QKV = (NH + 2 * NKV) * D, P = 64, TMAX = 16 };

typedef struct st_ctx {
  const kiln_hal_backend_t *t;
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  int32_t dtype;
  kiln_status_t status; /* first failure; later calls are skipped */
  kiln_hal_buffer_t *bufs[64];
  int nbufs;
} st_ctx_t;

static int st_ok(st_ctx_t *c) { return c->status == NULL; }

static void st_check(st_ctx_t *c, kiln_hal_error_t *err, const char *what) {
  if (!err) return;
  if (c->status) {
    kiln_hal_error_free(err);
    return;
  }
  c->status = kiln_hal_status_from_error(err, what);
}

static kiln_hal_buffer_t *st_alloc(st_ctx_t *c, size_t bytes) {
  kiln_hal_buffer_t *b = NULL;
  if (!st_ok(c)) return NULL;
  st_check(c, c->t->buffer_alloc(c->dev, bytes, 0, &b), "buffer_alloc");
  if (b) c->bufs[c->nbufs++] = b;
  return b;
}

/* A dense [rows, cols] view (rows == 0 means a 1-D view of cols). */
static kiln_hal_tensor_t st_view(kiln_hal_buffer_t *b, int32_t dtype, int64_t rows, int64_t cols) {
  int64_t shape[2] = {rows, cols};
  return rows ? kiln_hal_tensor_make(b, 0, dtype, 2, shape)
              : kiln_hal_tensor_make(b, 0, dtype, 1, shape + 1);
}

/* Uploads n doubles as dtype into b (rounding them in place, so the reference sees exactly
 * the stored values). */
static void st_upload(st_ctx_t *c, kiln_hal_buffer_t *b, int32_t dtype, double *v, size_t n) {
  if (!st_ok(c)) return;
  size_t es = kiln_hal_dtype_size(dtype);
  unsigned char *tmp = malloc(n * es);
  if (!tmp) {
    c->status = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "selftest: out of memory");
    return;
  }
  for (size_t i = 0; i < n; i++) {
    if (dtype == KILN_HAL_I32) {
      ((int32_t *)tmp)[i] = (int32_t)v[i];
    } else {
      kiln_hal_store_f32(tmp, dtype, (int64_t)i, (float)v[i]);
      v[i] = kiln_hal_load_f32(tmp, dtype, (int64_t)i);
    }
  }
  st_check(c, c->t->copy_h2d(c->stream, b, 0, tmp, n * es), "copy_h2d");
  st_check(c, c->t->stream_sync(c->stream), "stream_sync");
  free(tmp);
}

static void st_download(st_ctx_t *c, kiln_hal_buffer_t *b, int32_t dtype, double *out, size_t n) {
  if (!st_ok(c)) return;
  size_t es = kiln_hal_dtype_size(dtype);
  unsigned char *tmp = malloc(n * es);
  if (!tmp) {
    c->status = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "selftest: out of memory");
    return;
  }
  st_check(c, c->t->copy_d2h(c->stream, tmp, b, 0, n * es), "copy_d2h");
  st_check(c, c->t->stream_sync(c->stream), "stream_sync");
  for (size_t i = 0; st_ok(c) && i < n; i++)
    out[i] = dtype == KILN_HAL_I32 ? ((int32_t *)tmp)[i] : kiln_hal_load_f32(tmp, dtype, (int64_t)i);
  free(tmp);
}

static double st_rand(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* The host-side model: weights and the reference KV cache, all in double. */
typedef struct st_model {
  double embed[V * H], norm1[H], wqkv[QKV * H], wo[H * NH * D], norm2[H], wgu[2 * I * H],
      wdown[H * I], normf[H];
  double kc[NB * NKV * BS * D], vc[NB * NKV * BS * D];
  float cos_sin[P * D];
  double cs[P * D];
} st_model_t;

/* y[T, N] = x[T, K] @ w[N, K]^T, rounded to dtype. */
static void ref_linear(int32_t dt, int T, int N, int K, const double *x, const double *w,
                       double *y) {
  for (int t = 0; t < T; t++)
    for (int n = 0; n < N; n++) {
      double acc = 0;
      for (int k = 0; k < K; k++) acc += x[t * K + k] * w[n * K + k];
      y[t * N + n] = ops_ref_round(dt, acc);
    }
}

/* The reference forward for one step; logits [T, V] (not rounded: the device writes F32). */
static void ref_forward(st_model_t *m, int32_t dt, int T, const int32_t *ids, const int32_t *pos,
                        const int32_t *slots, const int32_t *bt, const int32_t *lens,
                        const int32_t *qsl, double *logits) {
  static double x[TMAX * H], res[TMAX * H], h[TMAX * H], qkv[TMAX * QKV], q[TMAX * NH * D],
      k[TMAX * NKV * D], v[TMAX * NKV * D], attn[TMAX * NH * D], gu[TMAX * 2 * I],
      act[TMAX * I];
  ops_ref_embedding(V, H, m->embed, T, ids, x);
  memcpy(res, x, sizeof(double) * (size_t)T * H);
  ops_ref_rmsnorm(dt, T, H, x, NULL, m->norm1, 1e-5, 0.0, h);
  ref_linear(dt, T, QKV, H, h, m->wqkv, qkv);
  for (int t = 0; t < T; t++) {
    memcpy(q + t * NH * D, qkv + t * QKV, sizeof(double) * NH * D);
    memcpy(k + t * NKV * D, qkv + t * QKV + NH * D, sizeof(double) * NKV * D);
    memcpy(v + t * NKV * D, qkv + t * QKV + (NH + NKV) * D, sizeof(double) * NKV * D);
  }
  ops_ref_rope(KILN_HAL_ROPE_NEOX, T, NH, D, D, pos, P, m->cs, q);
  ops_ref_rope(KILN_HAL_ROPE_NEOX, T, NKV, D, D, pos, P, m->cs, k);
  for (int i = 0; i < T * NH * D; i++) q[i] = ops_ref_round(dt, q[i]);
  for (int t = 0; t < T; t++) {
    int blk = slots[t] / BS, off = slots[t] % BS;
    for (int hh = 0; hh < NKV; hh++)
      for (int d = 0; d < D; d++) {
        size_t at = (((size_t)blk * NKV + hh) * BS + off) * D + d;
        m->kc[at] = ops_ref_round(dt, k[(t * NKV + hh) * D + d]);
        m->vc[at] = v[(t * NKV + hh) * D + d];
      }
  }
  ops_ref_attention_params_t ap = {S, NH, NKV, D, BS, MB, 1.0 / sqrt((double)D), true, 0, 0.0};
  ops_ref_attention(&ap, q, m->kc, m->vc, bt, lens, qsl, attn);
  for (int i = 0; i < T * NH * D; i++) attn[i] = ops_ref_round(dt, attn[i]);
  ref_linear(dt, T, H, NH * D, attn, m->wo, x);
  ops_ref_rmsnorm(dt, T, H, x, res, m->norm2, 1e-5, 0.0, h);
  ref_linear(dt, T, 2 * I, H, h, m->wgu, gu);
  ops_ref_act_mul(KILN_HAL_ACT_SILU, T, I, gu, act);
  for (int i = 0; i < T * I; i++) act[i] = ops_ref_round(dt, act[i]);
  ref_linear(dt, T, H, I, act, m->wdown, x);
  ops_ref_rmsnorm(dt, T, H, x, res, m->normf, 1e-5, 0.0, h);
  for (int t = 0; t < T; t++)
    for (int n = 0; n < V; n++) {
      double acc = 0;
      for (int kk = 0; kk < H; kk++) acc += h[t * H + kk] * m->embed[n * H + kk];
      logits[t * V + n] = acc;
    }
}

/* Device buffers of the layer. */
typedef struct st_dev {
  kiln_hal_buffer_t *embed, *norm1, *wqkv, *wo, *norm2, *wgu, *wdown, *normf, *kc, *vc, *cs;
  kiln_hal_buffer_t *ids, *pos, *slots, *bt, *lens, *qsl, *x, *res, *h, *qkv, *attn, *gu, *act,
      *logits, *out_ids;
} st_dev_t;

/* Issues the device forward for one step of T tokens. */
static void dev_forward(st_ctx_t *c, st_dev_t *b, int T, int max_q, int max_len) {
  const kiln_hal_backend_t *t = c->t;
  int32_t dt = c->dtype;
  kiln_hal_tensor_t x = st_view(b->x, dt, T, H), res = st_view(b->res, dt, T, H),
                    h = st_view(b->h, dt, T, H), absent;
  memset(&absent, 0, sizeof(absent));
  /* A PyTorch Linear weight [N, K] row-major, seen as the [K, N] operand b. */
#define WEIGHT_T(buf, N, K) \
  ((kiln_hal_tensor_t){buf, 0, dt, 2, {K, N, 0, 0}, {1, K, 0, 0}})

  kiln_hal_embedding_args_t ea = {sizeof(ea), st_view(b->embed, dt, V, H),
                                  st_view(b->ids, KILN_HAL_I32, 0, T), x};
  st_check(c, t->embedding(c->stream, &ea), "embedding");
  kiln_hal_copy_args_t ca = {sizeof(ca), x, res};
  st_check(c, t->copy(c->stream, &ca), "copy");
  kiln_hal_rmsnorm_args_t na = {sizeof(na), x, absent, st_view(b->norm1, dt, 0, H), h, 1e-5f, 0};
  st_check(c, t->rmsnorm(c->stream, &na), "rmsnorm");
  kiln_hal_gemm_args_t g = {sizeof(g), h, WEIGHT_T(b->wqkv, QKV, H), st_view(b->qkv, dt, T, QKV),
                            absent, 1.0f, 0.0f, false};
  st_check(c, t->gemm(c->stream, &g), "gemm qkv");
  kiln_hal_tensor_t q = {b->qkv, 0, dt, 3, {T, NH, D, 0}, {QKV, D, 1, 0}};
  kiln_hal_tensor_t k = q, v = q, attn = {b->attn, 0, dt, 3, {T, NH, D, 0}, {NH * D, D, 1, 0}};
  k.shape[1] = v.shape[1] = NKV;
  k.offset = (uint64_t)NH * D * kiln_hal_dtype_size(dt);
  v.offset = (uint64_t)(NH + NKV) * D * kiln_hal_dtype_size(dt);
  kiln_hal_rope_args_t ra = {sizeof(ra), q, k, st_view(b->pos, KILN_HAL_I32, 0, T),
                             st_view(b->cs, KILN_HAL_F32, P, D), KILN_HAL_ROPE_NEOX};
  st_check(c, t->rope(c->stream, &ra), "rope");
  int64_t cshape[4] = {NB, NKV, BS, D};
  kiln_hal_tensor_t kc = kiln_hal_tensor_make(b->kc, 0, dt, 4, cshape),
                    vc = kiln_hal_tensor_make(b->vc, 0, dt, 4, cshape);
  kiln_hal_kv_write_args_t kw = {sizeof(kw), k, v, kc, vc, st_view(b->slots, KILN_HAL_I32, 0, T),
                                 KILN_HAL_KV_FLOAT, 0.0f, 0.0f};
  st_check(c, t->kv_write(c->stream, &kw), "kv_write");
  kiln_hal_attention_args_t aa;
  memset(&aa, 0, sizeof(aa));
  aa.struct_size = sizeof(aa);
  aa.q = q;
  aa.k_cache = kc;
  aa.v_cache = vc;
  aa.out = attn;
  aa.block_table = st_view(b->bt, KILN_HAL_I32, S, MB);
  aa.seq_lens = st_view(b->lens, KILN_HAL_I32, 0, S);
  aa.query_start_loc = st_view(b->qsl, KILN_HAL_I32, 0, S + 1);
  aa.num_seqs = S;
  aa.max_query_len = max_q;
  aa.max_seq_len = max_len;
  aa.scale = 1.0f / sqrtf((float)D);
  aa.causal = true;
  st_check(c, t->attention(c->stream, &aa), "attention");
  g.a = st_view(b->attn, dt, T, NH * D);
  g.b = WEIGHT_T(b->wo, H, NH * D);
  g.c = x;
  st_check(c, t->gemm(c->stream, &g), "gemm o_proj");
  na.x = x;
  na.residual = res;
  na.weight = st_view(b->norm2, dt, 0, H);
  st_check(c, t->rmsnorm(c->stream, &na), "rmsnorm post-attention");
  g.a = h;
  g.b = WEIGHT_T(b->wgu, 2 * I, H);
  g.c = st_view(b->gu, dt, T, 2 * I);
  st_check(c, t->gemm(c->stream, &g), "gemm gate_up");
  kiln_hal_silu_mul_args_t sa = {sizeof(sa), g.c, st_view(b->act, dt, T, I), KILN_HAL_ACT_SILU};
  st_check(c, t->silu_mul(c->stream, &sa), "silu_mul");
  g.a = sa.out;
  g.b = WEIGHT_T(b->wdown, H, I);
  g.c = x;
  st_check(c, t->gemm(c->stream, &g), "gemm down");
  na.weight = st_view(b->normf, dt, 0, H);
  st_check(c, t->rmsnorm(c->stream, &na), "rmsnorm final");
  g.a = h;
  g.b = WEIGHT_T(b->embed, V, H); /* tied LM head */
  g.c = st_view(b->logits, KILN_HAL_F32, T, V);
  st_check(c, t->gemm(c->stream, &g), "gemm lm_head");
  kiln_hal_argmax_args_t am = {sizeof(am), g.c, st_view(b->out_ids, KILN_HAL_I32, 0, T), absent};
  st_check(c, t->argmax(c->stream, &am), "argmax");
  st_check(c, t->stream_sync(c->stream), "stream_sync");
#undef WEIGHT_T
}

static void st_fill_rand(double *v, size_t n, double scale, double bias, uint64_t *seed) {
  for (size_t i = 0; i < n; i++) v[i] = bias + scale * st_rand(seed);
}

/* Runs both steps in one dtype; returns 0 on pass. */
static int selftest_dtype(const kiln_hal_plugin_t *p, int32_t dtype, uint64_t seed) {
  st_ctx_t c;
  memset(&c, 0, sizeof(c));
  c.t = &p->table;
  c.dtype = dtype;
  st_model_t *m = calloc(1, sizeof(*m));
  double *logits = malloc(sizeof(double) * TMAX * V), *ref = malloc(sizeof(double) * TMAX * V),
         *ids_out = malloc(sizeof(double) * TMAX);
  double tmp[TMAX * MB + 8];
  int failed = 0;
  if (!m || !logits || !ref || !ids_out) {
    c.status = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "selftest: out of memory");
    goto done;
  }
  st_check(&c, c.t->device_open(0, &c.dev), "device_open");
  if (st_ok(&c)) st_check(&c, c.t->stream_create(c.dev, &c.stream), "stream_create");
  st_dev_t b;
  memset(&b, 0, sizeof(b));
  size_t es = kiln_hal_dtype_size(dtype);
  st_fill_rand(m->embed, V * H, 1.0, 0, &seed);
  st_fill_rand(m->norm1, H, 0.2, 1.0, &seed);
  st_fill_rand(m->norm2, H, 0.2, 1.0, &seed);
  st_fill_rand(m->normf, H, 0.2, 1.0, &seed);
  st_fill_rand(m->wqkv, QKV * H, 1.0 / sqrt(H), 0, &seed);
  st_fill_rand(m->wo, H * NH * D, 1.0 / sqrt(NH * D), 0, &seed);
  st_fill_rand(m->wgu, 2 * I * H, 1.0 / sqrt(H), 0, &seed);
  st_fill_rand(m->wdown, H * I, 1.0 / sqrt(I), 0, &seed);
  ops_ref_rope_table(P, D, 10000.0, m->cos_sin);
  for (int i = 0; i < P * D; i++) m->cs[i] = m->cos_sin[i];
#define ALLOC_UP(field, n)                   \
  b.field = st_alloc(&c, (n) * es);          \
  st_upload(&c, b.field, dtype, m->field, (n))
  ALLOC_UP(embed, V * H);
  ALLOC_UP(norm1, H);
  ALLOC_UP(norm2, H);
  ALLOC_UP(normf, H);
  ALLOC_UP(wqkv, QKV * H);
  ALLOC_UP(wo, H * NH * D);
  ALLOC_UP(wgu, 2 * I * H);
  ALLOC_UP(wdown, H * I);
#undef ALLOC_UP
  b.cs = st_alloc(&c, sizeof(m->cos_sin));
  if (st_ok(&c))
    st_check(&c, c.t->copy_h2d(c.stream, b.cs, 0, m->cos_sin, sizeof(m->cos_sin)), "copy_h2d");
  b.kc = st_alloc(&c, (size_t)NB * NKV * BS * D * es);
  b.vc = st_alloc(&c, (size_t)NB * NKV * BS * D * es);
  b.ids = st_alloc(&c, TMAX * 4);
  b.pos = st_alloc(&c, TMAX * 4);
  b.slots = st_alloc(&c, TMAX * 4);
  b.out_ids = st_alloc(&c, TMAX * 4);
  b.bt = st_alloc(&c, S * MB * 4);
  b.lens = st_alloc(&c, S * 4);
  b.qsl = st_alloc(&c, (S + 1) * 4);
  b.x = st_alloc(&c, TMAX * H * es);
  b.res = st_alloc(&c, TMAX * H * es);
  b.h = st_alloc(&c, TMAX * H * es);
  b.qkv = st_alloc(&c, TMAX * QKV * es);
  b.attn = st_alloc(&c, TMAX * NH * D * es);
  b.gu = st_alloc(&c, TMAX * 2 * I * es);
  b.act = st_alloc(&c, TMAX * I * es);
  b.logits = st_alloc(&c, TMAX * V * 4);

  /* Sequence 0 owns blocks {5, 2}, sequence 1 owns {0, 7, 3}: scattered on purpose. */
  const int32_t bt[S * MB] = {5, 2, 0, 0, 0, 7, 3, 0};
  /* Step 1: seq 0 prefills 5 tokens, seq 1 prefills 9. Step 2: seq 0 prefills a chunk of 2
   * more over its cache, seq 1 decodes one token (a mixed batch). */
  const int steps = 2;
  const int qlen[2][S] = {{5, 9}, {2, 1}};
  int cached[S] = {0, 0};
  double max_err = 0, max_ref = 0;
  int argmax_bad = 0;
  for (int step = 0; step < steps && st_ok(&c); step++) {
    int32_t ids[TMAX], pos[TMAX], slots[TMAX], lens[S], qsl[S + 1];
    int T = 0, max_q = 0, max_len = 0;
    qsl[0] = 0;
    for (int s = 0; s < S; s++) {
      for (int i = 0; i < qlen[step][s]; i++, T++) {
        int p0 = cached[s] + i;
        ids[T] = (int32_t)((st_rand(&seed) + 1.0) * 0.5 * (V - 1));
        pos[T] = p0;
        slots[T] = bt[s * MB + p0 / BS] * BS + p0 % BS;
      }
      cached[s] += qlen[step][s];
      lens[s] = cached[s];
      qsl[s + 1] = T;
      if (qlen[step][s] > max_q) max_q = qlen[step][s];
      if (lens[s] > max_len) max_len = lens[s];
    }
    for (int i = 0; i < T; i++) tmp[i] = ids[i];
    st_upload(&c, b.ids, KILN_HAL_I32, tmp, (size_t)T);
    for (int i = 0; i < T; i++) tmp[i] = pos[i];
    st_upload(&c, b.pos, KILN_HAL_I32, tmp, (size_t)T);
    for (int i = 0; i < T; i++) tmp[i] = slots[i];
    st_upload(&c, b.slots, KILN_HAL_I32, tmp, (size_t)T);
    for (int i = 0; i < S * MB; i++) tmp[i] = bt[i];
    st_upload(&c, b.bt, KILN_HAL_I32, tmp, S * MB);
    for (int i = 0; i < S; i++) tmp[i] = lens[i];
    st_upload(&c, b.lens, KILN_HAL_I32, tmp, S);
    for (int i = 0; i <= S; i++) tmp[i] = qsl[i];
    st_upload(&c, b.qsl, KILN_HAL_I32, tmp, S + 1);
    dev_forward(&c, &b, T, max_q, max_len);
    st_download(&c, b.logits, KILN_HAL_F32, logits, (size_t)T * V);
    st_download(&c, b.out_ids, KILN_HAL_I32, ids_out, (size_t)T);
    if (!st_ok(&c)) break;
    ref_forward(m, dtype, T, ids, pos, slots, bt, lens, qsl, ref);
    for (int i = 0; i < T * V; i++) {
      double e = fabs(logits[i] - ref[i]);
      if (e > max_err) max_err = e;
      if (fabs(ref[i]) > max_ref) max_ref = fabs(ref[i]);
    }
    /* The device's pick must be a maximum of the reference up to the tolerance. */
    for (int tt = 0; tt < T; tt++) {
      int id = (int)ids_out[tt];
      double best = -INFINITY;
      for (int n = 0; n < V; n++) best = fmax(best, ref[tt * V + n]);
      if (id < 0 || id >= V || ref[tt * V + id] < best - (dtype == KILN_HAL_F32 ? 1e-3 : 0.25))
        argmax_bad++;
    }
  }
  /* Relative to the largest logit: f32 accumulates in f32 over K <= 384 (seen: ~4e-7); the half
   * types round every activation the same way the reference does, so they differ only where a
   * rounding tie breaks the other way (seen: ~1e-4 for f16). A wrong op is off by O(1). */
  double tol = (dtype == KILN_HAL_F32 ? 1e-5 : dtype == KILN_HAL_BF16 ? 1e-2 : 2e-3) *
               (max_ref > 1 ? max_ref : 1);
  if (st_ok(&c)) {
    failed = max_err > tol || argmax_bad;
    printf("  %-5s logits max |err| %.3g (tolerance %.3g, max |logit| %.3g), argmax %s: %s\n",
           kiln_hal_dtype_name(dtype), max_err, tol, max_ref,
           argmax_bad ? "MISMATCH" : "ok", failed ? "FAIL" : "ok");
  }
done:
  if (c.status) {
    printf("  %-5s FAIL: %s\n", kiln_hal_dtype_name(dtype), kiln_status_message(c.status));
    kiln_status_free(c.status);
    failed = 1;
  }
  for (int i = 0; i < c.nbufs; i++) c.t->buffer_free(c.bufs[i]);
  if (c.stream) c.t->stream_destroy(c.stream);
  if (c.dev) c.t->device_close(c.dev);
  free(m);
  free(logits);
  free(ref);
  free(ids_out);
  return failed;
}

typedef struct st_args {
  uint64_t seed;
  bool has_seed;
} st_args_t;

/* --seed: any uint64 (the seed printed by an earlier run). */
static kiln_status_t st_parse_seed(const char *cmd, const char *name, const char *value,
                                   void *field) {
  char *end;
  errno = 0;
  unsigned long long x = strtoull(value, &end, 10);
  if (errno || end == value || *end || value[0] == '-' || value[0] == '+')
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s wants an integer in [0, %llu], got '%s'", cmd, name,
                            (unsigned long long)UINT64_MAX, value);
  *(uint64_t *)field = (uint64_t)x;
  return NULL;
}

static const kiln_opt_t st_rows[] = {
    {.name = "--seed",
     .metavar = "N",
     .help = "the random inputs' seed (default: from the time and the process id)",
     .kind = KILN_OPT_CUSTOM,
     .offset = offsetof(st_args_t, seed),
     .seen = KILN_OPT_SEEN(st_args_t, has_seed),
     .parse = st_parse_seed},
};

static const kiln_opts_t st_opts = {
    .cmd = "selftest",
    .usage =
        "usage: kiln selftest [--seed N]\n"
        "Runs one Llama-style decoder layer plus the LM head through the HAL ops of the\n"
        "configured backend (device 0) over two engine steps, a batch of prefills then a\n"
        "chunked prefill and a decode in one batch, and checks each step's logits and the\n"
        "device's argmax against an fp64 host reference: in float32, and in bfloat16 and\n"
        "float16 where the device has them.\n"
        "Exit status: 0 when every check passed.\n",
    .opts = st_rows,
    .num_opts = KILN_OPTS_COUNT(st_rows),
    .flags = KILN_OPTS_SAY_UNKNOWN,
    .hint = " (takes --seed N)",
    .common = &kiln_cli_common_opts,
};

int kiln_cmd_selftest(kiln_cli_t *cli) {
  st_args_t a = {0, false};
  bool help = false;
  kiln_status_t st = kiln_opts_parse(&st_opts, cli->argc, cli->argv, &a, &help);
  if (st) return kiln_cli_fail(st);
  if (help) return 0;
  st = kiln_cli_registry(cli);
  if (st) return kiln_cli_fail(st);
  const char *want = kiln_config_get_string(cli->config, "backend", "name");
  const kiln_hal_plugin_t *p = NULL;
  if ((st = kiln_hal_registry_open(cli->registry, want, &p))) return kiln_cli_fail(st);
  kiln_hal_device_info_t di;
  memset(&di, 0, sizeof(di));
  di.struct_size = sizeof(di);
  kiln_hal_error_t *err = p->table.device_info(0, &di);
  if (err) return kiln_cli_fail(kiln_hal_status_from_error(err, "device_info"));
  uint64_t seed = a.has_seed ? a.seed : (uint64_t)time(NULL) * 1000003u ^ (uint64_t)getpid();
  printf("kiln selftest: backend %s, device 0 (%s), seed %llu\n", p->name, di.name,
         (unsigned long long)seed);
  printf("  one decoder layer (H=%d, %d heads, %d KV heads, head dim %d, vocab %d) over 2 steps:\n"
         "  prefill 5 + 9 tokens, then a 2-token chunk and a decode in one mixed batch\n",
         H, NH, NKV, D, V);
  int failed = selftest_dtype(p, KILN_HAL_F32, seed);
  if (di.caps & KILN_HAL_CAP_BF16) failed |= selftest_dtype(p, KILN_HAL_BF16, seed);
  if (di.caps & KILN_HAL_CAP_F16) failed |= selftest_dtype(p, KILN_HAL_F16, seed);
  printf("selftest %s\n", failed ? "FAILED" : "passed");
  return failed ? 1 : 0;
}
