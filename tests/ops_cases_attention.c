/* ops_cases_attention.c - conformance cases for the paged KV cache: kv_write (scatter into
 * [NB, NKV, BS, D], skipped slots stay poison) and attention (prefill, chunked prefill, decode
 * and mixed batches over shuffled blocks whose unused slots hold NaN; long contexts, GQA
 * groups, head dims and launch bounds that reach every path of the GPU kernels; one graph
 * captured with large bounds and replayed over other batches). The FP8 KV cache (ABI 1.7,
 * kv_format = KILN_HAL_KV_FP8_E4M3) runs the same cases: kv_write's codes must equal the fp64
 * reference's round-to-nearest-even search exactly; attention's fp64 reference reads the exact
 * values scale * e4m3(code) of the codes it was given, so its tolerance is the float cache's. */
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

/* fp8: the FP8 cache with these scales (k_scale, v_scale); 0: the float cache in dt. */
static void kv_write_run(const oh_backend_t *be, int32_t dt, const kv_write_case_t *c,
                         float fp8_ks, float fp8_vs) {
  const int64_t BS = c->BS, NB = c->NB, NKV = c->NKV, D = c->D, T = c->T, NH = 2 * NKV;
  const int64_t row = c->fused ? (NH + 2 * NKV) * D : NKV * D, nslots = NB * BS;
  const bool fp8 = fp8_ks > 0;
  const size_t es = kiln_hal_dtype_size(dt), ces = fp8 ? 1 : es;
  const int32_t cdt = fp8 ? KILN_HAL_U8 : dt;
  oh_case(be, "kv_write", dt, "BS=%lld NB=%lld NKV=%lld D=%lld T=%lld%s%s", (long long)BS,
          (long long)NB, (long long)NKV, (long long)D, (long long)T,
          c->fused ? " (k, v are slices of a fused QKV buffer)" : "",
          fp8 ? " FP8 e4m3 cache" : "");
  oh_buf_t *kb = oh_buf_new(be, (size_t)(T * row) * es);
  oh_buf_t *vb = c->fused ? kb : oh_buf_new(be, (size_t)(T * row) * es);
  oh_buf_t *kcb = oh_buf_new(be, (size_t)(nslots * NKV * D + 8) * ces);
  oh_buf_t *vcb = oh_buf_new(be, (size_t)(nslots * NKV * D + 8) * ces);
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
  a.k_cache = oh_view(kcb, 0, cdt, 4, cshape, NULL);
  a.v_cache = oh_view(vcb, 0, cdt, 4, cshape, NULL);
  a.slot_mapping = oh_view(sb, 0, KILN_HAL_I32, 1, sshape, NULL);
  oh_write_rand(kb, &a.k, -2, 2, k);
  oh_write_rand(vb, &a.v, -2, 2, v);
  if (fp8) {
    a.kv_format = KILN_HAL_KV_FP8_E4M3;
    a.k_scale = fp8_ks;
    a.v_scale = fp8_vs;
    /* The edges of the cast: infinities and a huge value saturate, signed zeros keep their
     * sign, NaN is the NaN code; and values at the scaled rounding midpoints. */
    const double special[] = {INFINITY, -1e6, 0.0, -0.0, NAN, -INFINITY};
    for (size_t i = 0; i < ARRAY_LEN(special) && (int64_t)i < T * NKV * D; i++) k[i] = special[i];
    for (int64_t i = 0; i < 8 && 8 + i < T * NKV * D; i++) /* (m + 1/2) 2^-9 and (1 + (2m+1)/16) */
      v[8 + i] = (double)fp8_vs * (i < 4 ? (i + 0.5) * 0x1p-9 : 1.0 + (2 * i + 1) / 16.0);
    oh_write(kb, &a.k, k);
    oh_write(vb, &a.v, v);
    for (int64_t i = 0; i < T * NKV * D; i++) {
      k[i] = ops_ref_fp8_kv_code(k[i], fp8_ks);
      v[i] = ops_ref_fp8_kv_code(v[i], fp8_vs);
    }
  }
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
        uint64_t at = (uint64_t)((((s / BS) * NKV + h) * BS + s % BS) * D) * ces;
        kiln_hal_tensor_t kr = oh_view(kcb, at, cdt, 1, shape1, NULL);
        kiln_hal_tensor_t vr = oh_view(vcb, at, cdt, 1, shape1, NULL);
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
        kv_write_run(&oh_backends[bi], oh_float_dtypes[di], &kv_write_cases[ci], 0, 0);
    }
  }
  oh_test_end();
}

