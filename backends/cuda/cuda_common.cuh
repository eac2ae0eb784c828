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

/* ---- FP8 E4M3FN (kiln/hal_quant.h's definitions, bit for bit) ------------------------- */

/* e4m3(q) as kiln/hal_quant.h defines it, NaN for 0x7F / 0xFF (q < 256). */
static __device__ __forceinline__ float fp8_e4m3(uint32_t q) {
  const uint32_t e = (q >> 3) & 15, m = q & 7;
  if ((q & 0x7F) == 0x7F) return __int_as_float((int)((q & 0x80u) << 24 | 0x7fc00000u));
  const float mag = e ? __int_as_float((int)((e + 120) << 23 | m << 20)) : (float)m * 0x1p-9f;
  return q & 0x80 ? -mag : mag;
}

static __device__ __forceinline__ uint32_t f32_to_e4m3_code(float v) {
  /* kiln_hal_f32_to_fp8_e4m3 (round to nearest even, saturating at 448), in integer steps, so
   * that every architecture gives the same byte. */
  uint32_t bits = __float_as_uint(v);
  const uint32_t sign = (bits >> 24) & 0x80u;
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return 0x7Fu;
  if (bits >= 0x43E00000u) return sign | 0x7Eu;
  if (bits < 0x3C800000u) {
    const float t = __uint_as_float(bits) * 512.0f;
    int m = (int)t;
    const float r = t - (float)m;
    if (r > 0.5f || (r == 0.5f && (m & 1))) m++;
    return sign | (uint32_t)m;
  }
  const uint32_t r = bits + 0x7FFFFu + ((bits >> 20) & 1u);
  uint32_t code = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
  if (code > 0x7Eu) code = 0x7Eu;
  return sign | code;
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
