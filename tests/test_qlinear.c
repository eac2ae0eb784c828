/* test_qlinear.c - GPTQ and AWQ checkpoints (models/qlinear.c, the group formats of hal.h).
 *
 * 1. Hand-made packed words through the loader's unpacking (kiln_qpart_open / _write): the
 *    GPTQ low-nibble-first order along K, the v1 "zero - 1" convention (and v2 without it),
 *    8-bit words, AWQ's interleaved nibble order [0, 2, 4, 6, 1, 3, 5, 7] along N, and the
 *    load errors that name a missing or misshapen tensor.
 * 2. End to end: tools/make_quant_fixtures.py (numpy, packing written from the format
 *    description, independently of the C code) quantizes the llama2 fixture six ways (GPTQ
 *    4-bit sym g32, 4-bit asym desc_act g32, the same with a g_idx per Linear (fused q/k/v and
 *    gate/up then differ and are dequantized at load: the widening path), 8-bit asym g64
 *    gptq_v2, 4-bit one group over K, AWQ g32) and writes, next to each, the same model with
 *    the dequantized weights as plain F32 tensors. Kiln runs both on the CPU backend (the
 *    quantized one through gemm_quant, weights kept quantized), prefill (M = 20) and decode
 *    steps of 1 and 3 tokens; and Qwen3 (GPTQ desc_act, AWQ), whose fused QKV is dequantized
 *    at load (q/k norms split it) while the other Linears stay quantized.
 *    Tolerance: the weights are the same f32 values in both (hal.h defines W exactly), so
 *    only the order of the f32 sums differs (gemm_quant's own kernel vs sgemm): 2e-5 of the
 *    largest logit, as test_parity's self-consistency bound; every argmax must agree. Three
 *    variants are also served in bf16 (x bf16 into gemm_quant) against their twin in bf16,
 *    within test_parity's bf16 bound (3e-2).
 * 3. A checkpoint whose quantization_config Kiln does not run is refused at load, naming it.
 * KILN_TEST_BACKEND=cuda (or KILN_TEST_BACKENDS naming cuda) runs the same on a GPU, where the
 * CUDA backend's gemm_quant keeps the weights quantized as the CPU does, and the pairs must
 * still agree. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
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

#include "hal/loader.h"
#include "kiln/hal_quant.h"
#include "kiln/hal_util.h"
#include "models/model.h"
#include "models/model_internal.h"
#include "test_backend.h"
#include "test_model_util.h"

#define SELF_TOL 2e-5

static const kiln_hal_plugin_t *g_plugin;
static kiln_hal_registry_t *g_reg;
static kiln_hal_device_t *g_dev;
static kiln_hal_stream_t *g_stream;
static char g_dir[512]; /* the generated fixtures */
static bool g_keeps;    /* the device runs gemm_quant on int4_g and int8_g */

/* ---- 1. hand-made words ------------------------------------------------------------------- */

/* A weight set of hand-made tensors: written as <tmp>/model.safetensors, opened as Kiln does. */
typedef struct hand {
  kiln_weights_t *w;
  kiln_quant_config_t cfg;
  model_plan_t plan;
  char dir[64];
  int n;
  struct {
    char name[32];
    int32_t type;
    int64_t d0, d1;
    const void *data;
  } t[6];
} hand_t;

static void hand_init(hand_t *h, int32_t method, int32_t bits, int32_t gs) {
  memset(h, 0, sizeof(*h));
  h->cfg.method = method;
  h->cfg.bits = bits;
  h->cfg.group_size = gs;
  h->cfg.zero_minus_one = method == KILN_QUANT_GPTQ;
}

static void hand_add(hand_t *h, const char *name, int32_t type, int64_t d0, int64_t d1,
                     const void *data) {
  assert_true(h->n < 6);
  snprintf(h->t[h->n].name, sizeof(h->t[h->n].name), "%s", name);
  h->t[h->n].type = type;
  h->t[h->n].d0 = d0;
  h->t[h->n].d1 = d1;
  h->t[h->n].data = data;
  h->n++;
}