/* A valid FP8-cache call on a backend without KILN_HAL_CAP_KV_FP8 must fail, not misread. */
static void kv_fp8_refused(const oh_backend_t *be, bool attention) {
  oh_case(be, attention ? "attention" : "kv_write", KILN_HAL_F32,
          "FP8 cache on a device without KILN_HAL_CAP_KV_FP8");
  oh_buf_t *x = oh_buf_new(be, 4 * 64), *c = oh_buf_new(be, 256), *i = oh_buf_new(be, 64);
  int64_t xs[3] = {1, 1, 16}, cs[4] = {1, 1, 16, 16}, one[1] = {1}, two[1] = {2}, bt[2] = {1, 1};
  memset(i->host, 0, 64);
  i->host[4] = 1; /* query_start_loc {0, 1}, seq_lens {1} (at byte 8), block_table {0} */
  i->host[8] = 1;
  oh_push(i);
  if (attention) {
    kiln_hal_attention_args_t a;
    memset(&a, 0, sizeof(a));
    a.struct_size = sizeof(a);
    a.q = a.out = oh_view(x, 0, KILN_HAL_F32, 3, xs, NULL);
    a.k_cache = a.v_cache = oh_view(c, 0, KILN_HAL_U8, 4, cs, NULL);
    a.query_start_loc = oh_view(i, 0, KILN_HAL_I32, 1, two, NULL);
    a.seq_lens = oh_view(i, 8, KILN_HAL_I32, 1, one, NULL);
    a.block_table = oh_view(i, 16, KILN_HAL_I32, 2, bt, NULL);
    a.num_seqs = 1;
    a.max_query_len = a.max_seq_len = 1;
    a.scale = 1.0f;
    a.kv_format = KILN_HAL_KV_FP8_E4M3;
    a.k_scale = a.v_scale = 1.0f;
    oh_expect_error(be->t->attention(be->stream, &a), "attention (FP8 cache, no capability)");
  } else {
    kiln_hal_kv_write_args_t a;
    memset(&a, 0, sizeof(a));
    a.struct_size = sizeof(a);
    a.k = a.v = oh_view(x, 0, KILN_HAL_F32, 3, xs, NULL);
    a.k_cache = a.v_cache = oh_view(c, 0, KILN_HAL_U8, 4, cs, NULL);
    a.slot_mapping = oh_view(i, 16, KILN_HAL_I32, 1, one, NULL);
    a.kv_format = KILN_HAL_KV_FP8_E4M3;
    a.k_scale = a.v_scale = 1.0f;
    oh_expect_error(be->t->kv_write(be->stream, &a), "kv_write (FP8 cache, no capability)");
  }
  oh_free_all();
}

void test_ops_kv_write_fp8(void **state) {
  (void)state;
  oh_test_begin("kv_write_fp8");
  /* 1 (vLLM's uncalibrated default: small values fall into the subnormals), scales that
   * saturate (2 / 0.0037 > 448) and a scale that is not a power of two. */
  static const float scales[][2] = {{1.0f, 1.0f}, {0.0037f, 0.25f}, {0.3f, 3.0f}, {0.01f, 0.0037f}};
  for (int bi = 0; bi < oh_num_backends; bi++) {
    if (!(oh_backends[bi].info.caps & KILN_HAL_CAP_KV_FP8)) {
      kv_fp8_refused(&oh_backends[bi], false);
      continue;
    }
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(&oh_backends[bi], oh_float_dtypes[di])) continue;
      for (size_t ci = 0; ci < ARRAY_LEN(kv_write_cases); ci++)
        kv_write_run(&oh_backends[bi], oh_float_dtypes[di], &kv_write_cases[ci],
                     scales[ci % ARRAY_LEN(scales)][0], scales[ci % ARRAY_LEN(scales)][1]);
    }
  }
  oh_test_end();
}

/* ============================================================================= attention == */

typedef struct attn_seq {
  int32_t q_len, seq_len;
} attn_seq_t;

#define ATTN_MAX_SEQS 8

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
  attn_seq_t seqs[ATTN_MAX_SEQS];
  int32_t len_bound; /* > 0: max_seq_len (a graph's model-length bound) instead of max + slack */
  int misalign;      /* 1: q and out start one element past 16-byte alignment; 2: caches too */
} attn_case_t;

