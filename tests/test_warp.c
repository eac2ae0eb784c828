/* test_warp.c - the GPU kernels' warp-width-dependent algorithms, run on the CPU for warps of
 * W = 32 and 64 lanes (NVIDIA and RDNA: 32; AMD CDNA: 64) and W = 16 (no GPU has it: it catches
 * hidden assumptions), each checked against an fp64 reference (hal/ref/ops_ref.c) or an exact
 * count.
 *
 * The CUDA backend's kernels (backends/cuda, also built by hipcc for the ROCm plugin) take the
 * warp width as a template parameter WARP; kiln_shfl_xor / kiln_shfl_up (portable.h) are the
 * only cross-lane operations. Here a warp is an array of W lane values that execute in
 * lockstep: every shuffle reads all lanes before any lane writes, exactly as the hardware does,
 * with the intrinsics' documented results for out-of-range source lanes (shfl_*_src below).
 * Each emulation below names the kernel function it mirrors and keeps its loop bounds and index
 * expressions, so the two can be compared line by line; a per-thread variable of the kernel is
 * an array indexed by the thread (tid) or the lane; a __syncthreads() is the end of a loop over
 * threads. Where the emulation departs from the kernel (dtype unpacking, launch chunking) a
 * comment says so.
 *
 * Where the lane count matters, kernel by kernel (all of them are emulated here unless marked):
 *   cuda_common.cuh  warp_sum, warp_max        xor butterfly, o = WARP/2 .. 1
 *                    block_sum, block_max      lane = tid % WARP, wid = tid / WARP,
 *                                              nw = ceil(blockDim / WARP) partials in scratch
 *   cuda_ops.cu      rmsnorm_kernel            scratch[1024 / WARP + 1]; 256/512/1024 threads
 *                    layernorm_kernel          the same, two block_sums (mean, centred squares)
 *   cuda_sample.cu   block_best                xor tree on (value, index) pairs + nw merge
 *                    block_scan                Hillis-Steele scan with kiln_shfl_up (o = 1 ..
 *                                              WARP/2, `lane >= o` guard), lane WARP-1 partials
 *                    block_min_int             xor tree + nw merge
 *                    row_scratch               f/i/d[SAMPLE_THREADS / WARP]
 *                    row_argmax_lse, argmax_kernel, topk_kernel, min_present_at_least,
 *                    sample_kernel             all reductions and scans above, 1024 threads
 *                    penalize_kernel           `id >> 5`, `id & 31`: bitmap words of 32 tokens,
 *                                              not lanes (not warp-dependent; not emulated)
 *   cuda_attention.cu attention_kernel         NW = 256 / WARP warps, QT rows x KW = NW / QT
 *                                              key-splitting warps (r = wid % QT, kw = wid / QT),
 *                                              d = e * WARP + lane with E elements per lane,
 *                                              U = 4 warp_sum per key group, the merge over
 *                                              src = r + w * QT, sm_acc[NW][E * WARP]
 *                    attention_launch          QT = 1, 2, 4, 8 while QT < NW and < max_query_len
 *                    attention_dispatch_e      E = 2, 4 or 8 for D <= 2, 4, 8 x WARP
 *                    cuda_launch_attention     tensor cores only when warp == 32
 *   cuda_gemv.cu     gemv_kernel               GEMV_THREADS / WARP warps of NPW columns; lane l
 *                                              reads 16-byte pieces l + WARP * (u + UNROLL * t);
 *                                              warp_sum of every accumulator; lane 0 stores
 *                    gemv_launch               cols_per_block = NPW * (GEMV_THREADS / WARP)
 *   cuda_attention_mma.cuh (NVIDIA only: #if !__HIP_PLATFORM_AMD__, and dispatched only when
 *                    warp == 32): mma.sync/ldmatrix fragments (lane / 4, lane % 4, lane % 8,
 *                    lane / 16), 32-lane xor trees on lo_w/hi_w and the row max/sum
 *                    (__shfl_xor_sync(0xffffffffu, ., 1 and 2)), __all_sync(0xffffffffu),
 *                    tvalid[lane] / tvalid[lane + 32], att_combine_kernel's warp_max<32> /
 *                    warp_sum<32> with 4 warps of 32 and d = e * 32 + lane. These are 32 by
 *                    design (the m16n8k16 fragment layout); only the combine kernel's mapping is
 *                    checked here (test_mma_combine_mapping), the fragments are not mirrored
 *                    (the file has its own host emulation, KILN_ATT_EMU).
 *   portable.h       kiln_full_mask<WARP>      (unsigned)-cast 64-bit mask, used on CUDA only
 *                    KILN_WARP_DISPATCH        32 (CUDA), 32 and 64 (HIP)
 *
 * Inputs are random with a fresh seed per run (printed; KILN_TEST_SEED=n repeats a run). */
#define _POSIX_C_SOURCE 200809L
#include <float.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "hal/ref/ops_ref.h"
#include "kiln/hal.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define MAXW 64             /* widest warp emulated */
#define MAXT 1024           /* most threads in a block (SAMPLE_THREADS, rmsnorm's largest) */
#define SAMPLE_THREADS 1024 /* cuda_sample.cu */
#define ATT_THREADS 256     /* cuda_attention.cu */
#define ATT_U 4             /* cuda_attention.cu */
#define GEMV_THREADS 128    /* cuda_gemv.cu */

/* The widths: the two real ones, and 16 for assumptions that would hide behind them. */
static const int widths[] = {16, 32, 64};

static uint64_t g_seed, g_rng;

/* ---- random numbers -------------------------------------------------------------------------- */

static uint64_t rng_u64(void) {
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double rng_uniform(void) { return (double)(rng_u64() >> 11) * (1.0 / 9007199254740992.0); }
/* An integer in [lo, hi]. */
static int rng_int(int lo, int hi) { return lo + (int)(rng_u64() % (uint64_t)(hi - lo + 1)); }
static float rng_float(float lo, float hi) { return lo + (hi - lo) * (float)rng_uniform(); }

/* ---- checks ------------------------------------------------------------------------------------
 */

/* Fails the test with a message naming the seed, unless |got - want| <= atol + rtol * |want|. */
static void check_close(double got, double want, double atol, double rtol, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void check_close(double got, double want, double atol, double rtol, const char *fmt, ...) {
  if (fabs(got - want) <= atol + rtol * fabs(want)) return;
  if (isnan(want) && isnan(got)) return;
  char what[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof(what), fmt, ap);
  va_end(ap);
  fail_msg("%s: got %.9g, want %.9g (seed %llu)", what, got, want, (unsigned long long)g_seed);
}

/* A shared-memory (or register array) index against the size the kernel declares. */
#define CHECK_INDEX(i, n, what)                                                         \
  do {                                                                                  \
    if ((i) < 0 || (i) >= (n))                                                          \
      fail_msg("%s: index %lld outside the declared [0, %lld)", (what), (long long)(i), \
               (long long)(n));                                                         \
  } while (0)

/* ============================================================================================
 * The shuffles. Source lane read by lane `self` (of a hardware warp) for a segment of `width`
 * lanes, as specified by CUDA (Programming Guide, "Warp Shuffle Functions") and implemented by
 * HIP (hip/amd_detail/amd_warp_functions.h), whose formulas these are:
 *   __shfl_xor: self ^ lane_mask; a source in a later segment (or past the warp) returns the
 *               caller's own value ("...their own value of var will be returned").
 *   __shfl_up:  self - delta; a source before the caller's segment returns the caller's own
 *               value ("the lower delta lanes will be unchanged"): it does not wrap.
 *   __shfl:     CUDA: src_lane modulo width, within the caller's segment. HIP before ROCm 6.2
 *               adds the segment base without reducing src_lane (ds_bpermute then wraps at the
 *               wave size); later HIP masks it with width - 1 as CUDA does. No kernel calls
 *               kiln_shfl today; the difference is recorded here for whoever does.
 * ==========================================================================================*/

static int shfl_xor_src(int self, int lane_mask, int width) {
  int index = self ^ lane_mask;
  return index >= ((self + width) & ~(width - 1)) ? self : index;
}

static int shfl_up_src(int self, int delta, int width) {
  int index = self - delta;
  return index < (self & ~(width - 1)) ? self : index;
}

typedef enum { SHFL_CUDA, SHFL_HIP_PRE_6_2 } shfl_flavour_t;

static int shfl_idx_src(shfl_flavour_t f, int self, int src_lane, int width, int hw) {
  if (f == SHFL_CUDA) return (src_lane & (width - 1)) + (self & ~(width - 1));
  return (src_lane + (self & ~(width - 1))) & (hw - 1);
}

/* Whole-warp shuffles as the kernels issue them: kiln_shfl_xor<WARP> / kiln_shfl_up<WARP> on a
 * warp of WARP lanes with width WARP. out[l] is lane l's result; v is read only. */
#define DEFINE_SHUFFLES(T, S)                                                             \
  __attribute__((unused)) static void shfl_xor_##S(const T *v, T *out, int W, int mask) { \
    for (int l = 0; l < W; l++) out[l] = v[shfl_xor_src(l, mask, W)];                     \
  }                                                                                       \
  __attribute__((unused)) static void shfl_up_##S(const T *v, T *out, int W, int delta) { \
    for (int l = 0; l < W; l++) out[l] = v[shfl_up_src(l, delta, W)];                     \
  }
DEFINE_SHUFFLES(float, f)
DEFINE_SHUFFLES(double, d)
DEFINE_SHUFFLES(int, i)

/* ============================================================================================
 * Reductions (cuda_common.cuh, cuda_sample.cu). v holds one value per lane (warp functions) or
 * per thread (block functions); block functions return what every thread gets and require
 * blockDim % WARP == 0, which every launch satisfies (checked).
 * ==========================================================================================*/