/* Writes the safetensors file and opens it; the plan reads from it. */
static void hand_open(hand_t *h) {
  snprintf(h->dir, sizeof(h->dir), "/tmp/kiln_qhand_XXXXXX");
  assert_non_null(mkdtemp(h->dir));
  char hdr[2048], path[128];
  size_t len = 0;
  uint64_t off = 0, nb[6];
  len += (size_t)snprintf(hdr + len, sizeof(hdr) - len, "{");
  for (int i = 0; i < h->n; i++) {
    const int64_t numel = h->t[i].d0 * (h->t[i].d1 ? h->t[i].d1 : 1);
    nb[i] = (uint64_t)numel * (h->t[i].type == KILN_WTYPE_F16 ? 2 : 4);
    char shape[48];
    if (h->t[i].d1)
      snprintf(shape, sizeof(shape), "[%lld,%lld]", (long long)h->t[i].d0, (long long)h->t[i].d1);
    else
      snprintf(shape, sizeof(shape), "[%lld]", (long long)h->t[i].d0);
    len +=
        (size_t)snprintf(hdr + len, sizeof(hdr) - len,
                         "%s\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%llu,%llu]}",
                         i ? "," : "", h->t[i].name, h->t[i].type == KILN_WTYPE_F16 ? "F16" : "I32",
                         shape, (unsigned long long)off, (unsigned long long)(off + nb[i]));
    off += nb[i];
  }
  len += (size_t)snprintf(hdr + len, sizeof(hdr) - len, "}");
  snprintf(path, sizeof(path), "%s/model.safetensors", h->dir);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  uint8_t n8[8];
  for (int i = 0; i < 8; i++) n8[i] = (uint8_t)((uint64_t)len >> (8 * i));
  assert_int_equal(fwrite(n8, 1, 8, f), 8);
  assert_int_equal(fwrite(hdr, 1, len, f), len);
  for (int i = 0; i < h->n; i++) assert_int_equal(fwrite(h->t[i].data, 1, nb[i], f), nb[i]);
  fclose(f);
  check_st(kiln_weights_open_dir(h->dir, &h->w));
  h->plan.path = h->dir;
  h->plan.src = h->w;
  h->plan.quant = &h->cfg;
}

static kiln_status_t hand_part(hand_t *h, int64_t N, int64_t K, model_qpart_t **q) {
  hand_open(h);
  return kiln_qpart_open(&h->plan, "m", N, K, q);
}

static void hand_free(hand_t *h) {
  kiln_model_plan_free(&h->plan);
  kiln_weights_free(h->w);
  char path[128];
  snprintf(path, sizeof(path), "%s/model.safetensors", h->dir);
  unlink(path);
  rmdir(h->dir);
}

