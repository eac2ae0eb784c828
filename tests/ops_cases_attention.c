/* ops_cases_attention.c - conformance cases for the paged KV cache: kv_write (scatter into
 * [NB, NKV, BS, D], skipped slots stay poison) and attention (prefill, chunked prefill, decode
 * and mixed batches over shuffled blocks whose unused slots hold NaN). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ops_cases.h"
#include "ops_harness.h"
#include "hal/ref/ops_ref.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ============================================================================== kv_write == */

typedef struct kv_write_case {
  int64_t BS, NB, NKV, D, T;
  bool fused; /* k and v are strided slices of one [T, (NH + 2 NKV) * D] QKV buffer */
} kv_write_case_t;

static const kv_write_case_t kv_write_cases[] = {
    {8, 5, 1, 64, 9, false},
    {16, 7, 2, 80, 23, true},
    {32, 3, 4, 128, 40, false},
    {16, 2, 8, 64, 1, true},
};

static void kv_write_run(const oh_backend_t *be, int32_t dt, const kv_write_case_t *c) {
  const int64_t BS = c->BS, NB = c->NB, NKV = c->NKV, D = c->D, T = c->T, NH = 2 * NKV;
  const int64_t row = c->fused ? (NH + 2 * NKV) * D : NKV * D, nslots = NB * BS;
  const size_t es = kiln_hal_dtype_size(dt);
  oh_case(be, "kv_write", dt, "BS=%lld NB=%lld NKV=%lld D=%lld T=%lld%s", (long long)BS,
          (long long)NB, (long long)NKV, (long long)D, (long long)T,
          c->fused ? " (k, v are slices of a fused QKV buffer)" : "");
  oh_buf_t *kb = oh_buf_new(be, (size_t)(T * row) * es);
  oh_buf_t *vb = c->fused ? kb : oh_buf_new(be, (size_t)(T * row) * es);
  oh_buf_t *kcb = oh_buf_new(be, (size_t)(nslots * NKV * D + 8) * es);
  oh_buf_t *vcb = oh_buf_new(be, (size_t)(nslots * NKV * D + 8) * es);
  oh_buf_t *sb = oh_buf_new(be, (size_t)T * 4);
  double *k = OH_NEW(double, T *NKV *D), *v = OH_NEW(double, T *NKV *D);
  double *got = OH_NEW(double, NKV *D);
  int32_t *perm = OH_NEW(int32_t, nslots), *slots = OH_NEW(int32_t, T);
  for (int64_t i = 0; i < nslots; i++) perm[i] = (int32_t)i;
  oh_shuffle_i32(perm, nslots);
  /* Every fourth token is padding or outside the pool; the rest take distinct slots. */
  const int32_t skip[] = {-1, (int32_t)nslots, -100, (int32_t)nslots + 7, INT32_MAX, INT32_MIN};
  int64_t used = 0;
  for (int64_t t = 0; t < T; t++) {
    if (t % 4 == 3 || used == nslots)
      slots[t] = skip[(t / 4) % ARRAY_LEN(skip)];
    else
      slots[t] = perm[used++];
  }
  kiln_hal_kv_write_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  int64_t kshape[3] = {T, NKV, D}, kstride[3] = {row, D, 1};
  int64_t cshape[4] = {NB, NKV, BS, D}, sshape[1] = {T};
  a.k = oh_view(kb, c->fused ? (uint64_t)(NH * D) * es : 0, dt, 3, kshape, kstride);
  a.v = oh_view(vb, c->fused ? (uint64_t)((NH + NKV) * D) * es : 0, dt, 3, kshape, kstride);
  a.k_cache = oh_view(kcb, 0, dt, 4, cshape, NULL);
  a.v_cache = oh_view(vcb, 0, dt, 4, cshape, NULL);
  a.slot_mapping = oh_view(sb, 0, KILN_HAL_I32, 1, sshape, NULL);
  oh_write_rand(kb, &a.k, -2, 2, k);
  oh_write_rand(vb, &a.v, -2, 2, v);
  oh_write_i32(sb, &a.slot_mapping, slots);
  oh_push(kb);
  if (!c->fused) oh_push(vb);
  oh_push(sb);
  if (oh_ok(be->t->kv_write(be->stream, &a), "kv_write") && oh_pull(kcb) && oh_pull(vcb)) {
    for (int64_t t = 0; t < T; t++) {
      int64_t s = slots[t];
      if (s < 0 || s >= nslots) continue;
      for (int64_t h = 0; h < NKV; h++) {
        /* The row of (slot s, head h) in the cache: block s / BS, position s % BS. */
        int64_t shape1[1] = {D};
        uint64_t at = (uint64_t)((((s / BS) * NKV + h) * BS + s % BS) * D) * es;
        kiln_hal_tensor_t kr = oh_view(kcb, at, dt, 1, shape1, NULL);
        kiln_hal_tensor_t vr = oh_view(vcb, at, dt, 1, shape1, NULL);
        char what[96];
        oh_mark(kcb, &kr);
        oh_read(kcb, &kr, got);
        snprintf(what, sizeof(what), "k_cache (token %lld, slot %lld, head %lld)", (long long)t,
                 (long long)s, (long long)h);
        oh_compare(what, D, got, k + (t * NKV + h) * D, NULL, (oh_tol_t){0, 0, 0});
        oh_mark(vcb, &vr);
        oh_read(vcb, &vr, got);
        snprintf(what, sizeof(what), "v_cache (token %lld, slot %lld, head %lld)", (long long)t,
                 (long long)s, (long long)h);
        oh_compare(what, D, got, v + (t * NKV + h) * D, NULL, (oh_tol_t){0, 0, 0});
      }
    }
    oh_check_rest(kcb, "k_cache (slots not written: skipped tokens, unused slots)");
    oh_check_rest(vcb, "v_cache (slots not written: skipped tokens, unused slots)");
  }
  free(k);
  free(v);
  free(got);
  free(perm);
  free(slots);
  oh_free_all();
}

