/* quant_pack.h - a test-side quantizer for the GGUF block types (kiln/hal_quant.h): packs f32
 * weights into Q4_0, Q8_0, Q4_K, Q5_K and Q6_K blocks byte for byte as the format defines them,
 * with a simple min/max rounding (not llama.cpp's error-minimising search; the format does not
 * care how the integers were chosen). Used by test_quant (round trips) and test_engine (GGUF
 * fixtures). */
#ifndef KILN_TESTS_QUANT_PACK_H
#define KILN_TESTS_QUANT_PACK_H

#include <stdint.h>

/* The integers a block was given, before bit packing, so that a test can recompute the
 * format's values from them without the packing. */
typedef struct quant_ints {
  float d, dmin;  /* the f16 scales, as f32 */
  int32_t q[256]; /* Q4_0 0..15, Q8_0 -127..127, Q4_K 0..15, Q5_K 0..31, Q6_K -32..31 */
  int32_t sc[16]; /* K-quants: 6-bit sub-block scales (Q6_K: int8, 16 of them) */
  int32_t m[8];   /* Q4_K/Q5_K: 6-bit sub-block mins */
} quant_ints_t;

/* Packs one block of fmt (KILN_HAL_QFMT_*) from x[0 .. block_elems) into out
 * (block_bytes); ints, when not NULL, receives the integers chosen. */
void quant_pack_block(int32_t fmt, const float *x, uint8_t *out, quant_ints_t *ints);

/* Packs n values (a multiple of the block) as consecutive blocks. */
void quant_pack_row(int32_t fmt, const float *x, int64_t n, uint8_t *out);

#endif /* KILN_TESTS_QUANT_PACK_H */