static void test_gptq_words(void **state) {
  (void)state;
  for (int v2 = 0; v2 < 2; v2++) {
    hand_t h;
    hand_init(&h, KILN_QUANT_GPTQ, 4, 8);
    h.cfg.zero_minus_one = !v2;
    /* N = 8 columns, K = 8: one word per column; column 0 holds codes 0..7 (k = 0 in the low
     * nibble), column 1 codes 8..15, the others 0. */
    const int32_t qweight[8] = {0x76543210, (int32_t)0xFEDCBA98u, 0, 0, 0, 0, 0, 0};
    const int32_t qzeros[1] = {0x01234567}; /* column n's stored zero in nibble n: 7, 6, .. 0 */
    uint16_t scales[8];
    for (int n = 0; n < 8; n++) scales[n] = kiln_hal_f32_to_f16(0.5f);
    hand_add(&h, "m.qweight", KILN_WTYPE_I32, 1, 8, qweight);
    hand_add(&h, "m.qzeros", KILN_WTYPE_I32, 1, 1, qzeros);
    hand_add(&h, "m.scales", KILN_WTYPE_F16, 1, 8, scales);
    model_qpart_t *q;
    check_st(hand_part(&h, 8, 8, &q));
    assert_int_equal(kiln_qpart_format(q), KILN_HAL_QFMT_INT4_G);
    assert_int_equal(kiln_qpart_groups(q), 1);
    assert_null(kiln_qpart_g_idx(q));
    uint8_t codes[32], zeros[8];
    assert_int_equal(kiln_qpart_bytes(q, MODEL_Q_CODES, KILN_HAL_F32), 32);
    check_st(kiln_qpart_write(q, MODEL_Q_CODES, KILN_HAL_F32, codes));
    const uint8_t row0[4] = {0x10, 0x32, 0x54, 0x76}, row1[4] = {0x98, 0xBA, 0xDC, 0xFE};
    assert_memory_equal(codes, row0, 4);
    assert_memory_equal(codes + 4, row1, 4);
    for (int i = 8; i < 32; i++) assert_int_equal(codes[i], 0);
    check_st(kiln_qpart_write(q, MODEL_Q_ZEROS, KILN_HAL_F32, zeros));
    for (int n = 0; n < 8; n++) assert_int_equal(zeros[n], 7 - n + (v2 ? 0 : 1));
    float w[64];
    check_st(kiln_qpart_write(q, MODEL_Q_WIDEN, KILN_HAL_F32, w));
    for (int k = 0; k < 8; k++) {
      assert_true(w[k] == (float)(k - (v2 ? 7 : 8)) * 0.5f);
      assert_true(w[8 + k] == (float)(8 + k - (v2 ? 6 : 7)) * 0.5f);
      assert_true(w[56 + k] == (float)(0 - (v2 ? 0 : 1)) * 0.5f);
    }
    hand_free(&h);
  }
}

static void test_gptq8_words(void **state) {
  (void)state;
  hand_t h;
  hand_init(&h, KILN_QUANT_GPTQ, 8, -1);
  /* N = 4, K = 4: column 0's word holds codes 0x02, 0x01, 0xFF, 0x80 (k = 0 lowest byte). */
  const int32_t qweight[4] = {(int32_t)0x80FF0102u, 0, 0, 0};
  const int32_t qzeros[1] = {0x7F7F7F7F}; /* stored 127: z = 128 (v1) */
  const uint16_t one = kiln_hal_f32_to_f16(1.0f), scales[4] = {one, one, one, one};
  hand_add(&h, "m.qweight", KILN_WTYPE_I32, 1, 4, qweight);
  hand_add(&h, "m.qzeros", KILN_WTYPE_I32, 1, 1, qzeros);
  hand_add(&h, "m.scales", KILN_WTYPE_F16, 1, 4, scales);
  model_qpart_t *q;
  check_st(hand_part(&h, 4, 4, &q));
  assert_int_equal(kiln_qpart_format(q), KILN_HAL_QFMT_INT8_G);
  assert_int_equal(kiln_qpart_group_size(q), 4); /* -1: one group over all of K */
  uint8_t codes[16];
  check_st(kiln_qpart_write(q, MODEL_Q_CODES, KILN_HAL_F32, codes));
  const uint8_t row0[4] = {0x02, 0x01, 0xFF, 0x80};
  assert_memory_equal(codes, row0, 4);
  float w[16];
  check_st(kiln_qpart_write(q, MODEL_Q_WIDEN, KILN_HAL_F32, w));
  assert_true(w[0] == -126.0f && w[1] == -127.0f && w[2] == 127.0f && w[3] == 0.0f);
  hand_free(&h);

  /* A stored 255 in a v1 8-bit checkpoint would be zero 256: refused, naming the tensor. */
  hand_init(&h, KILN_QUANT_GPTQ, 8, -1);
  const int32_t bad_zeros[1] = {(int32_t)0x7F7FFF7Fu};
  hand_add(&h, "m.qweight", KILN_WTYPE_I32, 1, 4, qweight);
  hand_add(&h, "m.qzeros", KILN_WTYPE_I32, 1, 1, bad_zeros);
  hand_add(&h, "m.scales", KILN_WTYPE_F16, 1, 4, scales);
  check_st(hand_part(&h, 4, 4, &q));
  uint8_t zeros[4];
  expect_err(kiln_qpart_write(q, MODEL_Q_ZEROS, KILN_HAL_F32, zeros), "m.qzeros", "256");
  hand_free(&h);
}