void test_ops_kv_write(void **state) {
  (void)state;
  oh_test_begin("kv_write");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(&oh_backends[bi], oh_float_dtypes[di])) continue;
      for (size_t ci = 0; ci < ARRAY_LEN(kv_write_cases); ci++)
        kv_write_run(&oh_backends[bi], oh_float_dtypes[di], &kv_write_cases[ci]);
    }
  }
  oh_test_end();
}

/* ============================================================================= attention == */

typedef struct attn_seq {
  int32_t q_len, seq_len;
} attn_seq_t;

typedef struct attn_case {
  const char *name;
  int64_t NH, NKV, D, BS;
  bool causal;
  int32_t window;  /* sliding_window */
  float softcap;   /* 0 = off */
  float scale;     /* 0: 1/sqrt(D) */
  bool strided;    /* q is a slice of a fused QKV buffer; out has padded rows */
  int extra_rows;  /* rows of q/out at and beyond qsl[S]: must not be written */
  int bound_slack; /* max_query_len/max_seq_len exceed the batch's actual maxima by this */
  int nseq;
  attn_seq_t seqs[6];
} attn_case_t;

static const attn_case_t attn_cases[] = {
    {"causal prefill", 4, 4, 64, 16, true, 0, 0, 0, false, 2, 0, 1, {{17, 17}}},
    {"two prefills, GQA 2", 4, 2, 80, 8, true, 0, 0, 0, false, 0, 0, 2, {{5, 5}, {13, 13}}},
    {"chunked prefills, GQA 4",
     8,
     2,
     96,
     32,
     true,
     0,
     0,
     0,
     true,
     1,
     0,
     3,
     {{7, 40}, {1, 33}, {16, 16}}},
    {"decode batch, MQA (GQA 8)",
     8,
     1,
     128,
     16,
     true,
     0,
     0,
     0,
     false,
     0,
     0,
     4,
     {{1, 1}, {1, 9}, {1, 16}, {1, 47}}},
    {"mixed batch (prefill, chunk, decodes, q_len 0)",
     4,
     2,
     64,
     16,
     true,
     0,
     0,
     0,
     true,
     3,
     5,
     6,
     {{12, 12}, {5, 30}, {1, 17}, {0, 20}, {1, 64}, {0, 0}}},
    {"sliding window 7", 2, 1, 64, 8, true, 7, 0, 0, false, 1, 0, 3, {{20, 20}, {1, 40}, {6, 25}}},
    {"softcap 5, scale 0.25",
     2,
     1,
     256,
     16,
     true,
     0,
     5.0f,
     0.25f,
     false,
     0,
     0,
     2,
     {{9, 9}, {1, 23}}},
    {"non-causal", 4, 4, 64, 16, false, 0, 0, 0, false, 1, 0, 2, {{6, 6}, {3, 20}}},
    {"non-causal, sliding window 5", 2, 2, 64, 8, false, 5, 0, 0, false, 0, 0, 1, {{4, 12}}},
    {"long decode", 8, 2, 128, 32, true, 0, 0, 0, false, 0, 0, 2, {{1, 1500}, {1, 777}}},
    /* Group sizes that are not powers of two: a kernel that packs query heads in fours must
     * handle the ragged last group (the CPU kernel once read past it). */
    {"GQA 3, decode + chunk", 6, 2, 64, 16, true, 0, 0, 0, false, 0, 0, 2, {{1, 37}, {5, 21}}},
    {"GQA 5, decode", 5, 1, 96, 16, true, 0, 0, 0, false, 0, 0, 2, {{1, 50}, {1, 3}}},
    {"GQA 7, prefill", 14, 2, 64, 8, true, 0, 0, 0, false, 0, 0, 1, {{11, 11}}},
    {"scale 0.3, GQA 8", 16, 2, 96, 8, true, 0, 0, 0.3f, true, 0, 0, 2, {{3, 10}, {1, 5}}},
    {"head dim 256 chunk, GQA 2", 4, 2, 256, 32, true, 0, 0, 0, false, 0, 2, 1, {{33, 70}}},
    {"head dim 80, block 8, decode + prefill",
     6,
     3,
     80,
     8,
     true,
     0,
     0,
     0,
     true,
     2,
     0,
     2,
     {{1, 31}, {9, 9}}},
};