/* cuda_common.cuh warp_sum<WARP, T>:
 *   for (int o = WARP / 2; o > 0; o >>= 1) v += kiln_shfl_xor<WARP>(v, o); */
#define DEFINE_WARP_SUM(T, S)                   \
  static void warp_sum_##S(T *v, int W) {       \
    T n[MAXW];                                  \
    for (int o = W / 2; o > 0; o >>= 1) {       \
      shfl_xor_##S(v, n, W, o);                 \
      for (int l = 0; l < W; l++) v[l] += n[l]; \
    }                                           \
  }
DEFINE_WARP_SUM(float, f)
DEFINE_WARP_SUM(double, d)
DEFINE_WARP_SUM(int, i)

/* cuda_common.cuh warp_max<WARP>:
 *   for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, kiln_shfl_xor<WARP>(v, o)); */
static void warp_max_f(float *v, int W) {
  float n[MAXW];
  for (int o = W / 2; o > 0; o >>= 1) {
    shfl_xor_f(v, n, W, o);
    for (int l = 0; l < W; l++) v[l] = fmaxf(v[l], n[l]);
  }
}

static void check_block_shape(int W, int block_dim) {
  if (block_dim % W != 0 || block_dim > MAXT)
    fail_msg("a block of %d threads is not a whole number of %d-lane warps", block_dim, W);
}

/* cuda_common.cuh block_sum<WARP, T>(v, scratch), scratch declared with `cap` entries:
 *   lane = tid % WARP, wid = tid / WARP; nw = (blockDim.x + WARP - 1) / WARP;
 *   v = warp_sum<WARP>(v); if (lane == 0) scratch[wid] = v; __syncthreads();
 *   r = 0; for (i = 0; i < nw; i++) r += scratch[i]; __syncthreads(); return r; */
#define DEFINE_BLOCK_SUM(T, S)                                              \
  static T block_sum_##S(T *v, int W, int block_dim, T *scratch, int cap) { \
    check_block_shape(W, block_dim);                                        \
    const int nw = (block_dim + W - 1) / W;                                 \
    for (int w = 0; w < block_dim / W; w++) warp_sum_##S(v + w * W, W);     \
    for (int tid = 0; tid < block_dim; tid++) {                             \
      const int lane = tid % W, wid = tid / W;                              \
      if (lane == 0) {                                                      \
        CHECK_INDEX(wid, cap, "block_sum scratch");                         \
        scratch[wid] = v[tid];                                              \
      }                                                                     \
    }                                                                       \
    T r = 0;                                                                \
    for (int i = 0; i < nw; i++) {                                          \
      CHECK_INDEX(i, cap, "block_sum scratch");                             \
      r += scratch[i];                                                      \
    }                                                                       \
    return r;                                                               \
  }
DEFINE_BLOCK_SUM(float, f)
DEFINE_BLOCK_SUM(double, d)
DEFINE_BLOCK_SUM(int, i)

/* cuda_common.cuh block_max<WARP>(v, scratch): as block_sum with fmaxf, from -INFINITY. */
static float block_max_f(float *v, int W, int block_dim, float *scratch, int cap) {
  check_block_shape(W, block_dim);
  const int nw = (block_dim + W - 1) / W;
  for (int w = 0; w < block_dim / W; w++) warp_max_f(v + w * W, W);
  for (int tid = 0; tid < block_dim; tid++) {
    const int lane = tid % W, wid = tid / W;
    if (lane == 0) {
      CHECK_INDEX(wid, cap, "block_max scratch");
      scratch[wid] = v[tid];
    }
  }
  float r = -INFINITY;
  for (int i = 0; i < nw; i++) {
    CHECK_INDEX(i, cap, "block_max scratch");
    r = fmaxf(r, scratch[i]);
  }
  return r;
}

/* cuda_sample.cu ranks_before: larger value, or equal value and lower index. */
static bool ranks_before(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

/* cuda_sample.cu block_best<WARP>(v, i, sv, si): nw = blockDim.x / WARP;
 *   for (o = WARP / 2; o > 0; o >>= 1) { ov = shfl_xor(*v, o); oi = shfl_xor(*i, o);
 *                                        if (ranks_before(ov, oi, *v, *i)) { *v = ov; *i = oi; } }
 *   if (lane == 0) { sv[wid] = *v; si[wid] = *i; } __syncthreads();
 *   bv = sv[0], bi = si[0]; for (w = 1; w < nw; w++) if (ranks_before(sv[w], si[w], bv, bi)) ...
 * Every thread ends with (bv, bi). */
static void block_best(int W, int block_dim, float *v, int *idx, float *sv, int *si, int cap) {
  check_block_shape(W, block_dim);
  const int nw = block_dim / W;
  for (int w = 0; w < nw; w++) {
    float *wv = v + w * W;
    int *wi = idx + w * W;
    for (int o = W / 2; o > 0; o >>= 1) {
      float ov[MAXW];
      int oi[MAXW];
      shfl_xor_f(wv, ov, W, o);
      shfl_xor_i(wi, oi, W, o);
      for (int l = 0; l < W; l++)
        if (ranks_before(ov[l], oi[l], wv[l], wi[l])) {
          wv[l] = ov[l];
          wi[l] = oi[l];
        }
    }
  }
  for (int tid = 0; tid < block_dim; tid++) {
    const int lane = tid % W, wid = tid / W;
    if (lane == 0) {
      CHECK_INDEX(wid, cap, "block_best scratch");
      sv[wid] = v[tid];
      si[wid] = idx[tid];
    }
  }
  float bv = sv[0];
  int bi = si[0];
  for (int w = 1; w < nw; w++)
    if (ranks_before(sv[w], si[w], bv, bi)) {
      bv = sv[w];
      bi = si[w];
    }
  for (int tid = 0; tid < block_dim; tid++) {
    v[tid] = bv;
    idx[tid] = bi;
  }
}

/* cuda_sample.cu block_scan<WARP, T>(v, scratch, total): nw = blockDim.x / WARP;
 *   for (o = 1; o < WARP; o <<= 1) { n = kiln_shfl_up<WARP>(v, o); if (lane >= o) v += n; }
 *   if (lane == WARP - 1) scratch[wid] = v; __syncthreads();
 *   off = 0, tot = 0; for (w = 0; w < nw; w++) { x = scratch[w]; if (w < wid) off += x; tot += x; }
 *   __syncthreads(); *total = tot; return v + off;
 * v[tid] becomes thread tid's inclusive prefix. */
#define DEFINE_BLOCK_SCAN(T, S)                                                           \
  static void block_scan_##S(T *v, int W, int block_dim, T *scratch, int cap, T *total) { \
    check_block_shape(W, block_dim);                                                      \
    const int nw = block_dim / W;                                                         \
    for (int w = 0; w < nw; w++) {                                                        \
      T *wv = v + w * W;                                                                  \
      for (int o = 1; o < W; o <<= 1) {                                                   \
        T n[MAXW];                                                                        \
        shfl_up_##S(wv, n, W, o);                                                         \
        for (int lane = 0; lane < W; lane++)                                              \
          if (lane >= o) wv[lane] += n[lane];                                             \
      }                                                                                   \
    }                                                                                     \
    for (int tid = 0; tid < block_dim; tid++) {                                           \
      const int lane = tid % W, wid = tid / W;                                            \
      if (lane == W - 1) {                                                                \
        CHECK_INDEX(wid, cap, "block_scan scratch");                                      \
        scratch[wid] = v[tid];                                                            \
      }                                                                                   \
    }                                                                                     \
    T tot = 0;                                                                            \
    for (int w = 0; w < nw; w++) tot += scratch[w];                                       \
    for (int tid = 0; tid < block_dim; tid++) {                                           \
      const int wid = tid / W;                                                            \
      T off = 0;                                                                          \
      for (int w = 0; w < nw; w++)                                                        \
        if (w < wid) off += scratch[w];                                                   \
      v[tid] += off;                                                                      \
    }                                                                                     \
    *total = tot;                                                                         \
  }
DEFINE_BLOCK_SCAN(int, i)
DEFINE_BLOCK_SCAN(double, d)

/* cuda_sample.cu block_min_int<WARP>(v, scratch): nw = blockDim.x / WARP;
 *   for (o = WARP / 2; o > 0; o >>= 1) v = min(v, kiln_shfl_xor<WARP>(v, o));
 *   if (lane == 0) scratch[wid] = v; __syncthreads();
 *   r = INT_MAX; for (w = 0; w < nw; w++) r = min(r, scratch[w]); */
static int block_min_int(int *v, int W, int block_dim, int *scratch, int cap) {
  check_block_shape(W, block_dim);
  const int nw = block_dim / W;
  for (int w = 0; w < nw; w++) {
    int *wv = v + w * W;
    for (int o = W / 2; o > 0; o >>= 1) {
      int n[MAXW];
      shfl_xor_i(wv, n, W, o);
      for (int l = 0; l < W; l++) wv[l] = wv[l] < n[l] ? wv[l] : n[l];
    }
  }
  for (int tid = 0; tid < block_dim; tid++) {
    const int lane = tid % W, wid = tid / W;
    if (lane == 0) {
      CHECK_INDEX(wid, cap, "block_min_int scratch");
      scratch[wid] = v[tid];
    }
  }
  int r = INT_MAX;
  for (int w = 0; w < nw; w++) r = r < scratch[w] ? r : scratch[w];
  return r;
}

/* ============================================================================================
 * Tests of the primitives
 * ==========================================================================================*/

