/* sampler.c - a step's logits rows to tokens and logprobs, on the device or on the host.
 *
 * Which path. hal.h gives capabilities per device index (device_info), and a sampler is handed
 * an open device, not its index; the HAL has no way back from a handle to an index. So the
 * device path is chosen when force_host is false, the backend has the ops it needs
 * (embedding, penalize, topk, sample, the copies and stream_sync) and *every* device the
 * backend lists reports KILN_HAL_CAP_DEVICE_SAMPLING (one device, or a uniform multi-GPU
 * host: the usual cases). A backend whose devices differ falls back to the host path, which
 * is correct everywhere. KILN_HAL_CAP_HOST_MEMORY is read the same way, only to decide
 * whether a host-path sampler needs a buffer to read device rows into; at run time
 * buffer_host_ptr() decides per tensor.
 *
 * Device path, one run (rows are gathered so no row's penalties leak into another's):
 *
 *   staging --copy_h2d--> d_in: gather ids, score token ids, per-row parameters, token lists
 *   embedding(logits, gather ids) -> G [N + M, V] in d_work, rows laid out as
 *       [sample rows without top-N | sample rows with top-N | score rows]
 *              N0                       N1                     M
 *   penalize(G[0, N))                       (only when some row has a penalty or a bias)
 *   topk(G[N0, N + M), k, lse)              (one call: top-N of samples and scores)
 *   sample(G[0, N)) -> ids, logprob         (greedy rows are argmax inside sample)
 *   embedding(G[N, N + M) as a [M*V, 1] table, row*V + token) -> each score token's logit
 *   d_work results --copy_d2h--> staging; stream_sync
 *
 * Host path: the same semantics in C (hal.h's penalize, sample, topk), masses in double.
 * Sampling costs O(V) per row plus a selection over the candidates: every filter of hal.h's
 * rule keeps a prefix of the ranking (p descending, ties by index), so min_p is a threshold
 * test, top_k a quickselect, and top_p a quickselect that carries the mass of the part
 * known to rank first; nothing sorts the vocabulary. The kept set is then put back in index
 * order (a sort when small, a marked scan when large) for the draw.
 *
 * Memory: everything is allocated by kiln_sampler_create except the device path's input
 * staging, which holds the penalty token lists (unbounded: a long prompt under a repetition
 * penalty) and grows geometrically when a run needs more; it never shrinks.
 */
#include "core/sample/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "hal/loader.h"
#include "kiln/hal_rank.h"
#include "kiln/hal_util.h"

/* Token-list capacity (I32 entries) the device path's input staging starts with. */
#define SAMPLER_LIST_CAP0 16384

struct kiln_sampler {
  const kiln_hal_backend_t *be; /* NULL: host only */
  kiln_hal_device_t *device;
  kiln_hal_stream_t *stream;
  bool on_device;
  int32_t max_rows, max_top, vocab;
  int32_t ktop; /* max(max_top, 1): top-k width the device result area is sized for */

  /* Host path scratch. */
  float *x;           /* [V] a penalized copy of one row */
  double *e;          /* [V] exp((x - max) / t) */
  int32_t *cand;      /* [V] candidate tokens */
  int32_t *count;     /* [V] output counts; zero between rows */
  uint8_t *mark;      /* [V] repetition marks, kept flags; zero between rows */
  int32_t *heap;      /* [max_top + 1] top-N selection */
  int64_t *order;     /* [max_rows] (logits row << 32 | request row), for de-duplication */
  int32_t *slot;      /* [max_rows] request row -> slot (host rows read, device G row) */
  const float **rowp; /* [max_rows] request row -> its logits on the host */
  float *rows;        /* [max_rows, V] rows read from a device tensor; NULL when never needed */

  /* Device path. */
  kiln_hal_buffer_t *d_work; /* G [max_rows, V] F32, then the result area */
  uint64_t g_bytes;          /* where the result area starts in d_work */
  uint64_t out_bytes;        /* size of the result area */
  kiln_hal_buffer_t *d_in;   /* inputs of a run: in_cap bytes */
  uint64_t in_cap;
  kiln_hal_buffer_t *h_pin; /* pinned staging (out_bytes + in_cap), or NULL */
  void *h_stage;            /* host staging: results, then inputs */
  bool h_stage_malloced;
};

/* ============================================================================================
 * Small helpers
 * ==========================================================================================*/

static kiln_status_t oom(const char *what, uint64_t bytes) {
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "sampler: cannot allocate %llu bytes for %s",
                          (unsigned long long)bytes, what);
}

static void *xmalloc(size_t n, size_t size, const char *what, kiln_status_t *st) {
  if (*st) return NULL;
  size_t bytes = n * size;
  if (size && n > SIZE_MAX / size) bytes = SIZE_MAX;
  void *p = bytes == SIZE_MAX ? NULL : malloc(bytes ? bytes : 1);
  if (!p) *st = oom(what, bytes);
  return p;
}

/* logsumexp of a row in double (NaN entries count as -inf). */
static double row_lse(const float *x, int32_t V) {
  double mx = kiln_rank_key(x[kiln_rank_argmax(x, V)]);
  if (mx == -INFINITY || mx == INFINITY) return mx;
  double sum = 0.0;
  for (int32_t v = 0; v < V; v++)
    if (x[v] == x[v]) sum += exp((double)x[v] - mx);
  return sum > 0.0 ? mx + log(sum) : mx; /* sum >= 1: the maximum adds exp(0) */
}

/* ============================================================================================
 * Host path: top-N (by logit, ties by index)
 * ==========================================================================================*/

/* idx[0..k) = the k best tokens of x[0..V) in rank order (kiln/hal_rank.h, the CPU
 * backend's ranking too). */
static void top_n(const float *x, int32_t V, int32_t k, int32_t *idx) {
  kiln_rank_select_top(x, V, k, idx);
}

/* ============================================================================================
 * Host path: penalties (hal.h's penalize, f32 arithmetic as the CPU backend does it)
 * ==========================================================================================*/

static bool row_penalized(const kiln_sample_row_t *r) {
  return (r->repetition != 1.0f && r->num_prompt + r->num_output > 0) ||
         ((r->frequency != 0.0f || r->presence != 0.0f) && r->num_output > 0) || r->num_bias > 0 ||
         r->mask;
}

/* Tokens a row's mask bans (hal.h's mask_logits), counted. */
static int64_t mask_banned(const uint32_t *mask, int32_t V) {
  int64_t allowed = 0;
  for (int32_t w = 0; w < (V + 31) / 32; w++) {
    uint32_t bits = mask[w];
    if (w == (V - 1) / 32 && V % 32) bits &= (1u << (V % 32)) - 1;
    allowed += __builtin_popcount(bits);
  }
  return V - allowed;
}

static void host_penalize(kiln_sampler_t *s, float *x, const kiln_sample_row_t *r) {
  const int32_t V = s->vocab;
  uint8_t *mark = s->mark;
  int32_t *count = s->count;
  if (r->repetition != 1.0f) {
    const float rep = r->repetition;
    const int32_t *lists[2] = {r->prompt_ids, r->output_ids};
    const int32_t lens[2] = {r->num_prompt, r->num_output};
    for (int l = 0; l < 2; l++)
      for (int32_t i = 0; i < lens[l]; i++) {
        int32_t id = lists[l][i];
        if (id < 0 || id >= V || mark[id]) continue;
        mark[id] = 1;
        x[id] = x[id] > 0.0f ? x[id] / rep : x[id] * rep;
      }
    for (int l = 0; l < 2; l++)
      for (int32_t i = 0; i < lens[l]; i++) {
        int32_t id = lists[l][i];
        if (id >= 0 && id < V) mark[id] = 0;
      }
  }
  if (r->frequency != 0.0f || r->presence != 0.0f) {
    for (int32_t i = 0; i < r->num_output; i++) {
      int32_t id = r->output_ids[i];
      if (id >= 0 && id < V) count[id]++;
    }
    for (int32_t i = 0; i < r->num_output; i++) {
      int32_t id = r->output_ids[i];
      if (id < 0 || id >= V || count[id] == 0) continue;
      x[id] -= r->frequency * (float)count[id] + r->presence;
      count[id] = 0;
    }
  }
  for (int32_t i = 0; i < r->num_bias; i++) {
    int32_t id = r->bias_ids[i];
    if (id >= 0 && id < V) x[id] += r->bias_values[i];
  }
  if (r->mask)
    for (int32_t v = 0; v < V; v++)
      if (!((r->mask[v >> 5] >> (v & 31)) & 1)) x[v] = -INFINITY;
}