static const attn_case_t attn_cases[] = {
    {.name = "causal prefill",
     .NH = 4,
     .NKV = 4,
     .D = 64,
     .BS = 16,
     .causal = true,
     .extra_rows = 2,
     .nseq = 1,
     .seqs = {{17, 17}}},
    {.name = "two prefills, GQA 2",
     .NH = 4,
     .NKV = 2,
     .D = 80,
     .BS = 8,
     .causal = true,
     .nseq = 2,
     .seqs = {{5, 5}, {13, 13}}},
    {.name = "chunked prefills, GQA 4",
     .NH = 8,
     .NKV = 2,
     .D = 96,
     .BS = 32,
     .causal = true,
     .strided = true,
     .extra_rows = 1,
     .nseq = 3,
     .seqs = {{7, 40}, {1, 33}, {16, 16}}},
    {.name = "decode batch, MQA (GQA 8)",
     .NH = 8,
     .NKV = 1,
     .D = 128,
     .BS = 16,
     .causal = true,
     .nseq = 4,
     .seqs = {{1, 1}, {1, 9}, {1, 16}, {1, 47}}},
    {.name = "mixed batch (prefill, chunk, decodes, q_len 0)",
     .NH = 4,
     .NKV = 2,
     .D = 64,
     .BS = 16,
     .causal = true,
     .strided = true,
     .extra_rows = 3,
     .bound_slack = 5,
     .nseq = 6,
     .seqs = {{12, 12}, {5, 30}, {1, 17}, {0, 20}, {1, 64}, {0, 0}}},
    {.name = "sliding window 7",
     .NH = 2,
     .NKV = 1,
     .D = 64,
     .BS = 8,
     .causal = true,
     .window = 7,
     .extra_rows = 1,
     .nseq = 3,
     .seqs = {{20, 20}, {1, 40}, {6, 25}}},
    {.name = "softcap 5, scale 0.25",
     .NH = 2,
     .NKV = 1,
     .D = 256,
     .BS = 16,
     .causal = true,
     .softcap = 5.0f,
     .scale = 0.25f,
     .nseq = 2,
     .seqs = {{9, 9}, {1, 23}}},
    {.name = "non-causal",
     .NH = 4,
     .NKV = 4,
     .D = 64,
     .BS = 16,
     .causal = false,
     .extra_rows = 1,
     .nseq = 2,
     .seqs = {{6, 6}, {3, 20}}},
    {.name = "non-causal, sliding window 5",
     .NH = 2,
     .NKV = 2,
     .D = 64,
     .BS = 8,
     .causal = false,
     .window = 5,
     .nseq = 1,
     .seqs = {{4, 12}}},
    {.name = "long decode",
     .NH = 8,
     .NKV = 2,
     .D = 128,
     .BS = 32,
     .causal = true,
     .nseq = 2,
     .seqs = {{1, 1500}, {1, 777}}},
    /* Group sizes that are not powers of two: a kernel that packs query heads in fours must
     * handle the ragged last group (the CPU kernel once read past it). */
    {.name = "GQA 3, decode + chunk",
     .NH = 6,
     .NKV = 2,
     .D = 64,
     .BS = 16,
     .causal = true,
     .nseq = 2,
     .seqs = {{1, 37}, {5, 21}}},
    {.name = "GQA 5, decode",
     .NH = 5,
     .NKV = 1,
     .D = 96,
     .BS = 16,
     .causal = true,
     .nseq = 2,
     .seqs = {{1, 50}, {1, 3}}},
    {.name = "GQA 7, prefill",
     .NH = 14,
     .NKV = 2,
     .D = 64,
     .BS = 8,
     .causal = true,
     .nseq = 1,
     .seqs = {{11, 11}}},
    {.name = "scale 0.3, GQA 8",
     .NH = 16,
     .NKV = 2,
     .D = 96,
     .BS = 8,
     .causal = true,
     .scale = 0.3f,
     .strided = true,
     .nseq = 2,
     .seqs = {{3, 10}, {1, 5}}},
    {.name = "head dim 256 chunk, GQA 2",
     .NH = 4,
     .NKV = 2,
     .D = 256,
     .BS = 32,
     .causal = true,
     .bound_slack = 2,
     .nseq = 1,
     .seqs = {{33, 70}}},
    {.name = "head dim 80, block 8, decode + prefill",
     .NH = 6,
     .NKV = 3,
     .D = 80,
     .BS = 8,
     .causal = true,
     .strided = true,
     .extra_rows = 2,
     .nseq = 2,
     .seqs = {{1, 31}, {9, 9}}},
    /* The shapes of the GPU kernels' paths (backends/cuda/cuda_attention_mma.cuh): split-KV
     * decode when a batch has few query rows per sequence, 64-row tensor-core tiles otherwise,
     * GQA groups packed into rows, tiles of 32/64 keys, and launch bounds far above the batch
     * (as under graph capture) that must not change the result. */
    {.name = "Qwen2-7B decode, one long sequence (context split)",
     .NH = 28,
     .NKV = 4,
     .D = 128,
     .BS = 16,
     .causal = true,
     .nseq = 1,
     .seqs = {{1, 8200}}},
    {.name = "Qwen2-7B decode batch (GQA 7)",
     .NH = 28,
     .NKV = 4,
     .D = 128,
     .BS = 16,
     .causal = true,
     .extra_rows = 2,
     .nseq = 5,
     .seqs = {{1, 1}, {1, 100}, {1, 513}, {1, 2047}, {1, 64}}},
    {.name = "GQA 4 decode, head dim 64, max_seq_len 32768",
     .NH = 16,
     .NKV = 4,
     .D = 64,
     .BS = 32,
     .causal = true,
     .strided = true,
     .nseq = 3,
     .seqs = {{1, 3000}, {1, 17}, {1, 900}},
     .len_bound = 32768},
    {.name = "decode batch of 8, GQA 4, max_seq_len 32768",
     .NH = 32,
     .NKV = 8,
     .D = 128,
     .BS = 16,
     .causal = true,
     .nseq = 8,
     .seqs = {{1, 1}, {1, 2}, {1, 63}, {1, 64}, {1, 65}, {1, 1000}, {1, 4097}, {1, 129}},
     .len_bound = 32768},
    {.name = "GQA 7 prefill of 700",
     .NH = 14,
     .NKV = 2,
     .D = 128,
     .BS = 16,
     .causal = true,
     .extra_rows = 1,
     .nseq = 1,
     .seqs = {{700, 700}}},
    {.name = "GQA 4 prefills around the tile sizes, head dim 80",
     .NH = 8,
     .NKV = 2,
     .D = 80,
     .BS = 16,
     .causal = true,
     .nseq = 5,
     .seqs = {{1, 1}, {63, 63}, {65, 65}, {129, 129}, {200, 200}}},
    {.name = "chunked prefill over a cached prefix, head dim 96, GQA 3",
     .NH = 12,
     .NKV = 4,
     .D = 96,
     .BS = 16,
     .causal = true,
     .strided = true,
     .nseq = 3,
     .seqs = {{100, 1000}, {37, 37}, {250, 600}}},
    {.name = "sliding window 256, decode + prefill",
     .NH = 8,
     .NKV = 2,
     .D = 128,
     .BS = 16,
     .causal = true,
     .window = 256,
     .nseq = 3,
     .seqs = {{1, 3000}, {300, 300}, {90, 1000}}},
    {.name = "sliding window 64, decodes of 1 and 2 rows (context split)",
     .NH = 8,
     .NKV = 1,
     .D = 64,
     .BS = 8,
     .causal = true,
     .window = 64,
     .nseq = 2,
     .seqs = {{1, 5000}, {2, 700}}},
    {.name = "mixed batch, head dim 256",
     .NH = 8,
     .NKV = 2,
     .D = 256,
     .BS = 16,
     .causal = true,
     .extra_rows = 3,
     .nseq = 6,
     .seqs = {{1, 400}, {90, 200}, {1, 1}, {0, 10}, {1, 1300}, {17, 50}}},
    {.name = "short chunks over long contexts (GQA 7, q_len <= 9)",
     .NH = 28,
     .NKV = 4,
     .D = 128,
     .BS = 16,
     .causal = true,
     .nseq = 3,
     .seqs = {{9, 4000}, {1, 2000}, {5, 5}}},
    {.name = "head dim 256 decode, GQA 2, context split",
     .NH = 8,
     .NKV = 4,
     .D = 256,
     .BS = 16,
     .causal = true,
     .nseq = 2,
     .seqs = {{1, 6000}, {1, 33}}},
    {.name = "softcap 30, decode + prefill",
     .NH = 8,
     .NKV = 2,
     .D = 128,
     .BS = 16,
     .causal = true,
     .softcap = 30.0f,
     .nseq = 2,
     .seqs = {{1, 2500}, {40, 40}}},
    {.name = "softcap 30, decodes (context split)",
     .NH = 8,
     .NKV = 2,
     .D = 128,
     .BS = 16,
     .causal = true,
     .softcap = 30.0f,
     .nseq = 2,
     .seqs = {{1, 2500}, {1, 300}}},
    {.name = "MQA with 32 heads, decodes of 1 and 2 rows",
     .NH = 32,
     .NKV = 1,
     .D = 64,
     .BS = 16,
     .causal = true,
     .nseq = 2,
     .seqs = {{1, 2000}, {2, 50}}},
    {.name = "non-causal, head dim 96",
     .NH = 6,
     .NKV = 2,
     .D = 96,
     .BS = 16,
     .causal = false,
     .nseq = 2,
     .seqs = {{150, 150}, {1, 300}}},
    {.name = "q and out off 16-byte alignment, prefill + decode",
     .NH = 8,
     .NKV = 2,
     .D = 128,
     .BS = 16,
     .causal = true,
     .misalign = 1,
     .nseq = 2,
     .seqs = {{1, 300}, {20, 90}}},
    {.name = "q and out off 16-byte alignment, decodes",
     .NH = 8,
     .NKV = 2,
     .D = 64,
     .BS = 16,
     .causal = true,
     .misalign = 1,
     .nseq = 2,
     .seqs = {{1, 500}, {1, 40}}},
    {.name = "caches off 16-byte alignment",
     .NH = 4,
     .NKV = 2,
     .D = 64,
     .BS = 16,
     .causal = true,
     .misalign = 2,
     .nseq = 2,
     .seqs = {{5, 40}, {1, 90}}},
};