/* The intrinsics' results for every lane, hardware warp and segment width, on both vendors. */
static void test_shuffle_semantics(void **state) {
  (void)state;
  const int hws[] = {32, 64};
  for (size_t a = 0; a < ARRAY_LEN(hws); a++) {
    const int hw = hws[a];
    for (int width = 1; width <= hw; width *= 2) {
      for (int self = 0; self < hw; self++) {
        const int base = self & ~(width - 1);
        for (int m = 0; m < 2 * hw; m++) {
          const int s = shfl_xor_src(self, m, width);
          const int want = (self ^ m) >= base + width ? self : (self ^ m);
          assert_int_equal(s, want);
          assert_true(s >= 0 && s < hw);
        }
        for (int d = 0; d <= hw; d++) {
          const int s = shfl_up_src(self, d, width);
          /* CUDA: the lower delta lanes of each segment keep their own value */
          const int want = (self - base) < d ? self : self - d;
          assert_int_equal(s, want);
        }
        for (int src = 0; src < 2 * hw; src++) {
          const int c = shfl_idx_src(SHFL_CUDA, self, src, width, hw);
          assert_int_equal(c, base + src % width);
          const int h = shfl_idx_src(SHFL_HIP_PRE_6_2, self, src, width, hw);
          if (src < width) assert_int_equal(h, c); /* the two agree for in-range lanes only */
        }
      }
    }
  }
  /* The kernels' own calls: width == WARP, so xor never leaves the warp and shfl_up only keeps
   * lanes < delta. */
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a];
    for (int o = 1; o < W; o <<= 1)
      for (int l = 0; l < W; l++) {
        assert_int_equal(shfl_xor_src(l, o, W), l ^ o);
        assert_int_equal(shfl_up_src(l, o, W), l >= o ? l - o : l);
      }
  }
}

/* warp_sum (f32, f64, int) and warp_max against fp64, and every lane holding the same bits:
 * the attention kernel branches on the reduced score per lane (`if (mn == -INFINITY) continue`)
 * and only lane 0 stores it, so a butterfly that left lanes disagreeing would diverge. */
static void test_warp_reductions(void **state) {
  (void)state;
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a];
    for (int rep = 0; rep < 200; rep++) {
      float vf[MAXW] = {0}, mf[MAXW] = {0};
      double vd[MAXW] = {0}, ref = 0.0, refabs = 0.0, refmax = -INFINITY;
      int vi[MAXW] = {0};
      long long refi = 0;
      for (int l = 0; l < W; l++) {
        vf[l] = rng_float(-100.0f, 100.0f) * (rng_int(0, 9) == 0 ? 1e4f : 1.0f);
        mf[l] = rep % 7 == 0 && l != rep % W ? -INFINITY : vf[l];
        vd[l] = vf[l];
        vi[l] = rng_int(-100000, 100000);
        ref += vf[l];
        refabs += fabs(vf[l]);
        refmax = fmax(refmax, mf[l]);
        refi += vi[l];
      }
      warp_sum_f(vf, W);
      warp_sum_d(vd, W);
      warp_sum_i(vi, W);
      warp_max_f(mf, W);
      for (int l = 0; l < W; l++) {
        assert_memory_equal(&vf[l], &vf[0], sizeof(float));
        assert_memory_equal(&vd[l], &vd[0], sizeof(double));
        assert_int_equal(vi[l], vi[0]);
        assert_memory_equal(&mf[l], &mf[0], sizeof(float));
      }
      check_close(vf[0], ref, 1e-6 * refabs, 0.0, "warp_sum<%d> f32", W);
      check_close(vd[0], ref, 1e-9, 1e-12, "warp_sum<%d> f64", W);
      assert_int_equal((long long)vi[0], refi);
      assert_true(mf[0] == (float)refmax);
    }
  }
}

/* block_sum / block_max for every block size a launcher uses with a block reduction, against
 * the scratch sizes declared at each call site. */
static void test_block_reductions(void **state) {
  (void)state;
  static float vf[MAXT], mf[MAXT];
  static double vd[MAXT];
  static int vi[MAXT];
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a];
    /* rmsnorm_kernel: __shared__ float scratch[1024 / WARP + 1], blocks of 256, 512, 1024
     * (cuda_launch_rmsnorm); sample kernels: row_scratch<WARP>.f/.i/.d[SAMPLE_THREADS / WARP],
     * blocks of SAMPLE_THREADS. */
    const struct {
      int block_dim, cap;
    } sites[] = {{256, 1024 / W + 1},
                 {512, 1024 / W + 1},
                 {1024, 1024 / W + 1},
                 {SAMPLE_THREADS, SAMPLE_THREADS / W}};
    for (size_t c = 0; c < ARRAY_LEN(sites); c++) {
      const int dim = sites[c].block_dim, cap = sites[c].cap;
      for (int rep = 0; rep < 20; rep++) {
        double ref = 0.0, refabs = 0.0, refmax = -INFINITY;
        long long refi = 0;
        for (int t = 0; t < dim; t++) {
          vf[t] = rng_float(-1.0f, 1.0f);
          vd[t] = vf[t];
          mf[t] = rng_float(-50.0f, 50.0f);
          vi[t] = rng_int(-1000, 1000);
          ref += vf[t];
          refabs += fabs(vf[t]);
          refmax = fmax(refmax, mf[t]);
          refi += vi[t];
        }
        float sf[MAXT / 16 + 1];
        double sd[MAXT / 16 + 1];
        int si[MAXT / 16 + 1];
        const float rf = block_sum_f(vf, W, dim, sf, cap);
        const double rd = block_sum_d(vd, W, dim, sd, cap);
        const int ri = block_sum_i(vi, W, dim, si, cap);
        const float rm = block_max_f(mf, W, dim, sf, cap);
        check_close(rf, ref, 1e-6 * refabs, 0.0, "block_sum<%d> f32, %d threads", W, dim);
        check_close(rd, ref, 1e-12 * refabs, 0.0, "block_sum<%d> f64, %d threads", W, dim);
        assert_int_equal((long long)ri, refi);
        assert_true(rm == (float)refmax);
      }
    }
  }
}

/* block_scan (int and f64, as sample_kernel uses them) and block_min_int. */
static void test_block_scan_min(void **state) {
  (void)state;
  static int vi[MAXT], vm[MAXT];
  static double vd[MAXT], in_d[MAXT];
  static int in_i[MAXT];
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a], dim = SAMPLE_THREADS, cap = SAMPLE_THREADS / W;
    int si[SAMPLE_THREADS / 16];
    double sd[SAMPLE_THREADS / 16];
    for (int rep = 0; rep < 30; rep++) {
      int want_min = INT_MAX;
      for (int t = 0; t < dim; t++) {
        in_i[t] = vi[t] = rng_int(0, 3) == 0; /* flags, as the tie counts scan them */
        in_d[t] = vd[t] = rng_int(0, 2) ? rng_uniform() : 0.0;
        vm[t] = rng_int(0, 4) ? INT_MAX : rng_int(0, 1 << 20);
        want_min = vm[t] < want_min ? vm[t] : want_min;
      }
      int ti;
      double td;
      block_scan_i(vi, W, dim, si, cap, &ti);
      block_scan_d(vd, W, dim, sd, cap, &td);
      long long ri = 0;
      double rd = 0.0;
      for (int t = 0; t < dim; t++) {
        ri += in_i[t];
        rd += in_d[t];
        assert_int_equal((long long)vi[t], ri);
        check_close(vd[t], rd, 1e-12, 1e-12, "block_scan<%d> f64 at thread %d", W, t);
      }
      assert_int_equal((long long)ti, ri);
      check_close(td, rd, 1e-12, 1e-12, "block_scan<%d> f64 total", W);
      assert_int_equal(block_min_int(vm, W, dim, si, cap), want_min);
    }
    /* Without the `lane >= o` guard the scan would add the lanes' own values again: the lower
     * o lanes of kiln_shfl_up get their own value, on both vendors. */
    int ones[MAXW], n[MAXW];
    for (int l = 0; l < W; l++) ones[l] = 1;
    shfl_up_i(ones, n, W, 1);
    assert_int_equal(n[0], 1);
  }
}

/* ============================================================================================
 * rmsnorm (cuda_ops.cu rmsnorm_kernel + cuda_launch_rmsnorm), f32 storage (round_to<float> is
 * the identity; the other dtypes only round where hal.h says, which is not warp-dependent).
 * ==========================================================================================*/

static void emu_rmsnorm_row(int W, const float *xr, float *rr, const float *w, float *orow, int H,
                            float eps, float offset, int *writes) {
  /* cuda_launch_rmsnorm: threads = H >= 4096 ? 1024 : H >= 1024 ? 512 : 256 */
  const int threads = H >= 4096 ? 1024 : H >= 1024 ? 512 : 256;
  static float ss[MAXT];
  float scratch[1024 / 16 + 1]; /* __shared__ float scratch[1024 / WARP + 1] */
  for (int tid = 0; tid < threads; tid++) {
    ss[tid] = 0.0f;
    for (int64_t h = tid; h < H; h += threads) {
      float v = xr[h];
      if (rr) {
        v = v + rr[h];
        rr[h] = v;
      }
      ss[tid] += v * v;
    }
  }
  const float total = block_sum_f(ss, W, threads, scratch, 1024 / W + 1);
  const float inv = 1.0f / sqrtf(total / (float)H + eps);
  for (int tid = 0; tid < threads; tid++)
    for (int64_t h = tid; h < H; h += threads) {
      const float v = rr ? rr[h] : xr[h];
      const float n = v * inv;
      orow[h] = n * (w[h] + offset);
      writes[h]++;
    }
}

