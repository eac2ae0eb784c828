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
 * table are skipped, so a bad table can never cause an out-of-bounds read. */
#include "cuda_attention_args.cuh"
#include "cuda_common.cuh"

#define ATT_THREADS 256
#define ATT_U 4

template <int WARP, typename T, int E>
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

  const T *kc = (const T *)p.k_cache;
  const T *vc = (const T *)p.v_cache;
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
          if (d < D) dot += qv[e] * to_f32(kc[base[u] + d]);
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
        if (d < D) acc[e] += pu * to_f32(vc[base[u] + d]);
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
  const float inv = Ls > 0.0f ? 1.0f / Ls : 0.0f; /* no visible key: zeros */
  T *orow = (T *)p.out.ptr + ((int64_t)qs + i) * p.out.stride[0] + h * p.out.stride[1];
#pragma unroll
  for (int e = 0; e < E; e++) {
    const int64_t d = (int64_t)e * WARP + lane;
    if (d < D) orow[d] = from_f32<T>(o[e] * inv);
  }
}

template <int WARP, typename T, int E>
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
    attention_kernel<WARP, T, E><<<grid, ATT_THREADS, 0, st>>>(*p, QT, ntiles, base);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <int WARP, typename T>
static cudaError_t attention_dispatch_e(cudaStream_t st, const cuda_attention_params_t *p) {
  const int64_t D = p->q.shape[2];
  if (D <= 2 * WARP) return attention_launch<WARP, T, 2>(st, p);
  if (D <= 4 * WARP) return attention_launch<WARP, T, 4>(st, p);
  if (D <= 8 * WARP) return attention_launch<WARP, T, 8>(st, p);
  return cudaErrorInvalidValue;
}

/* The tensor-core launcher for p's head dim, or NULL. */
typedef cudaError_t (*att_mma_fn)(cudaStream_t, const cuda_attention_params_t *);
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
  if (fn) {
    cudaError_t e = fn(st, p);
    if (e != cudaErrorNotSupported) return e;
    (void)cudaGetLastError(); /* not supported here: the CUDA-core kernel takes it */
  }
  KILN_WARP_DISPATCH(
      warp, KILN_FLOAT_DISPATCH(p->q.dtype, { return attention_dispatch_e<WARP_, T_>(st, p); }));
  return cudaErrorInvalidValue;
}
