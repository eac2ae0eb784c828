/* cuda_sample.cu - sampling support on the device: argmax, top-k, penalties and the sampler.
 * One block of 1024 threads per row of logits [S, V] F32 (version 0: whole-row passes, no
 * scratch memory, so every op captures into graphs as is).
 *
 * The sampler keeps hal.h's rule without sorting: each filter keeps a prefix of the ranking
 * (by probability descending, ties by index), so each is described by a cut value c and the
 * number of tokens equal to c that it keeps (the first ones by index). The cut is found by
 * bisection over the order-preserving integer key of an f32, 32 whole-row reductions at most.
 * A final pass scans the row in index order, tests membership (tie ranks come from a block
 * scan), and returns the first kept token whose running kept mass exceeds uniform * W. Masses
 * are summed in f64 so the choice agrees with an exact reference except at ties of rounding. */
#include <limits.h>

#include "cuda_common.cuh"

#define SAMPLE_THREADS 1024
/* The block helpers below count whole warps (blockDim.x / WARP): a block is always a whole
 * number of warps of either width. */
static_assert(SAMPLE_THREADS % 64 == 0, "SAMPLE_THREADS must be a whole number of 64-lane wavefronts");

/* Order-preserving map f32 -> u32 (larger float, larger key) and back. */
static __device__ __forceinline__ uint32_t fkey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
static __device__ __forceinline__ float fval(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* (v, i) beats (bv, bi) in the ranking: larger value, or equal value and lower index. */
static __device__ __forceinline__ bool ranks_before(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

/* Block-wide best (value desc, index asc); every thread gets the result. */
template <int WARP>
static __device__ void block_best(float *v, int *i, float *sv, int *si) {
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  const int nw = blockDim.x / WARP;
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) {
    const float ov = kiln_shfl_xor<WARP>(*v, o);
    const int oi = kiln_shfl_xor<WARP>(*i, o);
    if (ranks_before(ov, oi, *v, *i)) {
      *v = ov;
      *i = oi;
    }
  }
  if (lane == 0) {
    sv[wid] = *v;
    si[wid] = *i;
  }
  __syncthreads();
  float bv = sv[0];
  int bi = si[0];
  for (int w = 1; w < nw; w++)
    if (ranks_before(sv[w], si[w], bv, bi)) {
      bv = sv[w];
      bi = si[w];
    }
  __syncthreads();
  *v = bv;
  *i = bi;
}

/* Block-wide inclusive scan; *total gets the block's sum. Ends with a barrier. */
template <int WARP, typename T>
static __device__ T block_scan(T v, T *scratch, T *total) {
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  const int nw = blockDim.x / WARP;
#pragma unroll
  for (int o = 1; o < WARP; o <<= 1) {
    const T n = kiln_shfl_up<WARP>(v, o);
    if (lane >= o) v += n;
  }
  if (lane == WARP - 1) scratch[wid] = v;
  __syncthreads();
  T off = 0, tot = 0;
  for (int w = 0; w < nw; w++) {
    const T x = scratch[w];
    if (w < wid) off += x;
    tot += x;
  }
  __syncthreads();
  *total = tot;
  return v + off;
}

template <int WARP>
static __device__ int block_min_int(int v, int *scratch) {
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  const int nw = blockDim.x / WARP;
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v = min(v, kiln_shfl_xor<WARP>(v, o));
  if (lane == 0) scratch[wid] = v;
  __syncthreads();
  int r = INT_MAX;
  for (int w = 0; w < nw; w++) r = min(r, scratch[w]);
  __syncthreads();
  return r;
}

/* Shared scratch for one block's reductions. */
template <int WARP>
struct row_scratch {
  float f[SAMPLE_THREADS / WARP];
  int i[SAMPLE_THREADS / WARP];
  double d[SAMPLE_THREADS / WARP];
};

/* Argmax (lowest index among maxima) and log(sum(exp(x - max))) of one row. */
template <int WARP>
static __device__ void row_argmax_lse(const float *x, int V, row_scratch<WARP> &sc, float *out_max,
                                      int *out_id, double *out_logsum) {
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float xv = x[v];
    if (ranks_before(xv, v, bv, bi)) {
      bv = xv;
      bi = v;
    }
  }
  block_best<WARP>(&bv, &bi, sc.f, sc.i);
  if (bi == INT_MAX) bi = 0; /* a row of NaNs */
  double z = 0.0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) z += (double)expf(x[v] - bv);
  z = block_sum<WARP>(z, sc.d);
  *out_max = bv;
  *out_id = bi;
  *out_logsum = log(z);
}