static void test_rmsnorm(void **state) {
  (void)state;
  const int Hs[] = {1, 7, 64, 255, 256, 257, 1000, 1024, 1500, 4095, 4096, 5000};
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a];
    for (size_t b = 0; b < ARRAY_LEN(Hs); b++) {
      const int H = Hs[b];
      const bool with_res = b % 2 == 0;
      float *x = malloc(sizeof(float) * (size_t)H * 4), *res = x + H, *w = res + H, *out = w + H;
      double *dx = malloc(sizeof(double) * (size_t)H * 4), *dres = dx + H, *dw = dres + H,
             *dout = dw + H;
      int *writes = calloc((size_t)H, sizeof(int));
      assert_true(x && dx && writes);
      for (int h = 0; h < H; h++) {
        dx[h] = x[h] = rng_float(-2.0f, 2.0f);
        dres[h] = res[h] = rng_float(-1.0f, 1.0f);
        dw[h] = w[h] = rng_float(0.5f, 1.5f);
      }
      emu_rmsnorm_row(W, x, with_res ? res : NULL, w, out, H, 1e-6f, 0.0f, writes);
      ops_ref_rmsnorm(KILN_HAL_F32, 1, H, dx, with_res ? dres : NULL, dw, 1e-6, 0.0, dout);
      for (int h = 0; h < H; h++) {
        assert_int_equal(writes[h], 1);
        check_close(out[h], dout[h], 1e-5, 1e-5, "rmsnorm<%d> H=%d element %d", W, H, h);
        if (with_res) check_close(res[h], dres[h], 0.0, 0.0, "rmsnorm<%d> residual %d", W, h);
      }
      free(x);
      free(dx);
      free(writes);
    }
  }
}

/* ============================================================================================
 * layernorm (cuda_ops.cu layernorm_kernel + cuda_launch_layernorm), f32 storage, as rmsnorm.
 * ==========================================================================================*/

static void emu_layernorm_row(int W, const float *xr, float *rr, const float *w, const float *b,
                              float *orow, int H, float eps, int *writes) {
  /* cuda_launch_layernorm: threads = H >= 4096 ? 1024 : H >= 1024 ? 512 : 256 */
  const int threads = H >= 4096 ? 1024 : H >= 1024 ? 512 : 256;
  static float part[MAXT];
  float scratch[1024 / 16 + 1]; /* __shared__ float scratch[1024 / WARP + 1] */
  for (int tid = 0; tid < threads; tid++) {
    part[tid] = 0.0f;
    for (int64_t h = tid; h < H; h += threads) {
      float v = xr[h];
      if (rr) {
        v = v + rr[h];
        rr[h] = v;
      }
      part[tid] += v;
    }
  }
  const float mean = block_sum_f(part, W, threads, scratch, 1024 / W + 1) / (float)H;
  for (int tid = 0; tid < threads; tid++) {
    part[tid] = 0.0f;
    for (int64_t h = tid; h < H; h += threads) {
      const float d = (rr ? rr[h] : xr[h]) - mean;
      part[tid] += d * d;
    }
  }
  const float inv =
      1.0f / sqrtf(block_sum_f(part, W, threads, scratch, 1024 / W + 1) / (float)H + eps);
  for (int tid = 0; tid < threads; tid++)
    for (int64_t h = tid; h < H; h += threads) {
      const float d = (rr ? rr[h] : xr[h]) - mean;
      orow[h] = d * inv * w[h] + (b ? b[h] : 0.0f);
      writes[h]++;
    }
}

static void test_layernorm(void **state) {
  (void)state;
  const int Hs[] = {1, 7, 64, 255, 256, 257, 1000, 1024, 1280, 3584, 4095, 4096, 5000};
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a];
    for (size_t c = 0; c < ARRAY_LEN(Hs); c++) {
      const int H = Hs[c];
      const bool with_res = c % 2 == 0, with_bias = c % 3 != 1;
      float *x = malloc(sizeof(float) * (size_t)H * 5), *res = x + H, *w = res + H, *b = w + H,
            *out = b + H;
      double *dx = malloc(sizeof(double) * (size_t)H * 5), *dres = dx + H, *dw = dres + H,
             *db = dw + H, *dout = db + H;
      int *writes = calloc((size_t)H, sizeof(int));
      assert_true(x && dx && writes);
      const float mean = rng_float(-10.0f, 10.0f); /* rows centred away from 0 */
      for (int h = 0; h < H; h++) {
        dx[h] = x[h] = mean + rng_float(-2.0f, 2.0f);
        dres[h] = res[h] = rng_float(-1.0f, 1.0f);
        dw[h] = w[h] = rng_float(-1.5f, 1.5f);
        db[h] = b[h] = rng_float(-0.5f, 0.5f);
      }
      emu_layernorm_row(W, x, with_res ? res : NULL, w, with_bias ? b : NULL, out, H, 1e-6f,
                        writes);
      ops_ref_layernorm(KILN_HAL_F32, 1, H, dx, with_res ? dres : NULL, dw, with_bias ? db : NULL,
                        1e-6, dout);
      for (int h = 0; h < H; h++) {
        assert_int_equal(writes[h], 1);
        check_close(out[h], dout[h], 1e-4, 1e-5, "layernorm<%d> H=%d element %d", W, H, h);
        if (with_res) check_close(res[h], dres[h], 0.0, 0.0, "layernorm<%d> residual %d", W, h);
      }
      free(x);
      free(dx);
      free(writes);
    }
  }
}

/* ============================================================================================
 * Sampling kernels (cuda_sample.cu): one block of SAMPLE_THREADS per row.
 * ==========================================================================================*/

/* cuda_sample.cu row_scratch<WARP>: f, i, d[SAMPLE_THREADS / WARP] (sized here for W = 16). */
typedef struct row_scratch {
  float f[SAMPLE_THREADS / 16];
  int i[SAMPLE_THREADS / 16];
  double d[SAMPLE_THREADS / 16];
  int cap; /* SAMPLE_THREADS / WARP: what the kernel declares */
} row_scratch_t;

/* Per-thread registers of the emulated block. */
static float t_f[MAXT], t_f2[MAXT];
static int t_i[MAXT], t_i2[MAXT];
static double t_d[MAXT];

/* cuda_sample.cu fkey / fval: order-preserving f32 <-> u32. */
static uint32_t fkey(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
static float fval(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

/* cuda_sample.cu row_argmax_lse<WARP>. */
static void emu_row_argmax_lse(int W, const float *x, int V, row_scratch_t *sc, float *out_max,
                               int *out_id, double *out_logsum) {
  const int dim = SAMPLE_THREADS;
  for (int tid = 0; tid < dim; tid++) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int v = tid; v < V; v += dim) {
      const float xv = x[v];
      if (ranks_before(xv, v, bv, bi)) {
        bv = xv;
        bi = v;
      }
    }
    t_f[tid] = bv;
    t_i[tid] = bi;
  }
  block_best(W, dim, t_f, t_i, sc->f, sc->i, sc->cap);
  float bv = t_f[0];
  int bi = t_i[0];
  if (bi == INT_MAX) bi = 0; /* a row of NaNs */
  for (int tid = 0; tid < dim; tid++) {
    double z = 0.0;
    for (int v = tid; v < V; v += dim) z += (double)expf(x[v] - bv);
    t_d[tid] = z;
  }
  const double z = block_sum_d(t_d, W, dim, sc->d, sc->cap);
  *out_max = bv;
  *out_id = bi;
  *out_logsum = log(z);
}

/* cuda_sample.cu topk_kernel<WARP> (one row): k selection passes, then the lse. */
static void emu_topk_row(int W, const float *x, int V, int k, float *vals, int *ids, float *lse) {
  row_scratch_t sc = {.cap = SAMPLE_THREADS / W};
  const int dim = SAMPLE_THREADS;
  float pv = INFINITY;
  int pi = -1;
  for (int r = 0; r < k; r++) {
    for (int tid = 0; tid < dim; tid++) {
      float bv = -INFINITY;
      int bi = INT_MAX;
      for (int v = tid; v < V; v += dim) {
        const float xv = x[v];
        if (ranks_before(pv, pi, xv, v) && ranks_before(xv, v, bv, bi)) {
          bv = xv;
          bi = v;
        }
      }
      t_f[tid] = bv;
      t_i[tid] = bi;
    }
    block_best(W, dim, t_f, t_i, sc.f, sc.i, sc.cap);
    float bv = t_f[0];
    int bi = t_i[0];
    if (bi == INT_MAX) bi = 0;
    vals[r] = bv;
    ids[r] = bi;
    pv = bv;
    pi = bi;
  }
  float M;
  int id;
  double logz;
  emu_row_argmax_lse(W, x, V, &sc, &M, &id, &logz);
  *lse = (float)((double)M + logz);
}

/* A row of logits with ties (values on a coarse grid) and, sometimes, -inf entries. */
static void random_logits(float *x, int V, bool ties, bool with_ninf) {
  for (int v = 0; v < V; v++) {
    x[v] = ties ? (float)rng_int(-40, 40) * 0.25f : rng_float(-8.0f, 8.0f);
    if (with_ninf && rng_int(0, 9) == 0) x[v] = -INFINITY;
  }
}

