/* cpu_attention.c - paged attention for mixed prefill/decode batches (online softmax, F32).
 *
 * Work is cut into items of (sequence, KV head, tile of query rows, KV range). An item loads
 * its tile's queries for all the query heads that share the KV head (GQA), walks the keys in
 * tiles of KEY_TILE rows gathered through the block table, and keeps a running max, sum and
 * F32 accumulator per (row, head) -- FlashAttention's online softmax, one rescale per key
 * tile. Per query row, the G heads go through the key tile together (cpu_vec_qk_tile and
 * cpu_vec_pv_tile), so decode reads each K/V row once per KV head and widens it in registers;
 * the next tile's rows are prefetched into L2 as the kernels go. When there are too few items
 * to occupy every thread (decode of a few long sequences), each item's KV range is cut into
 * chunks whose partial (max, sum, acc) are merged afterwards.
 * An FP8 cache (kv_format = KILN_HAL_KV_FP8_E4M3, ABI 1.7) is widened into kf/vf through a
 * 256-entry table of the codes' exact e4m3 values; k_scale is folded into q's scale and v_scale
 * into the final 1 / sum (hal.h allows both), so the products see e4m3 values exactly.
 *
 *   q rows of seq s:  [qsl[s], qsl[s+1])      row i sits at position p = L - q_len + i
 *   keys visible:     j < L, j <= p (causal), j > p - window (window > 0)
 */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

#define KEY_TILE 64
/* Query rows times heads per item: enough to reuse each K/V tile from L1 several times. */
#define PAIRS_PER_ITEM 32
/* Smallest KV chunk worth splitting off (partials cost a merge). */
#define MIN_CHUNK 256

typedef struct attn_item {
  int32_t s, g;      /* sequence, KV head */
  int32_t q0, q1;    /* query rows [q0, q1) within the sequence */
  int32_t k0, k1;    /* keys [k0, k1) */
  int32_t part;      /* partial slot, or -1: write out directly */
} attn_item_t;

typedef struct attn_group {
  int32_t first, count; /* consecutive items (chunks) of one (s, g, tile) */
} attn_group_t;

typedef struct attn_ctx {
  const kiln_hal_attention_args_t *a;
  const int32_t *bt, *lens, *qsl;
  int64_t NH, NKV, G, D, BS, MB, QT;
  const attn_item_t *items;
  const attn_group_t *groups;
  float *tmp;        /* per thread: tmp_floats */
  int64_t tmp_floats;
  float *parts;      /* per partial slot: QT*G*(D + 2) */
  int64_t nitems, per_task; /* a pool task runs items [t*per_task, (t+1)*per_task) in order */
  bool fp8;                 /* FP8 cache: codes widened through lut */
  float qscale, vscale;     /* scale (* k_scale), and v_scale (1 for a float cache) */
  float lut[256];           /* FP8: e4m3(code) */
} attn_ctx_t;

static inline int64_t seq_len(const attn_ctx_t *c, int64_t s) {
  return c->lens[s * c->a->seq_lens.stride[0]];
}
static inline int64_t qstart(const attn_ctx_t *c, int64_t s) {
  return c->qsl[s * c->a->query_start_loc.stride[0]];
}

static char *qrow_ptr(const kiln_hal_tensor_t *t, int64_t row, int64_t h) {
  return (char *)cpu_tensor_ptr(t) +
         (row * t->stride[0] + h * t->stride[1]) * (int64_t)kiln_hal_dtype_size(t->dtype);
}

/* out[i] = the cache row of key j0 + i for i < KEY_TILE, NULL from key j1 on; one block-table
 * lookup per block. */
static void row_ptrs(const attn_ctx_t *c, const char *base, const kiln_hal_tensor_t *t,
                     const int32_t *bt, int64_t j0, int64_t j1, const void **out) {
  int64_t es = (int64_t)kiln_hal_dtype_size(t->dtype), n = j1 - j0 < KEY_TILE ? j1 - j0 : KEY_TILE;
  int64_t b = j0 / c->BS, off = j0 % c->BS, i = 0;
  while (i < n) {
    const char *p = base + (bt[b] * t->stride[0] + off * t->stride[2]) * es;
    for (; off < c->BS && i < n; off++, i++, p += t->stride[2] * es) out[i] = p;
    b++;
    off = 0;
  }
  for (i = n < 0 ? 0 : n; i < KEY_TILE; i++) out[i] = NULL;
}