/* ============================================================================================
 * Host path: the draw (hal.h's sample rule)
 * ==========================================================================================*/

/* True when token a ranks before token b by probability (e), ties by lower index. */
static inline bool ranks_before(const double *e, int32_t a, int32_t b) {
  const double ea = e[a], eb = e[b];
  return ea > eb || (ea == eb && a < b);
}

static inline void swap32(int32_t *c, int32_t i, int32_t j) {
  int32_t t = c[i];
  c[i] = c[j];
  c[j] = t;
}

static void insertion_sort_rank(const double *e, int32_t *c, int32_t n) {
  for (int32_t i = 1; i < n; i++) {
    int32_t v = c[i], j = i;
    while (j > 0 && ranks_before(e, v, c[j - 1])) {
      c[j] = c[j - 1];
      j--;
    }
    c[j] = v;
  }
}

/* Partitions c[lo, hi) around a median-of-three pivot: afterwards c[lo, p) rank before
 * c[p] and c(p, hi) after it. Returns p. Keys are distinct (the index breaks ties). */
static int32_t partition_rank(const double *e, int32_t *c, int32_t lo, int32_t hi) {
  int32_t mid = lo + (hi - lo) / 2, last = hi - 1;
  if (ranks_before(e, c[mid], c[lo])) swap32(c, mid, lo);
  if (ranks_before(e, c[last], c[lo])) swap32(c, last, lo);
  if (ranks_before(e, c[last], c[mid])) swap32(c, last, mid);
  swap32(c, mid, last); /* the median is the pivot, parked at the end */
  int32_t pv = c[last], p = lo;
  for (int32_t i = lo; i < last; i++)
    if (ranks_before(e, c[i], pv)) swap32(c, i, p++);
  swap32(c, p, last);
  return p;
}

/* Heap sort of c[lo, hi) by rank: the fallback that bounds a degenerate quickselect. */
static void sift_rank(const double *e, int32_t *h, int32_t n, int32_t i) {
  for (;;) {
    int32_t l = 2 * i + 1, r = l + 1, w = i;
    if (l < n && ranks_before(e, h[w], h[l])) w = l;
    if (r < n && ranks_before(e, h[w], h[r])) w = r;
    if (w == i) return;
    swap32(h, i, w);
    i = w;
  }
}
static void heap_sort_rank(const double *e, int32_t *c, int32_t n) {
  for (int32_t i = n / 2 - 1; i >= 0; i--) sift_rank(e, c, n, i);
  for (int32_t m = n - 1; m > 0; m--) {
    swap32(c, 0, m);
    sift_rank(e, c, m, 0);
  }
}

static int32_t depth_limit(int32_t n) {
  int32_t d = 8;
  while (n > 1) {
    n >>= 1;
    d += 2;
  }
  return d;
}

/* Rearranges c[0, n) so that c[0, k) holds the k best-ranked (in any order). 0 < k < n. */
static void select_rank(const double *e, int32_t *c, int32_t n, int32_t k) {
  int32_t lo = 0, hi = n, depth = depth_limit(n);
  while (hi - lo > 16) {
    if (depth-- == 0) {
      heap_sort_rank(e, c + lo, hi - lo);
      return;
    }
    int32_t p = partition_rank(e, c, lo, hi);
    if (p == k || p + 1 == k) return;
    if (p > k)
      hi = p;
    else
      lo = p + 1;
  }
  insertion_sort_rank(e, c + lo, hi - lo);
}

/* c[0, n) holds, as a set, the ranks that follow tokens of mass `before` (< tpz) in the
 * ranking. Returns the smallest m >= 1 such that before plus the mass of c's best m tokens
 * reaches tpz (top_p * Z in e units), or n if none, and leaves those m tokens in c[0, m):
 * hal.h keeps a token iff mass_before < top_p, so exactly these m of c are kept.
 * A quickselect that carries `before`, the mass of everything ranked before c[lo, hi). */
static int32_t top_p_cut(const double *e, int32_t *c, int32_t n, double before, double tpz) {
  int32_t lo = 0, hi = n, depth = depth_limit(n);
  while (hi - lo > 16 && depth > 0) {
    depth--;
    int32_t p = partition_rank(e, c, lo, hi);
    double left = 0.0;
    for (int32_t i = lo; i < p; i++) left += e[c[i]];
    if (before + left >= tpz) {
      hi = p; /* reached inside c[lo, p) (not empty: before < tpz) */
    } else if (before + left + e[c[p]] >= tpz) {
      return p + 1;
    } else {
      before += left + e[c[p]];
      lo = p + 1;
    }
  }
  if (hi - lo > 16)
    heap_sort_rank(e, c + lo, hi - lo);
  else
    insertion_sort_rank(e, c + lo, hi - lo);
  for (int32_t i = lo; i < hi; i++) {
    before += e[c[i]];
    if (before >= tpz) return i + 1;
  }
  return hi; /* rounding fell short of tpz in a part whose sum (another order) reached it */
}

static int cmp_i32(const void *pa, const void *pb) {
  int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
  return (a > b) - (a < b);
}

/* Mass buckets, 8 per octave down to 2^-63: for b < SAMPLER_BUCKETS - 1, bucket b holds e in
 * [bucket_floor(b), bucket_floor(b - 1)); the last bucket holds everything below 2^-62 (and
 * zero). A token of a lower bucket has a strictly larger e, so it ranks before every token of
 * a higher bucket: per-bucket counts and masses bound the top_k and top_p cuts. */
#define SAMPLER_BUCKETS (63 * 8 + 1)

static inline int32_t mass_bucket(double ev) {
  uint64_t bits;
  memcpy(&bits, &ev, sizeof(bits));
  int32_t oct = 1023 - (int32_t)(bits >> 52); /* ev in [0, 1]: sign 0, exponent <= 1023 */
  if (oct >= 63) return SAMPLER_BUCKETS - 1;
  return oct * 8 + 7 - (int32_t)((bits >> 49) & 7); /* larger mantissa, lower bucket */
}

/* The smallest e of bucket b < SAMPLER_BUCKETS - 1. */
static inline double bucket_floor(int32_t b) {
  return ldexp(1.0 + (double)(7 - (b & 7)) / 8.0, -(b >> 3));
}

/* One row of hal.h's sample rule on host logits x[0, V). *out_lse receives logsumexp(x)
 * when it comes for free (temperature 1), else NaN. */