static void attention_run(const oh_backend_t *be, int32_t dt, const attn_case_t *c) {
  const int64_t NH = c->NH, NKV = c->NKV, D = c->D, BS = c->BS, S = c->nseq;
  const size_t es = kiln_hal_dtype_size(dt);
  const float scale = c->scale > 0 ? c->scale : (float)(1.0 / sqrt((double)D));
  int32_t qsl[7], lens[6];
  int64_t MB = 1, nblocks = 0;
  int32_t max_q = 0, max_len = 0;
  qsl[0] = 0;
  for (int64_t s = 0; s < S; s++) {
    int64_t nb = (c->seqs[s].seq_len + BS - 1) / BS;
    MB = nb + 1 > MB ? nb + 1 : MB; /* one spare column: must never be followed */
    nblocks += nb;
    lens[s] = c->seqs[s].seq_len;
    qsl[s + 1] = qsl[s] + c->seqs[s].q_len;
    if (c->seqs[s].q_len > max_q) max_q = c->seqs[s].q_len;
    if (lens[s] > max_len) max_len = lens[s];
  }
  const int64_t NB = nblocks + 3, Tq = qsl[S], T = Tq + c->extra_rows;
  const int64_t qrow = c->strided ? (NH + 2 * NKV) * D : NH * D;
  const int64_t orow = c->strided ? NH * D + 8 : NH * D;
  oh_case(be, "attention", dt,
          "%s: NH=%lld NKV=%lld D=%lld BS=%lld S=%lld T=%lld causal=%d window=%d softcap=%g "
          "scale=%g",
          c->name, (long long)NH, (long long)NKV, (long long)D, (long long)BS, (long long)S,
          (long long)Tq, c->causal, c->window, (double)c->softcap, (double)scale);

  /* Shuffled block ids; the trap block (all NaN) fills every unused table entry. */
  int32_t *ids = OH_NEW(int32_t, NB), *bt = OH_NEW(int32_t, S * MB);
  for (int64_t i = 0; i < NB; i++) ids[i] = (int32_t)i;
  oh_shuffle_i32(ids, NB);
  const int32_t trap = ids[NB - 1];
  int64_t next = 0;
  for (int64_t s = 0; s < S; s++) {
    int64_t nb = (lens[s] + BS - 1) / BS;
    for (int64_t j = 0; j < MB; j++) bt[s * MB + j] = j < nb ? ids[next++] : trap;
  }
  /* The caches: NaN everywhere but the visible keys of each sequence. */
  const int64_t csize = NB * NKV * BS * D;
  double *kc = OH_NEW(double, csize), *vc = OH_NEW(double, csize);
  for (int64_t i = 0; i < csize; i++) kc[i] = vc[i] = NAN;
  for (int64_t s = 0; s < S; s++) {
    for (int64_t j = 0; j < lens[s]; j++) {
      int64_t blk = bt[s * MB + j / BS];
      for (int64_t h = 0; h < NKV; h++) {
        int64_t at = ((blk * NKV + h) * BS + j % BS) * D;
        oh_rand_fill(kc + at, D, -1, 1);
        oh_rand_fill(vc + at, D, -1, 1);
      }
    }
  }
  oh_buf_t *qb = oh_buf_new(be, (size_t)(T * qrow + 4) * es);
  oh_buf_t *ob = oh_buf_new(be, (size_t)(T * orow + 4) * es);
  oh_buf_t *kcb = oh_buf_new(be, (size_t)csize * es), *vcb = oh_buf_new(be, (size_t)csize * es);
  oh_buf_t *btb = oh_buf_new(be, (size_t)(S * MB) * 4), *lb = oh_buf_new(be, (size_t)S * 4);
  oh_buf_t *qslb = oh_buf_new(be, (size_t)(S + 1) * 4);
  double *q = OH_NEW(double, T *NH *D), *want = OH_NEW(double, T *NH *D),
         *got = OH_NEW(double, T *NH *D);

  kiln_hal_attention_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  int64_t qshape[3] = {T, NH, D}, qstride[3] = {qrow, D, 1}, ostride[3] = {orow, D, 1};
  int64_t cshape[4] = {NB, NKV, BS, D}, btshape[2] = {S, MB}, lshape[1] = {S},
          qslshape[1] = {S + 1};
  a.q = oh_view(qb, 0, dt, 3, qshape, qstride);
  a.out = oh_view(ob, 0, dt, 3, qshape, ostride);
  a.k_cache = oh_view(kcb, 0, dt, 4, cshape, NULL);
  a.v_cache = oh_view(vcb, 0, dt, 4, cshape, NULL);
  a.block_table = oh_view(btb, 0, KILN_HAL_I32, 2, btshape, NULL);
  a.seq_lens = oh_view(lb, 0, KILN_HAL_I32, 1, lshape, NULL);
  a.query_start_loc = oh_view(qslb, 0, KILN_HAL_I32, 1, qslshape, NULL);
  a.num_seqs = (int32_t)S;
  a.max_query_len = max_q + c->bound_slack;
  a.max_seq_len = max_len + c->bound_slack;
  a.scale = scale;
  a.causal = c->causal;
  a.sliding_window = c->window;
  a.softcap = c->softcap;
  oh_write_rand(qb, &a.q, -3, 3, q);
  oh_write(kcb, &a.k_cache, kc); /* rounds the visible keys; NaN stays NaN */
  oh_write(vcb, &a.v_cache, vc);
  oh_write_i32(btb, &a.block_table, bt);
  oh_write_i32(lb, &a.seq_lens, lens);
  oh_write_i32(qslb, &a.query_start_loc, qsl);
  oh_push(qb);
  oh_push(kcb);
  oh_push(vcb);
  oh_push(btb);
  oh_push(lb);
  oh_push(qslb);
  if (oh_ok(be->t->attention(be->stream, &a), "attention") && oh_pull(ob)) {
    ops_ref_attention_params_t p = {
        S, NH, NKV, D, BS, MB, (double)scale, c->causal, c->window, (double)c->softcap};
    int64_t nan_reads = ops_ref_attention(&p, q, kc, vc, bt, lens, qsl, want);
    if (nan_reads)
      oh_fail("test bug: the reference read %lld NaN cache values", (long long)nan_reads);
    kiln_hal_tensor_t written = a.out;
    written.shape[0] = Tq;
    if (Tq > 0) {
      oh_mark(ob, &written);
      oh_read(ob, &written, got);
      /* report per sequence so a failure names the sequence */
      for (int64_t s = 0; s < S; s++) {
        char what[96];
        snprintf(what, sizeof(what), "out of seq %lld (q_len %d, seq_len %d)", (long long)s,
                 c->seqs[s].q_len, lens[s]);
        int64_t r0 = qsl[s] * NH * D, n = (int64_t)(qsl[s + 1] - qsl[s]) * NH * D;
        oh_compare(what, n, got + r0, want + r0, NULL, oh_tol_attention(dt));
      }
    }
    oh_check_rest(ob, "out (rows >= query_start_loc[S], row padding)");
  }
  free(ids);
  free(bt);
  free(kc);
  free(vc);
  free(q);
  free(want);
  free(got);
  oh_free_all();
}

