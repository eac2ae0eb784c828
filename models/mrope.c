/* mrope.c - M-RoPE positions of a prompt (see mrope.h). */
#include "models/mrope.h"

#include <stddef.h>

int64_t kiln_mrope_image_tokens(const kiln_model_config_t *c, kiln_mrope_grid_t g) {
  const int64_t ms = c->vision.spatial_merge_size > 0 ? c->vision.spatial_merge_size : 1;
  if (g.t < 1 || g.h < ms || g.w < ms || g.h % ms || g.w % ms) return -1;
  return (int64_t)g.t * (g.h / ms) * (g.w / ms);
}

#define BAD(...) kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "M-RoPE positions: " __VA_ARGS__)

kiln_status_t kiln_mrope_positions(const kiln_model_config_t *c, const int32_t *ids, int32_t n,
                                   const kiln_mrope_grid_t *grids, int32_t num_grids, int32_t *out,
                                   int32_t *out_delta) {
  if (!c->mrope) return BAD("model %s has no M-RoPE", c->architecture);
  if (n < 0 || num_grids < 0 || (n > 0 && (!ids || !out)) || (num_grids > 0 && !grids))
    return BAD("%d ids and %d image grids", n, num_grids);
  const int64_t ms = c->vision.spatial_merge_size;
  const int64_t ts = c->arch == KILN_ARCH_QWEN2_5_VL ? 0 : 1;
  int32_t *pt = out, *ph = out + n, *pw = out + 2 * (ptrdiff_t)n;
  int64_t next = 0, k = 0;
  for (int64_t i = 0; i < n;) {
    if (ids[i] == c->video_token_id)
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "M-RoPE positions: token %lld is a video token (%d): videos are not "
                              "supported yet",
                              (long long)i, ids[i]);
    if (ids[i] != c->image_token_id) {
      pt[i] = ph[i] = pw[i] = (int32_t)next++;
      i++;
      continue;
    }
    if (i == 0 || ids[i - 1] != c->vision_start_token_id)
      return BAD("the image tokens at %lld do not follow <|vision_start|> (%d)", (long long)i,
                 c->vision_start_token_id);
    if (k >= num_grids)
      return BAD("image %lld at token %lld, but only %d image grids were given", (long long)k,
                 (long long)i, num_grids);
    const kiln_mrope_grid_t g = grids[k];
    const int64_t len = kiln_mrope_image_tokens(c, g);
    if (len < 0)
      return BAD("image %lld: grid %d x %d x %d is not whole %lld x %lld merge units", (long long)k,
                 g.t, g.h, g.w, (long long)ms, (long long)ms);
    int64_t run = 0;
    while (i + run < n && ids[i + run] == c->image_token_id) run++;
    if (run != len)
      return BAD(
          "image %lld (grid %d x %d x %d) needs %lld image tokens, the prompt has %lld at "
          "token %lld",
          (long long)k, g.t, g.h, g.w, (long long)len, (long long)run, (long long)i);
    const int64_t gh = g.h / ms, gw = g.w / ms, st = next;
    int64_t mx = st;
    for (int64_t j = 0; j < len; j++) {
      const int64_t ti = j / (gh * gw), hi = (j / gw) % gh, wi = j % gw;
      const int64_t a = st + ti * ts, b = st + hi, d = st + wi;
      if (d > INT32_MAX || b > INT32_MAX || a > INT32_MAX) return BAD("positions overflow");
      pt[i + j] = (int32_t)a;
      ph[i + j] = (int32_t)b;
      pw[i + j] = (int32_t)d;
      if (a > mx) mx = a;
      if (b > mx) mx = b;
      if (d > mx) mx = d;
    }
    next = mx + 1;
    i += len;
    k++;
  }
  if (k != num_grids)
    return BAD("%d image grids for %lld images in the prompt", num_grids, (long long)k);
  if (next > INT32_MAX) return BAD("positions overflow");
  *out_delta = (int32_t)(next - n);
  return NULL;
}
