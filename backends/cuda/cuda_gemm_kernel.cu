/* cuda_gemm_kernel.cu - Kiln's own gemm: c = alpha * a @ b + beta * c + bias for f32, f16 and
 * bf16, any strides, batched with broadcast, on CUDA cores only. It is the ROCm plugin's gemm
 * when rocBLAS is absent, and any GPU plugin's when KILN_GPU_GEMM=kernel (to test it).
 *
 * Tiling. A block of 256 threads owns a BM x BN tile of one product's c: 128 x 128 when the
 * call has enough such tiles to fill a large GPU (each thread an 8 x 8 register micro-tile),
 * else 64 x 64 (4 x 4 per thread). K is walked in steps of BK = 16. Per step the block stages
 * a BM x BK slice of a and a BK x BN slice of b in shared memory, converted to f32 there (so
 * one kernel body serves every storage dtype), k-major: As[k][m], Bs[k][n], each row padded by
 * 4 floats. Thread (ty, tx) of the 16 x 16 thread grid owns rows ty*4 + {0..3} (+ 64 when TM
 * = 8) and columns tx*4 + {0..3} (+ 64 when TN = 8): per k it reads its TM values of a and TN
 * values of b as float4s (8 consecutive lanes read 128 contiguous bytes of Bs; 16 consecutive
 * lanes share ty, so As reads are broadcasts: no bank conflicts) and does TM x TN fmas.
 * The accumulators stay f32 for the whole K; the epilogue computes alpha * acc + beta * c +
 * bias[n] in f32 and rounds once to c's dtype (hal.h's rule; beta == 0 never reads c).
 *
 * Staging. Each thread moves BM*BK/256 elements of a and BN*BK/256 of b per step with plain
 * scalar loads, in an order picked per operand from its strides so that a warp's loads are
 * coalesced: consecutive threads walk k when k has the smaller stride (a row-major a, a
 * PyTorch [N, K] weight as b), else m (n). Elements outside M, N or K are staged as zeros, so
 * edge tiles need no other care. The step loop is double-buffered: the next step's elements
 * are loaded into registers before the fmas of the current one and stored to the other shared
 * buffer after them, one barrier per step. There is no vectorised global load and so no
 * alignment condition anywhere: a step costs a thread TM*TN*BK fmas against (TM+TN)*BK/16
 * global loads (1024 : 16 for 128 x 128), so the loop is fma-bound on CUDA cores either way,
 * and every pointer, stride (negative, zero, overlapping) and size takes the same path.
 *
 * Grid. x: the product's tiles, in groups of 8 tile rows (consecutive blocks share b's
 * columns and nearby rows of a, for L2 reuse); capped and looped (int64 indices throughout).
 * z: the batch, capped at 65535 and looped. Batch stride 0 broadcasts an operand. No warp-level
 * operation: the kernel does not depend on the warp width (32 or 64).
 *
 * No allocation, no synchronisation, one launch: it captures into graphs as is. */
#include "cuda_common.cuh"

#define GEMM_THREADS 256
#define GEMM_BK 16
#define GEMM_GROUP_M 8            /* tile rows per swizzle group */
#define GEMM_MAX_GRID_X (1 << 20) /* blocks along x; more tiles loop */
#define GEMM_MAX_GRID_Z 65535     /* blocks along z; more products loop */

/* The unrolling of a step's k loop. Full on CUDA. hip-clang, fully unrolled, hoists all the
 * step's shared-memory reads ahead of the fmas and needs 256 VGPRs and spills (ROCm 5.2,
 * gfx90a and gfx1030); by two it takes 208 (128 x 128) and 98 (64 x 64) without spilling. */
#if defined(__HIP_PLATFORM_AMD__)
#define GEMM_KK_UNROLL _Pragma("unroll 2")
#else
#define GEMM_KK_UNROLL _Pragma("unroll")
#endif

/* min(v, 256) as an int: what is left of a dimension, capped above a tile's size. v > -256. */
static __device__ __forceinline__ int gemm_left(int64_t v) { return v < 256 ? (int)v : 256; }