static void test_awq_words(void **state) {
  (void)state;
  hand_t h;
  hand_init(&h, KILN_QUANT_AWQ, 4, 2);
  /* N = 8, K = 2: row k = 0's word has nibble i = i, so column c (nibble [0,4,1,5,2,6,3,7][c])
   * has code 0, 4, 1, 5, 2, 6, 3, 7; row k = 1 is all 9. Zeros: nibble i holds i as well. */
  const int32_t qweight[2] = {0x76543210, (int32_t)0x99999999u};
  const int32_t qzeros[1] = {0x76543210};
  const uint16_t one = kiln_hal_f32_to_f16(1.0f);
  uint16_t scales[8];
  for (int n = 0; n < 8; n++) scales[n] = one;
  hand_add(&h, "m.qweight", KILN_WTYPE_I32, 2, 1, qweight);
  hand_add(&h, "m.qzeros", KILN_WTYPE_I32, 1, 1, qzeros);
  hand_add(&h, "m.scales", KILN_WTYPE_F16, 1, 8, scales);
  model_qpart_t *q;
  check_st(hand_part(&h, 8, 2, &q));
  static const int order[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int c = 0; c < 8; c++) assert_int_equal(kiln_hal_awq_nibble(c), order[c]);
  uint8_t codes[8], zeros[8];
  check_st(kiln_qpart_write(q, MODEL_Q_CODES, KILN_HAL_F32, codes));
  check_st(kiln_qpart_write(q, MODEL_Q_ZEROS, KILN_HAL_F32, zeros));
  float w[16];
  check_st(kiln_qpart_write(q, MODEL_Q_WIDEN, KILN_HAL_F32, w));
  for (int c = 0; c < 8; c++) {
    assert_int_equal(codes[c], order[c] | 9 << 4);
    assert_int_equal(zeros[c], order[c]); /* as is: no "+ 1" for AWQ */
    assert_true(w[2 * c] == 0.0f);
    assert_true(w[2 * c + 1] == (float)(9 - order[c]));
  }
  hand_free(&h);
}

static void test_bad_tensors(void **state) {
  (void)state;
  const int32_t qweight[8] = {0}, qzeros[2] = {0}, g_idx[8] = {0, 0, 0, 0, 0, 0, 0, 1};
  uint16_t scales[16] = {0};
  model_qpart_t *q;
  hand_t h;
  hand_init(&h, KILN_QUANT_GPTQ, 4, 8);
  hand_add(&h, "m.qweight", KILN_WTYPE_I32, 1, 8, qweight);
  hand_add(&h, "m.scales", KILN_WTYPE_F16, 1, 8, scales);
  expect_err(hand_part(&h, 8, 8, &q), "m.qzeros", "missing");
  hand_free(&h);

  hand_init(&h, KILN_QUANT_GPTQ, 4, 8);
  hand_add(&h, "m.qweight", KILN_WTYPE_I32, 1, 8, qweight);
  hand_add(&h, "m.qzeros", KILN_WTYPE_I32, 1, 1, qzeros);
  hand_add(&h, "m.scales", KILN_WTYPE_F16, 2, 8, scales); /* two groups where K has one */
  expect_err(hand_part(&h, 8, 8, &q), "m.scales", "[1, 8]");
  hand_free(&h);

  hand_init(&h, KILN_QUANT_GPTQ, 4, 8);
  h.cfg.desc_act = true;
  hand_add(&h, "m.qweight", KILN_WTYPE_I32, 1, 8, qweight);
  hand_add(&h, "m.qzeros", KILN_WTYPE_I32, 1, 1, qzeros);
  hand_add(&h, "m.scales", KILN_WTYPE_F16, 1, 8, scales);
  expect_err(hand_part(&h, 8, 8, &q), "m.g_idx", "missing");
  hand_free(&h);

  hand_init(&h, KILN_QUANT_GPTQ, 4, 8);
  hand_add(&h, "m.qweight", KILN_WTYPE_I32, 1, 8, qweight);
  hand_add(&h, "m.qzeros", KILN_WTYPE_I32, 1, 1, qzeros);
  hand_add(&h, "m.scales", KILN_WTYPE_F16, 1, 8, scales);
  hand_add(&h, "m.g_idx", KILN_WTYPE_I32, 8, 0, g_idx); /* group 1 of one */
  expect_err(hand_part(&h, 8, 8, &q), "m.g_idx", "outside");
  hand_free(&h);

  hand_init(&h, KILN_QUANT_GPTQ, 4, 8);
  hand_add(&h, "m.qweight", KILN_WTYPE_F16, 1, 8, scales); /* not I32 */
  hand_add(&h, "m.qzeros", KILN_WTYPE_I32, 1, 1, qzeros);
  hand_add(&h, "m.scales", KILN_WTYPE_F16, 1, 8, scales);
  expect_err(hand_part(&h, 8, 8, &q), "m.qweight", "i32");
  hand_free(&h);

  hand_init(&h, KILN_QUANT_AWQ, 4, 8);
  hand_add(&h, "m.qweight", KILN_WTYPE_I32, 8, 1, qweight);
  hand_add(&h, "m.qzeros", KILN_WTYPE_I32, 1, 1, qzeros);
  hand_add(&h, "m.scales", KILN_WTYPE_F16, 1, 8, scales);
  expect_err(hand_part(&h, 12, 8, &q), "out_features 12", "8 codes");
  hand_free(&h);
}