static int32_t host_sample_row(kiln_sampler_t *s, const float *x, const kiln_sample_row_t *r,
                               double *out_lse) {
  const int32_t V = s->vocab;
  const int32_t imax = (int32_t)kiln_rank_argmax(x, V);
  const double xmax = kiln_rank_key(x[imax]);
  *out_lse = NAN;
  /* top_p <= 0 keeps only the most probable token (always kept). */
  if (!(r->temperature > 0.0f) || r->top_p <= 0.0f || xmax == -INFINITY || xmax == INFINITY)
    return imax;
  double *e = s->e;
  int32_t *cand = s->cand;
  const double it = 1.0 / (double)r->temperature;
  /* e[v] = p[v] * Z with e[imax] = 1, so p >= min_p * max(p) reads e >= min_p. */
  double Z = 0.0, bmass[SAMPLER_BUCKETS] = {0};
  int32_t bcount[SAMPLER_BUCKETS] = {0};
  for (int32_t v = 0; v < V; v++) {
    double ev = x[v] == x[v] ? exp(((double)x[v] - xmax) * it) : 0.0;
    int32_t b = mass_bucket(ev);
    e[v] = ev;
    Z += ev;
    bmass[b] += ev;
    bcount[b]++;
  }
  if (r->temperature == 1.0f) *out_lse = xmax + log(Z);
  const bool use_k = r->top_k > 0 && r->top_k < V, use_p = r->top_p < 1.0f;
  const double tpz = (double)r->top_p * Z, slack = 1e-9 * Z; /* slack: room for rounding */
  /* hi: every token of a bucket above it is cut (the buckets up to hi hold top_k tokens, or
   * top_p of the mass). lo: every token of a bucket up to lo passes top_k and top_p (fewer
   * than top_k tokens, and less than top_p of the mass, up to and including it). */
  int32_t hi = SAMPLER_BUCKETS - 1, lo = SAMPLER_BUCKETS - 1;
  if (use_k || use_p) {
    int64_t c = 0;
    double m = 0.0;
    lo = -1;
    for (int32_t b = 0; b < SAMPLER_BUCKETS - 1; b++) {
      c += bcount[b];
      m += bmass[b];
      bool over = (use_k && c >= r->top_k) || (use_p && m >= tpz + slack);
      bool under = (!use_k || c < r->top_k) && (!use_p || m < tpz - slack);
      if (under) lo = b;
      if (over) {
        hi = b;
        break;
      }
    }
  }
  /* Candidates: the most probable token always, else e > 0 (a zero-mass token can never be
   * drawn, wherever the filters put it), min_p, and not cut by hi. Those of buckets up to lo
   * are kept for sure ("fixed", in index order at the front); the rest gather at the back. */
  double thr = hi < SAMPLER_BUCKETS - 1 ? bucket_floor(hi) : 0.0;
  if (r->min_p > 0.0f && (double)r->min_p > thr) thr = (double)r->min_p;
  const double fix = lo < 0 ? INFINITY : lo < SAMPLER_BUCKETS - 1 ? bucket_floor(lo) : 0.0;
  int32_t nf = 0, nr = 0;
  double before = 0.0; /* mass of the fixed tokens, all ranked before the rest */
  for (int32_t v = 0; v < V; v++) {
    double ev = e[v];
    if (!((ev > 0.0 && ev >= thr) || v == imax)) continue;
    if (ev >= fix) {
      cand[nf++] = v;
      before += ev;
    } else {
      cand[V - 1 - nr++] = v;
    }
  }
  int32_t n = nf;
  if (nr > 0) {
    int32_t *rest = cand + nf;
    memmove(rest, cand + V - nr, (size_t)nr * sizeof(int32_t));
    if (use_k && r->top_k - nf < nr) {
      select_rank(e, rest, nr, r->top_k - nf); /* top_k - nf >= 1: lo is below top_k */
      nr = r->top_k - nf;
    }
    if (use_p) nr = top_p_cut(e, rest, nr, before, tpz);
    n = nf + nr;
    /* Back to index order for the draw. */
    if ((int64_t)n * 32 < V) {
      qsort(cand, (size_t)n, sizeof(int32_t), cmp_i32);
    } else {
      for (int32_t i = 0; i < n; i++) s->mark[cand[i]] = 1;
      int32_t m = 0;
      for (int32_t v = 0; v < V; v++)
        if (s->mark[v]) {
          s->mark[v] = 0;
          cand[m++] = v;
        }
    }
  }
  double W = 0.0;
  for (int32_t i = 0; i < n; i++) W += e[cand[i]];
  const double target = (double)r->uniform * W;
  double cum = 0.0;
  for (int32_t i = 0; i < n; i++) {
    cum += e[cand[i]];
    if (cum > target) return cand[i];
  }
  return cand[n - 1]; /* unreachable: the last cum is W > target */
}

/* ============================================================================================
 * Validation
 * ==========================================================================================*/

static kiln_status_t bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static kiln_status_t bad(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_status_t st = kiln_status_makev(KILN_ERR_INVALID_ARGUMENT, fmt, ap);
  va_end(ap);
  return kiln_status_annotate(st, "sampler");
}

static kiln_status_t check_list(int32_t i, const char *name, const void *ids, int32_t n,
                                const char *vname, const void *values) {
  if (n < 0) return bad("samples[%d].num_%s = %d, want >= 0", (int)i, name, (int)n);
  if (n > 0 && !ids)
    return bad("samples[%d].%s_ids is NULL with num_%s = %d", (int)i, name, name, (int)n);
  if (vname && n > 0 && !values)
    return bad("samples[%d].%s is NULL with num_%s = %d", (int)i, vname, name, (int)n);
  return NULL;
}

