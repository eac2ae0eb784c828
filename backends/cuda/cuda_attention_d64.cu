/* cuda_attention_d64.cu - the tensor-core attention kernels for head dim 64 (f16, bf16). */
#include "cuda_attention_mma.cuh"

#if !defined(__HIP_PLATFORM_AMD__)
KILN_ATT_MMA_LAUNCHER(64)
#endif
