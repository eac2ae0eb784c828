/* cuda_attention_d256.cu - the tensor-core attention kernels for head dim 256 (f16, bf16). */
#include "cuda_attention_mma.cuh"

#if !defined(__HIP_PLATFORM_AMD__)
KILN_ATT_MMA_LAUNCHER(256)
#endif
