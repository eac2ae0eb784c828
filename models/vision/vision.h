/* vision.h - the vision tower of a Qwen2-VL / Qwen2.5-VL model: images in, the embeddings of
 * their prompt tokens out.
 *
 * An image arrives as the image processor's patches (Qwen2VLImageProcessor's pixel_values for
 * it): grid_t * grid_h * grid_w rows of C * temporal_patch_size * patch_size^2 floats (3 x 2 x
 * 14 x 14 = 1176), rows in the processor's order (merge units of spatial_merge_size^2
 * neighbouring patches together), each row channel-major then frame, y, x. The tower runs over
 * the HAL (models/vision/vision.c) and writes grid_t * grid_h * grid_w / merge^2 rows of the
 * text hidden size per image, in prompt order: exactly the rows the prompt's image tokens take
 * (kiln_batch_t.embeds).
 *
 *   Qwen2-VL    patch embedding (the Conv3d as a GEMM), blocks of LayerNorm + attention with a
 *               2-D rotary embedding over the whole image + LayerNorm + quick-GELU MLP, then the
 *               patch merger (LayerNorm, MLP over each merge unit's 4 x embed values, GELU).
 *   Qwen2.5-VL  RMSNorm and a SwiGLU MLP with biases; attention within windows of
 *               window_size pixels (the rows permuted so each window is contiguous, the merger
 *               output permuted back) except in the fullatt_block_indexes blocks.
 * Attention is the HAL's paged attention with causal = false: each image (or window) one
 * sequence of a scratch KV pool.
 *
 * Images only: grid_t must be 1 (a video's frames are refused for now).
 */
#ifndef KILN_MODELS_VISION_VISION_H
#define KILN_MODELS_VISION_VISION_H

#include <stdint.h>

#include "base/status.h"
#include "kiln/hal.h"
#include "models/model.h"

typedef struct kiln_vision_image {
  const float *pixels; /* [grid_t * grid_h * grid_w, C * tp * p * p] */
  int32_t grid_t, grid_h, grid_w;
} kiln_vision_image_t;

/* Rows of the tower's output (= prompt tokens) for an image; -1 when its grid is not valid for
 * the model (not whole merge units, or the model has no vision tower). */
int64_t kiln_vision_image_tokens(const kiln_model_t *m, const kiln_vision_image_t *img);

/* Encodes n images into out: a [rows, H] row-major (row stride H) tensor in the model's
 * serving dtype on its device, rows >= the images' tokens together; image i's rows follow
 * image i-1's. Enqueues the work on the model's stream after copying the pixels to its own
 * staging (the caller's pixels may be freed on return); the rows are ready in stream order
 * (before any later forward). Errors: no vision tower, a bad grid (named with the image), a
 * video (grid_t != 1), an output tensor of the wrong shape or dtype, out of memory for the
 * scratch (sized for the largest call so far), device errors. */
kiln_status_t kiln_vision_encode(kiln_model_t *m, const kiln_vision_image_t *images, int32_t n,
                                 kiln_hal_tensor_t out);

#endif /* KILN_MODELS_VISION_VISION_H */