/* ---- argmax ----------------------------------------------------------------------------- */

template <int WARP>
static __global__ void __launch_bounds__(SAMPLE_THREADS)
    argmax_kernel(const float *logits, int64_t ls, int V, int32_t *ids, int64_t is, float *lp,
                  int64_t lps) {
  __shared__ row_scratch<WARP> sc;
  const int64_t s = blockIdx.x;
  const float *x = logits + s * ls;
  float M;
  int id;
  double logz;
  row_argmax_lse<WARP>(x, V, sc, &M, &id, &logz);
  if (threadIdx.x == 0) {
    ids[s * is] = id;
    if (lp) lp[s * lps] = (float)((double)x[id] - (double)M - logz);
  }
}

extern "C" cudaError_t cuda_launch_argmax(cudaStream_t st, int warp, cuda_view_t logits,
                                          cuda_view_t ids, cuda_view_t logprob) {
  const int64_t S = logits.shape[0];
  if (S > INT32_MAX) return cudaErrorInvalidValue;
  KILN_WARP_DISPATCH(warp, {
    argmax_kernel<WARP_><<<(unsigned)S, SAMPLE_THREADS, 0, st>>>(
        (const float *)logits.ptr, logits.stride[0], (int)logits.shape[1], (int32_t *)ids.ptr,
        ids.stride[0], (float *)logprob.ptr, logprob.ptr ? logprob.stride[0] : 0);
  });
  return cudaGetLastError();
}

/* ---- top-k: k selection passes, each finding the next element of the ranking. ------------ */

template <int WARP>
static __global__ void __launch_bounds__(SAMPLE_THREADS)
    topk_kernel(const float *logits, int64_t ls, int V, int k, float *vals, int64_t vs,
                int32_t *ids, int64_t is, float *lse, int64_t lses) {
  __shared__ row_scratch<WARP> sc;
  const int64_t s = blockIdx.x;
  const float *x = logits + s * ls;
  float pv = INFINITY;
  int pi = -1; /* the previous pick: everything ranked after it is a candidate */
  for (int r = 0; r < k; r++) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      const float xv = x[v];
      if (ranks_before(pv, pi, xv, v) && ranks_before(xv, v, bv, bi)) {
        bv = xv;
        bi = v;
      }
    }
    block_best<WARP>(&bv, &bi, sc.f, sc.i);
    if (bi == INT_MAX) bi = 0; /* NaNs only: nothing left to rank */
    if (threadIdx.x == 0) {
      vals[s * vs + r] = bv;
      ids[s * is + r] = bi;
    }
    pv = bv;
    pi = bi;
  }
  if (lse) {
    float M;
    int id;
    double logz;
    row_argmax_lse<WARP>(x, V, sc, &M, &id, &logz);
    if (threadIdx.x == 0) lse[s * lses] = (float)((double)M + logz);
  }
}

extern "C" cudaError_t cuda_launch_topk(cudaStream_t st, int warp, cuda_view_t logits,
                                        cuda_view_t values, cuda_view_t ids, cuda_view_t lse) {
  const int64_t S = logits.shape[0];
  if (S > INT32_MAX) return cudaErrorInvalidValue;
  KILN_WARP_DISPATCH(warp, {
    topk_kernel<WARP_><<<(unsigned)S, SAMPLE_THREADS, 0, st>>>(
        (const float *)logits.ptr, logits.stride[0], (int)logits.shape[1], (int)values.shape[1],
        (float *)values.ptr, values.stride[0], (int32_t *)ids.ptr, ids.stride[0], (float *)lse.ptr,
        lse.ptr ? lse.stride[0] : 0);
  });
  return cudaGetLastError();
}

/* ---- penalize --------------------------------------------------------------------------- */

extern "C" int64_t cuda_penalize_smem_bytes(int64_t V) { return 2 * ((V + 31) / 32) * 4; }

/* The [b0, b1) range of row s in a flattened list of n entries, clamped into [0, n). */
static __device__ __forceinline__ void list_range(const cuda_view_t &off, int64_t n, int64_t s,
                                                  int64_t *b0, int64_t *b1) {
  const int32_t *o = (const int32_t *)off.ptr;
  int64_t a = o[s * off.stride[0]], b = o[(s + 1) * off.stride[0]];
  a = a < 0 ? 0 : a > n ? n : a;
  b = b < a ? a : b > n ? n : b;
  *b0 = a;
  *b1 = b;
}