/* ---- 2. end to end ------------------------------------------------------------------------ */

static int setup(void **state) {
  (void)state;
  if (test_open_backend(&g_reg, &g_plugin, &g_dev, &g_stream)) return -1;
  const kiln_hal_backend_t *be = &g_plugin->table;
  kiln_hal_device_info_t di;
  memset(&di, 0, sizeof(di));
  di.struct_size = sizeof(di);
  if (be->device_info(0, &di)) return -1;
  g_keeps = KILN_HAL_HAS(be, gemm_quant) && be->gemm_quant &&
            (di.caps & KILN_HAL_CAP_QUANT(KILN_HAL_QFMT_INT4_G)) &&
            (di.caps & KILN_HAL_CAP_QUANT(KILN_HAL_QFMT_INT8_G));
  const char *src = getenv("KILN_SOURCE_DIR");
  if (!src) src = "..";
  snprintf(g_dir, sizeof(g_dir), "/tmp/kiln_qlinear_XXXXXX");
  if (!mkdtemp(g_dir)) return -1;
  /* The first python3 that imports numpy, Debian's first (make deps installs python3-numpy). */
  static const char *const pythons[] = {"/usr/bin/python3", "python3"};
  for (size_t i = 0; i < sizeof(pythons) / sizeof(pythons[0]); i++) {
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "%s -c 'import numpy' 2>/dev/null", pythons[i]);
    if (system(cmd) != 0) continue;
    snprintf(cmd, sizeof(cmd),
             "%s %s/tools/make_quant_fixtures.py %s/tests/fixtures/models/llama2 %s && "
             "%s %s/tools/make_quant_fixtures.py %s/tests/fixtures/models/qwen3 %s/qwen3 "
             "gptq_asym_act awq_g32",
             pythons[i], src, src, g_dir, pythons[i], src, src, g_dir);
    if (system(cmd) == 0) return 0;
    fprintf(stderr, "test_qlinear: '%s' failed\n", cmd);
    return -1;
  }
  fprintf(stderr, "test_qlinear: no python3 with numpy (apt-get install python3-numpy)\n");
  return -1;
}

static int teardown(void **state) {
  (void)state;
  if (g_stream) g_plugin->table.stream_destroy(g_stream);
  if (g_dev) g_plugin->table.device_close(g_dev);
  kiln_hal_registry_free(g_reg);
  if (g_dir[0] && strncmp(g_dir, "/tmp/kiln_qlinear_", 18) == 0) {
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "test_qlinear: could not remove %s\n", g_dir);
  }
  return 0;
}

