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

/* The host half of kiln_vision_encode, apart for its tests and kiln-bench-image: n images of
 * grids whole in ms x ms merge units (checked by the caller), patch_dim K and vision head dim
 * Dv (a multiple of 4). Rows run merge unit by merge unit; with vw > 0 (Qwen2.5-VL: window_size
 * / ms / patch_size) in windows of vw x vw units, row-major inside a window, windows row-major
 * over each image; with vw = 0 in the image's order. Fills, for N = the images' patches:
 *   order[N / U]    the source merge unit (counted over all images) of each row's unit;
 *   lens[n + W]     each image's rows, then each window's rows (W windows; none when vw = 0);
 *   pix[N * K]      each row's patch;
 *   rope[N * Dv]    each row's 2-D rotary row: cos(h f_i), cos(w f_i), sin(h f_i), sin(w f_i)
 *                   for the Dv/4 frequencies f_i = 1 / theta^(4i / Dv) (float32, as PyTorch),
 *                   h and w the patch's row and column in its image, h f_i rounded to float32,
 *                   its cosine computed in double and rounded to float32.
 * Errors: KILN_ERR_INVALID_ARGUMENT for a bad geometry or theta. */
kiln_status_t kiln_vision_host_rows(const kiln_vision_image_t *images, int32_t n, int32_t ms,
                                    int32_t vw, int64_t K, int64_t Dv, double theta, float *pix,
                                    float *rope, int32_t *order, int64_t *lens);

#endif /* KILN_MODELS_VISION_VISION_H */
