/* cuda_attention.cu - paged attention for mixed prefill/decode batches: the dispatcher, and the
 * CUDA-core kernel that serves f32, head dims without a tensor-core build, and ROCm.
 *
 * Dispatch. f16/bf16 with head dim 64, 80, 96, 128 or 256 and 16-byte aligned caches go to the
 * tensor-core kernels (cuda_attention_mma.cuh): a split-KV decode kernel when every sequence
 * has few query rows (max_query_len * G <= 64), else a FlashAttention-2 style kernel for the
 * whole batch, decodes of a mixed batch included. Everything else takes the kernel below.
 *
 * The CUDA-core kernel. Grid: x = (query tile, head), y = sequence. A block has 256 threads =
 * NW warps. Its QT query rows (1, 2, 4 or 8; fewer for short queries) each get KW = NW / QT
 * warps, which split the row's visible keys between them round-robin in groups of U keys. A
 * warp holds its row of q (pre-scaled) and its partial output spread over its lanes, E
 * elements per lane (d = e*WARP + lane), and keeps an online softmax in f32: running max m,
 * sum l, and acc. Per key group it issues U independent K loads, U warp reductions, then the V
 * accumulation. At the end the KW partial states of each row are merged through shared memory
 * and written once.
 * K/V are read through the block table; block ids outside [0, NB) and positions past the
 * table are skipped, so a bad table can never cause an out-of-bounds read.
 * The FP8 KV cache (ABI 1.7, p->kv_fp8): every kernel reads the codes as their exact e4m3
 * values (KV = uint8_t here, a compile-time parameter of the tensor-core kernels); k_scale was
 * folded into p->scale by the host side and the outputs are multiplied by p->v_scale (1, exact,
 * for a float cache). The f32 tiled kernel below takes float caches only. */
#include "cuda_attention_args.cuh"
#include "cuda_common.cuh"

#define ATT_THREADS 256
#define ATT_U 4

/* A cache element as f32: the stored float, or an FP8 code's e4m3 value (exact). */
template <typename KV>
static __device__ __forceinline__ float att_kv_f32(KV x) {
  return to_f32(x);
}
template <>
__device__ __forceinline__ float att_kv_f32<uint8_t>(uint8_t x) {
  return fp8_e4m3(x);
}