static void test_argmax_topk(void **state) {
  (void)state;
  const int Vs[] = {1, 2, 31, 64, 100, 1023, 1024, 1025, 3000, 5000};
  float *x = malloc(sizeof(float) * 5000);
  double *dx = malloc(sizeof(double) * 5000);
  assert_true(x && dx);
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a];
    for (size_t b = 0; b < ARRAY_LEN(Vs); b++) {
      for (int variant = 0; variant < 3; variant++) {
        const int V = Vs[b];
        random_logits(x, V, variant >= 1, variant == 2);
        if (variant == 2 && rng_int(0, 1)) x[rng_int(0, V - 1)] = 9.0f; /* keep a finite max */
        for (int v = 0; v < V; v++) dx[v] = x[v];
        /* argmax_kernel */
        row_scratch_t sc = {.cap = SAMPLE_THREADS / W};
        float M;
        int id;
        double logz;
        emu_row_argmax_lse(W, x, V, &sc, &M, &id, &logz);
        const float lp = (float)((double)x[id] - (double)M - logz);
        double ref_lp;
        const int32_t ref_id = ops_ref_argmax(V, dx, &ref_lp);
        if (id != ref_id)
          fail_msg("argmax<%d> V=%d: id %d, want %d (seed %llu)", W, V, id, ref_id,
                   (unsigned long long)g_seed);
        if (M > -INFINITY) check_close(lp, ref_lp, 1e-5, 1e-5, "argmax<%d> logprob V=%d", W, V);
        /* topk_kernel */
        const int k = V < 8 ? V : 8;
        float vals[8], lse;
        int ids[8];
        int32_t rids[8];
        double rvals[8];
        emu_topk_row(W, x, V, k, vals, ids, &lse);
        ops_ref_topk(V, dx, k, rids, rvals);
        for (int r = 0; r < k; r++) {
          if (ids[r] != rids[r])
            fail_msg("topk<%d> V=%d rank %d: id %d, want %d (seed %llu)", W, V, r, ids[r], rids[r],
                     (unsigned long long)g_seed);
          assert_true(vals[r] == (float)rvals[r]);
        }
        if (M > -INFINITY)
          check_close(lse, ops_ref_logsumexp(V, dx), 1e-5, 1e-6, "topk<%d> lse V=%d", W, V);
      }
    }
    /* A row of NaNs yields an index in [0, V) (hal.h), from the `bi == INT_MAX` fallback. */
    for (int v = 0; v < 300; v++) x[v] = NAN;
    row_scratch_t sc = {.cap = SAMPLE_THREADS / W};
    float M;
    int id;
    double logz;
    emu_row_argmax_lse(W, x, 300, &sc, &M, &id, &logz);
    assert_true(id >= 0 && id < 300);
  }
  free(x);
  free(dx);
}

/* cuda_sample.cu min_present_at_least<WARP>: the smallest value whose key is >= k0. */
static float emu_min_present_at_least(int W, const float *x, int V, uint32_t k0,
                                      row_scratch_t *sc) {
  for (int tid = 0; tid < SAMPLE_THREADS; tid++) {
    float best = INFINITY;
    for (int v = tid; v < V; v += SAMPLE_THREADS) {
      const float xv = x[v];
      if (fkey(xv) >= k0 && xv < best) best = xv;
    }
    t_f[tid] = -best;
  }
  return -block_max_f(t_f, W, SAMPLE_THREADS, sc->f, sc->cap);
}

/* The per-row parameters of sample_kernel (absent = the kernel's default). */
typedef struct sample_params {
  float t, u;
  bool has_k, has_p, has_min;
  int top_k;
  float top_p, min_p;
} sample_params_t;

/* cuda_sample.cu sample_kernel<WARP> (one row). Returns the chosen id; *out_logprob its
 * logprob. Per-thread accumulators live in t_*; every block function returns to all threads. */
static int emu_sample_row(int W, const float *x, int V, const sample_params_t *sp,
                          float *out_logprob) {
  const int dim = SAMPLE_THREADS;
  row_scratch_t sc = {.cap = SAMPLE_THREADS / W};
  float M;
  int am;
  double logz;
  emu_row_argmax_lse(W, x, V, &sc, &M, &am, &logz);
  const float t = sp->t;
  int chosen = am;
  if (t > 0.0f && M > -INFINITY) {
    const float u = sp->u;
    const int K = sp->has_k ? sp->top_k : 0;
    const float tp = sp->has_p ? sp->top_p : 1.0f;
    const float mp = sp->has_min ? sp->min_p : 0.0f;
    const bool use_k = K > 0 && K < V, use_p = tp<1.0f, use_min = mp> 0.0f;
    const float inv_t = 1.0f / t;
#define E_OF(xv) expf(((xv)-M) * inv_t)
    for (int tid = 0; tid < dim; tid++) {
      double Z = 0.0;
      float mn = INFINITY;
      for (int v = tid; v < V; v += dim) {
        const float xv = x[v];
        Z += (double)E_OF(xv);
        mn = fminf(mn, xv);
      }
      t_d[tid] = Z;
      t_f2[tid] = -mn;
    }
    const double Z = block_sum_d(t_d, W, dim, sc.d, sc.cap);
    const float mn = -block_max_f(t_f2, W, dim, sc.f, sc.cap);

    float cK = -INFINITY, cP = -INFINITY;
    long long allowK = LLONG_MAX, allowP = LLONG_MAX;
    if (use_k) {
      uint32_t lo = fkey(mn), hi = fkey(M);
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        const float th = fval(mid);
        for (int tid = 0; tid < dim; tid++) {
          int c = 0;
          for (int v = tid; v < V; v += dim) c += x[v] > th;
          t_i[tid] = c;
        }
        const int c = block_sum_i(t_i, W, dim, sc.i, sc.cap);
        if (c < K)
          hi = mid;
        else
          lo = mid + 1;
      }
      cK = emu_min_present_at_least(W, x, V, lo, &sc);
      for (int tid = 0; tid < dim; tid++) {
        int c = 0;
        for (int v = tid; v < V; v += dim) c += x[v] > cK;
        t_i[tid] = c;
      }
      const int c = block_sum_i(t_i, W, dim, sc.i, sc.cap);
      allowK = (long long)K - c;
    }
    if (use_p) {
      const double target = (double)tp * Z;
      if (target <= 0.0) {
        cP = M;
        allowP = 0;
      } else {
        uint32_t lo = fkey(mn), hi = fkey(M);
        while (lo < hi) {
          const uint32_t mid = lo + (hi - lo) / 2;
          const float th = fval(mid);
          for (int tid = 0; tid < dim; tid++) {
            double g = 0.0;
            for (int v = tid; v < V; v += dim) {
              const float xv = x[v];
              if (xv > th) g += (double)E_OF(xv);
            }
            t_d[tid] = g;
          }
          const double g = block_sum_d(t_d, W, dim, sc.d, sc.cap);
          if (g < target)
            hi = mid;
          else
            lo = mid + 1;
        }
        cP = emu_min_present_at_least(W, x, V, lo, &sc);
        for (int tid = 0; tid < dim; tid++) {
          double g = 0.0;
          for (int v = tid; v < V; v += dim) {
            const float xv = x[v];
            if (xv > cP) g += (double)E_OF(xv);
          }
          t_d[tid] = g;
        }
        const double g = block_sum_d(t_d, W, dim, sc.d, sc.cap);
        const double ec = (double)E_OF(cP);
        if (ec > 0.0) {
          const double q = ceil((target - g) / ec);
          allowP = q <= 0.0 ? 0 : q >= 9.0e18 ? LLONG_MAX : (long long)q;
        }
      }
    }

    /* Two scans in index order: pass 0 sums the kept mass W, pass 1 finds the token. */
    static bool keep[MAXT];
    static float xvs[MAXT], evs[MAXT];
    static int flags[MAXT];
    double Wm = 0.0;
    int found = INT_MAX;
    for (int pass = 0; pass < 2 && found == INT_MAX; pass++) {
      const double thr = (double)u * Wm;
      long long tiesK = 0, tiesP = 0;
      double cum = 0.0;
      for (int base = 0; base < V; base += dim) {
        for (int tid = 0; tid < dim; tid++) {
          const int v = base + tid;
          const bool in = v < V;
          xvs[tid] = in ? x[v] : -INFINITY;
          evs[tid] = in ? E_OF(xvs[tid]) : 0.0f;
          keep[tid] = in;
        }
        if (use_k) {
          int tk;
          for (int tid = 0; tid < dim; tid++)
            t_i[tid] = flags[tid] = base + tid < V && xvs[tid] == cK;
          block_scan_i(t_i, W, dim, sc.i, sc.cap, &tk);
          for (int tid = 0; tid < dim; tid++) {
            const int rk = t_i[tid] - flags[tid];
            keep[tid] = keep[tid] && (xvs[tid] > cK || (flags[tid] && tiesK + rk < allowK));
          }
          tiesK += tk;
        }
        if (use_p) {
          int tpn;
          for (int tid = 0; tid < dim; tid++)
            t_i[tid] = flags[tid] = base + tid < V && xvs[tid] == cP;
          block_scan_i(t_i, W, dim, sc.i, sc.cap, &tpn);
          for (int tid = 0; tid < dim; tid++) {
            const int rp = t_i[tid] - flags[tid];
            keep[tid] = keep[tid] && (xvs[tid] > cP || (flags[tid] && tiesP + rp < allowP));
          }
          tiesP += tpn;
        }
        for (int tid = 0; tid < dim; tid++) {
          if (use_min) keep[tid] = keep[tid] && evs[tid] >= mp;
          if (base + tid == am) keep[tid] = true;
          t_d[tid] = keep[tid] ? (double)evs[tid] : 0.0;
        }
        double tot;
        block_scan_d(t_d, W, dim, sc.d, sc.cap, &tot);       /* t_d[tid] = the inclusive prefix */
        for (int tid = 0; tid < dim; tid++) t_d[tid] += cum; /* incl = cum + block_scan(...) */
        cum += tot;
        if (pass == 1) {
          for (int tid = 0; tid < dim; tid++)
            t_i2[tid] = keep[tid] && t_d[tid] > thr ? base + tid : INT_MAX;
          found = block_min_int(t_i2, W, dim, sc.i, sc.cap);
          if (found != INT_MAX) break;
        }
      }
      Wm = cum;
    }
#undef E_OF
    chosen = found == INT_MAX ? am : found;
  }
  *out_logprob = (float)((double)x[chosen] - (double)M - logz);
  return chosen;
}

/* sample_kernel against ops_ref_sample: the same token, except where the reference reports a
 * decision within 1e-4 (relative) of its threshold, where f32 softmax terms may decide
 * otherwise (the bound tests/test_sampler.c uses for the CPU backend); such rows are redrawn. */