static kiln_status_t validate(const kiln_sampler_t *s, const kiln_sample_logits_t *lg,
                              const kiln_sample_row_t *samples, int32_t ns,
                              const kiln_score_row_t *scores, int32_t nc,
                              const kiln_sample_out_t *out) {
  if (!lg || !out) return bad("logits and out must not be NULL");
  if (ns < 0 || nc < 0)
    return bad("num_samples = %d, num_scores = %d, want >= 0", (int)ns, (int)nc);
  if ((int64_t)ns + nc > s->max_rows)
    return bad("%d sample rows + %d score rows exceed max_rows = %d", (int)ns, (int)nc,
               (int)s->max_rows);
  if (ns + nc == 0) return NULL;
  if ((ns > 0 && !samples) || (nc > 0 && !scores)) return bad("samples or scores is NULL");
  const int32_t R = lg->num_rows, V = s->vocab;
  if (R < 0) return bad("logits->num_rows = %d, want >= 0", (int)R);
  if (!lg->host && !lg->tensor.buffer) return bad("logits has neither host rows nor a tensor");
  if (lg->tensor.buffer && (s->on_device || !lg->host)) { /* the tensor will be read */
    const kiln_hal_tensor_t *t = &lg->tensor;
    if (!s->be) return bad("logits is a device tensor but the sampler has no backend");
    if (t->dtype != KILN_HAL_F32 || t->ndim != 2 || t->shape[1] != V ||
        (V > 1 && t->stride[1] != 1) || t->shape[0] < R || t->stride[0] < 0)
      return bad(
          "logits tensor is %s [%lld, %lld] with strides [%lld, %lld], want f32 "
          "[>= %d, %d] contiguous in its last dimension",
          kiln_hal_dtype_name(t->dtype), (long long)t->shape[0], (long long)t->shape[1],
          (long long)t->stride[0], (long long)t->stride[1], (int)R, (int)V);
  }
  bool want_lp = false, want_top = false;
  for (int32_t i = 0; i < ns; i++) {
    const kiln_sample_row_t *r = &samples[i];
    kiln_status_t st;
    if (r->logits_row < 0 || r->logits_row >= R)
      return bad("samples[%d].logits_row = %d is outside [0, %d)", (int)i, (int)r->logits_row,
                 (int)R);
    if (r->num_top < -1 || r->num_top > s->max_top || r->num_top > V)
      return bad("samples[%d].num_top = %d, want -1..%d (max_top %d, vocabulary %d)", (int)i,
                 (int)r->num_top, (int)(s->max_top < V ? s->max_top : V), (int)s->max_top, (int)V);
    if (r->temperature != r->temperature) return bad("samples[%d].temperature is NaN", (int)i);
    if (r->top_k < 0) return bad("samples[%d].top_k = %d, want >= 0", (int)i, (int)r->top_k);
    if (r->top_p != r->top_p) return bad("samples[%d].top_p is NaN", (int)i);
    if (r->min_p != r->min_p) return bad("samples[%d].min_p is NaN", (int)i);
    if (!(r->repetition > 0.0f && r->repetition <= 3.4e38f))
      return bad("samples[%d].repetition = %g, want a finite value > 0", (int)i,
                 (double)r->repetition);
    if (!isfinite(r->frequency) || !isfinite(r->presence))
      return bad("samples[%d].frequency = %g, presence = %g, want finite values", (int)i,
                 (double)r->frequency, (double)r->presence);
    if (!(r->uniform >= 0.0f && r->uniform < 1.0f))
      return bad("samples[%d].uniform = %.9g is outside [0, 1)", (int)i, (double)r->uniform);
    if ((st = check_list(i, "prompt", r->prompt_ids, r->num_prompt, NULL, NULL)) ||
        (st = check_list(i, "output", r->output_ids, r->num_output, NULL, NULL)) ||
        (st = check_list(i, "bias", r->bias_ids, r->num_bias, "bias_values", r->bias_values)))
      return st;
    for (int32_t b = 0; b < r->num_bias; b++)
      if (r->bias_values[b] != r->bias_values[b])
        return bad("samples[%d].bias_values[%d] is NaN", (int)i, (int)b);
    want_lp |= r->num_top >= 0;
    want_top |= r->num_top > 0;
  }
  bool want_stop = false;
  for (int32_t j = 0; j < nc; j++) {
    const kiln_score_row_t *c = &scores[j];
    if (c->logits_row < 0 || c->logits_row >= R)
      return bad("scores[%d].logits_row = %d is outside [0, %d)", (int)j, (int)c->logits_row,
                 (int)R);
    if (c->token < 0 || c->token >= V)
      return bad("scores[%d].token = %d is outside the vocabulary [0, %d)", (int)j, (int)c->token,
                 (int)V);
    if (c->num_top < 0 || c->num_top > s->max_top || c->num_top > V)
      return bad("scores[%d].num_top = %d, want 0..%d (max_top %d, vocabulary %d)", (int)j,
                 (int)c->num_top, (int)(s->max_top < V ? s->max_top : V), (int)s->max_top, (int)V);
    want_stop |= c->num_top > 0;
  }
  if (ns > 0 && !out->tokens) return bad("out->tokens is NULL");
  if (want_lp && !out->logprobs)
    return bad("out->logprobs is NULL but a sample row wants logprobs");
  if (want_top && (!out->top_ids || !out->top_logprobs))
    return bad("out->top_ids / out->top_logprobs is NULL but a sample row has num_top > 0");
  if (nc > 0 && !out->score_logprobs) return bad("out->score_logprobs is NULL");
  if (want_stop && (!out->score_top_ids || !out->score_top_logprobs))
    return bad(
        "out->score_top_ids / out->score_top_logprobs is NULL but a score row has "
        "num_top > 0");
  return NULL;
}

/* ============================================================================================
 * Host path
 * ==========================================================================================*/

static int cmp_i64(const void *pa, const void *pb) {
  int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
  return (a > b) - (a < b);
}

kiln_status_t kiln_sampler_read_row(kiln_sampler_t *s, const kiln_sample_logits_t *lg,
                                    int32_t row, float *dst) {
  const int32_t V = s->vocab;
  if (row < 0 || row >= lg->num_rows)
    return bad("read_row: row %d outside [0, %d)", (int)row, (int)lg->num_rows);
  if (lg->host) {
    memcpy(dst, lg->host + (int64_t)row * V, (size_t)V * sizeof(float));
    return NULL;
  }
  if (!lg->tensor.buffer) return bad("logits has neither host rows nor a tensor");
  if (!s->be) return bad("logits is a device tensor but the sampler has no backend");
  const kiln_hal_tensor_t *t = &lg->tensor;
  kiln_hal_error_t *e = s->be->stream_sync(s->stream);
  if (e) return kiln_hal_status_from_error(e, "sampler: stream_sync");
  char *hp = s->be->buffer_host_ptr ? s->be->buffer_host_ptr(t->buffer) : NULL;
  uint64_t off = t->offset + (uint64_t)row * (uint64_t)t->stride[0] * sizeof(float);
  if (hp) {
    memcpy(dst, hp + off, (size_t)V * sizeof(float));
    return NULL;
  }
  e = s->be->copy_d2h(s->stream, dst, t->buffer, off, (uint64_t)V * sizeof(float));
  if (!e) e = s->be->stream_sync(s->stream);
  if (e) {
    kiln_status_t st = kiln_hal_status_from_error(e, "sampler: reading a logits row");
    kiln_hal_error_free(s->be->stream_sync(s->stream));
    return st;
  }
  return NULL;
}

/* Points s->rowp[i] (i over samples then scores) at each request row's logits on the host:
 * the caller's host array, the tensor's own memory when it is host-visible, or copies read
 * into s->rows (each distinct row once; consecutive rows of a dense tensor in one copy). */
static kiln_status_t host_rows(kiln_sampler_t *s, const kiln_sample_logits_t *lg,
                               const kiln_sample_row_t *samples, int32_t ns,
                               const kiln_score_row_t *scores, int32_t nc) {
  const int32_t V = s->vocab, n = ns + nc;
  const float *base = lg->host;
  int64_t stride = V;
  kiln_hal_error_t *e = NULL;
  if (!base) {
    const kiln_hal_tensor_t *t = &lg->tensor;
    char *hp = s->be->buffer_host_ptr ? s->be->buffer_host_ptr(t->buffer) : NULL;
    /* Ops enqueued before us may still be writing the logits on an asynchronous device. */
    if ((e = s->be->stream_sync(s->stream)))
      return kiln_hal_status_from_error(e, "sampler: stream_sync");
    stride = t->stride[0];
    if (hp) {
      base = (const float *)(const void *)(hp + t->offset);
    } else {
      if (!s->rows)
        return kiln_status_make(KILN_ERR_INTERNAL,
                                "sampler: logits buffer is not host-visible "
                                "but the backend reported host memory");
      for (int32_t i = 0; i < n; i++) {
        int32_t row = i < ns ? samples[i].logits_row : scores[i - ns].logits_row;
        s->order[i] = (int64_t)row << 32 | i;
      }
      qsort(s->order, (size_t)n, sizeof(int64_t), cmp_i64);
      const bool dense = stride == V;
      int32_t slots = 0;
      for (int32_t a = 0; a < n && !e;) {
        /* A run: one logits row, or consecutive rows of a dense tensor: one copy. Repeats of a
         * row share its slot. */
        const int32_t first = slots, row0 = (int32_t)(s->order[a] >> 32);
        int32_t cur = -1, b = a;
        for (; b < n; b++) {
          int32_t rb = (int32_t)(s->order[b] >> 32), i = (int32_t)(s->order[b] & 0xffffffff);
          if (cur >= 0 && rb == cur) {
            s->slot[i] = slots - 1;
          } else if (cur < 0 || (dense && rb == cur + 1)) {
            s->slot[i] = slots++;
            cur = rb;
          } else {
            break;
          }
        }
        e = s->be->copy_d2h(s->stream, s->rows + (int64_t)first * V, t->buffer,
                            t->offset + (uint64_t)row0 * (uint64_t)stride * sizeof(float),
                            (uint64_t)(slots - first) * (uint64_t)V * sizeof(float));
        a = b;
      }
      if (!e) e = s->be->stream_sync(s->stream);
      if (e) {
        kiln_status_t st = kiln_hal_status_from_error(e, "sampler: reading logits rows");
        kiln_hal_error_free(s->be->stream_sync(s->stream)); /* no copy may still be pending */
        return st;
      }
      for (int32_t i = 0; i < n; i++) s->rowp[i] = s->rows + (int64_t)s->slot[i] * V;
      return NULL;
    }
  }
  for (int32_t i = 0; i < n; i++) {
    int32_t row = i < ns ? samples[i].logits_row : scores[i - ns].logits_row;
    s->rowp[i] = base + (int64_t)row * stride;
  }
  return NULL;
}

