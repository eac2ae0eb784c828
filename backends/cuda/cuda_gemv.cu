/* cuda_gemv.cu - the skinny gemm of decode: c[M, N] = alpha * x[M, K] @ W[N, K]^T + beta * c +
 * bias for M <= 8 and f16/bf16 (or f32) x and W, streaming W once with 16-byte loads.
 *
 * Work split. A warp owns NPW consecutive output columns n, i.e. NPW rows of W, each contiguous
 * in K. Its lanes split K into 16-byte pieces (8 elements): lane l reads pieces l, l + WARP,
 * l + 2 WARP, ... of every owned row, UNROLL * NPW independent loads in flight per lane before
 * any arithmetic. The x rows (at most 8 x K, a few KiB to 300 KiB) are read with the same
 * 16-byte pieces through L1, where every warp of the SM finds them. Products are summed in f32
 * per lane, then over the warp with xor shuffles; lane 0 applies alpha, beta * c and the bias
 * and rounds once to c's dtype (hal.h's rule). M is a compile-time MT in {1, 2, 4, 8}; rows
 * m >= M re-read row M - 1 and are never stored, and a warp's columns past N re-read row N - 1
 * of W and are never stored, so the inner loop has no row or column branches.
 *
 * No allocation, no synchronisation, one launch: it captures into graphs as is. */
#include "cuda_common.cuh"

#define GEMV_THREADS 128

/* Elements per 16-byte piece: 8 halves, or 4 floats. */
template <typename T>
struct gemv_epp {
  static constexpr int value = 8;
};
template <>
struct gemv_epp<float> {
  static constexpr int value = 4;
};

/* The elements of a 16-byte piece, in memory order, as f32 (8 halves, or 4 floats). */
template <typename T>
static __device__ __forceinline__ void unpack8(const uint4 &v, float f[8]);

template <>
__device__ __forceinline__ void unpack8<float>(const uint4 &v, float f[8]) {
  f[0] = __uint_as_float(v.x);
  f[1] = __uint_as_float(v.y);
  f[2] = __uint_as_float(v.z);
  f[3] = __uint_as_float(v.w);
}

template <>
__device__ __forceinline__ void unpack8<kiln_bf16>(const uint4 &v, float f[8]) {
  const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) { /* bf16 is the high half of an f32: shift, or mask */
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void unpack8<kiln_f16>(const uint4 &v, float f[8]) {
  const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    f[2 * i] = __half2float(__ushort_as_half((unsigned short)(u[i] & 0xffffu)));
    f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(u[i] >> 16)));
  }
}

/* x: [M, K], row stride ldx; w: [N, K], row stride ldw; c: [M, N], row stride ldc; bias: [N]
 * or NULL. K % 8 == 0; x, w, ldx and ldw 16-byte aligned (ldx unused when M == 1, ldw when
 * N == 1). Grid: ceil(N / (NPW * GEMV_THREADS / WARP)) blocks of GEMV_THREADS. */
template <int WARP, int MT, int NPW, int UNROLL, typename T, typename TC>
static __global__ void __launch_bounds__(GEMV_THREADS)
    gemv_kernel(const T *__restrict__ x, int64_t ldx, const T *__restrict__ w, int64_t ldw,
                TC *__restrict__ c, int64_t ldc, const TC *__restrict__ bias, int M, int N, int K,
                float alpha, float beta) {
  const int lane = threadIdx.x % WARP;
  const int64_t n0 = ((int64_t)blockIdx.x * (GEMV_THREADS / WARP) + threadIdx.x / WARP) * NPW;
  if (n0 >= N) return; /* warp-uniform; the kernel has no barrier */

  const uint4 *wr[NPW];
#pragma unroll
  for (int j = 0; j < NPW; j++) {
    const int64_t n = n0 + j < N ? n0 + j : (int64_t)N - 1;
    wr[j] = reinterpret_cast<const uint4 *>(w + n * ldw);
  }
  const uint4 *xr[MT];
#pragma unroll
  for (int m = 0; m < MT; m++)
    xr[m] = reinterpret_cast<const uint4 *>(x + (int64_t)(m < M ? m : M - 1) * ldx);

  float acc[MT][NPW];
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int j = 0; j < NPW; j++) acc[m][j] = 0.0f;

  constexpr int EPP = gemv_epp<T>::value;
  const int K8 = K / EPP; /* 16-byte pieces per row */
  for (int base = lane; base < K8; base += WARP * UNROLL) {
    uint4 wv[UNROLL][NPW];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int k = base + u * WARP;
#pragma unroll
      for (int j = 0; j < NPW; j++) wv[u][j] = k < K8 ? __ldg(wr[j] + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int k = base + u * WARP;
      if (k < K8) {
        float wf[NPW][8];
#pragma unroll
        for (int j = 0; j < NPW; j++) unpack8<T>(wv[u][j], wf[j]);
#pragma unroll
        for (int m = 0; m < MT; m++) {
          float xf[8];
          unpack8<T>(__ldg(xr[m] + k), xf);
#pragma unroll
          for (int j = 0; j < NPW; j++)
#pragma unroll
            for (int e = 0; e < EPP; e++) acc[m][j] = fmaf(xf[e], wf[j][e], acc[m][j]);
        }
      }
    }
  }