/* Loads a thread's L elements of one operand's step into registers. Element r sits at
 * (row, k) = (r0 + r * dr, k0 + r * dk) of the step's slice, at src[off + r * step]; rows_left
 * = rows from r0 to the end of the operand, k_left = K - k0, both clamped to at most the
 * slice's size (gemm_left), and possibly <= 0. Elements outside are zero. */
template <int L, typename T>
static __device__ __forceinline__ void gemm_load(T (&reg)[L], const T *__restrict__ src,
                                                 int64_t off, int64_t step, int dr, int dk,
                                                 int rows_left, int k_left) {
  const T *q = src + off;
#pragma unroll
  for (int r = 0; r < L; r++) {
    const bool in = r * dr < rows_left && r * dk < k_left;
    reg[r] = in ? *q : from_f32<T>(0.0f);
    q += step;
  }
}

/* Stores those elements, as f32, to the k-major shared slice s[BK][LD]. */
template <int L, int LD, typename T>
static __device__ __forceinline__ void gemm_store(float (*s)[LD], const T (&reg)[L], int r0, int k0,
                                                  int dr, int dk) {
#pragma unroll
  for (int r = 0; r < L; r++) s[k0 + r * dk][r0 + r * dr] = to_f32(reg[r]);
}

/* Grid: x = min(tiles, GEMM_MAX_GRID_X), z = min(batch, GEMM_MAX_GRID_Z); GEMM_THREADS threads.
 * a_kfast / b_kfast: the staging order of a and b (consecutive threads walk k, or m / n).
 * MINB: blocks per multiprocessor to leave registers for (2 for 8 x 8 micro-tiles: 128
 * registers, where nvcc would otherwise take ~180 and run one block of 8 warps per SM). */