/* Fills top ids / logprobs of a row: x's best k, logprob = value - lse. */
static void host_top(kiln_sampler_t *s, const float *x, double lse, int32_t k, int32_t *ids,
                     float *lps) {
  top_n(x, s->vocab, k, s->heap);
  for (int32_t i = 0; i < k; i++) {
    ids[i] = s->heap[i];
    lps[i] = (float)((double)x[s->heap[i]] - lse);
  }
}

static kiln_status_t host_run(kiln_sampler_t *s, const kiln_sample_logits_t *lg,
                              const kiln_sample_row_t *samples, int32_t ns,
                              const kiln_score_row_t *scores, int32_t nc, kiln_sample_out_t *out) {
  kiln_status_t st = host_rows(s, lg, samples, ns, scores, nc);
  if (st) return st;
  const int32_t V = s->vocab;
  for (int32_t i = 0; i < ns; i++) {
    const kiln_sample_row_t *r = &samples[i];
    const float *x = s->rowp[i];
    if (row_penalized(r)) {
      memcpy(s->x, x, (size_t)V * sizeof(float));
      host_penalize(s, s->x, r);
      x = s->x;
    }
    double lse;
    int32_t tok = host_sample_row(s, x, r, &lse);
    out->tokens[i] = tok;
    if (r->num_top < 0) {
      if (out->logprobs) out->logprobs[i] = 0.0f;
      continue;
    }
    if (lse != lse) lse = row_lse(x, V);
    out->logprobs[i] = (float)((double)x[tok] - lse);
    if (r->num_top > 0)
      host_top(s, x, lse, r->num_top, out->top_ids + (int64_t)i * s->max_top,
               out->top_logprobs + (int64_t)i * s->max_top);
  }
  for (int32_t j = 0; j < nc; j++) {
    const kiln_score_row_t *c = &scores[j];
    const float *x = s->rowp[ns + j];
    double lse = row_lse(x, V);
    out->score_logprobs[j] = (float)((double)x[c->token] - lse);
    if (c->num_top > 0)
      host_top(s, x, lse, c->num_top, out->score_top_ids + (int64_t)j * s->max_top,
               out->score_top_logprobs + (int64_t)j * s->max_top);
  }
  return NULL;
}

/* ============================================================================================
 * Device path
 * ==========================================================================================*/

static void stage_free(kiln_sampler_t *s) {
  if (s->h_pin) s->be->buffer_free(s->h_pin);
  if (s->h_stage_malloced) free(s->h_stage);
  if (s->d_in) s->be->buffer_free(s->d_in);
  s->h_pin = NULL;
  s->h_stage = NULL;
  s->h_stage_malloced = false;
  s->d_in = NULL;
  s->in_cap = 0;
}

/* (Re)allocates the input staging for in_cap bytes: d_in on the device, and the host side
 * (results, then inputs) in pinned memory when the backend gives it, else malloc. */
static kiln_status_t stage_alloc(kiln_sampler_t *s, uint64_t in_cap) {
  stage_free(s);
  const kiln_hal_backend_t *be = s->be;
  uint64_t host_bytes = s->out_bytes + in_cap;
  kiln_hal_error_t *e = be->buffer_alloc(s->device, in_cap, KILN_HAL_BUFFER_DEFAULT, &s->d_in);
  if (e) {
    s->d_in = NULL;
    return kiln_hal_status_from_error(e, "sampler: allocating the input staging");
  }
  if (be->buffer_host_ptr) {
    e = be->buffer_alloc(s->device, host_bytes, KILN_HAL_BUFFER_HOST_PINNED, &s->h_pin);
    if (e) {
      kiln_hal_error_free(e); /* no pinned memory: malloc below */
      s->h_pin = NULL;
    } else if (!(s->h_stage = be->buffer_host_ptr(s->h_pin))) {
      be->buffer_free(s->h_pin);
      s->h_pin = NULL;
    }
  }
  if (!s->h_stage) {
    if (host_bytes > SIZE_MAX || !(s->h_stage = malloc((size_t)host_bytes))) {
      stage_free(s);
      return oom("the host staging", host_bytes);
    }
    s->h_stage_malloced = true;
  }
  memset(s->h_stage, 0, (size_t)host_bytes); /* section padding is uploaded too */
  s->in_cap = in_cap;
  return NULL;
}

/* One device run: the slots of G, which op groups run, and where every input and result
 * lives. Input offsets are bytes into d_in (and into the staging after the result area);
 * result offsets are bytes after G in d_work (and from the start of the staging). */
typedef struct dev_plan {
  int32_t ns, nc;
  int32_t n0, n1; /* sample rows without / with top-N: G rows [0, n0), [n0, ns) */
  int32_t nt, k;  /* topk over G rows [n0, ns + nc): nt rows, k wide */
  int32_t chunk;  /* score rows per token-logit gather (the flat index must fit in I32) */
  bool any_rep, any_freq, any_bias, any_lp, any_k, any_p, any_m;
  int64_t np, no, nb; /* token-list lengths (each list holds at least one entry) */
  int32_t nmask;      /* rows with a token mask */
  bool mask_op;       /* masks through mask_logits (else as -inf biases) */
  uint64_t gather, tok, temp, uni, topk, topp, minp, rep, freq, pres;
  uint64_t poff, ooff, boff, pids, oids, bids, bval, mrows, masks, in_bytes;
  uint64_t ids, lp, lse, toklogit, vals, tids, out_bytes;
} dev_plan_t;

/* A bump allocator of 4-byte words, each section 16-byte aligned. */
static uint64_t lay(uint64_t *at, int64_t words) {
  uint64_t o = *at;
  *at += ((uint64_t)words * 4 + 15) & ~(uint64_t)15;
  return o;
}

static kiln_hal_tensor_t vec(kiln_hal_buffer_t *b, uint64_t off, int32_t dtype, int64_t n) {
  return kiln_hal_tensor_make(b, off, dtype, 1, &n);
}

static kiln_hal_tensor_t mat(kiln_hal_buffer_t *b, uint64_t off, int32_t dtype, int64_t r,
                             int64_t c) {
  int64_t shape[2] = {r, c};
  return kiln_hal_tensor_make(b, off, dtype, 2, shape);
}

static bool row_rep(const kiln_sample_row_t *r) {
  return r->repetition != 1.0f && r->num_prompt + r->num_output > 0;
}
static bool row_freq(const kiln_sample_row_t *r) {
  return (r->frequency != 0.0f || r->presence != 0.0f) && r->num_output > 0;
}

/* Assigns slots (s->slot: request row -> G row; s->order: G row -> sample row) and lays out
 * the run. Errors: token lists too long for I32 offsets. */