#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int j = 0; j < NPW; j++) acc[m][j] = warp_sum<WARP>(acc[m][j]);

  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < MT; m++) {
      if (m >= M) break;
#pragma unroll
      for (int j = 0; j < NPW; j++) {
        const int64_t n = n0 + j;
        if (n >= N) break;
        TC *p = c + (int64_t)m * ldc + n;
        float v = alpha * acc[m][j];
        if (beta != 0.0f) v += beta * to_f32(*p); /* beta == 0: c is never read */
        if (bias) v += to_f32(bias[n]);
        *p = from_f32<TC>(v);
      }
    }
  }
}

/* Columns per warp and pieces in flight per (lane, column): wider warps (in columns) for more
 * rows, so that each x piece read from L1 feeds more W pieces. */
template <int WARP, int MT, typename T, typename TC>
static cudaError_t gemv_launch(cudaStream_t st, const cuda_gemv_params_t *p) {
  constexpr int NPW = MT <= 2 ? 2 : 4;
  constexpr int UNROLL = MT <= 2 ? 4 : 2;
  constexpr int cols_per_block = NPW * (GEMV_THREADS / WARP);
  const int64_t blocks = ((int64_t)p->N + cols_per_block - 1) / cols_per_block;
  gemv_kernel<WARP, MT, NPW, UNROLL, T, TC><<<(unsigned)blocks, GEMV_THREADS, 0, st>>>(
      (const T *)p->x, p->ldx, (const T *)p->w, p->ldw, (TC *)p->c, p->ldc, (const TC *)p->bias,
      p->M, p->N, p->K, p->alpha, p->beta);
  return cudaGetLastError();
}

template <int WARP, typename T, typename TC>
static cudaError_t gemv_pick_m(cudaStream_t st, const cuda_gemv_params_t *p) {
  if (p->M <= 1) return gemv_launch<WARP, 1, T, TC>(st, p);
  if (p->M <= 2) return gemv_launch<WARP, 2, T, TC>(st, p);
  if (p->M <= 4) return gemv_launch<WARP, 4, T, TC>(st, p);
  return gemv_launch<WARP, 8, T, TC>(st, p);
}

template <int WARP, typename T>
static cudaError_t gemv_pick_c(cudaStream_t st, const cuda_gemv_params_t *p) {
  if (p->dtype_c == KILN_HAL_F32) return gemv_pick_m<WARP, T, float>(st, p);
  if (p->dtype_c == p->dtype_ab) return gemv_pick_m<WARP, T, T>(st, p);
  return cudaErrorInvalidValue;
}

template <int WARP>
static cudaError_t gemv_pick(cudaStream_t st, const cuda_gemv_params_t *p) {
  if (p->dtype_ab == KILN_HAL_BF16) return gemv_pick_c<WARP, kiln_bf16>(st, p);
  if (p->dtype_ab == KILN_HAL_F16) return gemv_pick_c<WARP, kiln_f16>(st, p);
  if (p->dtype_ab == KILN_HAL_F32 && p->dtype_c == KILN_HAL_F32)
    return gemv_pick_m<WARP, float, float>(st, p);
  return cudaErrorInvalidValue;
}

extern "C" cudaError_t cuda_launch_gemv(cudaStream_t st, int warp, const cuda_gemv_params_t *p) {
  if (p->M < 1 || p->M > CUDA_GEMV_MAX_M || p->N < 1 || p->K < 8 || p->K % 8 != 0)
    return cudaErrorInvalidValue;
  KILN_WARP_DISPATCH(warp, return gemv_pick<WARP_>(st, p));
  return cudaSuccess; /* not reached */
}