template <int BM, int BN, int TM, int TN, int MINB, typename T, typename TC>
static __global__ void __launch_bounds__(GEMM_THREADS, MINB)
    gemm_kernel(cuda_gemm_kernel_params_t p, int64_t tiles_m, int64_t tiles_n, int a_kfast,
                int b_kfast) {
  constexpr int BK = GEMM_BK;
  constexpr int TX = BN / TN, TY = BM / TM; /* thread grid: TY rows of TX threads */
  constexpr int LA = BM * BK / GEMM_THREADS, LB = BN * BK / GEMM_THREADS;
  static_assert(TX * TY == GEMM_THREADS, "one micro-tile per thread");
  static_assert(TM % 4 == 0 && TN % 4 == 0, "micro-tiles are read as float4s");
  static_assert(LA * GEMM_THREADS == BM * BK && LB * GEMM_THREADS == BN * BK, "even staging");
  static_assert(GEMM_THREADS % BM == 0 && GEMM_THREADS % BN == 0, "m-/n-fast staging");
  constexpr int LDA = BM + 4, LDB = BN + 4; /* padded rows, still 16-byte multiples */
  __shared__ __align__(16) float As[2][BK][LDA];
  __shared__ __align__(16) float Bs[2][BK][LDB];

  const int tid = threadIdx.x;
  const int tx = tid % TX, ty = tid / TX;

  /* This thread's staging: first element (row, k) and the steps between its elements. */
  const int am = a_kfast ? tid / BK : tid % BM, ak = a_kfast ? tid % BK : tid / BM;
  const int adm = a_kfast ? GEMM_THREADS / BK : 0, adk = a_kfast ? 0 : GEMM_THREADS / BM;
  const int bn = b_kfast ? tid / BK : tid % BN, bk = b_kfast ? tid % BK : tid / BN;
  const int bdn = b_kfast ? GEMM_THREADS / BK : 0, bdk = b_kfast ? 0 : GEMM_THREADS / BN;
  const int64_t a_step = (int64_t)adm * p.a_rs + (int64_t)adk * p.a_cs;
  const int64_t b_step = (int64_t)bdk * p.b_rs + (int64_t)bdn * p.b_cs;

  const int64_t M = p.M, N = p.N, K = p.K;
  const int64_t nk = (K + BK - 1) / BK;
  const int64_t tiles = tiles_m * tiles_n, per_group = (int64_t)GEMM_GROUP_M * tiles_n;
  const float alpha = K > 0 ? p.alpha : 0.0f, beta = p.beta; /* K == 0: beta * c + bias */

  for (int64_t z = blockIdx.z; z < p.batch; z += gridDim.z) {
    const T *__restrict__ A = (const T *)p.a + z * p.a_bs;
    const T *__restrict__ B = (const T *)p.b + z * p.b_bs;
    TC *C = (TC *)p.c + z * p.c_bs;

    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int64_t g = t / per_group, first = g * GEMM_GROUP_M, in_g = t - g * per_group;
      const int64_t gm = tiles_m - first < GEMM_GROUP_M ? tiles_m - first : GEMM_GROUP_M;
      const int64_t m0 = (first + in_g % gm) * BM, n0 = (in_g / gm) * BN;

      const int a_rows = gemm_left(M - m0 - am), b_rows = gemm_left(N - n0 - bn);
      const int64_t a_off = (m0 + am) * p.a_rs + (int64_t)ak * p.a_cs;
      const int64_t b_off = (int64_t)bk * p.b_rs + (n0 + bn) * p.b_cs;

      float acc[TM][TN];
#pragma unroll
      for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;

      if (nk > 0) {
        T ra[LA], rb[LB];
        gemm_load(ra, A, a_off, a_step, adm, adk, a_rows, gemm_left(K - ak));
        gemm_load(rb, B, b_off, b_step, bdn, bdk, b_rows, gemm_left(K - bk));
        gemm_store(As[0], ra, am, ak, adm, adk);
        gemm_store(Bs[0], rb, bn, bk, bdn, bdk);
        __syncthreads();

        for (int64_t kt = 0; kt < nk; kt++) {
          const int cur = (int)(kt & 1);
          const bool more = kt + 1 < nk;
          if (more) { /* the next step, into registers, while this one computes */
            const int64_t k0 = (kt + 1) * BK;
            gemm_load(ra, A, a_off + k0 * p.a_cs, a_step, adm, adk, a_rows, gemm_left(K - k0 - ak));
            gemm_load(rb, B, b_off + k0 * p.b_rs, b_step, bdn, bdk, b_rows, gemm_left(K - k0 - bk));
          }
          GEMM_KK_UNROLL
          for (int kk = 0; kk < BK; kk++) {
            float af[TM], bf[TN];
#pragma unroll
            for (int i = 0; i < TM / 4; i++) {
              const float4 v = *reinterpret_cast<const float4 *>(&As[cur][kk][i * TY * 4 + ty * 4]);
              af[4 * i] = v.x;
              af[4 * i + 1] = v.y;
              af[4 * i + 2] = v.z;
              af[4 * i + 3] = v.w;
            }
#pragma unroll
            for (int j = 0; j < TN / 4; j++) {
              const float4 v = *reinterpret_cast<const float4 *>(&Bs[cur][kk][j * TX * 4 + tx * 4]);
              bf[4 * j] = v.x;
              bf[4 * j + 1] = v.y;
              bf[4 * j + 2] = v.z;
              bf[4 * j + 3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
              for (int j = 0; j < TN; j++) acc[i][j] = fmaf(af[i], bf[j], acc[i][j]);
          }
          if (more) {
            gemm_store(As[cur ^ 1], ra, am, ak, adm, adk);
            gemm_store(Bs[cur ^ 1], rb, bn, bk, bdn, bdk);
          }
          __syncthreads(); /* also orders this tile's last reads before the next tile's stores */
        }
      }

      /* Epilogue: one rounding of alpha * acc + beta * c + bias. */
      float bv[TN];
#pragma unroll
      for (int j = 0; j < TN; j++) {
        const int64_t n = n0 + (j / 4) * TX * 4 + tx * 4 + j % 4;
        bv[j] = (p.bias && n < N) ? to_f32(((const TC *)p.bias)[n]) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < TM; i++) {
        const int64_t m = m0 + (i / 4) * TY * 4 + ty * 4 + i % 4;
        if (m >= M) continue;
        TC *crow = C + m * p.c_rs;
#pragma unroll
        for (int j = 0; j < TN; j++) {
          const int64_t n = n0 + (j / 4) * TX * 4 + tx * 4 + j % 4;
          if (n >= N) continue;
          float v = alpha * acc[i][j];
          if (beta != 0.0f) v += beta * to_f32(crow[n]); /* beta == 0: c is never read */
          crow[n] = from_f32<TC>(v + bv[j]);
        }
      }
    }
  }
}

/* True when consecutive threads should stage along k: k's stride is 1, or the smaller one. */
static int gemm_k_fastest(int64_t s_k, int64_t s_other) {
  if (s_k == 1) return 1;
  if (s_other == 1) return 0;
  const uint64_t ak = s_k < 0 ? 0 - (uint64_t)s_k : (uint64_t)s_k;
  const uint64_t ao = s_other < 0 ? 0 - (uint64_t)s_other : (uint64_t)s_other;
  return ak <= ao;
}

template <int BM, int BN, int TM, int TN, int MINB, typename T, typename TC>
static cudaError_t gemm_launch(cudaStream_t st, const cuda_gemm_kernel_params_t *p) {
  const int64_t tiles_m = (p->M + BM - 1) / BM, tiles_n = (p->N + BN - 1) / BN;
  const int64_t tiles = tiles_m * tiles_n;
  dim3 grid((unsigned)(tiles < GEMM_MAX_GRID_X ? tiles : GEMM_MAX_GRID_X), 1,
            (unsigned)(p->batch < GEMM_MAX_GRID_Z ? p->batch : GEMM_MAX_GRID_Z));
  gemm_kernel<BM, BN, TM, TN, MINB, T, TC><<<grid, GEMM_THREADS, 0, st>>>(
      *p, tiles_m, tiles_n, gemm_k_fastest(p->a_cs, p->a_rs), gemm_k_fastest(p->b_rs, p->b_cs));
  return cudaGetLastError();
}

/* 128 x 128 tiles when there are enough of them to give a large GPU (132 SMs on an H200, 304
 * CUs on an MI300X) about two blocks per multiprocessor, else 64 x 64 ones. */
template <typename T, typename TC>
static cudaError_t gemm_pick_tile(cudaStream_t st, const cuda_gemm_kernel_params_t *p) {
  const int64_t big = ((p->M + 127) / 128) * ((p->N + 127) / 128) * p->batch;
  if (p->M > 64 && p->N > 64 && big >= 256) return gemm_launch<128, 128, 8, 8, 2, T, TC>(st, p);
  return gemm_launch<64, 64, 4, 4, 1, T, TC>(st, p);
}

template <typename T>
static cudaError_t gemm_pick_c(cudaStream_t st, const cuda_gemm_kernel_params_t *p) {
  if (p->dtype_c == KILN_HAL_F32) return gemm_pick_tile<T, float>(st, p);
  if (p->dtype_c == p->dtype_ab) return gemm_pick_tile<T, T>(st, p);
  return cudaErrorInvalidValue;
}

extern "C" cudaError_t cuda_launch_gemm_kernel(cudaStream_t st, int warp,
                                               const cuda_gemm_kernel_params_t *p) {
  (void)warp; /* no warp-level operation: any width works */
  if (!p || p->M < 0 || p->N < 0 || p->K < 0 || p->batch < 0) return cudaErrorInvalidValue;
  if (p->M == 0 || p->N == 0 || p->batch == 0) return cudaSuccess; /* nothing to write */
  if (!p->c || (p->K > 0 && (!p->a || !p->b))) return cudaErrorInvalidValue;
  KILN_FLOAT_DISPATCH(p->dtype_ab, return gemm_pick_c<T_>(st, p));
  return cudaSuccess; /* not reached */
}