/* The paged layout of a batch: shuffled block ids (the last id is a trap block, every unused
 * table entry names it), and caches that are NaN everywhere but the visible keys, which get
 * random values (rounded to dt by the caller's oh_write). bt: [S, MB]; kc, vc: [NB, NKV, BS, D]. */
static void attn_layout(int64_t S, const int32_t *lens, int64_t MB, int64_t NB, int64_t NKV,
                        int64_t BS, int64_t D, int32_t *bt, double *kc, double *vc) {
  int32_t *ids = OH_NEW(int32_t, NB);
  for (int64_t i = 0; i < NB; i++) ids[i] = (int32_t)i;
  oh_shuffle_i32(ids, NB);
  const int32_t trap = ids[NB - 1];
  int64_t next = 0;
  for (int64_t s = 0; s < S; s++) {
    int64_t nb = (lens[s] + BS - 1) / BS;
    for (int64_t j = 0; j < MB; j++) bt[s * MB + j] = j < nb ? ids[next++] : trap;
  }
  const int64_t csize = NB * NKV * BS * D;
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
  free(ids);
}

/* The FP8 cache of a layout: codes[i] (as doubles, for oh_write on a U8 view) of kc[i] with
 * scale s (unused slots: the NaN code), and kc[i] replaced by the value attention must read. */
static void attn_fp8_encode(int64_t n, double *kc, float s, double *codes) {
  for (int64_t i = 0; i < n; i++) {
    const uint8_t q = isnan(kc[i]) ? 0x7F : ops_ref_fp8_kv_code(kc[i], s);
    codes[i] = q;
    kc[i] = ops_ref_fp8_kv_value(q, s);
  }
}

/* Random FP8 cache scales: 1 (uncalibrated: values of [-1, 1] reach the subnormals) a third of
 * the time, else 1/448 .. 1/64 (a few keys saturate at 448 s). */
static float attn_fp8_scale(void) {
  return oh_rand_int(0, 2) == 0 ? 1.0f : (float)(1.0 / oh_rand_uniform(64, 600));
}

/* Compares out (pulled) with the reference, sequence by sequence, and checks that nothing else
 * of ob was written. */