static kiln_status_t load(const char *sub, int32_t dtype, kiln_model_t **m) {
  char path[700];
  snprintf(path, sizeof(path), "%s/%s", g_dir, sub);
  kiln_model_options_t o = {0};
  o.dtype = dtype;
  o.max_tokens = 32;
  o.max_seqs = 4;
  o.max_blocks_per_seq = 64;
  return kiln_model_load(path, &g_plugin->table, g_dev, g_stream, &o, m);
}

static double rel_err(const float *a, const float *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (!(d <= num)) num = d;
    if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
  }
  return den > 0 ? num / den : num;
}

static int64_t argmax(const float *v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; i++)
    if (v[i] > v[best]) best = i;
  return best;
}

static void check_variant(const char *name) {
  char ref[128];
  snprintf(ref, sizeof(ref), "%s_ref", name);
  if (getenv("KILN_TEST_VERBOSE")) printf("  %s\n", name);
  kiln_model_t *mq = NULL, *mr = NULL;
  check_st(load(name, KILN_HAL_F32, &mq));
  check_st(load(ref, KILN_HAL_F32, &mr));
  /* Kept quantized: the quantized model's weights are smaller than the float one's (else
   * dequantized at load: the same size). */
  if (g_keeps)
    assert_true(kiln_model_weight_bytes(mq) < kiln_model_weight_bytes(mr));
  else
    assert_true(kiln_model_weight_bytes(mq) == kiln_model_weight_bytes(mr));
  const int64_t V = kiln_model_get_config(mq)->vocab_size;
  int32_t ids[20];
  for (int i = 0; i < 20; i++) ids[i] = (int32_t)((i * 37 + 11) % V);
  const int32_t n = 20;
  float *a = malloc((size_t)(n * V) * sizeof(float)), *b = malloc((size_t)(n * V) * sizeof(float));
  assert_non_null(a);
  assert_non_null(b);
  static const int32_t chunks[] = {0, 1, 3}; /* prefill (M = 20), decode (M = 1), M = 3 */
  for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
    check_st(kiln_model_score(mq, ids, n, chunks[c], 16, a));
    check_st(kiln_model_score(mr, ids, n, chunks[c], 16, b));
    double e = rel_err(a, b, (size_t)(n * V));
    if (getenv("KILN_TEST_VERBOSE")) printf("  %-14s chunk %d: rel err %.3g\n", name, chunks[c], e);
    if (!(e <= SELF_TOL))
      fail_msg("%s chunk %d: relative error %.3g > %.0e", name, chunks[c], e, SELF_TOL);
    for (int32_t t = 0; t < n; t++)
      if (argmax(a + t * V, V) != argmax(b + t * V, V))
        fail_msg("%s chunk %d: argmax of position %d differs", name, chunks[c], t);
  }
  free(a);
  free(b);
  kiln_model_free(mq);
  kiln_model_free(mr);
}

static void test_gptq_sym_g32(void **state) {
  (void)state;
  check_variant("gptq_sym_g32");
}
static void test_gptq_asym_act(void **state) {
  (void)state;
  check_variant("gptq_asym_act");
}
static void test_gptq_asym_act_mixed(void **state) { /* fused parts widened at load */
  (void)state;
  check_variant("gptq_asym_act_mixed");
}
static void test_gptq_int8(void **state) {
  (void)state;
  check_variant("gptq_int8_g64");
}
static void test_gptq_all_k(void **state) {
  (void)state;
  check_variant("gptq_all_k");
}
static void test_awq_g32(void **state) {
  (void)state;
  check_variant("awq_g32");
}
/* Qwen3: q/k norms split the fused QKV, which is dequantized at load; o, gate/up, down stay
 * quantized. */
static void test_qwen3(void **state) {
  (void)state;
  check_variant("qwen3/gptq_asym_act");
  check_variant("qwen3/awq_g32");
}

/* Serving in bf16 (x and the activations bf16; the float twin's weights rounded to bf16, the
 * quantized ones exact): test_parity's bf16 bound, 3e-2 of the largest logit (the rounding of
 * the twin's weights alone is 2^-9 relative per weight). */
