/* portable.h - the one place where the CUDA backend's sources meet a vendor runtime: CUDA names
 * as used by the sources, mapped to HIP ones when compiled with hipcc for AMD GPUs
 * (__HIP_PLATFORM_AMD__), so the ROCm plugin can build the same files.
 *
 * Rules the sources follow so that the mapping stays small:
 *   - only the runtime calls and types listed here (add a row to both branches when you need
 *     another one);
 *   - warp width is never hard-coded: kernels take it as a template parameter WARP (32 or 64),
 *     the launchers dispatch on the width read from the device (cudaDeviceProp.warpSize), and
 *     shuffles go through kiln_shfl_xor / kiln_shfl with a full mask of that width;
 *   - BLAS goes through cuda_gemm.c only (cuBLASLt here; hipBLASLt has the same shape).
 * Host-only C files include this too: the device-side part is guarded by __CUDACC__/__HIPCC__. */
#ifndef KILN_CUDA_PORTABLE_H
#define KILN_CUDA_PORTABLE_H

/* hipcc compiles for AMD (clang defines __HIP__) but does not itself define the platform
 * macro the HIP headers want; the build passes it, and a bare `hipcc -x hip` gets it here. */
#if defined(__HIP__) && !defined(__HIP_PLATFORM_AMD__) && !defined(__HIP_PLATFORM_NVIDIA__)
#define __HIP_PLATFORM_AMD__ 1
#endif
#if defined(__HIP_PLATFORM_AMD__)
/* ------------------------------------------------------------------ HIP (ROCm) ----------- */
#include <hip/hip_runtime_api.h>
#if defined(__HIPCC__)
#include <hip/hip_bfloat16.h>
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
/* hip_bfloat16 exists from ROCm 5.2 (Debian 12) through 6.x; its float constructor rounds to
 * nearest even, as hal.h asks. (__hip_bfloat16 of <hip/hip_bf16.h> is 5.7+ only.) */
typedef hip_bfloat16 kiln_bf16;
typedef __half kiln_f16;
static __device__ __forceinline__ float kiln_bf16_to_f32(kiln_bf16 v) { return (float)v; }
static __device__ __forceinline__ kiln_bf16 kiln_f32_to_bf16(float v) { return kiln_bf16(v); }
#endif
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaErrorInvalidValue hipErrorInvalidValue
#define cudaErrorNotSupported hipErrorNotSupported
#define cudaErrorMemoryAllocation hipErrorOutOfMemory
#define cudaGetErrorName hipGetErrorName
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaSetDevice hipSetDevice
#define cudaGetDevice hipGetDevice
#define cudaDeviceProp hipDeviceProp_t
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaMemGetInfo hipMemGetInfo
#define cudaFree hipFree
#define cudaMalloc hipMalloc
#define cudaMallocHost(p, n) hipHostMalloc((p), (n), hipHostMallocDefault)
#define cudaFreeHost hipHostFree
#define cudaStream_t hipStream_t
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamIsCapturing hipStreamIsCapturing
#define cudaStreamCaptureStatus hipStreamCaptureStatus
#define cudaStreamCaptureStatusNone hipStreamCaptureStatusNone
#define cudaStreamBeginCapture hipStreamBeginCapture
#define cudaStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define cudaStreamEndCapture hipStreamEndCapture
#define cudaGraph_t hipGraph_t
#define cudaGraphExec_t hipGraphExec_t
#define cudaGraphDestroy hipGraphDestroy
#define cudaGraphExecDestroy hipGraphExecDestroy
#define cudaGraphLaunch hipGraphLaunch
#define kiln_graph_instantiate(exec, graph) hipGraphInstantiate((exec), (graph), NULL, NULL, 0)
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpyDefault hipMemcpyDefault
#define cudaMemsetAsync hipMemsetAsync
#define cudaFuncSetAttribute hipFuncSetAttribute
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaDriverGetVersion hipDriverGetVersion
#define cudaRuntimeGetVersion hipRuntimeGetVersion
#define KILN_GPU_PLUGIN_NAME "rocm"
#else
/* ------------------------------------------------------------------ CUDA ----------------- */
#include <cuda_runtime_api.h>
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
typedef __nv_bfloat16 kiln_bf16;
typedef __half kiln_f16;
static __device__ __forceinline__ float kiln_bf16_to_f32(kiln_bf16 v) { return __bfloat162float(v); }
static __device__ __forceinline__ kiln_bf16 kiln_f32_to_bf16(float v) { return __float2bfloat16_rn(v); }
#endif
#define kiln_graph_instantiate(exec, graph) cudaGraphInstantiate((exec), (graph), 0)
#define KILN_GPU_DRIVER_SONAME "libcuda.so.1"
#define KILN_GPU_PLUGIN_NAME "cuda"
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)
/* ---- device-side helpers shared by every kernel file ----------------------------------- */

/* Lane mask of a full warp of WARP lanes. */
template <int WARP>
__device__ __forceinline__ unsigned long long kiln_full_mask() {
  return WARP == 64 ? ~0ull : ((1ull << WARP) - 1ull);
}

template <int WARP, typename T>
__device__ __forceinline__ T kiln_shfl_xor(T v, int lane_mask) {
#if defined(__HIP_PLATFORM_AMD__)
  return __shfl_xor(v, lane_mask, WARP);
#else
  return __shfl_xor_sync((unsigned)kiln_full_mask<WARP>(), v, lane_mask, WARP);
#endif
}

template <int WARP, typename T>
__device__ __forceinline__ T kiln_shfl(T v, int src_lane) {
#if defined(__HIP_PLATFORM_AMD__)
  /* HIP before 6.2 does not reduce src_lane modulo the width, as CUDA does. */
  return __shfl(v, src_lane & (WARP - 1), WARP);
#else
  return __shfl_sync((unsigned)kiln_full_mask<WARP>(), v, src_lane, WARP);
#endif
}

template <int WARP, typename T>
__device__ __forceinline__ T kiln_shfl_up(T v, int delta) {
#if defined(__HIP_PLATFORM_AMD__)
  return __shfl_up(v, delta, WARP);
#else
  return __shfl_up_sync((unsigned)kiln_full_mask<WARP>(), v, delta, WARP);
#endif
}

/* Dispatches a launcher body on the device's warp width: `body` is instantiated with the
 * constexpr int WARP_ set to 32 (and 64 on AMD). Unknown widths return cudaErrorNotSupported. */
#if defined(__HIP_PLATFORM_AMD__)
#define KILN_WARP_DISPATCH(warp, ...) \
  do {                                \
    if ((warp) == 32) {               \
      constexpr int WARP_ = 32;       \
      __VA_ARGS__;                    \
    } else if ((warp) == 64) {        \
      constexpr int WARP_ = 64;       \
      __VA_ARGS__;                    \
    } else {                          \
      return cudaErrorNotSupported;   \
    }                                 \
  } while (0)
#else
#define KILN_WARP_DISPATCH(warp, ...) \
  do {                                \
    if ((warp) == 32) {               \
      constexpr int WARP_ = 32;       \
      __VA_ARGS__;                    \
    } else {                          \
      return cudaErrorNotSupported;   \
    }                                 \
  } while (0)
#endif
#endif /* __CUDACC__ || __HIPCC__ */

#endif /* KILN_CUDA_PORTABLE_H */