/* Phases, separated by barriers: (1) mark tokens seen in prompt or output (bitmap `seen`) and
 * in output (`out`); (2) repetition and presence per marked token; (3) frequency: each output
 * occurrence subtracts frequency (atomics of one value: order does not change the sum);
 * (4) bias: the first entry of each distinct id adds all of that id's entries in list order. */
static __global__ void __launch_bounds__(SAMPLE_THREADS) penalize_kernel(cuda_penalize_params_t p) {
  extern __shared__ uint32_t bits[];
  const int64_t s = blockIdx.x;
  const int64_t V = p.logits.shape[1];
  const int64_t words = (V + 31) / 32;
  uint32_t *seen = bits, *outm = bits + words;
  float *x = (float *)p.logits.ptr + s * p.logits.stride[0];
  const float rep =
      p.repetition.ptr ? ((const float *)p.repetition.ptr)[s * p.repetition.stride[0]] : 1.0f;
  const float freq =
      p.frequency.ptr ? ((const float *)p.frequency.ptr)[s * p.frequency.stride[0]] : 0.0f;
  const float pres =
      p.presence.ptr ? ((const float *)p.presence.ptr)[s * p.presence.stride[0]] : 0.0f;
  const bool use_rep = p.repetition.ptr != nullptr;
  const bool use_pres = p.presence.ptr != nullptr;

  for (int64_t w = threadIdx.x; w < 2 * words; w += blockDim.x) bits[w] = 0;
  __syncthreads();
  int64_t ob0 = 0, ob1 = 0;
  if (p.output_ids.ptr) list_range(p.output_offsets, p.output_ids.shape[0], s, &ob0, &ob1);
  const int32_t *oids = (const int32_t *)p.output_ids.ptr;
  if (p.prompt_ids.ptr && use_rep) {
    int64_t b0, b1;
    list_range(p.prompt_offsets, p.prompt_ids.shape[0], s, &b0, &b1);
    const int32_t *ids = (const int32_t *)p.prompt_ids.ptr;
    for (int64_t j = b0 + threadIdx.x; j < b1; j += blockDim.x) {
      const int32_t id = ids[j * p.prompt_ids.stride[0]];
      if (id >= 0 && id < V) atomicOr(&seen[id >> 5], 1u << (id & 31));
    }
  }
  for (int64_t j = ob0 + threadIdx.x; j < ob1; j += blockDim.x) {
    const int32_t id = oids[j * p.output_ids.stride[0]];
    if (id >= 0 && id < V) {
      atomicOr(&seen[id >> 5], 1u << (id & 31));
      atomicOr(&outm[id >> 5], 1u << (id & 31));
    }
  }
  __syncthreads();
  if (use_rep || use_pres) {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      const bool in_seen = (seen[v >> 5] >> (v & 31)) & 1u;
      const bool in_out = (outm[v >> 5] >> (v & 31)) & 1u;
      if (!(use_rep && in_seen) && !(use_pres && in_out)) continue;
      float l = x[v];
      if (use_rep && in_seen) l = l > 0.0f ? l / rep : l * rep;
      if (use_pres && in_out) l -= pres;
      x[v] = l;
    }
  }
  __syncthreads();
  if (p.frequency.ptr) {
    for (int64_t j = ob0 + threadIdx.x; j < ob1; j += blockDim.x) {
      const int32_t id = oids[j * p.output_ids.stride[0]];
      if (id >= 0 && id < V) atomicAdd(&x[id], -freq);
    }
  }
  __syncthreads();
  if (p.bias_ids.ptr) {
    int64_t b0, b1;
    list_range(p.bias_offsets, p.bias_ids.shape[0], s, &b0, &b1);
    const int32_t *ids = (const int32_t *)p.bias_ids.ptr;
    const float *vals = (const float *)p.bias_values.ptr;
    const int64_t is = p.bias_ids.stride[0], vs = p.bias_values.stride[0];
    for (int64_t j = b0 + threadIdx.x; j < b1; j += blockDim.x) {
      const int32_t id = ids[j * is];
      if (id < 0 || id >= V) continue;
      bool first = true;
      for (int64_t q = b0; q < j && first; q++) first = ids[q * is] != id;
      if (!first) continue;
      float l = x[id];
      for (int64_t q = j; q < b1; q++)
        if (ids[q * is] == id) l += vals[q * vs];
      x[id] = l;
    }
  }
}