/* The K and V rows of an item's KV head start at kbase/vbase (plus block and offset). */
static void item_bases(const attn_ctx_t *c, const attn_item_t *it, const char **kbase,
                       const char **vbase, const int32_t **bt) {
  const kiln_hal_attention_args_t *a = c->a;
  int64_t kes = (int64_t)kiln_hal_dtype_size(a->k_cache.dtype);
  *kbase = (const char *)cpu_tensor_ptr(&a->k_cache) + it->g * a->k_cache.stride[1] * kes;
  *vbase = (const char *)cpu_tensor_ptr(&a->v_cache) + it->g * a->v_cache.stride[1] * kes;
  *bt = c->bt + it->s * a->block_table.stride[0];
}

/* Runs item idx; while its last tile runs, the first tile of item `next` (>= 0) is
 * prefetched, so consecutive items stream without a cold start. */
static void attn_item(const attn_ctx_t *c, int64_t idx, int64_t next, int thread) {
  const kiln_hal_attention_args_t *a = c->a;
  const attn_item_t *it = &c->items[idx];
  int64_t G = c->G, D = c->D, rows = it->q1 - it->q0, npairs = rows * G;
  float *qf = c->tmp + (int64_t)thread * c->tmp_floats;
  float *acc = qf + c->QT * G * D, *m = acc + c->QT * G * D, *l = m + c->QT * G;
  float *corr = l + c->QT * G, *sc = corr + c->QT * G;
  float *kf = sc + c->QT * G * KEY_TILE, *vf = kf + KEY_TILE * D;
  int64_t L = seq_len(c, it->s), qs = qstart(c, it->s);
  int64_t qlen = qstart(c, it->s + 1) - qs, p0 = L - qlen + it->q0;
  int32_t kdt = a->k_cache.dtype;
  size_t kes = kiln_hal_dtype_size(kdt);
  const char *kbase, *vbase;
  const int32_t *bt;
  item_bases(c, it, &kbase, &vbase, &bt);

  for (int64_t r = 0; r < rows; r++)
    for (int64_t hh = 0; hh < G; hh++) {
      float *q = qf + (r * G + hh) * D;
      cpu_vec_to_f32(a->q.dtype, qrow_ptr(&a->q, qs + it->q0 + r, it->g * G + hh), q, D);
      for (int64_t d = 0; d < D; d++) q[d] *= c->qscale;
    }
  memset(acc, 0, (size_t)(npairs * D) * sizeof(float));
  for (int64_t i = 0; i < npairs; i++) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }

  /* Decode (one or two query rows) reads each K/V row once and widens it in registers; more
   * rows re-read the tile per row, so half dtypes are widened into kf/vf once instead. */
  bool widen = c->fp8 || (rows > 2 && kdt != KILN_HAL_F32);
  int32_t tdt = widen ? KILN_HAL_F32 : kdt;
  /* Row pointers of this tile and the next (ping-pong): the tile kernels prefetch the next
   * tile's rows a few at a time as they go. Blocks are scattered over the pool, so each starts
   * on a new page where the hardware prefetcher stops. */
  const void *kpp[2][KEY_TILE], *vpp[2][KEY_TILE], *kw[KEY_TILE], *vw[KEY_TILE];
  for (int64_t jj = 0; jj < KEY_TILE; jj++) {
    kw[jj] = kf + jj * D;
    vw[jj] = vf + jj * D;
  }
  int64_t rowbytes = D * (int64_t)kes;
  row_ptrs(c, kbase, &a->k_cache, bt, it->k0, it->k1, kpp[0]);
  row_ptrs(c, vbase, &a->v_cache, bt, it->k0, it->k1, vpp[0]);
  for (int64_t j0 = it->k0, t = 0; j0 < it->k1; j0 += KEY_TILE, t ^= 1) {
    int64_t jn = it->k1 - j0 < KEY_TILE ? it->k1 - j0 : KEY_TILE;
    const void **kp = kpp[t], **vp = vpp[t], **kn = kpp[t ^ 1], **vn = vpp[t ^ 1];
    if (j0 + KEY_TILE < it->k1 || next < 0) {
      row_ptrs(c, kbase, &a->k_cache, bt, j0 + KEY_TILE, it->k1, kn);
      row_ptrs(c, vbase, &a->v_cache, bt, j0 + KEY_TILE, it->k1, vn);
    } else {
      const attn_item_t *nx = &c->items[next];
      const char *nkb, *nvb;
      const int32_t *nbt;
      item_bases(c, nx, &nkb, &nvb, &nbt);
      row_ptrs(c, nkb, &a->k_cache, nbt, nx->k0, nx->k1, kn);
      row_ptrs(c, nvb, &a->v_cache, nbt, nx->k0, nx->k1, vn);
    }
    if (widen) {
      for (int64_t jj = 0; jj < jn; jj++) {
        for (int64_t o = 0; kn[jj] && o < rowbytes; o += 64) {
          __builtin_prefetch((const char *)kn[jj] + o, 0, 2);
          __builtin_prefetch((const char *)vn[jj] + o, 0, 2);
        }
        if (c->fp8) {
          const uint8_t *kc8 = kp[jj], *vc8 = vp[jj];
          float *kd = kf + jj * D, *vd = vf + jj * D;
          for (int64_t d = 0; d < D; d++) {
            kd[d] = c->lut[kc8[d]];
            vd[d] = c->lut[vc8[d]];
          }
        } else {
          cpu_vec_to_f32(kdt, kp[jj], kf + jj * D, D);
          cpu_vec_to_f32(kdt, vp[jj], vf + jj * D, D);
        }
      }
      kp = kw;
      vp = vw;
    }
    /* Per query row: the G heads share the row's visible keys [ja, jb) of the tile (only the
     * diagonal and window-edge tiles cut it), so masked keys are neither scored nor summed. */
    for (int64_t r = 0; r < rows; r++) {
      int64_t p = p0 + r;
      int64_t lo = a->sliding_window > 0 ? p - a->sliding_window + 1 : 0;
      int64_t hi = a->causal ? p + 1 : L;
      int64_t ja = (lo > j0 ? lo : j0) - j0, jb = (hi < j0 + jn ? hi : j0 + jn) - j0, n = jb - ja;
      if (n <= 0) continue;
      float *srow0 = sc + r * G * KEY_TILE + ja;
      bool pf = !widen && r == 0;
      cpu_vec_qk_tile(tdt, qf + r * G * D, G, D, kp + ja, n, srow0, KEY_TILE, pf ? kn + ja : NULL);
      for (int64_t hh = 0; hh < G; hh++) {
        int64_t pi = r * G + hh;
        float *srow = srow0 + hh * KEY_TILE;
        if (a->softcap > 0.0f)
          for (int64_t jj = 0; jj < n; jj++) srow[jj] = a->softcap * tanhf(srow[jj] / a->softcap);
        float mx = cpu_vec_max(srow, n), mnew = m[pi] > mx ? m[pi] : mx;
        corr[hh] = 1.0f;
        if (mnew == -INFINITY) { /* nothing finite yet: weights 0, state unchanged */
          memset(srow, 0, (size_t)n * sizeof(float));
          continue;
        }
        if (m[pi] != -INFINITY && mnew > m[pi]) corr[hh] = expf(m[pi] - mnew);
        m[pi] = mnew;
        l[pi] = l[pi] * corr[hh] + cpu_vec_exp_sum(srow, n, mnew);
      }
      cpu_vec_pv_tile(tdt, srow0, KEY_TILE, G, vp + ja, n, D, corr, acc + r * G * D,
                      pf ? vn + ja : NULL);
    }
  }

  if (it->part >= 0) {
    float *pp = c->parts + (int64_t)it->part * c->QT * G * (D + 2);
    memcpy(pp, acc, (size_t)(npairs * D) * sizeof(float));
    memcpy(pp + c->QT * G * D, m, (size_t)npairs * sizeof(float));
    memcpy(pp + c->QT * G * D + c->QT * G, l, (size_t)npairs * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < rows; r++)
    for (int64_t hh = 0; hh < G; hh++) {
      int64_t pi = r * G + hh;
      float *o = acc + pi * D, inv = l[pi] > 0.0f ? c->vscale / l[pi] : 0.0f;
      for (int64_t d = 0; d < D; d++) o[d] *= inv;
      cpu_vec_from_f32(a->out.dtype, o, qrow_ptr(&a->out, qs + it->q0 + r, it->g * G + hh), D);
    }
}