template <int WARP, typename T, typename KV, int E>
static __global__ void __launch_bounds__(ATT_THREADS)
    attention_kernel(cuda_attention_params_t p, int QT, int64_t ntiles, int seq_base) {
  constexpr int NW = ATT_THREADS / WARP;
  constexpr int U = ATT_U;
  __shared__ float sm_m[NW], sm_l[NW];
  __shared__ float sm_acc[NW][E * WARP];

  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  const int KW = NW / QT;
  const int r = wid % QT, kw = wid / QT;
  const int64_t NH = p.q.shape[1], D = p.q.shape[2], T_rows = p.q.shape[0];
  const int64_t h = (int64_t)(blockIdx.x % (uint64_t)NH);
  const int64_t tile = (int64_t)(blockIdx.x / (uint64_t)NH);
  const int s = seq_base + (int)blockIdx.y;
  (void)ntiles;

  const int32_t qs = p.qsl[(int64_t)s * p.qsl_stride];
  const int32_t qe = p.qsl[(int64_t)(s + 1) * p.qsl_stride];
  const int32_t L = p.seq_lens[(int64_t)s * p.seq_lens_stride];
  const int64_t q_len = (int64_t)qe - qs;
  const int64_t i = tile * QT + r;
  const bool valid = qs >= 0 && i < q_len && (int64_t)qs + i < T_rows;
  const int64_t kvh = h / (NH / p.num_kv_heads);

  float qv[E], acc[E];
  float m = -INFINITY, l = 0.0f;
#pragma unroll
  for (int e = 0; e < E; e++) {
    qv[e] = 0.0f;
    acc[e] = 0.0f;
  }
  int64_t lo = 0, hi = 0;
  if (valid) {
    const int64_t pos = (int64_t)L - q_len + i;
    hi = p.causal ? (pos + 1 < L ? pos + 1 : L) : L;
    lo = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
    if (lo < 0) lo = 0;
    const T *qrow = (const T *)p.q.ptr + ((int64_t)qs + i) * p.q.stride[0] + h * p.q.stride[1];
#pragma unroll
    for (int e = 0; e < E; e++) {
      const int64_t d = (int64_t)e * WARP + lane;
      if (d < D) qv[e] = to_f32(qrow[d]) * p.scale;
    }
  }

  const KV *kc = (const KV *)p.k_cache;
  const KV *vc = (const KV *)p.v_cache;
  const int64_t BS = p.block_size;
  const int64_t head_off = kvh * BS * D;
  const int64_t blk_elems = (int64_t)p.num_kv_heads * BS * D;
  const int32_t *bt = p.block_table + (int64_t)s * p.bt_stride;

  for (int64_t j0 = lo + (int64_t)kw * U; j0 < hi; j0 += (int64_t)KW * U) {
    int64_t base[U];
    float sc[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int64_t j = j0 + u;
      base[u] = -1;
      if (j < hi) {
        const int64_t bi = j / BS;
        if (bi < p.max_blocks) {
          const int32_t blk = bt[bi];
          if (blk >= 0 && blk < p.num_blocks) base[u] = blk * blk_elems + head_off + (j % BS) * D;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      float dot = 0.0f;
      if (base[u] >= 0) {
#pragma unroll
        for (int e = 0; e < E; e++) {
          const int64_t d = (int64_t)e * WARP + lane;
          if (d < D) dot += qv[e] * att_kv_f32<KV>(kc[base[u] + d]);
        }
      }
      sc[u] = dot;
    }
#pragma unroll
    for (int u = 0; u < U; u++) sc[u] = warp_sum<WARP>(sc[u]);
    float mn = m;
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (base[u] < 0) {
        sc[u] = -INFINITY;
      } else if (p.softcap > 0.0f) {
        sc[u] = p.softcap * tanhf(sc[u] / p.softcap);
      }
      mn = fmaxf(mn, sc[u]);
    }
    if (mn == -INFINITY) continue;
    const float corr = m == -INFINITY ? 0.0f : expf(m - mn);
    l *= corr;
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] *= corr;
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (sc[u] == -INFINITY) continue;
      const float pu = expf(sc[u] - mn);
      l += pu;
#pragma unroll
      for (int e = 0; e < E; e++) {
        const int64_t d = (int64_t)e * WARP + lane;
        if (d < D) acc[e] += pu * att_kv_f32<KV>(vc[base[u] + d]);
      }
    }
    m = mn;
  }

  if (lane == 0) {
    sm_m[wid] = m;
    sm_l[wid] = l;
  }
#pragma unroll
  for (int e = 0; e < E; e++) sm_acc[wid][e * WARP + lane] = acc[e];
  __syncthreads();
  if (kw != 0 || !valid) return;

  float M = -INFINITY;
  for (int w = 0; w < KW; w++) M = fmaxf(M, sm_m[r + w * QT]);
  float Ls = 0.0f, o[E];
#pragma unroll
  for (int e = 0; e < E; e++) o[e] = 0.0f;
  for (int w = 0; w < KW; w++) {
    const int src = r + w * QT;
    const float mw = sm_m[src];
    if (mw == -INFINITY) continue;
    const float f = expf(mw - M);
    Ls += sm_l[src] * f;
#pragma unroll
    for (int e = 0; e < E; e++) o[e] += sm_acc[src][e * WARP + lane] * f;
  }
  const float inv = Ls > 0.0f ? p.v_scale / Ls : 0.0f; /* no visible key: zeros */
  T *orow = (T *)p.out.ptr + ((int64_t)qs + i) * p.out.stride[0] + h * p.out.stride[1];