static void attn_check(oh_buf_t *ob, const kiln_hal_attention_args_t *a, int32_t dt,
                       const ops_ref_attention_params_t *p, const double *q, const double *kc,
                       const double *vc, const int32_t *bt, const int32_t *lens, const int32_t *qsl,
                       const int32_t *qlens) {
  const int64_t S = p->num_seqs, NH = p->NH, D = p->D, Tq = qsl[S], T = a->q.shape[0];
  double *want = OH_NEW(double, T *NH *D), *got = OH_NEW(double, T *NH *D);
  int64_t nan_reads = ops_ref_attention(p, q, kc, vc, bt, lens, qsl, want);
  if (nan_reads)
    oh_fail("test bug: the reference read %lld NaN cache values", (long long)nan_reads);
  kiln_hal_tensor_t written = a->out;
  written.shape[0] = Tq;
  if (Tq > 0) {
    oh_mark(ob, &written);
    oh_read(ob, &written, got);
    /* report per sequence so a failure names the sequence */
    for (int64_t s = 0; s < S; s++) {
      char what[96];
      snprintf(what, sizeof(what), "out of seq %lld (q_len %d, seq_len %d)", (long long)s, qlens[s],
               lens[s]);
      int64_t r0 = qsl[s] * NH * D, n = (int64_t)(qsl[s + 1] - qsl[s]) * NH * D;
      oh_compare(what, n, got + r0, want + r0, NULL, oh_tol_attention(dt));
    }
  }
  oh_check_rest(ob, "out (rows >= query_start_loc[S], row padding)");
  free(want);
  free(got);
}

static void attention_run(const oh_backend_t *be, int32_t dt, const attn_case_t *c, bool fp8) {
  const int64_t NH = c->NH, NKV = c->NKV, D = c->D, BS = c->BS, S = c->nseq;
  const size_t es = kiln_hal_dtype_size(dt), ces = fp8 ? 1 : es;
  const int32_t cdt = fp8 ? KILN_HAL_U8 : dt;
  double work = 0; /* multiply-adds of the reference: q rows x visible keys x heads x dims x 2 */
  for (int64_t s = 0; s < S; s++) work += 2.0 * c->seqs[s].q_len * c->seqs[s].seq_len * NH * D;
  if (oh_skip_big(work)) return;
  const float scale = c->scale > 0 ? c->scale : (float)(1.0 / sqrt((double)D));
  int32_t qsl[ATTN_MAX_SEQS + 1], lens[ATTN_MAX_SEQS], qlens[ATTN_MAX_SEQS];
  int64_t MB = 1, nblocks = 0;
  int32_t max_q = 0, max_len = 0;
  qsl[0] = 0;
  for (int64_t s = 0; s < S; s++) {
    int64_t nb = (c->seqs[s].seq_len + BS - 1) / BS;
    MB = nb + 1 > MB ? nb + 1 : MB; /* one spare column: must never be followed */
    nblocks += nb;
    lens[s] = c->seqs[s].seq_len;
    qlens[s] = c->seqs[s].q_len;
    qsl[s + 1] = qsl[s] + c->seqs[s].q_len;
    if (c->seqs[s].q_len > max_q) max_q = c->seqs[s].q_len;
    if (lens[s] > max_len) max_len = lens[s];
  }
  const int64_t NB = nblocks + 3, Tq = qsl[S], T = Tq + c->extra_rows;
  const int64_t qrow = c->strided ? (NH + 2 * NKV) * D : NH * D;
  const int64_t orow = c->strided ? NH * D + 8 : NH * D;
  const uint64_t qoff = c->misalign ? es : 0, coff = c->misalign == 2 ? ces : 0;
  const float ks = fp8 ? attn_fp8_scale() : 0.0f, vs = fp8 ? attn_fp8_scale() : 0.0f;
  char kvs[64] = "";
  if (fp8) snprintf(kvs, sizeof(kvs), " FP8 cache k_scale=%g v_scale=%g", (double)ks, (double)vs);
  oh_case(be, "attention", dt,
          "%s: NH=%lld NKV=%lld D=%lld BS=%lld S=%lld T=%lld causal=%d window=%d softcap=%g "
          "scale=%g%s",
          c->name, (long long)NH, (long long)NKV, (long long)D, (long long)BS, (long long)S,
          (long long)Tq, c->causal, c->window, (double)c->softcap, (double)scale, kvs);

  const int64_t csize = NB * NKV * BS * D;
  int32_t *bt = OH_NEW(int32_t, S * MB);
  double *kc = OH_NEW(double, csize), *vc = OH_NEW(double, csize);
  attn_layout(S, lens, MB, NB, NKV, BS, D, bt, kc, vc);
  double *kcode = fp8 ? OH_NEW(double, csize) : NULL, *vcode = fp8 ? OH_NEW(double, csize) : NULL;
  if (fp8) {
    attn_fp8_encode(csize, kc, ks, kcode);
    attn_fp8_encode(csize, vc, vs, vcode);
  }
  oh_buf_t *qb = oh_buf_new(be, (size_t)(T * qrow + 4) * es);
  oh_buf_t *ob = oh_buf_new(be, (size_t)(T * orow + 4) * es);
  oh_buf_t *kcb = oh_buf_new(be, (size_t)(csize + 1) * ces),
           *vcb = oh_buf_new(be, (size_t)(csize + 1) * ces);
  oh_buf_t *btb = oh_buf_new(be, (size_t)(S * MB) * 4), *lb = oh_buf_new(be, (size_t)S * 4);
  oh_buf_t *qslb = oh_buf_new(be, (size_t)(S + 1) * 4);
  double *q = OH_NEW(double, T *NH *D);

  kiln_hal_attention_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  int64_t qshape[3] = {T, NH, D}, qstride[3] = {qrow, D, 1}, ostride[3] = {orow, D, 1};
  int64_t cshape[4] = {NB, NKV, BS, D}, btshape[2] = {S, MB}, lshape[1] = {S},
          qslshape[1] = {S + 1};
  a.q = oh_view(qb, qoff, dt, 3, qshape, qstride);
  a.out = oh_view(ob, qoff, dt, 3, qshape, ostride);
  a.k_cache = oh_view(kcb, coff, cdt, 4, cshape, NULL);
  a.v_cache = oh_view(vcb, coff, cdt, 4, cshape, NULL);
  a.block_table = oh_view(btb, 0, KILN_HAL_I32, 2, btshape, NULL);
  a.seq_lens = oh_view(lb, 0, KILN_HAL_I32, 1, lshape, NULL);
  a.query_start_loc = oh_view(qslb, 0, KILN_HAL_I32, 1, qslshape, NULL);
  if (fp8) {
    a.kv_format = KILN_HAL_KV_FP8_E4M3;
    a.k_scale = ks;
    a.v_scale = vs;
  }
  a.num_seqs = (int32_t)S;
  a.max_query_len = max_q + c->bound_slack;
  a.max_seq_len = c->len_bound > 0 ? c->len_bound : max_len + c->bound_slack;
  a.scale = scale;
  a.causal = c->causal;
  a.sliding_window = c->window;
  a.softcap = c->softcap;
  oh_write_rand(qb, &a.q, -3, 3, q);
  oh_write(kcb, &a.k_cache, fp8 ? kcode : kc); /* rounds the visible keys; NaN stays NaN */
  oh_write(vcb, &a.v_cache, fp8 ? vcode : vc);
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
    attn_check(ob, &a, dt, &p, q, kc, vc, bt, lens, qsl, qlens);
  }
  free(bt);
  free(kc);
  free(vc);
  free(kcode);
  free(vcode);
  free(q);
  oh_free_all();
}