static void check_bf16(const char *name) {
  char ref[128];
  snprintf(ref, sizeof(ref), "%s_ref", name);
  kiln_model_t *mq = NULL, *mr = NULL;
  check_st(load(name, KILN_HAL_BF16, &mq));
  check_st(load(ref, KILN_HAL_BF16, &mr));
  const int64_t V = kiln_model_get_config(mq)->vocab_size;
  int32_t ids[12];
  for (int i = 0; i < 12; i++) ids[i] = (int32_t)((i * 53 + 5) % V);
  float *a = malloc((size_t)(12 * V) * sizeof(float)),
        *b = malloc((size_t)(12 * V) * sizeof(float));
  assert_non_null(a);
  assert_non_null(b);
  for (int32_t chunk = 0; chunk <= 1; chunk++) {
    check_st(kiln_model_score(mq, ids, 12, chunk, 16, a));
    check_st(kiln_model_score(mr, ids, 12, chunk, 16, b));
    double e = rel_err(a, b, (size_t)(12 * V));
    if (getenv("KILN_TEST_VERBOSE"))
      printf("  %-14s bf16 chunk %d: rel err %.3g\n", name, chunk, e);
    if (!(e <= 3e-2)) fail_msg("%s bf16 chunk %d: relative error %.3g > 3e-2", name, chunk, e);
  }
  free(a);
  free(b);
  kiln_model_free(mq);
  kiln_model_free(mr);
}

static void test_bf16(void **state) {
  (void)state;
  check_bf16("gptq_asym_act");
  check_bf16("gptq_int8_g64");
  check_bf16("awq_g32");
}

/* ---- 3. refusals -------------------------------------------------------------------------- */

/* Rewrites <dir>/config.json's "quant_method": "gptq" block with extra keys. */
static void patch_config(const char *sub, const char *from, const char *to) {
  char path[700];
  snprintf(path, sizeof(path), "%s/%s/config.json", g_dir, sub);
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  char buf[8192];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  char *at = strstr(buf, from);
  assert_non_null(at);
  char out[8400];
  snprintf(out, sizeof(out), "%.*s%s%s", (int)(at - buf), buf, to, at + strlen(from));
  f = fopen(path, "wb");
  assert_non_null(f);
  fputs(out, f);
  fclose(f);
}

static void test_refused(void **state) {
  (void)state;
  kiln_model_t *m = NULL;
  patch_config("gptq_all_k", "\"bits\": 4", "\"bits\": 3");
  expect_err(load("gptq_all_k", KILN_HAL_F32, &m), "quantization_config.bits", "3");
  patch_config("gptq_all_k", "\"bits\": 3", "\"bits\": 4");
  patch_config("awq_g32", "\"version\": \"gemm\"", "\"version\": \"gemv\"");
  expect_err(load("awq_g32", KILN_HAL_F32, &m), "quantization_config.version", "gemv");
  patch_config("awq_g32", "\"version\": \"gemv\"", "\"version\": \"gemm\"");
  /* A config that says 8 bits over 4-bit tensors: the shapes do not match. */
  patch_config("gptq_sym_g32", "\"bits\": 4", "\"bits\": 8");
  expect_err(load("gptq_sym_g32", KILN_HAL_F32, &m), "qweight", "want");
  patch_config("gptq_sym_g32", "\"bits\": 8", "\"bits\": 4");
  assert_null(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gptq_words),
      cmocka_unit_test(test_gptq8_words),
      cmocka_unit_test(test_awq_words),
      cmocka_unit_test(test_bad_tensors),
      cmocka_unit_test(test_gptq_sym_g32),
      cmocka_unit_test(test_gptq_asym_act),
      cmocka_unit_test(test_gptq_asym_act_mixed),
      cmocka_unit_test(test_gptq_int8),
      cmocka_unit_test(test_gptq_all_k),
      cmocka_unit_test(test_awq_g32),
      cmocka_unit_test(test_qwen3),
      cmocka_unit_test(test_bf16),
      cmocka_unit_test(test_refused),
  };
  return cmocka_run_group_tests_name("qlinear", tests, setup, teardown);
}
