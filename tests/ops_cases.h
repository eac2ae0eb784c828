/* ops_cases.h - the cmocka tests of the op conformance suite, one per op or concern; main() in
 * test_ops.c runs them on every backend under test (see ops_harness.h). */
#ifndef KILN_TESTS_OPS_CASES_H
#define KILN_TESTS_OPS_CASES_H

/* ops_cases_basic.c */
void test_ops_gemm(void **state);
void test_ops_embedding(void **state);
void test_ops_rmsnorm(void **state);
void test_ops_rope(void **state);
void test_ops_silu_mul(void **state);
void test_ops_add(void **state);
void test_ops_copy(void **state);

/* ops_cases_attention.c */
void test_ops_kv_write(void **state);
void test_ops_kv_write_fp8(void **state);
void test_ops_attention(void **state);
void test_ops_attention_fp8(void **state);
void test_ops_attention_vision(void **state);

/* ops_cases_sampling.c */
void test_ops_argmax(void **state);
void test_ops_topk(void **state);
void test_ops_penalize(void **state);
void test_ops_sample(void **state);
void test_ops_mask_logits(void **state); /* ABI 1.3 */

/* ops_cases_vision.c (ABI 1.2) */
void test_ops_layernorm(void **state);
void test_ops_activation(void **state);
void test_ops_vision_bad_args(void **state);
void test_ops_vision_graphs(void **state);

/* ops_cases_quant.c (ABI 1.4) */
void test_ops_gemm_quant(void **state);

/* ops_cases_misc.c */
void test_ops_graphs(void **state);
void test_ops_bad_args(void **state);

#endif /* KILN_TESTS_OPS_CASES_H */