extern "C" cudaError_t cuda_launch_penalize(cudaStream_t st, int warp,
                                            const cuda_penalize_params_t *p, int64_t smem_limit) {
  (void)warp;
  const int64_t S = p->logits.shape[0];
  const int64_t smem = cuda_penalize_smem_bytes(p->logits.shape[1]);
  if (S > INT32_MAX || smem > smem_limit) return cudaErrorInvalidValue;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute((const void *)penalize_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  penalize_kernel<<<(unsigned)S, SAMPLE_THREADS, (size_t)smem, st>>>(*p);
  return cudaGetLastError();
}

/* ---- mask_logits (ABI 1.3) ------------------------------------------------------------- */

/* One thread per logit; blockIdx.y is the row. */
static __global__ void mask_logits_kernel(cuda_view_t logits, cuda_view_t mask, cuda_view_t rows) {
  const int64_t s = blockIdx.y, V = logits.shape[1], M = mask.shape[0];
  const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= V) return;
  const int64_t r = rows.ptr ? (int64_t)((const int32_t *)rows.ptr)[s * rows.stride[0]] : s;
  if (r < 0 || r >= M) return;
  const uint32_t w = ((const uint32_t *)mask.ptr)[r * mask.stride[0] + (v >> 5)];
  if (!((w >> (v & 31)) & 1u)) ((float *)logits.ptr)[s * logits.stride[0] + v] = -INFINITY;
}

extern "C" cudaError_t cuda_launch_mask_logits(cudaStream_t st, cuda_view_t logits, cuda_view_t mask,
                                               cuda_view_t rows) {
  const int64_t S = logits.shape[0], V = logits.shape[1];
  if (S == 0 || V == 0) return cudaSuccess;
  if (S > 65535) return cudaErrorInvalidValue;
  const unsigned threads = 256;
  const dim3 grid((unsigned)((V + threads - 1) / threads), (unsigned)S);
  mask_logits_kernel<<<grid, threads, 0, st>>>(logits, mask, rows);
  return cudaGetLastError();
}

/* ---- sample ----------------------------------------------------------------------------- */

/* Smallest present value whose key is >= k0 (the row's values are all >= val(kmin)). */
template <int WARP>
static __device__ float min_present_at_least(const float *x, int V, uint32_t k0,
                                             row_scratch<WARP> &sc) {
  float best = INFINITY;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float xv = x[v];
    if (fkey(xv) >= k0 && xv < best) best = xv;
  }
  return -block_max<WARP>(-best, sc.f);
}