static void test_sample(void **state) {
  (void)state;
  float *x = malloc(sizeof(float) * 3000);
  double *dx = malloc(sizeof(double) * 3000);
  assert_true(x && dx);
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a];
    int checked = 0, redrawn = 0;
    while (checked < 24) {
      const int V = rng_int(0, 3) == 0 ? rng_int(1, 40) : rng_int(900, 3000);
      random_logits(x, V, rng_int(0, 1), rng_int(0, 4) == 0);
      x[rng_int(0, V - 1)] = 5.0f;
      for (int v = 0; v < V; v++) dx[v] = x[v];
      sample_params_t sp = {.t = rng_int(0, 5) == 0 ? 0.0f : rng_float(0.3f, 2.0f),
                            .u = (float)rng_uniform(),
                            .has_k = rng_int(0, 1),
                            .has_p = rng_int(0, 1),
                            .has_min = rng_int(0, 2) == 0,
                            .top_k = rng_int(0, 1) ? rng_int(1, 50) : rng_int(0, V + 2),
                            .top_p = rng_float(0.05f, 1.0f),
                            .min_p = rng_float(0.0f, 0.3f)};
      double margin;
      const int32_t ref =
          ops_ref_sample(V, dx, sp.t, sp.has_k ? sp.top_k : 0, sp.has_p ? sp.top_p : 1.0,
                         sp.has_min ? sp.min_p : 0.0, sp.u, &margin);
      if (margin < 1e-4) {
        redrawn++;
        continue;
      }
      float lp;
      const int got = emu_sample_row(W, x, V, &sp, &lp);
      if (got != ref)
        fail_msg(
            "sample<%d> V=%d t=%g k=%d(%d) p=%g(%d) min_p=%g(%d) u=%g: id %d, want %d "
            "(seed %llu)",
            W, V, sp.t, sp.top_k, sp.has_k, sp.top_p, sp.has_p, sp.min_p, sp.has_min, sp.u, got,
            ref, (unsigned long long)g_seed);
      check_close(lp, dx[got] - ops_ref_logsumexp(V, dx), 1e-5, 1e-5, "sample<%d> logprob", W);
      checked++;
    }
    printf("test_warp: sample<%d>: %d rows checked, %d redrawn near a threshold\n", W, checked,
           redrawn);
  }
  free(x);
  free(dx);
}

/* ============================================================================================
 * Attention (cuda_attention.cu): the CUDA-core kernel, f32 storage.
 * ==========================================================================================*/

/* cuda_attention.cu attention_dispatch_e: E for head dim D, or 0 (cudaErrorInvalidValue). */
static int att_e_for(int D, int W) {
  if (D <= 2 * W) return 2;
  if (D <= 4 * W) return 4;
  if (D <= 8 * W) return 8;
  return 0;
}

/* cuda_attention.cu attention_launch: QT. */
static int att_qt_for(int W, int max_query_len) {
  const int NW = ATT_THREADS / W;
  int QT = 1;
  while (QT < NW && QT < max_query_len && QT < 8) QT *= 2;
  return QT;
}

/* Every lane mapping of the kernel, for every head dim 1..256 and width: d = e * WARP + lane
 * covers [0, D) exactly once with E from attention_dispatch_e, and stays inside sm_acc's row of
 * E * WARP; QT query rows x KW key warps are a bijection onto the NW warps, the merge reads
 * exactly the KW warps of its row, tiles cover every query row once, and the round-robin key
 * groups cover every visible key once; the static shared memory fits 48 KiB (CUDA) and 64 KiB
 * (one CDNA workgroup's LDS). */
static void test_attention_mapping(void **state) {
  (void)state;
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a], NW = ATT_THREADS / W;
    for (int D = 1; D <= 256; D++) {
      const int E = att_e_for(D, W);
      if (E == 0) {
        assert_true(W < 32); /* only the hypothetical 16-lane warp cannot take D > 128 */
        continue;
      }
      int seen[256] = {0};
      for (int lane = 0; lane < W; lane++)
        for (int e = 0; e < E; e++) {
          const int64_t d = (int64_t)e * W + lane;
          CHECK_INDEX(e * W + lane, E * W, "sm_acc[wid][e * WARP + lane]");
          if (d < D) seen[d]++;
        }
      for (int d = 0; d < D; d++)
        if (seen[d] != 1)
          fail_msg("attention<%d> D=%d E=%d: element %d handled %d times", W, D, E, d, seen[d]);
      const size_t smem = sizeof(float) * (size_t)(2 * NW + NW * E * W);
      assert_true(smem <= 48 * 1024);
    }
    for (int mql = 1; mql <= 64; mql++) {
      const int QT = att_qt_for(W, mql), KW = NW / QT;
      assert_true(QT >= 1 && QT <= 8 && NW % QT == 0 && KW >= 1);
      int pair[8][MAXT / 16] = {{0}};
      for (int wid = 0; wid < NW; wid++) {
        const int r = wid % QT, kw = wid / QT;
        CHECK_INDEX(kw, KW, "kw");
        pair[r][kw]++;
      }
      for (int r = 0; r < QT; r++) {
        for (int kw = 0; kw < KW; kw++) assert_int_equal(pair[r][kw], 1);
        /* the merge: for (w = 0; w < KW; w++) src = r + w * QT, which is warp (r, kw = w) */
        for (int w = 0; w < KW; w++) {
          const int src = r + w * QT;
          CHECK_INDEX(src, NW, "sm_m[r + w * QT]");
          assert_int_equal(src % QT, r);
          assert_int_equal(src / QT, w);
        }
      }
      const int64_t ntiles = ((int64_t)mql + QT - 1) / QT;
      int rows[64] = {0};
      for (int64_t tile = 0; tile < ntiles; tile++)
        for (int r = 0; r < QT; r++) {
          const int64_t i = tile * QT + r;
          if (i < mql) rows[i]++;
        }
      for (int i = 0; i < mql; i++) assert_int_equal(rows[i], 1);
      /* keys: for (j0 = lo + kw * U; j0 < hi; j0 += KW * U) keys j0 .. j0 + U - 1 (< hi) */
      for (int rep = 0; rep < 4; rep++) {
        const int64_t lo = rng_int(0, 50), hi = lo + rng_int(0, 200);
        static int keys[300];
        memset(keys, 0, sizeof(keys));
        for (int kw = 0; kw < KW; kw++)
          for (int64_t j0 = lo + (int64_t)kw * ATT_U; j0 < hi; j0 += (int64_t)KW * ATT_U)
            for (int u = 0; u < ATT_U; u++)
              if (j0 + u < hi) keys[j0 + u]++;
        for (int64_t j = 0; j < 300; j++) assert_int_equal(keys[j], j >= lo && j < hi ? 1 : 0);
      }
    }
  }
}

/* One attention problem: q [T, NH, D], caches [NB, NKV, BS, D] (unused slots NaN), the block
 * table [S, MB], seq_lens [S], query_start_loc [S + 1]. */
typedef struct att_case {
  int S, T, NH, NKV, D, BS, NB, MB, max_query_len;
  float scale, softcap;
  int sliding_window;
  bool causal;
  int32_t qsl[9], seq_lens[8], *bt;
  float *q, *kc, *vc;
} att_case_t;

/* cuda_attention.cu attention_kernel<WARP, T = float, E> for block (blockIdx.x = bx,
 * blockIdx.y = s - seq_base). Warps run one after the other up to the __syncthreads() (they
 * share nothing before it); the lanes of a warp run in lockstep. writes[] counts the stores to
 * each element of out. */
