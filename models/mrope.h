/* mrope.h - the 3-D rotary positions of a Qwen2-VL prompt (M-RoPE), as transformers'
 * get_rope_index computes them.
 *
 * Text tokens take consecutive positions with t == h == w. An image (announced by
 * <|vision_start|>, then grid_t * grid_h * grid_w / merge^2 image tokens, grid in patches as
 * the image processor's image_grid_thw) takes, for its token at merged grid cell (ti, hi, wi),
 *     (st + ti * ts, st + hi, st + wi)
 * where st is the position the next text token would have had and ts is 1 for Qwen2-VL and 0
 * for Qwen2.5-VL images (its temporal index is frame * second_per_grid_t * tokens_per_second,
 * with second_per_grid_t = 0 for images); the text after it continues from the image's
 * largest position + 1. So positions can run behind the token count: the delta
 * (max position + 1 - n) carries decoding on: a token at KV position p has rotary position
 * p + delta on all three axes.
 */
#ifndef KILN_MODELS_MROPE_H
#define KILN_MODELS_MROPE_H

#include <stdint.h>

#include "base/status.h"
#include "models/model_config.h"

typedef struct kiln_mrope_grid {
  int32_t t, h, w; /* patches (image_grid_thw) */
} kiln_mrope_grid_t;

/* Tokens an image of this grid becomes in the prompt: t * h * w / merge^2; -1 when the grid
 * is not whole merge units (h or w not a multiple of spatial_merge_size, or < 1). */
int64_t kiln_mrope_image_tokens(const kiln_model_config_t *c, kiln_mrope_grid_t g);

/* Positions of the n ids of a prompt holding num_grids images, in order, written to
 * out[3 * n] (every t, then every h, then every w); *out_delta = max + 1 - n (0 for text).
 * Errors (KILN_ERR_INVALID_ARGUMENT, naming the token index): a model without M-RoPE, an image
 * token run not preceded by <|vision_start|>, a run whose length is not its grid's token count,
 * more or fewer runs than grids, video tokens (KILN_ERR_UNSUPPORTED: videos are not supported
 * yet). */
kiln_status_t kiln_mrope_positions(const kiln_model_config_t *c, const int32_t *ids, int32_t n,
                                   const kiln_mrope_grid_t *grids, int32_t num_grids, int32_t *out,
                                   int32_t *out_delta);

#endif /* KILN_MODELS_MROPE_H */
