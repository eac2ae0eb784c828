/* preproc.h - Qwen2-VL / Qwen2.5-VL image preprocessing: an RGB image to the vision tower's
 * flattened patches, matching transformers' slow, PIL-based Qwen2VLImageProcessor.
 *
 * The steps (transformers 5.x Qwen2VLImageProcessorPil._preprocess, 4.x
 * Qwen2VLImageProcessor._preprocess):
 *   1. smart_resize: both sides to multiples of factor = patch_size * merge_size (28) with
 *      the pixel count within [min_pixels, max_pixels] (kiln_vision_smart_resize);
 *   2. resize with PIL's BICUBIC on the uint8 RGB image (kiln_image_resize_bicubic);
 *   3. rescale: x * rescale_factor computed in float64, then cast to float32;
 *   4. normalize: (x - mean) / std in float32 (mean and std cast to float32 first);
 *   5. the image repeated temporal_patch_size times along time (a still image: grid_t = 1) and
 *      cut into patches [grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size^2],
 *      grid_h = resized_h / patch_size, in merge-window order: patches are listed window by
 *      window (merge_size x merge_size patches, row-major inside the window, windows row-major
 *      over the image), and inside a patch the values run channel, time, row, column.
 *
 * Steps 2 and 5 may run on a few threads (kiln_vision_preproc_t.threads); the values do not
 * depend on the thread count.
 *
 * Ownership: kiln_image_patches_t.pixels is malloc'ed and owned by the caller
 * (kiln_image_patches_free). The config is plain data. Thread-safety: no shared state.
 */
#ifndef KILN_MODELS_VISION_PREPROC_H
#define KILN_MODELS_VISION_PREPROC_H

#include <stdbool.h>
#include <stdint.h>

#include "base/json.h"
#include "base/status.h"
#include "models/vision/image.h"

/* The image processor's settings (preprocessor_config.json / processor_config.json). */
typedef struct kiln_vision_preproc {
  int64_t min_pixels, max_pixels; /* size.shortest_edge / longest_edge (56*56, 28*28*1280) */
  int32_t patch_size;             /* 14 */
  int32_t temporal_patch_size;    /* 2 */
  int32_t merge_size;             /* 2 */
  double image_mean[3];           /* OPENAI_CLIP_MEAN */
  double image_std[3];            /* OPENAI_CLIP_STD */
  double rescale_factor;          /* 1/255 */
  int32_t resample;               /* PIL's code; only 3 (BICUBIC) is implemented */
  bool do_resize, do_rescale, do_normalize, do_convert_rgb;
  int32_t threads;  /* not from the file: threads for one image ([model] image_threads); 0 = auto
                       (min(4, online CPUs), fewer for a small image) */
  char source[512]; /* the file the settings came from ("" for the defaults) */
} kiln_vision_preproc_t;

typedef struct kiln_image_patches {
  float *pixels;                  /* [num_patches, patch_dim] */
  int64_t num_patches;            /* grid_t * grid_h * grid_w */
  int64_t patch_dim;              /* 3 * temporal_patch_size * patch_size * patch_size (1176) */
  int32_t grid_t, grid_h, grid_w; /* image_grid_thw, in patches */
  int32_t resized_height, resized_width;
  uint64_t hash[2]; /* kiln_image_hash of the decoded image (not of the patches) */
} kiln_image_patches_t;

/* transformers' defaults for Qwen2VLImageProcessor (what a config that names none gets). */
void kiln_vision_preproc_default(kiln_vision_preproc_t *out);

/* Reads model_dir/preprocessor_config.json, or, when that is absent, model_dir/
 * processor_config.json (transformers 5.x save_pretrained: the image processor's settings are
 * the object under "image_processor"), the order transformers looks in. Keys absent from the
 * file keep the defaults; min_pixels/max_pixels override size.shortest_edge/longest_edge (as
 * in transformers' __init__). Errors: KILN_ERR_NOT_FOUND when neither file exists (a
 * vision-language model cannot run without its processor settings), KILN_ERR_INVALID_ARGUMENT
 * naming the file and key for a wrong type or value, KILN_ERR_UNSUPPORTED for a resample
 * filter other than bicubic. */
kiln_status_t kiln_vision_preproc_load(const char *model_dir, kiln_vision_preproc_t *out);

/* The same from a parsed object (the file's root, or its "image_processor" member: either is
 * accepted); name is used in messages. */
kiln_status_t kiln_vision_preproc_from_json(const kiln_json_t *obj, const char *name,
                                            kiln_vision_preproc_t *out);

/* transformers' smart_resize(height, width, factor, min_pixels, max_pixels), including its
 * rounding (Python's round: half to even; floor when over max_pixels, never below factor; ceil
 * when under min_pixels) and its error for an aspect ratio over 200. Errors:
 * KILN_ERR_INVALID_ARGUMENT ("absolute aspect ratio must be smaller than 200, got 250", a size
 * or factor < 1, a result over KILN_IMAGE_HARD_MAX_SIDE). */
kiln_status_t kiln_vision_smart_resize(int64_t height, int64_t width, int32_t factor,
                                       int64_t min_pixels, int64_t max_pixels, int32_t *out_height,
                                       int32_t *out_width);

/* Runs the steps above on img. *out is zeroed on entry. Errors: KILN_ERR_INVALID_ARGUMENT (the
 * image's aspect ratio; with do_resize off, a side that is not a multiple of patch_size *
 * merge_size), KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_image_preprocess(const kiln_vision_preproc_t *pp, const kiln_image_t *img,
                                    kiln_image_patches_t *out);

/* Steps 3-5 alone, on an image already at its final size (what kiln_image_preprocess runs
 * after the resize; kiln-bench-image times it apart). out->hash is left zero. Errors as
 * kiln_image_preprocess with do_resize off. */
kiln_status_t kiln_image_patchify(const kiln_vision_preproc_t *pp, const kiln_image_t *img,
                                  kiln_image_patches_t *out);

void kiln_image_patches_free(kiln_image_patches_t *p);

/* The language-model tokens the image becomes: grid_t * grid_h * grid_w / merge_size^2. */
int64_t kiln_image_num_tokens(const kiln_image_patches_t *p, int32_t merge_size);

#endif /* KILN_MODELS_VISION_PREPROC_H */
