/* cuda_common.cuh - device helpers shared by the backend's kernel files: dtype conversion,
 * warp/block reductions written for a warp of WARP lanes (32 or 64), and dtype dispatch. */
#ifndef KILN_CUDA_COMMON_CUH
#define KILN_CUDA_COMMON_CUH

#include <stdint.h>

#include "kiln/hal.h"

#include "cuda_kernels.h"
#include "portable.h"

/* ---- f32 <-> storage dtype (round to nearest even, as hal.h asks) ------------------------- */

static __device__ __forceinline__ float to_f32(float v) { return v; }
static __device__ __forceinline__ float to_f32(kiln_f16 v) { return __half2float(v); }
static __device__ __forceinline__ float to_f32(kiln_bf16 v) { return kiln_bf16_to_f32(v); }

template <typename T>
static __device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ kiln_f16 from_f32<kiln_f16>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ kiln_bf16 from_f32<kiln_bf16>(float v) {
  return kiln_f32_to_bf16(v);
}

/* v rounded to what T holds, back in f32. */
template <typename T>
static __device__ __forceinline__ float round_to(float v) {
  return to_f32(from_f32<T>(v));
}

/* ---- reductions ------------------------------------------------------------------------- */

template <int WARP, typename T>
static __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v += kiln_shfl_xor<WARP>(v, o);
  return v;
}

template <int WARP>
static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, kiln_shfl_xor<WARP>(v, o));
  return v;
}

/* Sum over the block; every thread gets the result. `scratch` holds >= ceil(blockDim.x/WARP) values
 * and may be reused right after the call returns (the function ends with a barrier). */
template <int WARP, typename T>
static __device__ T block_sum(T v, T *scratch) {
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  const int nw = (blockDim.x + WARP - 1) / WARP;
  v = warp_sum<WARP>(v);
  if (lane == 0) scratch[wid] = v;
  __syncthreads();
  T r = 0;
  for (int i = 0; i < nw; i++) r += scratch[i];
  __syncthreads();
  return r;
}

template <int WARP>
static __device__ float block_max(float v, float *scratch) {
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  const int nw = (blockDim.x + WARP - 1) / WARP;
  v = warp_max<WARP>(v);
  if (lane == 0) scratch[wid] = v;
  __syncthreads();
  float r = -INFINITY;
  for (int i = 0; i < nw; i++) r = fmaxf(r, scratch[i]);
  __syncthreads();
  return r;
}

/* ---- dispatch -------------------------------------------------------------------------- */

/* Runs `body` with the storage type T_ for a float dtype; other dtypes return
 * cudaErrorInvalidValue from the enclosing launcher. */
#define KILN_FLOAT_DISPATCH(dtype, ...)      \
  do {                                       \
    switch (dtype) {                         \
      case KILN_HAL_F32: {                   \
        typedef float T_;                    \
        __VA_ARGS__;                         \
      } break;                               \
      case KILN_HAL_F16: {                   \
        typedef kiln_f16 T_;                 \
        __VA_ARGS__;                         \
      } break;                               \
      case KILN_HAL_BF16: {                  \
        typedef kiln_bf16 T_;                \
        __VA_ARGS__;                         \
      } break;                               \
      default: return cudaErrorInvalidValue; \
    }                                        \
  } while (0)

/* Blocks for a grid-stride loop over n elements. */
static inline unsigned grid_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  if (b > 65535LL * 16) b = 65535LL * 16;
  if (b < 1) b = 1;
  return (unsigned)b;
}

#endif /* KILN_CUDA_COMMON_CUH */