static void attn_task(void *vctx, int64_t task, int thread) {
  const attn_ctx_t *c = vctx;
  int64_t i0 = task * c->per_task, i1 = i0 + c->per_task < c->nitems ? i0 + c->per_task : c->nitems;
  for (int64_t i = i0; i < i1; i++) attn_item(c, i, i + 1 < i1 ? i + 1 : -1, thread);
}

/* Combines the chunks of one (sequence, KV head, tile) into the output. */
static void attn_merge(void *vctx, int64_t gi, int thread) {
  const attn_ctx_t *c = vctx;
  const attn_group_t *gr = &c->groups[gi];
  const attn_item_t *it0 = &c->items[gr->first];
  int64_t G = c->G, D = c->D, rows = it0->q1 - it0->q0, stride = c->QT * G * (D + 2);
  float *o = c->tmp + (int64_t)thread * c->tmp_floats;
  int64_t qs = qstart(c, it0->s);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t hh = 0; hh < G; hh++) {
      int64_t pi = r * G + hh;
      float mx = -INFINITY;
      for (int32_t k = 0; k < gr->count; k++) {
        const float *pp = c->parts + (int64_t)c->items[gr->first + k].part * stride;
        float mk = pp[c->QT * G * D + pi];
        mx = mk > mx ? mk : mx;
      }
      memset(o, 0, (size_t)D * sizeof(float));
      float lsum = 0.0f;
      if (mx != -INFINITY) {
        for (int32_t k = 0; k < gr->count; k++) {
          const float *pp = c->parts + (int64_t)c->items[gr->first + k].part * stride;
          float mk = pp[c->QT * G * D + pi], lk = pp[c->QT * G * D + c->QT * G + pi];
          if (mk == -INFINITY) continue;
          float w = expf(mk - mx);
          lsum += w * lk;
          for (int64_t d = 0; d < D; d++) o[d] += w * pp[pi * D + d];
        }
      }
      float inv = lsum > 0.0f ? c->vscale / lsum : 0.0f;
      for (int64_t d = 0; d < D; d++) o[d] *= inv;
      cpu_vec_from_f32(c->a->out.dtype, o, qrow_ptr(&c->a->out, qs + it0->q0 + r, it0->g * G + hh),
                       D);
    }
}