static kiln_status_t dev_plan(kiln_sampler_t *s, const kiln_sample_row_t *samples, int32_t ns,
                              const kiln_score_row_t *scores, int32_t nc, dev_plan_t *p) {
  memset(p, 0, sizeof(*p));
  p->ns = ns;
  p->nc = nc;
  p->k = 1;
  for (int32_t i = 0; i < ns; i++) p->n0 += samples[i].num_top <= 0;
  for (int32_t i = 0, a = 0, b = p->n0; i < ns; i++) {
    const kiln_sample_row_t *r = &samples[i];
    s->slot[i] = r->num_top <= 0 ? a++ : b++;
    s->order[s->slot[i]] = i;
    if (r->num_top > p->k) p->k = r->num_top;
    p->any_rep |= row_rep(r);
    p->any_freq |= row_freq(r);
    p->any_bias |= r->num_bias > 0;
    p->any_lp |= r->num_top >= 0;
    p->any_k |= r->top_k > 0;
    p->any_p |= r->top_p < 1.0f;
    p->any_m |= r->min_p > 0.0f;
    if (row_rep(r)) p->np += r->num_prompt;
    if (row_rep(r) || row_freq(r)) p->no += r->num_output;
    p->nb += r->num_bias;
    if (r->mask) {
      p->nmask++;
      if (!s->be->mask_logits) { /* a 1.2 plugin: the banned tokens become -inf biases */
        p->nb += mask_banned(r->mask, s->vocab);
        p->any_bias = true;
      }
    }
  }
  p->mask_op = p->nmask > 0 && s->be->mask_logits;
  p->n1 = ns - p->n0;
  for (int32_t j = 0; j < nc; j++) {
    s->slot[ns + j] = ns + j;
    if (scores[j].num_top > p->k) p->k = scores[j].num_top;
  }
  p->nt = p->n1 + nc;
  p->chunk = INT32_MAX / s->vocab;
  if (p->np > INT32_MAX || p->no > INT32_MAX || p->nb > INT32_MAX)
    return bad(
        "the batch's penalty token lists hold %lld prompt, %lld output and %lld bias ids; "
        "at most %d each",
        (long long)p->np, (long long)p->no, (long long)p->nb, INT32_MAX);
  /* Each list holds at least one entry (an ignored -1), so no tensor is empty. */
  p->np = p->np ? p->np : 1;
  p->no = p->no ? p->no : 1;
  p->nb = p->nb ? p->nb : 1;
  const bool pen = p->any_rep || p->any_freq || p->any_bias;
  uint64_t at = 0;
  p->gather = lay(&at, ns + nc);
  p->tok = lay(&at, nc);
  p->temp = lay(&at, ns);
  p->uni = lay(&at, ns);
  p->topk = lay(&at, ns);
  p->topp = lay(&at, ns);
  p->minp = lay(&at, ns);
  p->rep = lay(&at, ns);
  p->freq = lay(&at, ns);
  p->pres = lay(&at, ns);
  p->poff = lay(&at, ns + 1);
  p->ooff = lay(&at, ns + 1);
  p->boff = lay(&at, ns + 1);
  p->pids = lay(&at, pen ? p->np : 0);
  p->oids = lay(&at, pen ? p->no : 0);
  p->bids = lay(&at, pen ? p->nb : 0);
  p->bval = lay(&at, pen ? p->nb : 0);
  const int64_t W = (s->vocab + 31) / 32;
  p->mrows = lay(&at, p->mask_op ? ns : 0);
  p->masks = lay(&at, p->mask_op ? (int64_t)p->nmask * W : 0);
  p->in_bytes = at;
  at = 0;
  p->ids = lay(&at, ns);
  p->lp = lay(&at, ns);
  p->lse = lay(&at, p->nt);
  p->toklogit = lay(&at, nc);
  p->vals = lay(&at, (int64_t)p->nt * p->k);
  p->tids = lay(&at, (int64_t)p->nt * p->k);
  p->out_bytes = at;
  return NULL;
}

/* Writes the run's inputs into the staging (in = its input part). */
static void dev_stage(const kiln_sampler_t *s, const dev_plan_t *p,
                      const kiln_sample_row_t *samples, const kiln_score_row_t *scores, char *in) {
  const int32_t ns = p->ns, V = s->vocab;
#define IN(T, off) ((T *)(void *)(in + (off)))
  for (int32_t j = 0; j < p->nc; j++) {
    IN(int32_t, p->gather)[ns + j] = scores[j].logits_row;
    /* The token's flat index in its chunk of G's score rows (see dev_score_tokens). */
    IN(int32_t, p->tok)[j] = (j % p->chunk) * V + scores[j].token;
  }
  int32_t cp = 0, co = 0, cb = 0;
  for (int32_t t = 0; t < ns; t++) { /* in slot order: the offsets must be */
    const kiln_sample_row_t *r = &samples[s->order[t]];
    IN(int32_t, p->gather)[t] = r->logits_row;
    IN(float, p->temp)[t] = r->temperature;
    IN(float, p->uni)[t] = r->uniform;
    IN(int32_t, p->topk)[t] = r->top_k;
    IN(float, p->topp)[t] = r->top_p;
    IN(float, p->minp)[t] = r->min_p;
    IN(float, p->rep)[t] = r->repetition;
    IN(float, p->freq)[t] = r->frequency;
    IN(float, p->pres)[t] = r->presence;
    if (!(p->any_rep || p->any_freq || p->any_bias)) continue;
    IN(int32_t, p->poff)[t] = cp;
    IN(int32_t, p->ooff)[t] = co;
    IN(int32_t, p->boff)[t] = cb;
    if (row_rep(r) && r->num_prompt > 0) {
      memcpy(IN(int32_t, p->pids) + cp, r->prompt_ids, (size_t)r->num_prompt * 4);
      cp += r->num_prompt;
    }
    if ((row_rep(r) || row_freq(r)) && r->num_output > 0) {
      memcpy(IN(int32_t, p->oids) + co, r->output_ids, (size_t)r->num_output * 4);
      co += r->num_output;
    }
    if (r->num_bias > 0) {
      memcpy(IN(int32_t, p->bids) + cb, r->bias_ids, (size_t)r->num_bias * 4);
      memcpy(IN(float, p->bval) + cb, r->bias_values, (size_t)r->num_bias * 4);
      cb += r->num_bias;
    }
    if (r->mask && !p->mask_op)
      for (int32_t v = 0; v < V; v++)
        if (!((r->mask[v >> 5] >> (v & 31)) & 1)) {
          IN(int32_t, p->bids)[cb] = v;
          IN(float, p->bval)[cb++] = -INFINITY;
        }
  }
  if (p->mask_op) {
    const int64_t W = (V + 31) / 32;
    int32_t mi = 0;
    for (int32_t t = 0; t < ns; t++) {
      const kiln_sample_row_t *r = &samples[s->order[t]];
      IN(int32_t, p->mrows)[t] = r->mask ? mi : -1;
      if (r->mask) memcpy(IN(uint32_t, p->masks) + (int64_t)mi++ * W, r->mask, (size_t)W * 4);
    }
  }
  if (p->any_rep || p->any_freq || p->any_bias) {
    IN(int32_t, p->poff)[ns] = cp;
    IN(int32_t, p->ooff)[ns] = co;
    IN(int32_t, p->boff)[ns] = cb;
    if (!cp) IN(int32_t, p->pids)[0] = -1;
    if (!co) IN(int32_t, p->oids)[0] = -1;
    if (!cb) {
      IN(int32_t, p->bids)[0] = -1;
      IN(float, p->bval)[0] = 0.0f;
    }
  }
#undef IN
}

/* G[t] = logits[gather[t]]: every row the run reads, into the sampler's own buffer. */
static kiln_status_t dev_gather(const kiln_sampler_t *s, const dev_plan_t *p,
                                const kiln_sample_logits_t *lg) {
  kiln_hal_embedding_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.table = lg->tensor;
  a.table.shape[0] = lg->num_rows;
  a.ids = vec(s->d_in, p->gather, KILN_HAL_I32, p->ns + p->nc);
  a.out = mat(s->d_work, 0, KILN_HAL_F32, p->ns + p->nc, s->vocab);
  return kiln_hal_status_from_error(s->be->embedding(s->stream, &a), "embedding (gather)");
}

