/* cuda_attention_d96.cu - the tensor-core attention kernels for head dim 96 (f16, bf16). */
#include "cuda_attention_mma.cuh"

#if !defined(__HIP_PLATFORM_AMD__)
KILN_ATT_MMA_LAUNCHER(96)
#endif