/* Attention captured in a graph with launch bounds for the largest batch (max_seq_len 4096),
 * then replayed over batches of other lengths, tables and contents at the same addresses: the
 * launch (its context splits included) may depend on the bounds only. */
static void attention_graph_run(const oh_backend_t *be, int32_t dt, bool fp8) {
  enum { S = 4, BOUND = 4096 };
  const int64_t NH = 8, NKV = 2, D = 128, BS = 16, MB = BOUND / BS, NB = S * MB + 1;
  const size_t es = kiln_hal_dtype_size(dt), ces = fp8 ? 1 : es;
  const int32_t cdt = fp8 ? KILN_HAL_U8 : dt;
  /* The scales are the graph's (captured by value, per layer static): fixed for all replays. */
  const float ks = fp8 ? (float)(1.0 / 300.0) : 0.0f, vs = fp8 ? 1.0f : 0.0f;
  const kiln_hal_backend_t *t = be->t;
  static const int32_t rounds[3][S] = {{1, 700, 4096, 33}, {4000, 1, 65, 1024}, {17, 2049, 1, 300}};
  int32_t qsl[S + 1], qlens[S] = {1, 1, 1, 1};
  for (int s = 0; s <= S; s++) qsl[s] = s;
  const int64_t csize = NB * NKV * BS * D;
  int32_t *bt = OH_NEW(int32_t, S * MB);
  double *kc = OH_NEW(double, csize), *vc = OH_NEW(double, csize), *q = OH_NEW(double, S *NH *D);
  double *kcode = fp8 ? OH_NEW(double, csize) : NULL, *vcode = fp8 ? OH_NEW(double, csize) : NULL;
  oh_buf_t *qb = oh_buf_new(be, (size_t)(S * NH * D) * es);
  oh_buf_t *ob = oh_buf_new(be, (size_t)(S * NH * D) * es);
  oh_buf_t *kcb = oh_buf_new(be, (size_t)csize * ces), *vcb = oh_buf_new(be, (size_t)csize * ces);
  oh_buf_t *btb = oh_buf_new(be, (size_t)(S * MB) * 4), *lb = oh_buf_new(be, (size_t)S * 4);
  oh_buf_t *qslb = oh_buf_new(be, (size_t)(S + 1) * 4);
  kiln_hal_attention_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  int64_t qshape[3] = {S, NH, D}, cshape[4] = {NB, NKV, BS, D}, btshape[2] = {S, MB},
          lshape[1] = {S}, qslshape[1] = {S + 1};
  a.q = oh_view(qb, 0, dt, 3, qshape, NULL);
  a.out = oh_view(ob, 0, dt, 3, qshape, NULL);
  a.k_cache = oh_view(kcb, 0, cdt, 4, cshape, NULL);
  a.v_cache = oh_view(vcb, 0, cdt, 4, cshape, NULL);
  a.block_table = oh_view(btb, 0, KILN_HAL_I32, 2, btshape, NULL);
  a.seq_lens = oh_view(lb, 0, KILN_HAL_I32, 1, lshape, NULL);
  a.query_start_loc = oh_view(qslb, 0, KILN_HAL_I32, 1, qslshape, NULL);
  if (fp8) {
    a.kv_format = KILN_HAL_KV_FP8_E4M3;
    a.k_scale = ks;
    a.v_scale = vs;
  }
  a.num_seqs = S;
  a.max_query_len = 1;
  a.max_seq_len = BOUND;
  a.scale = (float)(1.0 / sqrt((double)D));
  a.causal = true;
  oh_write_i32(qslb, &a.query_start_loc, qsl);
  oh_push(qslb);
  ops_ref_attention_params_t p = {S, NH, NKV, D, BS, MB, (double)a.scale, true, 0, 0};
  kiln_hal_graph_t *g = NULL;
  for (int r = 0; r < 3; r++) {
    const int32_t *lens = rounds[r];
    oh_case(be, "attention", dt, "graph replay %d: decode S=%d, lens %d %d %d %d, bound %d%s", r,
            S, lens[0], lens[1], lens[2], lens[3], BOUND, fp8 ? ", FP8 cache" : "");
    attn_layout(S, lens, MB, NB, NKV, BS, D, bt, kc, vc);
    if (fp8) {
      attn_fp8_encode(csize, kc, ks, kcode);
      attn_fp8_encode(csize, vc, vs, vcode);
    }
    oh_write_rand(qb, &a.q, -3, 3, q);
    oh_write(kcb, &a.k_cache, fp8 ? kcode : kc);
    oh_write(vcb, &a.v_cache, fp8 ? vcode : vc);
    oh_write_i32(btb, &a.block_table, bt);
    oh_write_i32(lb, &a.seq_lens, lens);
    oh_push(qb);
    oh_push(kcb);
    oh_push(vcb);
    oh_push(btb);
    oh_push(lb);
    oh_poison(ob);
    if (r == 0) {
      if (!oh_ok(t->graph_begin(be->stream), "graph_begin")) break;
      bool ok = oh_ok(t->attention(be->stream, &a), "attention (capturing)");
      ok = oh_ok(t->graph_end(be->stream, &g), "graph_end") && ok;
      if (!ok || !g) {
        if (ok) oh_fail("graph_end returned no graph");
        break;
      }
    }
    if (oh_ok(t->graph_replay(g, be->stream), "graph_replay") && oh_pull(ob))
      attn_check(ob, &a, dt, &p, q, kc, vc, bt, lens, qsl, qlens);
  }
  if (g) t->graph_destroy(g);
  free(bt);
  free(kc);
  free(vc);
  free(kcode);
  free(vcode);
  free(q);
  oh_free_all();
}