static void emu_attention_block(const att_case_t *p, int W, int E, int QT, int64_t bx, int s,
                                float *out, int *writes) {
  const int NW = ATT_THREADS / W, U = ATT_U;
  float sm_m[MAXT / 16], sm_l[MAXT / 16];
  static float sm_acc[MAXT / 16][8 * MAXW]; /* __shared__ float sm_acc[NW][E * WARP] */
  const int KW = NW / QT;
  const int64_t NH = p->NH, D = p->D, T_rows = p->T;
  const int64_t h = bx % NH, tile = bx / NH;
  const int32_t qs = p->qsl[s], qe = p->qsl[s + 1], L = p->seq_lens[s];
  const int64_t q_len = (int64_t)qe - qs;
  const int64_t kvh = h / (NH / p->NKV);
  const int64_t BS = p->BS, head_off = kvh * BS * D, blk_elems = (int64_t)p->NKV * BS * D;
  const int32_t *bt = p->bt + (int64_t)s * p->MB;
  bool valid_of[MAXT / 16];

  for (int wid = 0; wid < NW; wid++) {
    const int r = wid % QT, kw = wid / QT;
    const int64_t i = tile * QT + r;
    const bool valid = qs >= 0 && i < q_len && (int64_t)qs + i < T_rows;
    valid_of[wid] = valid;
    float qv[8][MAXW], acc[8][MAXW], m[MAXW], l[MAXW];
    for (int lane = 0; lane < W; lane++) {
      m[lane] = -INFINITY;
      l[lane] = 0.0f;
      for (int e = 0; e < E; e++) qv[e][lane] = acc[e][lane] = 0.0f;
    }
    int64_t lo = 0, hi = 0;
    if (valid) {
      const int64_t pos = (int64_t)L - q_len + i;
      hi = p->causal ? (pos + 1 < L ? pos + 1 : L) : L;
      lo = p->sliding_window > 0 ? pos - p->sliding_window + 1 : 0;
      if (lo < 0) lo = 0;
      const float *qrow = p->q + ((int64_t)qs + i) * NH * D + h * D;
      for (int lane = 0; lane < W; lane++)
        for (int e = 0; e < E; e++) {
          const int64_t d = (int64_t)e * W + lane;
          if (d < D) qv[e][lane] = qrow[d] * p->scale;
        }
    }
    for (int64_t j0 = lo + (int64_t)kw * U; j0 < hi; j0 += (int64_t)KW * U) {
      int64_t base[ATT_U];
      float sc[ATT_U][MAXW];
      for (int u = 0; u < U; u++) {
        const int64_t j = j0 + u;
        base[u] = -1;
        if (j < hi) {
          const int64_t bi = j / BS;
          if (bi < p->MB) {
            const int32_t blk = bt[bi];
            if (blk >= 0 && blk < p->NB) base[u] = blk * blk_elems + head_off + (j % BS) * D;
          }
        }
      }
      for (int u = 0; u < U; u++)
        for (int lane = 0; lane < W; lane++) {
          float dot = 0.0f;
          if (base[u] >= 0)
            for (int e = 0; e < E; e++) {
              const int64_t d = (int64_t)e * W + lane;
              if (d < D) dot += qv[e][lane] * p->kc[base[u] + d];
            }
          sc[u][lane] = dot;
        }
      for (int u = 0; u < U; u++) warp_sum_f(sc[u], W);
      bool skipped[MAXW];
      for (int lane = 0; lane < W; lane++) {
        float mn = m[lane];
        for (int u = 0; u < U; u++) {
          if (base[u] < 0) {
            sc[u][lane] = -INFINITY;
          } else if (p->softcap > 0.0f) {
            sc[u][lane] = p->softcap * tanhf(sc[u][lane] / p->softcap);
          }
          mn = fmaxf(mn, sc[u][lane]);
        }
        skipped[lane] = mn == -INFINITY;
        if (skipped[lane]) continue;
        const float corr = m[lane] == -INFINITY ? 0.0f : expf(m[lane] - mn);
        l[lane] *= corr;
        for (int e = 0; e < E; e++) acc[e][lane] *= corr;
        for (int u = 0; u < U; u++) {
          if (sc[u][lane] == -INFINITY) continue;
          const float pu = expf(sc[u][lane] - mn);
          l[lane] += pu;
          for (int e = 0; e < E; e++) {
            const int64_t d = (int64_t)e * W + lane;
            if (d < D) acc[e][lane] += pu * p->vc[base[u] + d];
          }
        }
        m[lane] = mn;
      }
      /* `continue` and the next iteration's warp_sum need the whole warp: the branch must be
       * warp-uniform (it is, because warp_sum leaves every lane the same bits). */
      for (int lane = 1; lane < W; lane++)
        if (skipped[lane] != skipped[0])
          fail_msg("attention<%d>: lanes disagree on skipping a key group", W);
    }
    sm_m[wid] = m[0]; /* if (lane == 0) */
    sm_l[wid] = l[0];
    for (int lane = 0; lane < W; lane++)
      for (int e = 0; e < E; e++) {
        CHECK_INDEX(e * W + lane, E * W, "sm_acc row");
        sm_acc[wid][e * W + lane] = acc[e][lane];
      }
  }
  /* __syncthreads(); if (kw != 0 || !valid) return; */
  for (int wid = 0; wid < NW; wid++) {
    const int r = wid % QT, kw = wid / QT;
    if (kw != 0 || !valid_of[wid]) continue;
    const int64_t i = tile * QT + r;
    for (int lane = 0; lane < W; lane++) {
      float M = -INFINITY;
      for (int w = 0; w < KW; w++) M = fmaxf(M, sm_m[r + w * QT]);
      float Ls = 0.0f, o[8];
      for (int e = 0; e < E; e++) o[e] = 0.0f;
      for (int w = 0; w < KW; w++) {
        const int src = r + w * QT;
        const float mw = sm_m[src];
        if (mw == -INFINITY) continue;
        const float f = expf(mw - M);
        Ls += sm_l[src] * f;
        for (int e = 0; e < E; e++) o[e] += sm_acc[src][e * W + lane] * f;
      }
      const float inv = Ls > 0.0f ? 1.0f / Ls : 0.0f;
      float *orow = out + ((int64_t)qs + i) * NH * D + h * D;
      for (int e = 0; e < E; e++) {
        const int64_t d = (int64_t)e * W + lane;
        if (d < D) {
          orow[d] = o[e] * inv;
          writes[((int64_t)qs + i) * NH * D + h * D + d]++;
        }
      }
    }
  }
}

/* cuda_attention.cu attention_launch<WARP, T, E>: grid x = NH * ntiles, y = sequences (the
 * launcher's chunks of 65535 sequences are not emulated: a problem here has at most 8). */
static void emu_attention(const att_case_t *p, int W, float *out, int *writes) {
  const int E = att_e_for(p->D, W);
  const int QT = att_qt_for(W, p->max_query_len);
  const int64_t ntiles = ((int64_t)p->max_query_len + QT - 1) / QT;
  for (int s = 0; s < p->S; s++)
    for (int64_t bx = 0; bx < p->NH * ntiles; bx++)
      emu_attention_block(p, W, E, QT, bx, s, out, writes);
}

static void test_attention(void **state) {
  (void)state;
  const int Ds[] = {1, 5, 16, 31, 32, 33, 63, 64, 80, 96, 100, 128, 129, 192, 255, 256};
  const int heads[][2] = {{1, 1}, {2, 2}, {4, 2}, {4, 1}, {6, 3}};
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a];
    for (size_t b = 0; b < ARRAY_LEN(Ds); b++) {
      const int D = Ds[b];
      if (att_e_for(D, W) == 0) continue; /* W = 16 and D > 128: the launcher refuses */
      for (int rep = 0; rep < 3; rep++) {
        att_case_t c = {0};
        const int *hv = heads[rng_int(0, (int)ARRAY_LEN(heads) - 1)];
        c.NH = hv[0];
        c.NKV = hv[1];
        c.D = D;
        c.S = rng_int(1, 4);
        const int bss[] = {1, 3, 8, 16};
        c.BS = bss[rng_int(0, 3)];
        c.causal = rng_int(0, 3) != 0;
        c.sliding_window = rng_int(0, 2) == 0 ? rng_int(1, 12) : 0;
        c.softcap = rng_int(0, 3) == 0 ? 5.0f : 0.0f;
        c.scale = 1.0f / sqrtf((float)D);
        int q_lens[8], total_blocks = 0, mql = 0;
        c.qsl[0] = 0;
        for (int s = 0; s < c.S; s++) {
          q_lens[s] = rng_int(0, 3) == 0 ? 1 : rng_int(1, 11);
          c.seq_lens[s] = q_lens[s] + rng_int(0, 30);
          c.qsl[s + 1] = c.qsl[s] + q_lens[s];
          mql = q_lens[s] > mql ? q_lens[s] : mql;
          const int nb = (c.seq_lens[s] + c.BS - 1) / c.BS;
          c.MB = nb > c.MB ? nb : c.MB;
          total_blocks += nb;
        }
        c.MB += rng_int(0, 1);
        c.max_query_len = mql + rng_int(0, 3); /* an upper bound, as under graph capture */
        c.T = c.qsl[c.S] + rng_int(0, 2);      /* rows past qsl[S] are not written */
        c.NB = total_blocks + rng_int(1, 3);
        /* a random permutation of blocks, each used once; table tails point at -1 or a
         * valid block beyond the sequence (the kernel must not read either) */
        int *perm = malloc(sizeof(int) * (size_t)c.NB);
        c.bt = malloc(sizeof(int32_t) * (size_t)c.S * (size_t)c.MB);
        const size_t qn = (size_t)c.T * c.NH * D, cn = (size_t)c.NB * c.NKV * c.BS * D;
        c.q = malloc(sizeof(float) * qn);
        c.kc = malloc(sizeof(float) * cn);
        c.vc = malloc(sizeof(float) * cn);
        float *out = malloc(sizeof(float) * qn);
        int *writes = calloc(qn, sizeof(int));
        double *dq = malloc(sizeof(double) * qn), *dout = malloc(sizeof(double) * qn);
        double *dk = malloc(sizeof(double) * cn), *dv = malloc(sizeof(double) * cn);
        assert_true(perm && c.bt && c.q && c.kc && c.vc && out && writes && dq && dout && dk && dv);
        for (int i = 0; i < c.NB; i++) perm[i] = i;
        for (int i = c.NB - 1; i > 0; i--) {
          const int j = rng_int(0, i), t = perm[i];
          perm[i] = perm[j];
          perm[j] = t;
        }
        for (size_t i = 0; i < cn; i++) c.kc[i] = c.vc[i] = NAN;
        int next = 0;
        for (int s = 0; s < c.S; s++) {
          const int nb = (c.seq_lens[s] + c.BS - 1) / c.BS;
          for (int bi = 0; bi < c.MB; bi++) c.bt[s * c.MB + bi] = bi < nb ? perm[next++] : -1;
          for (int j = 0; j < c.seq_lens[s]; j++) {
            const int blk = c.bt[s * c.MB + j / c.BS];
            for (int kvh = 0; kvh < c.NKV; kvh++)
              for (int d = 0; d < D; d++) {
                const size_t at = (((size_t)blk * c.NKV + kvh) * c.BS + j % c.BS) * D + d;
                c.kc[at] = rng_float(-1.0f, 1.0f);
                c.vc[at] = rng_float(-1.0f, 1.0f);
              }
          }
        }
        for (size_t i = 0; i < qn; i++) {
          dq[i] = c.q[i] = rng_float(-1.0f, 1.0f);
          out[i] = 12345.0f;
          dout[i] = 12345.0;
        }
        for (size_t i = 0; i < cn; i++) {
          dk[i] = c.kc[i];
          dv[i] = c.vc[i];
        }
        emu_attention(&c, W, out, writes);
        const ops_ref_attention_params_t rp = {.num_seqs = c.S,
                                               .NH = c.NH,
                                               .NKV = c.NKV,
                                               .D = D,
                                               .BS = c.BS,
                                               .MB = c.MB,
                                               .scale = c.scale,
                                               .causal = c.causal,
                                               .sliding_window = c.sliding_window,
                                               .softcap = c.softcap};
        assert_int_equal(ops_ref_attention(&rp, dq, dk, dv, c.bt, c.seq_lens, c.qsl, dout), 0);
        for (size_t i = 0; i < qn; i++) {
          const int64_t row = (int64_t)(i / ((size_t)c.NH * D));
          const int want_writes = row < c.qsl[c.S] ? 1 : 0;
          if (writes[i] != want_writes)
            fail_msg(
                "attention<%d> D=%d: element %zu (row %lld) written %d times, want %d "
                "(seed %llu)",
                W, D, i, (long long)row, writes[i], want_writes, (unsigned long long)g_seed);
          check_close(out[i], dout[i], 2e-5, 1e-4,
                      "attention<%d> D=%d S=%d NH=%d NKV=%d BS=%d causal=%d window=%d softcap=%g "
                      "element %zu",
                      W, D, c.S, c.NH, c.NKV, c.BS, c.causal, c.sliding_window, c.softcap, i);
        }
        free(perm);
        free(c.bt);
        free(c.q);
        free(c.kc);
        free(c.vc);
        free(out);
        free(writes);
        free(dq);
        free(dout);
        free(dk);
        free(dv);
      }
    }
  }
}