#pragma unroll
  for (int e = 0; e < E; e++) {
    const int64_t d = (int64_t)e * WARP + lane;
    if (d < D) orow[d] = from_f32<T>(o[e] * inv);
  }
}

template <int WARP, typename T, typename KV, int E>
static cudaError_t attention_launch(cudaStream_t st, const cuda_attention_params_t *p) {
  constexpr int NW = ATT_THREADS / WARP;
  int QT = 1;
  while (QT < NW && QT < p->max_query_len && QT < 8) QT *= 2;
  const int64_t NH = p->q.shape[1];
  const int64_t ntiles = ((int64_t)p->max_query_len + QT - 1) / QT;
  if (NH * ntiles > INT32_MAX) return cudaErrorInvalidValue;
  for (int base = 0; base < p->num_seqs; base += 65535) {
    const int n = p->num_seqs - base < 65535 ? p->num_seqs - base : 65535;
    dim3 grid((unsigned)(NH * ntiles), (unsigned)n, 1);
    attention_kernel<WARP, T, KV, E><<<grid, ATT_THREADS, 0, st>>>(*p, QT, ntiles, base);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <int WARP, typename T, typename KV>
static cudaError_t attention_dispatch_kv(cudaStream_t st, const cuda_attention_params_t *p) {
  const int64_t D = p->q.shape[2];
  if (D <= 2 * WARP) return attention_launch<WARP, T, KV, 2>(st, p);
  if (D <= 4 * WARP) return attention_launch<WARP, T, KV, 4>(st, p);
  if (D <= 8 * WARP) return attention_launch<WARP, T, KV, 8>(st, p);
  return cudaErrorInvalidValue;
}

template <int WARP, typename T>
static cudaError_t attention_dispatch_e(cudaStream_t st, const cuda_attention_params_t *p) {
  if (p->kv_fp8) return attention_dispatch_kv<WARP, T, uint8_t>(st, p);
  return attention_dispatch_kv<WARP, T, T>(st, p);
}

/* ---- f32 prefill: a tiled CUDA-core kernel ---------------------------------------------------
 * The f32 path has no tensor cores (the HAL's f32 means f32 products, not TF32), and the
 * kernel above spends a warp-wide shuffle reduction on every (row, key) pair, which is fine for
 * decode rows but left a 4,784-patch vision block at ~1 TFLOP/s (Qwen2-VL-7B in fp32: 4.7 s to
 * the first token on an H200, 2026-12-02). This one tiles like FlashAttention: one CTA per
 * (sequence, query head, 64-row tile), 256 threads; per tile of 64 keys the K and V rows are
 * read once into shared memory (through the block table; absent keys as zeros), each thread
 * forms a 4 x 4 block of S = (q * scale) k^T from shared memory, the rows' online softmax
 * (expf, as the kernel above) runs over 16 threads per row, P goes to shared memory, and each
 * thread accumulates 4 rows x D/16 columns of P V. Head dims 64, 80, 96, 128 (a multiple of 16
 * up to 128); masking (causal, sliding window, seq_len, absent blocks, softcap) as above. */
typedef cudaError_t (*att_mma_fn)(cudaStream_t, const cuda_attention_params_t *);

#if !defined(__HIP_PLATFORM_AMD__)
#define ATT_F32_BQ 64
#define ATT_F32_BK 64

template <int D>
struct att_f32_cfg {
  static constexpr int LDK = D + 1;          /* K rows padded: column reads hit every bank */
  static constexpr int LDP = ATT_F32_BK + 1; /* P rows */
  static constexpr size_t smem =
      sizeof(float) * ((size_t)ATT_F32_BQ * D + (size_t)ATT_F32_BK * LDK + (size_t)ATT_F32_BK * D +
                       (size_t)ATT_F32_BQ * LDP) +
      sizeof(long long) * ATT_F32_BK;
};

template <int D>
static __global__ void __launch_bounds__(256)
    attention_f32_tiled(cuda_attention_params_t p, int seq_base) {
  typedef att_f32_cfg<D> C;
  constexpr int BQ = ATT_F32_BQ, BK = ATT_F32_BK, LDK = C::LDK, LDP = C::LDP, DC = D / 16;
  extern __shared__ float att_f32_smem[];
  float *sQ = att_f32_smem;  /* [BQ][D], scaled */
  float *sK = sQ + BQ * D;   /* [BK][LDK] */
  float *sV = sK + BK * LDK; /* [BK][D] */
  float *sP = sV + BK * D;   /* [BQ][LDP] */
  long long *sOff = (long long *)(sP + BQ * LDP);

  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t NH = p.q.shape[1], T_rows = p.q.shape[0];
  const int64_t h = (int64_t)(blockIdx.x % (uint64_t)NH);
  const int64_t tile = (int64_t)(blockIdx.x / (uint64_t)NH);
  const int s = seq_base + (int)blockIdx.y;
  const int32_t qs = p.qsl[(int64_t)s * p.qsl_stride];
  const int32_t qe = p.qsl[(int64_t)(s + 1) * p.qsl_stride];
  int32_t L = p.seq_lens[(int64_t)s * p.seq_lens_stride];
  if (L < 0) L = 0;
  const int64_t q_len = (int64_t)qe - qs;
  const int64_t i0 = tile * BQ;
  if (qs < 0 || i0 >= q_len) return;
  const int64_t kvh = h / (NH / p.num_kv_heads);
  const int64_t pos0 = (int64_t)L - q_len;

  /* This thread's 4 rows (ty * 4 + r) and their visible keys [lo, hi). */
  int64_t lo[4], hi[4];
  int64_t lo_cta = INT64_MAX, hi_cta = 0;
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int64_t i = i0 + ty * 4 + r;
    lo[r] = 1;
    hi[r] = 0;
    if (i < q_len && (int64_t)qs + i < T_rows) {
      const int64_t pos = pos0 + i;
      hi[r] = p.causal ? (pos + 1 < L ? pos + 1 : L) : L;
      lo[r] = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
      if (lo[r] < 0) lo[r] = 0;
    }
  }
  {
    /* The CTA's key range, from its first and last rows (both bounds grow with the row). */
    const int64_t last = (i0 + BQ - 1 < q_len ? i0 + BQ - 1 : q_len - 1);
    const int64_t pf = pos0 + i0, pl = pos0 + last;
    hi_cta = p.causal ? (pl + 1 < L ? pl + 1 : L) : L;
    lo_cta = p.sliding_window > 0 ? pf - p.sliding_window + 1 : 0;
    if (lo_cta < 0) lo_cta = 0;
  }

  /* Q, scaled, rows past the sequence as zeros. */
  for (int c = tid; c < BQ * D; c += 256) {
    const int r = c / D, d = c % D;
    const int64_t i = i0 + r;
    float v = 0.0f;
    if (i < q_len && (int64_t)qs + i < T_rows)
      v = ((const float *)p.q.ptr)[((int64_t)qs + i) * p.q.stride[0] + h * p.q.stride[1] + d] *
          p.scale;
    sQ[r * D + d] = v;
  }

  float acc[4][DC];
  float m[4], l[4];
#pragma unroll
  for (int r = 0; r < 4; r++) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < DC; c++) acc[r][c] = 0.0f;
  }
  const float *kc = (const float *)p.k_cache, *vc = (const float *)p.v_cache;
  const int64_t BS = p.block_size, head_off = kvh * BS * D;
  const int64_t blk_elems = (int64_t)p.num_kv_heads * BS * D;
  const int32_t *bt = p.block_table + (int64_t)s * p.bt_stride;
  const int64_t k_begin = lo_cta / BK * BK;

  for (int64_t j0 = k_begin; j0 < hi_cta; j0 += BK) {
    __syncthreads(); /* the previous tile's K, V and P are no longer read */
    if (tid < BK) {
      const int64_t j = j0 + tid;
      long long off = -1;
      if (j >= lo_cta && j < hi_cta) {
        const int64_t bi = j / BS;
        if (bi < p.max_blocks) {
          const int32_t blk = bt[bi];
          if (blk >= 0 && blk < p.num_blocks) off = blk * blk_elems + head_off + (j % BS) * D;
        }
      }
      sOff[tid] = off;
    }
    __syncthreads();
    for (int c = tid; c < BK * D; c += 256) {
      const int k = c / D, d = c % D;
      const long long off = sOff[k];
      sK[k * LDK + d] = off >= 0 ? kc[off + d] : 0.0f;
      sV[k * D + d] = off >= 0 ? vc[off + d] : 0.0f;
    }
    __syncthreads();

    /* S for rows ty*4 + r, keys tx + 16 * c (strided: conflict-free K reads). */
    float sc[4][4];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int c = 0; c < 4; c++) sc[r][c] = 0.0f;