template <int WARP>
static __global__ void __launch_bounds__(SAMPLE_THREADS) sample_kernel(cuda_sample_params_t p) {
  __shared__ row_scratch<WARP> sc;
  const int64_t s = blockIdx.x;
  const int V = (int)p.logits.shape[1];
  const float *x = (const float *)p.logits.ptr + s * p.logits.stride[0];
  float M;
  int am;
  double logz;
  row_argmax_lse<WARP>(x, V, sc, &M, &am, &logz);
  const float t = ((const float *)p.temperature.ptr)[s * p.temperature.stride[0]];
  int chosen = am;
  if (t > 0.0f && M > -INFINITY) {
    const float u = ((const float *)p.uniform.ptr)[s * p.uniform.stride[0]];
    const int K = p.top_k.ptr ? ((const int32_t *)p.top_k.ptr)[s * p.top_k.stride[0]] : 0;
    const float tp = p.top_p.ptr ? ((const float *)p.top_p.ptr)[s * p.top_p.stride[0]] : 1.0f;
    const float mp = p.min_p.ptr ? ((const float *)p.min_p.ptr)[s * p.min_p.stride[0]] : 0.0f;
    const bool use_k = K > 0 && K < V, use_p = tp<1.0f, use_min = mp> 0.0f;
    const float inv_t = 1.0f / t;
#define E_OF(xv) expf(((xv)-M) * inv_t)
    double Z = 0.0;
    float mn = INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      const float xv = x[v];
      Z += (double)E_OF(xv);
      mn = fminf(mn, xv);
    }
    Z = block_sum<WARP>(Z, sc.d);
    mn = -block_max<WARP>(-mn, sc.f);

    /* Cut of a filter: keep x > c, and the first `allow` tokens (by index) with x == c. */
    float cK = -INFINITY, cP = -INFINITY;
    long long allowK = LLONG_MAX, allowP = LLONG_MAX;
    if (use_k) {
      uint32_t lo = fkey(mn), hi = fkey(M); /* count(x > val(hi)) = 0 < K */
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        const float th = fval(mid);
        int c = 0;
        for (int v = threadIdx.x; v < V; v += blockDim.x) c += x[v] > th;
        c = block_sum<WARP>(c, sc.i);
        if (c < K)
          hi = mid;
        else
          lo = mid + 1;
      }
      cK = min_present_at_least<WARP>(x, V, lo, sc);
      int c = 0;
      for (int v = threadIdx.x; v < V; v += blockDim.x) c += x[v] > cK;
      c = block_sum<WARP>(c, sc.i);
      allowK = (long long)K - c;
    }
    if (use_p) {
      const double target = (double)tp * Z;
      if (target <= 0.0) {
        cP = M;
        allowP = 0; /* only the most probable token, kept below */
      } else {
        uint32_t lo = fkey(mn), hi = fkey(M); /* mass(x > M) = 0 < target */
        while (lo < hi) {
          const uint32_t mid = lo + (hi - lo) / 2;
          const float th = fval(mid);
          double g = 0.0;
          for (int v = threadIdx.x; v < V; v += blockDim.x) {
            const float xv = x[v];
            if (xv > th) g += (double)E_OF(xv);
          }
          g = block_sum<WARP>(g, sc.d);
          if (g < target)
            hi = mid;
          else
            lo = mid + 1;
        }
        cP = min_present_at_least<WARP>(x, V, lo, sc);
        double g = 0.0;
        for (int v = threadIdx.x; v < V; v += blockDim.x) {
          const float xv = x[v];
          if (xv > cP) g += (double)E_OF(xv);
        }
        g = block_sum<WARP>(g, sc.d);
        const double ec = (double)E_OF(cP);
        if (ec > 0.0) {
          const double q = ceil((target - g) / ec);
          allowP = q <= 0.0 ? 0 : q >= 9.0e18 ? LLONG_MAX : (long long)q;
        }
      }
    }

    /* Two scans in index order: pass 0 sums the kept mass W, pass 1 finds the token. */
    double W = 0.0;
    int found = INT_MAX;
    for (int pass = 0; pass < 2 && found == INT_MAX; pass++) {
      const double thr = (double)u * W;
      long long tiesK = 0, tiesP = 0;
      double cum = 0.0;
      for (int base = 0; base < V; base += blockDim.x) {
        const int v = base + threadIdx.x;
        const bool in = v < V;
        const float xv = in ? x[v] : -INFINITY;
        const float ev = in ? E_OF(xv) : 0.0f;
        bool keep = in;
        if (use_k) {
          int tk;
          const int flag = in && xv == cK;
          const int rk = block_scan<WARP>(flag, sc.i, &tk) - flag;
          keep = keep && (xv > cK || (flag && tiesK + rk < allowK));
          tiesK += tk;
        }
        if (use_p) {
          int tpn;
          const int flag = in && xv == cP;
          const int rp = block_scan<WARP>(flag, sc.i, &tpn) - flag;
          keep = keep && (xv > cP || (flag && tiesP + rp < allowP));
          tiesP += tpn;
        }
        if (use_min) keep = keep && ev >= mp;
        if (v == am) keep = true;
        double tot;
        const double incl = cum + block_scan<WARP>(keep ? (double)ev : 0.0, sc.d, &tot);
        cum += tot;
        if (pass == 1) {
          const int cand = keep && incl > thr ? v : INT_MAX;
          found = block_min_int<WARP>(cand, sc.i);
          if (found != INT_MAX) break;
        }
      }
      W = cum;
    }
#undef E_OF
    chosen = found == INT_MAX ? am : found;
  }
  if (threadIdx.x == 0) {
    ((int32_t *)p.out_ids.ptr)[s * p.out_ids.stride[0]] = chosen;
    if (p.out_logprob.ptr)
      ((float *)p.out_logprob.ptr)[s * p.out_logprob.stride[0]] =
          (float)((double)x[chosen] - (double)M - logz);
  }
}

extern "C" cudaError_t cuda_launch_sample(cudaStream_t st, int warp,
                                          const cuda_sample_params_t *p) {
  const int64_t S = p->logits.shape[0];
  if (S > INT32_MAX) return cudaErrorInvalidValue;
  KILN_WARP_DISPATCH(warp, { sample_kernel<WARP_><<<(unsigned)S, SAMPLE_THREADS, 0, st>>>(*p); });
  return cudaGetLastError();
}