/* Checks the integer metadata the kernels will follow (it lives in buffers, so it can only be
 * checked when the op runs). */
static kiln_hal_error_t *check_metadata(const attn_ctx_t *c, int64_t S, int64_t T, int64_t NB) {
  const kiln_hal_attention_args_t *a = c->a;
  int64_t prev = 0;
  for (int64_t s = 0; s < S; s++) {
    int64_t q0 = qstart(c, s), q1 = qstart(c, s + 1), L = seq_len(c, s);
    if (q0 < 0 || q1 < q0 || q1 > T || (s > 0 && q0 < prev))
      return cpu_err("attention: query_start_loc[%lld..%lld] = %lld..%lld is not a "
                     "non-decreasing range within T = %lld",
                     (long long)s, (long long)s + 1, (long long)q0, (long long)q1, (long long)T);
    prev = q1;
    if (L < 0 || L > c->MB * c->BS)
      return cpu_err("attention: seq_lens[%lld] = %lld outside [0, MB*BS = %lld]", (long long)s,
                     (long long)L, (long long)(c->MB * c->BS));
    if (q1 - q0 > L)
      return cpu_err("attention: sequence %lld has %lld queries but seq_lens = %lld", (long long)s,
                     (long long)(q1 - q0), (long long)L);
    const int32_t *bt = c->bt + s * a->block_table.stride[0];
    for (int64_t b = 0; b < (L + c->BS - 1) / c->BS; b++)
      if (bt[b] < 0 || bt[b] >= NB)
        return cpu_err("attention: block_table[%lld][%lld] = %d outside the pool of %lld blocks",
                       (long long)s, (long long)b, (int)bt[b], (long long)NB);
  }
  return NULL;
}