/* The vision towers' attention (Qwen2-VL / Qwen2.5-VL): non-causal, q_len == seq_len, one
 * sequence per image or per window, NH == NKV (16 heads of 80 in the real models; 64 too), block
 * size 16, lengths that are not multiples of it. The windows (<= 64 rows with G = 1) reach the
 * GPU's decode-shaped tensor-core kernel, with and without context splits (a large
 * max_seq_len bound); the full images its prefill kernel; the long ones its longest grids.
 * gpu_only cases would cost the CPU backend (and the fp64 reference on the 2-core CI runners)
 * minutes; the CPU's tiling is the same for them as for the shorter cases. */
typedef struct vision_attn_case {
  attn_case_t c;
  bool gpu_only;
  int reps; /* runs, each on fresh random inputs */
} vision_attn_case_t;

static const vision_attn_case_t vision_attn_cases[] = {
    {{.name = "vision windows (Qwen2.5-VL), D 80",
      .NH = 16,
      .NKV = 16,
      .D = 80,
      .BS = 16,
      .causal = false,
      .extra_rows = 1,
      .nseq = 8,
      .seqs = {{64, 64}, {64, 64}, {48, 48}, {56, 56}, {16, 16}, {1, 1}, {35, 35}, {64, 64}}},
     false,
     3},
    {{.name = "vision windows, fused QKV rows, D 64",
      .NH = 16,
      .NKV = 16,
      .D = 64,
      .BS = 16,
      .causal = false,
      .strided = true,
      .nseq = 5,
      .seqs = {{17, 17}, {64, 64}, {3, 3}, {40, 40}, {63, 63}}},
     false,
     3},
    {{.name = "vision windows, few heads, max_seq_len bound 2048 (context splits)",
      .NH = 2,
      .NKV = 2,
      .D = 80,
      .BS = 16,
      .causal = false,
      .len_bound = 2048,
      .nseq = 2,
      .seqs = {{64, 64}, {29, 29}}},
     false,
     3},
    {{.name = "vision windows, one of 65 rows (prefill kernel for all)",
      .NH = 16,
      .NKV = 16,
      .D = 80,
      .BS = 16,
      .causal = false,
      .nseq = 4,
      .seqs = {{65, 65}, {64, 64}, {7, 7}, {1, 1}}},
     false,
     2},
    {{.name = "vision full attention, images of 700/257/100 patches, D 80",
      .NH = 16,
      .NKV = 16,
      .D = 80,
      .BS = 16,
      .causal = false,
      .strided = true,
      .extra_rows = 2,
      .nseq = 3,
      .seqs = {{700, 700}, {257, 257}, {100, 100}}},
     true, /* 1.3e9 multiply-adds per dtype: 20% of test_ops' CPU time, 5x that under ASan */
     1},
    {{.name = "vision full attention, images of 300/129/17 patches, D 80",
      .NH = 16,
      .NKV = 16,
      .D = 80,
      .BS = 16,
      .causal = false,
      .strided = true,
      .extra_rows = 2,
      .nseq = 3,
      .seqs = {{300, 300}, {129, 129}, {17, 17}}},
     false,
     1},
    {{.name = "vision full attention, D 64",
      .NH = 16,
      .NKV = 16,
      .D = 64,
      .BS = 16,
      .causal = false,
      .nseq = 3,
      .seqs = {{333, 333}, {129, 129}, {1, 1}}},
     false,
     1},
    {{.name = "vision, a 4100-patch image, D 80",
      .NH = 4,
      .NKV = 4,
      .D = 80,
      .BS = 16,
      .causal = false,
      .strided = true,
      .nseq = 2,
      .seqs = {{4100, 4100}, {95, 95}}},
     true,
     1},
    {{.name = "vision, 7999- and 2049-patch images, D 64",
      .NH = 2,
      .NKV = 2,
      .D = 64,
      .BS = 16,
      .causal = false,
      .nseq = 2,
      .seqs = {{7999, 7999}, {2049, 2049}}},
     true,
     1},
    {{.name = "vision full attention, 16 heads of 80, 2100 patches",
      .NH = 16,
      .NKV = 16,
      .D = 80,
      .BS = 16,
      .causal = false,
      .nseq = 1,
      .seqs = {{2100, 2100}}},
     true,
     1},
};