#pragma unroll 8
    for (int d = 0; d < D; d++) {
      float qv[4], kv[4];
#pragma unroll
      for (int r = 0; r < 4; r++) qv[r] = sQ[(ty * 4 + r) * D + d];
#pragma unroll
      for (int c = 0; c < 4; c++) kv[c] = sK[(tx + 16 * c) * LDK + d];
#pragma unroll
      for (int r = 0; r < 4; r++)
#pragma unroll
        for (int c = 0; c < 4; c++) sc[r][c] = fmaf(qv[r], kv[c], sc[r][c]);
    }
    /* Mask, cap, online softmax over the 16 threads of each row (lanes of one half-warp). */
#pragma unroll
    for (int r = 0; r < 4; r++) {
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const int k = tx + 16 * c;
        const int64_t j = j0 + k;
        float x = sc[r][c];
        if (j < lo[r] || j >= hi[r] || sOff[k] < 0) {
          x = -INFINITY;
        } else if (p.softcap > 0.0f) {
          x = p.softcap * tanhf(x / p.softcap);
        }
        sc[r][c] = x;
        mx = fmaxf(mx, x);
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float mn = fmaxf(m[r], mx);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const float e = sc[r][c] == -INFINITY ? 0.0f : expf(sc[r][c] - mn);
        sP[(ty * 4 + r) * LDP + tx + 16 * c] = e;
        sum += e;
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float corr = m[r] == -INFINITY ? (mn == -INFINITY ? 1.0f : 0.0f) : expf(m[r] - mn);
      l[r] = l[r] * corr + sum;
#pragma unroll
      for (int c = 0; c < DC; c++) acc[r][c] *= corr;
      m[r] = mn;
    }
    __syncthreads();
    /* O += P V: rows ty*4 + r, columns tx + 16 * c. */