kiln_hal_error_t *cpu_attention(kiln_hal_stream_t *s, const kiln_hal_attention_args_t *a,
                                bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_attention(&cpu_check_env, a);
  if (e || dry_run) return e;
  int64_t T = a->q.shape[0], NH = a->q.shape[1], D = a->q.shape[2];
  int64_t NKV = a->k_cache.shape[1], NB = a->k_cache.shape[0], S = a->num_seqs;
  if (S == 0 || NH == 0) return NULL;
  attn_ctx_t c;
  memset(&c, 0, sizeof(c));
  c.a = a;
  c.bt = cpu_tensor_ptr(&a->block_table);
  c.lens = cpu_tensor_ptr(&a->seq_lens);
  c.qsl = cpu_tensor_ptr(&a->query_start_loc);
  c.NH = NH;
  c.NKV = NKV;
  c.G = NH / NKV;
  c.D = D;
  c.BS = a->k_cache.shape[2];
  c.MB = a->block_table.shape[1];
  c.QT = PAIRS_PER_ITEM / c.G > 1 ? PAIRS_PER_ITEM / c.G : 1;
  c.fp8 = a->kv_format == KILN_HAL_KV_FP8_E4M3;
  c.qscale = c.fp8 ? a->scale * a->k_scale : a->scale;
  c.vscale = c.fp8 ? a->v_scale : 1.0f;
  if (c.fp8)
    for (int i = 0; i < 256; i++) c.lut[i] = kiln_hal_fp8_e4m3_to_f32((uint8_t)i);
  if ((e = check_metadata(&c, S, T, NB))) return e;

  /* Count items without splitting, and the key rows they would read. */
  int64_t base = 0, work = 0;
  for (int64_t q = 0; q < S; q++) {
    int64_t ql = qstart(&c, q + 1) - qstart(&c, q), tiles = (ql + c.QT - 1) / c.QT;
    base += tiles * NKV;
    work += tiles * NKV * seq_len(&c, q);
  }
  if (base == 0) return NULL;
  int threads = cpu_num_threads();
  int64_t chunk = INT64_MAX;
  if (threads > 1 && base < 4 * (int64_t)threads) {
    chunk = (work + 4 * threads - 1) / (4 * threads);
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : (chunk + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
  }

  /* Two passes over the same loop: count items and partial slots, then fill them. */
  attn_item_t *items = NULL;
  attn_group_t *groups = NULL;
  int64_t nitems = 0, ngroups = 0, nparts = 0;
  for (int pass = 0; pass < 2; pass++) {
    nitems = ngroups = nparts = 0;
    for (int64_t q = 0; q < S; q++) {
      int64_t ql = qstart(&c, q + 1) - qstart(&c, q), L = seq_len(&c, q);
      for (int64_t q0 = 0; q0 < ql; q0 += c.QT) {
        int64_t q1 = q0 + c.QT < ql ? q0 + c.QT : ql;
        int64_t pmin = L - ql + q0, pmax = L - ql + q1 - 1;
        int64_t lo = a->sliding_window > 0 ? pmin - a->sliding_window + 1 : 0;
        int64_t hi = a->causal ? pmax + 1 : L;
        lo = lo < 0 ? 0 : lo;
        hi = hi > L ? L : hi;
        int64_t nch = hi > lo && chunk != INT64_MAX ? (hi - lo + chunk - 1) / chunk : 1;
        for (int64_t g = 0; g < NKV; g++) {
          if (pass && nch > 1) groups[ngroups] = (attn_group_t){(int32_t)nitems, (int32_t)nch};
          if (nch > 1) ngroups++;
          for (int64_t k = 0; k < nch; k++) {
            if (pass) {
              int64_t k0 = nch > 1 ? lo + k * chunk : lo, k1 = nch > 1 ? k0 + chunk : hi;
              items[nitems] = (attn_item_t){(int32_t)q, (int32_t)g, (int32_t)q0, (int32_t)q1,
                                            (int32_t)k0, (int32_t)(k1 < hi ? k1 : hi),
                                            nch > 1 ? (int32_t)nparts : -1};
            }
            nitems++;
            if (nch > 1) nparts++;
          }
        }
      }
    }
    if (pass == 0) {
      c.tmp_floats = c.QT * c.G * (2 * D + 3 + KEY_TILE) + 2 * KEY_TILE * D;
      c.tmp_floats = (c.tmp_floats + 15) & ~(int64_t)15;
      size_t tmpb = (size_t)(c.tmp_floats * threads) * sizeof(float);
      size_t partb = (size_t)(nparts * c.QT * c.G * (D + 2)) * sizeof(float);
      size_t itemb = (size_t)nitems * sizeof(attn_item_t), groupb = (size_t)ngroups * sizeof(attn_group_t);
      char *scratch = cpu_scratch(s, tmpb + partb + itemb + groupb + 256);
      if (!scratch)
        return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "attention: out of scratch memory");
      c.tmp = (float *)scratch;
      c.parts = (float *)(scratch + tmpb);
      items = (attn_item_t *)(scratch + tmpb + partb);
      groups = (attn_group_t *)(scratch + tmpb + partb + itemb);
    }
  }
  c.items = items;
  c.groups = groups;
  /* Runs of consecutive items per task (16 tasks per thread keep the load balanced). */
  c.nitems = nitems;
  c.per_task = nitems / (16 * (int64_t)threads) > 1 ? nitems / (16 * (int64_t)threads) : 1;
  cpu_pool_run(cpu_g_pool, (nitems + c.per_task - 1) / c.per_task, attn_task, &c);
  if (ngroups) cpu_pool_run(cpu_g_pool, ngroups, attn_merge, &c);
  return NULL;
}