void test_ops_attention(void **state) {
  (void)state;
  oh_test_begin("attention");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(&oh_backends[bi], oh_float_dtypes[di])) continue;
      for (size_t ci = 0; ci < ARRAY_LEN(attn_cases); ci++)
        attention_run(&oh_backends[bi], oh_float_dtypes[di], &attn_cases[ci]);
      /* Fresh batches every run (the seed reproduces them). */
      for (int r = 0; r < 3; r++) {
        static const int64_t dims[] = {64, 80, 96, 128, 256}, bss[] = {8, 16, 32};
        attn_case_t c;
        memset(&c, 0, sizeof(c));
        c.name = "random";
        c.NKV = oh_rand_int(1, 2);
        c.NH = c.NKV << oh_rand_int(0, 3);
        c.D = dims[oh_rand_int(0, 4)];
        c.BS = bss[oh_rand_int(0, 2)];
        c.causal = oh_rand_int(0, 4) != 0;
        c.window = oh_rand_int(0, 3) == 0 ? (int32_t)oh_rand_int(1, 40) : 0;
        c.softcap = oh_rand_int(0, 3) == 0 ? 8.0f : 0.0f;
        c.strided = oh_rand_int(0, 1);
        c.extra_rows = (int)oh_rand_int(0, 2);
        c.nseq = (int)oh_rand_int(1, 4);
        for (int s = 0; s < c.nseq; s++) {
          c.seqs[s].seq_len = (int32_t)oh_rand_int(1, 200);
          int32_t mq = c.seqs[s].seq_len < 24 ? c.seqs[s].seq_len : 24;
          c.seqs[s].q_len = oh_rand_int(0, 1) ? 1 : (int32_t)oh_rand_int(0, mq);
        }
        attention_run(&oh_backends[bi], oh_float_dtypes[di], &c);
      }
    }
  }
  oh_test_end();
}