static kiln_status_t dev_penalize(const kiln_sampler_t *s, const dev_plan_t *p) {
  kiln_hal_buffer_t *di = s->d_in;
  const int32_t ns = p->ns;
  kiln_hal_penalize_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = mat(s->d_work, 0, KILN_HAL_F32, ns, s->vocab);
  if (p->any_rep) {
    a.repetition = vec(di, p->rep, KILN_HAL_F32, ns);
    a.prompt_ids = vec(di, p->pids, KILN_HAL_I32, p->np);
    a.prompt_offsets = vec(di, p->poff, KILN_HAL_I32, ns + 1);
  }
  if (p->any_rep || p->any_freq) {
    a.output_ids = vec(di, p->oids, KILN_HAL_I32, p->no);
    a.output_offsets = vec(di, p->ooff, KILN_HAL_I32, ns + 1);
  }
  if (p->any_freq) {
    a.frequency = vec(di, p->freq, KILN_HAL_F32, ns);
    a.presence = vec(di, p->pres, KILN_HAL_F32, ns);
  }
  if (p->any_bias) {
    a.bias_ids = vec(di, p->bids, KILN_HAL_I32, p->nb);
    a.bias_values = vec(di, p->bval, KILN_HAL_F32, p->nb);
    a.bias_offsets = vec(di, p->boff, KILN_HAL_I32, ns + 1);
  }
  return kiln_hal_status_from_error(s->be->penalize(s->stream, &a), "penalize");
}

/* Token masks on the gathered sample rows (hal.h's mask_logits, ABI 1.3). */
static kiln_status_t dev_mask(const kiln_sampler_t *s, const dev_plan_t *p) {
  kiln_hal_mask_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = mat(s->d_work, 0, KILN_HAL_F32, p->ns, s->vocab);
  a.mask = mat(s->d_in, p->masks, KILN_HAL_I32, p->nmask, (s->vocab + 31) / 32);
  a.rows = vec(s->d_in, p->mrows, KILN_HAL_I32, p->ns);
  return kiln_hal_status_from_error(s->be->mask_logits(s->stream, &a), "mask_logits");
}

/* Top-N and logsumexp of the sample rows that want alternatives and of the score rows. */
static kiln_status_t dev_topk(const kiln_sampler_t *s, const dev_plan_t *p) {
  kiln_hal_buffer_t *dw = s->d_work;
  const uint64_t G = s->g_bytes;
  kiln_hal_topk_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = mat(dw, (uint64_t)p->n0 * (uint64_t)s->vocab * 4, KILN_HAL_F32, p->nt, s->vocab);
  a.out_values = mat(dw, G + p->vals, KILN_HAL_F32, p->nt, p->k);
  a.out_ids = mat(dw, G + p->tids, KILN_HAL_I32, p->nt, p->k);
  a.out_lse = vec(dw, G + p->lse, KILN_HAL_F32, p->nt);
  return kiln_hal_status_from_error(s->be->topk(s->stream, &a), "topk");
}

static kiln_status_t dev_sample(const kiln_sampler_t *s, const dev_plan_t *p) {
  kiln_hal_buffer_t *dw = s->d_work, *di = s->d_in;
  const uint64_t G = s->g_bytes;
  const int32_t ns = p->ns;
  kiln_hal_sample_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = mat(dw, 0, KILN_HAL_F32, ns, s->vocab);
  a.temperature = vec(di, p->temp, KILN_HAL_F32, ns);
  a.uniform = vec(di, p->uni, KILN_HAL_F32, ns);
  if (p->any_k) a.top_k = vec(di, p->topk, KILN_HAL_I32, ns);
  if (p->any_p) a.top_p = vec(di, p->topp, KILN_HAL_F32, ns);
  if (p->any_m) a.min_p = vec(di, p->minp, KILN_HAL_F32, ns);
  a.out_ids = vec(dw, G + p->ids, KILN_HAL_I32, ns);
  if (p->any_lp) a.out_logprob = vec(dw, G + p->lp, KILN_HAL_F32, ns);
  return kiln_hal_status_from_error(s->be->sample(s->stream, &a), "sample");
}

/* Each score token's logit: G's score rows seen as one column [rows * V, 1], indexed by
 * row * V + token, in chunks of p->chunk rows so that the index fits in I32. */
static kiln_status_t dev_score_tokens(const kiln_sampler_t *s, const dev_plan_t *p) {
  const int64_t V = s->vocab;
  kiln_status_t st = NULL;
  for (int32_t j0 = 0; !st && j0 < p->nc; j0 += p->chunk) {
    int32_t cnt = p->nc - j0 < p->chunk ? p->nc - j0 : p->chunk;
    kiln_hal_embedding_args_t a;
    memset(&a, 0, sizeof(a));
    a.struct_size = sizeof(a);
    a.table = mat(s->d_work, (uint64_t)(p->ns + j0) * (uint64_t)V * 4, KILN_HAL_F32, cnt * V, 1);
    a.ids = vec(s->d_in, p->tok + 4 * (uint64_t)j0, KILN_HAL_I32, cnt);
    a.out = mat(s->d_work, s->g_bytes + p->toklogit + 4 * (uint64_t)j0, KILN_HAL_F32, cnt, 1);
    st = kiln_hal_status_from_error(s->be->embedding(s->stream, &a), "embedding (score tokens)");
  }
  return st;
}

/* Results from the staging (res) into the caller's arrays. */
static void dev_unpack(const kiln_sampler_t *s, const dev_plan_t *p,
                       const kiln_sample_row_t *samples, const kiln_score_row_t *scores,
                       const char *res, kiln_sample_out_t *out) {
#define RES(T, off) ((const T *)(const void *)(res + (off)))
  const int64_t mt = s->max_top, k = p->k;
  for (int32_t i = 0; i < p->ns; i++) {
    const kiln_sample_row_t *r = &samples[i];
    int32_t t = s->slot[i];
    out->tokens[i] = RES(int32_t, p->ids)[t];
    if (r->num_top < 0) {
      if (out->logprobs) out->logprobs[i] = 0.0f;
      continue;
    }
    out->logprobs[i] = RES(float, p->lp)[t];
    int64_t tr = t - p->n0; /* its row of the topk call */
    for (int32_t q = 0; q < r->num_top; q++) {
      out->top_ids[i * mt + q] = RES(int32_t, p->tids)[tr * k + q];
      out->top_logprobs[i * mt + q] =
          (float)((double)RES(float, p->vals)[tr * k + q] - (double)RES(float, p->lse)[tr]);
    }
  }
  for (int32_t j = 0; j < p->nc; j++) {
    int64_t tr = p->n1 + j;
    double lse = RES(float, p->lse)[tr];
    out->score_logprobs[j] = (float)((double)RES(float, p->toklogit)[j] - lse);
    for (int32_t q = 0; q < scores[j].num_top; q++) {
      out->score_top_ids[j * mt + q] = RES(int32_t, p->tids)[tr * k + q];
      out->score_top_logprobs[j * mt + q] = (float)((double)RES(float, p->vals)[tr * k + q] - lse);
    }
  }
#undef RES
}

static kiln_status_t dev_run(kiln_sampler_t *s, const kiln_sample_logits_t *lg,
                             const kiln_sample_row_t *samples, int32_t ns,
                             const kiln_score_row_t *scores, int32_t nc, kiln_sample_out_t *out) {
  const kiln_hal_backend_t *be = s->be;
  dev_plan_t p;
  kiln_status_t st = dev_plan(s, samples, ns, scores, nc, &p);
  if (st) return st;
  if (p.in_bytes > s->in_cap) {
    st = stage_alloc(s, s->in_cap * 2 > p.in_bytes ? s->in_cap * 2 : p.in_bytes);
    if (st) return st;
  }
  char *in = (char *)s->h_stage + s->out_bytes;
  dev_stage(s, &p, samples, scores, in);

  st = kiln_hal_status_from_error(be->copy_h2d(s->stream, s->d_in, 0, in, p.in_bytes), "copy_h2d");
  if (!st) st = dev_gather(s, &p, lg);
  if (!st && (p.any_rep || p.any_freq || p.any_bias)) st = dev_penalize(s, &p);
  if (!st && p.mask_op) st = dev_mask(s, &p);
  if (!st && p.nt > 0) st = dev_topk(s, &p);
  if (!st && ns > 0) st = dev_sample(s, &p);
  if (!st && nc > 0) st = dev_score_tokens(s, &p);
  if (!st)
    st = kiln_hal_status_from_error(
        be->copy_d2h(s->stream, s->h_stage, s->d_work, s->g_bytes, p.out_bytes), "copy_d2h");
  if (!st) st = kiln_hal_status_from_error(be->stream_sync(s->stream), "stream_sync");
  if (st) {
    kiln_hal_error_free(be->stream_sync(s->stream)); /* nothing may still use the staging */
    return kiln_status_annotate(st, "sampler");
  }
  dev_unpack(s, &p, samples, scores, (const char *)s->h_stage, out);
  return NULL;
}

