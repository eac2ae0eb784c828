/* hal_rank.h - ranking tokens by logit, shared by the CPU backend's sampling ops and
 * libkiln's host sampler (one definition of "better token": larger logit, ties to the lower
 * index, NaN ranks with -inf). Header-only: the plugin and libkiln are separate binaries. */
#ifndef KILN_HAL_RANK_H
#define KILN_HAL_RANK_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

/* A logit as a sort key: NaN ranks with -inf so it never wins. */
static inline float kiln_rank_key(float x) { return x != x ? -INFINITY : x; }

/* Index of the largest logit, the lowest among equals (0 for a row of NaN / -inf). */
static inline int64_t kiln_rank_argmax(const float *x, int64_t V) {
  int64_t best = 0;
  float bv = kiln_rank_key(x[0]);
  for (int64_t v = 1; v < V; v++)
    if (x[v] > bv) {
      bv = x[v];
      best = v;
    }
  return best;
}

/* True when token a ranks after token b. */
static inline bool kiln_rank_worse(const float *x, int32_t a, int32_t b) {
  float ka = kiln_rank_key(x[a]), kb = kiln_rank_key(x[b]);
  return ka < kb || (ka == kb && a > b);
}

static inline void kiln_rank_sift_down(const float *x, int32_t *h, int64_t n, int64_t i) {
  for (;;) {
    int64_t l = 2 * i + 1, r = l + 1, w = i;
    if (l < n && kiln_rank_worse(x, h[l], h[w])) w = l;
    if (r < n && kiln_rank_worse(x, h[r], h[w])) w = r;
    if (w == i) return;
    int32_t t = h[i];
    h[i] = h[w];
    h[w] = t;
    i = w;
  }
}

/* idx[0..m) = the m best tokens of x[0..V) in rank order: a heap of the m best seen, worst on
 * top, so almost every token costs one comparison, then a heap sort. O(V log m); m <= V. */
static inline void kiln_rank_select_top(const float *x, int64_t V, int64_t m, int32_t *idx) {
  if (m <= 0) return;
  for (int64_t i = 0; i < m; i++) idx[i] = (int32_t)i;
  for (int64_t i = m / 2 - 1; i >= 0; i--) kiln_rank_sift_down(x, idx, m, i);
  for (int64_t v = m; v < V; v++)
    if (kiln_rank_worse(x, idx[0], (int32_t)v)) {
      idx[0] = (int32_t)v;
      kiln_rank_sift_down(x, idx, m, 0);
    }
  for (int64_t n = m - 1; n > 0; n--) {
    int32_t t = idx[0];
    idx[0] = idx[n];
    idx[n] = t;
    kiln_rank_sift_down(x, idx, n, 0);
  }
}

#endif /* KILN_HAL_RANK_H */