/* att_combine_kernel (cuda_attention_mma.cuh, NVIDIA only, 128 threads = 4 warps of 32):
 * d = e * 32 + lane with E = (D + 31) / 32 covers each of the tensor-core head dims once, and
 * the splits sp = warp, warp + 4, ... are each summed by one warp. Hard-coded 32 by design; a
 * port to 64-lane wavefronts would have to revisit this kernel (see the file header). */
static void test_mma_combine_mapping(void **state) {
  (void)state;
  const int Ds[] = {64, 80, 96, 128, 256};
  for (size_t b = 0; b < ARRAY_LEN(Ds); b++) {
    const int D = Ds[b], E = (D + 31) / 32;
    int seen[256] = {0};
    for (int tid = 0; tid < 128; tid++) {
      const int lane = tid % 32;
      if (tid / 32 != 0) continue; /* every warp covers the row; count one */
      for (int e = 0; e < E; e++) {
        const int d = e * 32 + lane;
        if (d < D) seen[d]++;
      }
    }
    for (int d = 0; d < D; d++) assert_int_equal(seen[d], 1);
  }
  for (int nsplit = 1; nsplit <= 256; nsplit++) {
    int seen[256] = {0};
    for (int warp = 0; warp < 4; warp++)
      for (int sp = warp; sp < nsplit; sp += 4) seen[sp]++;
    for (int sp = 0; sp < nsplit; sp++) assert_int_equal(seen[sp], 1);
  }
}

/* ============================================================================================
 * The decode gemv (cuda_gemv.cu gemv_kernel + gemv_launch). T = float here, with a "16-byte
 * piece" being 8 consecutive floats: unpack8 (bf16/f16 -> 8 f32) is the only change and is
 * not warp-dependent. Bias and beta * c as in the kernel; c f32.
 * ==========================================================================================*/

static void emu_gemv(int W, int M, const float *x, const float *w, float *c, const float *bias,
                     int N, int K, float alpha, float beta, int *reads, int *stores) {
  /* gemv_pick_m: MT = 1, 2, 4, 8; gemv_launch: NPW, UNROLL, cols_per_block, blocks */
  const int MT = M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : 8;
  const int NPW = MT <= 2 ? 2 : 4;
  const int UNROLL = MT <= 2 ? 4 : 2;
  const int cols_per_block = NPW * (GEMV_THREADS / W);
  const int64_t blocks = ((int64_t)N + cols_per_block - 1) / cols_per_block;
  for (int64_t blk = 0; blk < blocks; blk++) {
    for (int wp = 0; wp < GEMV_THREADS / W; wp++) { /* threadIdx.x / WARP */
      const int64_t n0 = (blk * (GEMV_THREADS / W) + wp) * NPW;
      if (n0 >= N) continue; /* return: warp-uniform */
      const float *wr[4];
      for (int j = 0; j < NPW; j++) {
        const int64_t n = n0 + j < N ? n0 + j : (int64_t)N - 1;
        wr[j] = w + n * K;
      }
      const float *xr[8];
      for (int m = 0; m < MT; m++) xr[m] = x + (int64_t)(m < M ? m : M - 1) * K;
      float acc[8][4][MAXW];
      for (int m = 0; m < MT; m++)
        for (int j = 0; j < NPW; j++)
          for (int lane = 0; lane < W; lane++) acc[m][j][lane] = 0.0f;
      const int K8 = K / 8;
      for (int lane = 0; lane < W; lane++) {
        for (int base = lane; base < K8; base += W * UNROLL) {
          /* the loads of wv[UNROLL][NPW] (k < K8 ? piece : zeros), then the arithmetic */
          for (int u = 0; u < UNROLL; u++) {
            const int k = base + u * W;
            if (k < K8) {
              for (int j = 0; j < NPW; j++)
                if (n0 + j < N) reads[(n0 + j) * K8 + k]++;
              for (int m = 0; m < MT; m++)
                for (int j = 0; j < NPW; j++)
                  for (int e = 0; e < 8; e++)
                    acc[m][j][lane] = fmaf(xr[m][k * 8 + e], wr[j][k * 8 + e], acc[m][j][lane]);
            }
          }
        }
      }
      for (int m = 0; m < MT; m++)
        for (int j = 0; j < NPW; j++) warp_sum_f(acc[m][j], W);
      /* if (lane == 0) */
      for (int m = 0; m < MT; m++) {
        if (m >= M) break;
        for (int j = 0; j < NPW; j++) {
          const int64_t n = n0 + j;
          if (n >= N) break;
          float *p = c + (int64_t)m * N + n;
          float v = alpha * acc[m][j][0];
          if (beta != 0.0f) v += beta * *p;
          if (bias) v += bias[n];
          *p = v;
          stores[(int64_t)m * N + n]++;
        }
      }
    }
  }
}

static void test_gemv(void **state) {
  (void)state;
  for (size_t a = 0; a < ARRAY_LEN(widths); a++) {
    const int W = widths[a];
    for (int rep = 0; rep < 30; rep++) {
      /* mostly short rows over many columns; every tenth a deep row (many pieces per lane) */
      const bool deep = rep % 10 == 0;
      const int M = rng_int(1, 8), N = deep ? rng_int(1, 24) : rng_int(1, 200);
      const int K = 8 * (deep ? rng_int(200, 400) : rng_int(1, 64));
      const bool has_bias = rng_int(0, 1);
      const float alpha = rng_float(0.5f, 2.0f), beta = rng_int(0, 1) ? 0.0f : rng_float(-1, 1);
      float *x = malloc(sizeof(float) * (size_t)M * K), *w = malloc(sizeof(float) * (size_t)N * K);
      float *c = malloc(sizeof(float) * (size_t)M * N), *bias = malloc(sizeof(float) * (size_t)N);
      double *da = malloc(sizeof(double) * (size_t)M * K),
             *db = malloc(sizeof(double) * (size_t)K * N);
      double *dc = malloc(sizeof(double) * (size_t)M * N),
             *dbias = malloc(sizeof(double) * (size_t)N);
      double *dout = malloc(sizeof(double) * (size_t)M * N),
             *mag = malloc(sizeof(double) * (size_t)M * N);
      int *reads = calloc((size_t)N * (K / 8), sizeof(int)),
          *stores = calloc((size_t)M * N, sizeof(int));
      assert_true(x && w && c && bias && da && db && dc && dbias && dout && mag && reads && stores);
      for (int i = 0; i < M * K; i++) da[i] = x[i] = rng_float(-1, 1);
      for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) db[(size_t)k * N + n] = w[(size_t)n * K + k] = rng_float(-1, 1);
      for (int i = 0; i < M * N; i++) dc[i] = c[i] = rng_float(-1, 1);
      for (int n = 0; n < N; n++) dbias[n] = bias[n] = rng_float(-1, 1);
      emu_gemv(W, M, x, w, c, has_bias ? bias : NULL, N, K, alpha, beta, reads, stores);
      ops_ref_gemm(M, N, K, da, db, has_bias ? dbias : NULL, alpha, beta, beta != 0.0f ? dc : NULL,
                   dout, mag);
      for (int i = 0; i < N * (K / 8); i++)
        if (reads[i] != 1)
          fail_msg("gemv<%d> M=%d N=%d K=%d: W piece %d read %d times (seed %llu)", W, M, N, K, i,
                   reads[i], (unsigned long long)g_seed);
      for (int i = 0; i < M * N; i++) {
        assert_int_equal(stores[i], 1);
        check_close(c[i], dout[i], 1e-6 + 1e-5 * mag[i], 0.0,
                    "gemv<%d> M=%d N=%d K=%d element %d (mag %g)", W, M, N, K, i, mag[i]);
      }
      free(x);
      free(w);
      free(c);
      free(bias);
      free(da);
      free(db);
      free(dc);
      free(dbias);
      free(dout);
      free(mag);
      free(reads);
      free(stores);
    }
  }
}

int main(void) {
  const char *env = getenv("KILN_TEST_SEED");
  g_seed = env && *env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL);
  g_rng = g_seed;
  printf("test_warp: seed %llu (set KILN_TEST_SEED=%llu to reproduce)\n",
         (unsigned long long)g_seed, (unsigned long long)g_seed);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shuffle_semantics),
      cmocka_unit_test(test_warp_reductions),
      cmocka_unit_test(test_block_reductions),
      cmocka_unit_test(test_block_scan_min),
      cmocka_unit_test(test_rmsnorm),
      cmocka_unit_test(test_layernorm),
      cmocka_unit_test(test_argmax_topk),
      cmocka_unit_test(test_sample),
      cmocka_unit_test(test_attention_mapping),
      cmocka_unit_test(test_attention),
      cmocka_unit_test(test_mma_combine_mapping),
      cmocka_unit_test(test_gemv),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