#pragma unroll 4
    for (int k = 0; k < BK; k++) {
      float pv[4];
#pragma unroll
      for (int r = 0; r < 4; r++) pv[r] = sP[(ty * 4 + r) * LDP + k];
#pragma unroll
      for (int c = 0; c < DC; c++) {
        const float v = sV[k * D + tx + 16 * c];
#pragma unroll
        for (int r = 0; r < 4; r++) acc[r][c] = fmaf(pv[r], v, acc[r][c]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int64_t i = i0 + ty * 4 + r;
    if (i >= q_len || (int64_t)qs + i >= T_rows) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f; /* no visible key: zeros */
    float *orow = (float *)p.out.ptr + ((int64_t)qs + i) * p.out.stride[0] + h * p.out.stride[1];
#pragma unroll
    for (int c = 0; c < DC; c++) orow[tx + 16 * c] = acc[r][c] * inv;
  }
}

template <int D>
static cudaError_t attention_f32_tiled_launch(cudaStream_t st, const cuda_attention_params_t *p) {
  typedef att_f32_cfg<D> C;
  if ((int64_t)C::smem > p->smem_optin) return cudaErrorNotSupported;
  if (C::smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(attention_f32_tiled<D>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::smem);
    if (e != cudaSuccess) return e;
  }
  const int64_t NH = p->q.shape[1];
  const int64_t ntiles = ((int64_t)p->max_query_len + ATT_F32_BQ - 1) / ATT_F32_BQ;
  if (NH * ntiles > INT32_MAX) return cudaErrorInvalidValue;
  for (int base = 0; base < p->num_seqs; base += 65535) {
    const int n = p->num_seqs - base < 65535 ? p->num_seqs - base : 65535;
    dim3 grid((unsigned)(NH * ntiles), (unsigned)n, 1);
    attention_f32_tiled<D><<<grid, 256, C::smem, st>>>(*p, base);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

/* The tiled f32 kernel for prefill-sized calls (some sequence has at least 16 query rows) with
 * head dim 64, 80, 96 or 128; NULL: the kernel above. KILN_CUDA_ATT_F32=v0 turns it off (A/B
 * runs). */
static att_mma_fn att_f32_for(const cuda_attention_params_t *p) {
  if (p->q.dtype != KILN_HAL_F32 || p->max_query_len < 16 || p->kv_fp8) return NULL;
  if (p->num_kv_heads < 1 || p->q.shape[1] % p->num_kv_heads != 0) return NULL;
  if (p->q.stride[2] != 1 || p->out.stride[2] != 1) return NULL;
  static int off = -1;
  if (off < 0) {
    const char *v = getenv("KILN_CUDA_ATT_F32");
    off = v && !strcmp(v, "v0");
  }
  if (off) return NULL;
  switch (p->q.shape[2]) {
    case 64: return attention_f32_tiled_launch<64>;
    case 80: return attention_f32_tiled_launch<80>;
    case 96: return attention_f32_tiled_launch<96>;
    case 128: return attention_f32_tiled_launch<128>;
    default: return NULL;
  }
}
#endif /* !__HIP_PLATFORM_AMD__ */

/* The tensor-core launcher for p's head dim, or NULL. */
static att_mma_fn att_mma_for(const cuda_attention_params_t *p) {
#if defined(__HIP_PLATFORM_AMD__)
  (void)p;
  return NULL;
#else
  if (p->q.dtype != KILN_HAL_F16 && p->q.dtype != KILN_HAL_BF16) return NULL;
  if ((uintptr_t)p->k_cache % 16 != 0 || (uintptr_t)p->v_cache % 16 != 0) return NULL;
  if (p->num_kv_heads < 1 || p->q.shape[1] % p->num_kv_heads != 0) return NULL;
  switch (p->q.shape[2]) {
    case 64: return cuda_attention_mma_d64;
    case 80: return cuda_attention_mma_d80;
    case 96: return cuda_attention_mma_d96;
    case 128: return cuda_attention_mma_d128;
    case 256: return cuda_attention_mma_d256;
    default: return NULL;
  }
#endif
}

extern "C" cudaError_t cuda_launch_attention(cudaStream_t st, int warp,
                                             const cuda_attention_params_t *p) {
  att_mma_fn fn = warp == 32 ? att_mma_for(p) : NULL;
#if !defined(__HIP_PLATFORM_AMD__)
  if (!fn && warp == 32) fn = att_f32_for(p);
#endif
  if (fn) {
    cudaError_t e = fn(st, p);
    if (e != cudaErrorNotSupported) return e;
    (void)cudaGetLastError(); /* not supported here: the CUDA-core kernel takes it */
  }
  KILN_WARP_DISPATCH(
      warp, KILN_FLOAT_DISPATCH(p->q.dtype, { return attention_dispatch_e<WARP_, T_>(st, p); }));
  return cudaErrorInvalidValue;
}