/* ============================================================================================
 * Public API
 * ==========================================================================================*/

/* The capabilities every device of the backend has (see the top of the file for why). */
static kiln_status_t common_caps(const kiln_hal_backend_t *be, uint64_t *out_caps) {
  *out_caps = 0;
  int32_t count = 0;
  kiln_hal_error_t *e = be->device_count ? be->device_count(&count) : NULL;
  if (e) return kiln_hal_status_from_error(e, "sampler: device_count");
  if (count <= 0 || !be->device_info) return NULL;
  uint64_t caps = ~(uint64_t)0;
  for (int32_t i = 0; i < count; i++) {
    kiln_hal_device_info_t info;
    memset(&info, 0, sizeof(info));
    info.struct_size = sizeof(info);
    if ((e = be->device_info(i, &info)))
      return kiln_hal_status_from_error(e, "sampler: device_info");
    caps &= info.caps;
  }
  *out_caps = caps;
  return NULL;
}

kiln_status_t kiln_sampler_create(const kiln_hal_backend_t *backend, kiln_hal_device_t *device,
                                  kiln_hal_stream_t *stream, bool force_host, int32_t max_rows,
                                  int32_t max_top, int32_t vocab, kiln_sampler_t **out) {
  if (!out) return bad("create: out is NULL");
  *out = NULL;
  if (max_rows < 1 || max_top < 0 || vocab < 1)
    return bad("create: max_rows = %d, max_top = %d, vocab = %d, want >= 1, >= 0, >= 1",
               (int)max_rows, (int)max_top, (int)vocab);
  if (backend && (!device || !stream || !backend->stream_sync))
    return bad("create: a backend needs a device and a stream");
  uint64_t caps = 0;
  kiln_status_t st = backend ? common_caps(backend, &caps) : NULL;
  if (st) return st;
  kiln_sampler_t *s = calloc(1, sizeof(*s));
  if (!s) return oom("the sampler", sizeof(*s));
  s->be = backend;
  s->device = device;
  s->stream = stream;
  s->max_rows = max_rows;
  s->max_top = max_top;
  s->vocab = vocab;
  s->ktop = max_top > 1 ? max_top : 1;
  s->on_device = backend && !force_host && (caps & KILN_HAL_CAP_DEVICE_SAMPLING) &&
                 backend->embedding && backend->penalize && backend->topk && backend->sample &&
                 backend->buffer_alloc && backend->buffer_free && backend->copy_h2d &&
                 backend->copy_d2h;
  const size_t V = (size_t)vocab, R = (size_t)max_rows;
  s->x = xmalloc(V, sizeof(float), "a logits row", &st);
  s->e = xmalloc(V, sizeof(double), "sampling masses", &st);
  s->cand = xmalloc(V, sizeof(int32_t), "sampling candidates", &st);
  s->heap = xmalloc((size_t)max_top + 1, sizeof(int32_t), "top-N selection", &st);
  s->order = xmalloc(R, sizeof(int64_t), "row order", &st);
  s->slot = xmalloc(R, sizeof(int32_t), "row slots", &st);
  s->rowp = xmalloc(R, sizeof(float *), "row pointers", &st);
  if (!st) {
    s->count = calloc(V, sizeof(int32_t));
    s->mark = calloc(V, 1);
    if (!s->count || !s->mark) st = oom("penalty counts", V * 5);
  }
  /* Host path over device tensors that are not host-visible: rows are read into here. */
  if (!st && backend && !s->on_device && !(caps & KILN_HAL_CAP_HOST_MEMORY))
    s->rows = xmalloc(R * V, sizeof(float), "logits rows read from the device", &st);
  if (!st && s->on_device) {
    s->g_bytes = ((uint64_t)R * V * sizeof(float) + 255) & ~(uint64_t)255;
    /* Results: ids, logprobs (N), lse, token logits (T), values and ids (T * ktop), each
     * section rounded up to 16 bytes. */
    uint64_t w = 4 * ((uint64_t)R + 4) + 2 * ((uint64_t)R * (uint64_t)s->ktop + 4);
    s->out_bytes = (w * 4 + 255) & ~(uint64_t)255;
    kiln_hal_error_t *e = backend->buffer_alloc(device, s->g_bytes + s->out_bytes,
                                                KILN_HAL_BUFFER_DEFAULT, &s->d_work);
    if (e) {
      s->d_work = NULL;
      st = kiln_status_annotate(kiln_hal_status_from_error(e, "allocating gathered rows"),
                                "sampler: %d rows of %d logits", (int)max_rows, (int)vocab);
    }
    /* Inputs: 13 words a row and 16 sections of padding, plus room for token lists. */
    if (!st) st = stage_alloc(s, (13 * (uint64_t)R + 3 + 16 * 4) * 4 + SAMPLER_LIST_CAP0 * 4);
  }
  if (st) {
    kiln_sampler_free(s);
    return st;
  }
  *out = s;
  return NULL;
}

void kiln_sampler_free(kiln_sampler_t *s) {
  if (!s) return;
  if (s->be) {
    stage_free(s);
    if (s->d_work) s->be->buffer_free(s->d_work);
  }
  free(s->x);
  free(s->e);
  free(s->cand);
  free(s->count);
  free(s->mark);
  free(s->heap);
  free(s->order);
  free(s->slot);
  free(s->rowp);
  free(s->rows);
  free(s);
}

bool kiln_sampler_on_device(const kiln_sampler_t *s) { return s && s->on_device; }

kiln_status_t kiln_sampler_run(kiln_sampler_t *s, const kiln_sample_logits_t *logits,
                               const kiln_sample_row_t *samples, int32_t num_samples,
                               const kiln_score_row_t *scores, int32_t num_scores,
                               kiln_sample_out_t *out) {
  if (!s) return bad("run: the sampler is NULL");
  kiln_status_t st = validate(s, logits, samples, num_samples, scores, num_scores, out);
  if (st || num_samples + num_scores == 0) return st;
  /* Host logits without a device tensor run on the host even on a device sampler. */
  if (s->on_device && logits->tensor.buffer)
    return dev_run(s, logits, samples, num_samples, scores, num_scores, out);
  return host_run(s, logits, samples, num_samples, scores, num_scores, out);
}

#define SPLITMIX_STEP 0x9e3779b97f4a7c15ull

float kiln_sample_uniform_ahead(uint64_t state, uint64_t k) {
  state += k * SPLITMIX_STEP;
  return kiln_sample_uniform(&state);
}

void kiln_sample_skip(uint64_t *state, uint64_t n) { *state += n * SPLITMIX_STEP; }

float kiln_sample_uniform(uint64_t *state) {
  uint64_t z = (*state += SPLITMIX_STEP);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  double d = (double)(z >> 11) * (1.0 / 9007199254740992.0); /* exact: 53 bits, in [0, 1) */
  float f = (float)d;
  if ((double)f > d) f = nextafterf(f, 0.0f); /* round down, so never 1.0f */
  return f;
}