void test_ops_attention_vision(void **state) {
  (void)state;
  oh_test_begin("attention_vision");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    const oh_backend_t *be = &oh_backends[bi];
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(be, oh_float_dtypes[di])) continue;
      for (size_t ci = 0; ci < ARRAY_LEN(vision_attn_cases); ci++) {
        const vision_attn_case_t *v = &vision_attn_cases[ci];
        if (v->gpu_only && be->info.kind == KILN_HAL_DEVICE_CPU) continue;
        for (int r = 0; r < v->reps; r++) attention_run(be, oh_float_dtypes[di], &v->c, false);
      }
      /* Fresh vision batches: windows and images of random sizes, 1..8 per call. */
      for (int r = 0; r < 4; r++) {
        attn_case_t c;
        memset(&c, 0, sizeof(c));
        c.name = "random vision batch";
        c.NH = c.NKV = r % 2 ? 16 : oh_rand_int(1, 4);
        c.D = oh_rand_int(0, 1) ? 80 : 64;
        c.BS = 16;
        c.causal = false;
        c.strided = oh_rand_int(0, 1);
        c.nseq = (int)oh_rand_int(1, ATTN_MAX_SEQS);
        const int32_t cap = r < 2 ? 64 : 300;
        for (int s = 0; s < c.nseq; s++)
          c.seqs[s].q_len = c.seqs[s].seq_len = (int32_t)oh_rand_int(1, cap);
        attention_run(be, oh_float_dtypes[di], &c, false);
      }
    }
  }
  oh_test_end();
}

static void attention_test(const char *name, bool fp8) {
  oh_test_begin(name);
  for (int bi = 0; bi < oh_num_backends; bi++) {
    const oh_backend_t *be = &oh_backends[bi];
    if (fp8 && !(be->info.caps & KILN_HAL_CAP_KV_FP8)) {
      kv_fp8_refused(be, true);
      continue;
    }
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(be, oh_float_dtypes[di])) continue;
      /* The CPU widens FP8 codes to f32 whatever q's dtype: its fixed FP8 cases run in bf16
       * only (the random ones in every dtype), which keeps the 2-core CI's time in check. */
      const bool fixed = !fp8 || be->info.kind != KILN_HAL_DEVICE_CPU ||
                         oh_float_dtypes[di] == KILN_HAL_BF16;
      for (size_t ci = 0; fixed && ci < ARRAY_LEN(attn_cases); ci++)
        attention_run(be, oh_float_dtypes[di], &attn_cases[ci], fp8);
      /* Fresh batches every run (the seed reproduces them). */
      for (int r = 0; r < 5; r++) {
        static const int64_t dims[] = {64, 80, 96, 128, 256}, bss[] = {8, 16, 32};
        static const int64_t groups[] = {1, 2, 3, 4, 7, 8};
        const bool big = r >= 3; /* longer contexts and chunks */
        attn_case_t c;
        memset(&c, 0, sizeof(c));
        c.name = big ? "random, long" : "random";
        c.NKV = oh_rand_int(1, 2);
        c.NH = c.NKV * groups[oh_rand_int(0, 5)];
        c.D = dims[oh_rand_int(0, 4)];
        c.BS = bss[oh_rand_int(0, 2)];
        c.causal = oh_rand_int(0, 4) != 0;
        c.window = oh_rand_int(0, 3) == 0 ? (int32_t)oh_rand_int(1, big ? 500 : 40) : 0;
        c.softcap = oh_rand_int(0, 3) == 0 ? 8.0f : 0.0f;
        c.strided = oh_rand_int(0, 1);
        c.extra_rows = (int)oh_rand_int(0, 2);
        c.nseq = (int)oh_rand_int(1, big ? 3 : 4);
        for (int s = 0; s < c.nseq; s++) {
          c.seqs[s].seq_len = (int32_t)oh_rand_int(1, big ? 2500 : 200);
          int32_t cap = big ? 70 : 24;
          int32_t mq = c.seqs[s].seq_len < cap ? c.seqs[s].seq_len : cap;
          c.seqs[s].q_len = oh_rand_int(0, 1) ? 1 : (int32_t)oh_rand_int(0, mq);
        }
        if (oh_rand_int(0, 2) == 0) c.len_bound = 8192;
        attention_run(be, oh_float_dtypes[di], &c, fp8);
      }
    }
    if (be->info.caps & KILN_HAL_CAP_GRAPHS && be->t->graph_begin && be->t->graph_end &&
        be->t->graph_replay && be->t->graph_destroy) {
      for (int di = 0; di < 3; di++)
        if (oh_dtype_ok(be, oh_float_dtypes[di])) attention_graph_run(be, oh_float_dtypes[di], fp8);
    }
  }
  oh_test_end();
}

void test_ops_attention(void **state) {
  (void)state;
  attention_test("attention", false);
}

/* The same cases over FP8 caches (ABI 1.7): prefill, chunked prefill over a cached prefix,
 * decode with context splits, mixed batches, misaligned caches, and the graph replay. */
void test_ops_attention_fp8(void **state) {
  (void)state;
  attention_test("attention_fp8", true);
}
