/* cuda_qgemv.cu - gemm_quant (ABI 1.4): y[M, N] = x[M, K] @ dequant(W)^T + bias with W in a
 * GGUF block format (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K), a group format (INT4_G, INT8_G) or
 * FP8_E4M3 (1.5), never widened in memory: every kernel decodes the weights in registers from
 * the quantized bytes. FP8 at M <= 8 has its own GEMV, qgemv_fp8_kernel (16 codes a load, any
 * K, K split over a block's warps for narrow layers); its decode (fp8_deq in cuda_qdeq.cuh)
 * gives e4m3(q) * s rounded once, as hal.h, or with per-channel scales the codes' exact values
 * and the row's sum times s.
 *
 * Dequantization. qdeq8() gives the 8 consecutive weights k .. k + 7 (k % 8 == 0) of row n as
 * exactly the f32 values kiln/hal_quant.h defines (hal.h's contract): Q4_0/Q8_0 (q - 8) * d
 * and q * d; Q4_K/Q5_K (d * sc) * q - dmin * m, where d * sc * q is exact (an f16 times a 6-bit
 * and a 5-bit integer, 22 significant bits), so the fused fmaf() rounds once, like the
 * header's two steps; Q6_K (d * sc) * q, exact; the group formats (q - z) * s, exact. A piece
 * of 8 never crosses a block or a K-quant sub-block (32 weights). ALN is what the caller
 * knows of the alignment of every row start (1, or the format's natural one: 2 for Q4_0, Q8_0
 * and Q6_K, whose blocks are 18, 34 and 210 bytes; 8 for Q4_K, Q5_K and the group formats'
 * code rows): with it, each field is read with the widest load its offset in the block allows
 * (u16 pairs for Q4_0's 18-byte blocks, 8-byte loads for K-quant quants), with ALN 1 byte by
 * byte. A g_idx entry outside [0, G) gives a NaN weight and no read (hal.h: never out of
 * bounds; the backend cannot inspect device memory without a host synchronisation, which a
 * graph capture forbids, so the host's load-time check is the error path).
 *
 * Decode (M <= 8, f16/bf16 x rows 16-byte aligned, weight rows at the format's natural
 * alignment, K % 8 == 0): qgemv_kernel, cuda_gemv.cu's shape. A
 * warp owns NPW consecutive rows of W; lane l decodes pieces l, l + WARP, ... (8 weights
 * each) of every owned row, UNROLL * NPW pieces decoded before any product so their loads are
 * in flight together; the quantized bytes of a row are read once (a warp's lanes cover
 * consecutive blocks), the x pieces (16 bytes of f16/bf16) through L1 like
 * cuda_gemv.cu. Products and sums in f32 per lane, then over the warp with xor shuffles; lane
 * 0 adds the bias and rounds once to y's dtype. M is a compile-time MT in {1, 2, 4, 8}; rows
 * m >= M re-read row M - 1 and are never stored; a warp's rows past N re-read row N - 1.
 *
 * Everything else (M > 8, f32 x, unaligned x or weight rows, or K % 8 != 0): qgemm_kernel, a
 * CUDA-core tiled gemm with the dequantization fused into its staging (one instantiation per
 * format: x's dtype a run-time switch there, the weights read byte by byte, ALN 1): a block
 * of 256 threads owns a 64 x 64 tile of y, walks K in steps of 32, and stages x (widened to f32) and
 * the step's 64 rows of W (qdeq8, f32) in shared memory, then 4 x 4 f32 fmas per thread per
 * k. No scratch, no library call. Why not a dequantize-to-bf16 tile and cuBLASLt: hal.h wants
 * x times the f32 weight (a Q4_0 (q - 8) * d has up to 14 significant bits; bf16 keeps 8, f16
 * 11), so a half-precision tile changes the math; an f32 tile and an f32 cuBLASLt gemm (no
 * TF32) keep it but run on the same CUDA cores as this kernel, after a scratch round trip of
 * 4 bytes per weight and of x widened to f32. Cost: prefill through gemm_quant runs at CUDA-
 * core f32 speed (some tens of TFLOP/s on an H200, not the ~800 of bf16 tensor cores); a
 * tensor-core path with an exact split of the weight (hi + lo halves) is future work.
 *
 * No allocation, no synchronisation, one launch per call: both capture into graphs as is. */
#include <math.h>

#include "cuda_common.cuh"
#include "cuda_qdeq.cuh"

#define QGEMV_THREADS 128
#define QGEMM_THREADS 256
#define QGEMM_BM 64
#define QGEMM_BN 64
#define QGEMM_BK 32
#define QGEMM_MAX_GRID_Y 65535

/* ---- x and y ---------------------------------------------------------------------------- */

/* x[k .. k + 8) of an f16/bf16 row whose start and k are 16-byte aligned, as f32. */
static __device__ __forceinline__ void qx8(const kiln_bf16 *x, int k, float f[8]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4 *>(x + k));
  const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) { /* bf16 is the high half of an f32 */
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

static __device__ __forceinline__ void qx8(const kiln_f16 *x, int k, float f[8]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4 *>(x + k));
  const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    f[2 * i] = qf16(u[i]);
    f[2 * i + 1] = qf16(u[i] >> 16);
  }
}

/* x[i] of any float dtype, as f32 (the tiled kernel's staging: one kernel for every x dtype). */
static __device__ __forceinline__ float qxload(const void *x, int32_t dt, int64_t i) {
  switch (dt) {
    case KILN_HAL_F32: return __ldg((const float *)x + i);
    case KILN_HAL_F16: return to_f32(((const kiln_f16 *)x)[i]);
    default: return to_f32(((const kiln_bf16 *)x)[i]);
  }
}

/* y[idx] = round(v + bias[n]) in y's dtype (bias NULL = none; bias has y's dtype). */
static __device__ __forceinline__ void qstore(void *y, int32_t dt, int64_t idx, const void *bias,
                                              int64_t n, float v) {
  switch (dt) {
    case KILN_HAL_F32:
      if (bias) v += ((const float *)bias)[n];
      ((float *)y)[idx] = v;
      break;
    case KILN_HAL_F16:
      if (bias) v += to_f32(((const kiln_f16 *)bias)[n]);
      ((kiln_f16 *)y)[idx] = from_f32<kiln_f16>(v);
      break;
    default:
      if (bias) v += to_f32(((const kiln_bf16 *)bias)[n]);
      ((kiln_bf16 *)y)[idx] = from_f32<kiln_bf16>(v);
      break;
  }
}

/* ---- decode: M <= 8 --------------------------------------------------------------------- */

/* Grid: ceil(N / (NPW * QGEMV_THREADS / WARP)) blocks of QGEMV_THREADS. K % 8 == 0; x and ldx
 * 16-byte aligned (ldx unused when M == 1). */
template <int WARP, int MT, int NPW, int UNROLL, int FMT, int ALN, typename T>
static __global__ void __launch_bounds__(QGEMV_THREADS)
    qgemv_kernel(const T *__restrict__ x, int64_t ldx, qgemm_w_t q, void *__restrict__ y,
                 int64_t ldy, int32_t dty, const void *__restrict__ bias, int M, int N, int K) {
  const int lane = threadIdx.x % WARP;
  const int64_t n0 = ((int64_t)blockIdx.x * (QGEMV_THREADS / WARP) + threadIdx.x / WARP) * NPW;
  if (n0 >= N) return; /* warp-uniform; no barrier in the kernel */

  int64_t nr[NPW];
#pragma unroll
  for (int j = 0; j < NPW; j++) nr[j] = n0 + j < N ? n0 + j : (int64_t)N - 1;
  const T *xr[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) xr[m] = x + (int64_t)(m < M ? m : M - 1) * ldx;

  float acc[MT][NPW];
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int j = 0; j < NPW; j++) acc[m][j] = 0.0f;

  const int K8 = K / 8;
  for (int base = lane; base < K8; base += WARP * UNROLL) {
    float wf[UNROLL][NPW][8];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int p = base + u * WARP;
      const int pk = (p < K8 ? p : K8 - 1) * 8; /* past the end: re-decode the last piece */
#pragma unroll
      for (int j = 0; j < NPW; j++) qdeq8<FMT, ALN>(q, nr[j], pk, wf[u][j]);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int p = base + u * WARP;
      if (p < K8) {
#pragma unroll
        for (int m = 0; m < MT; m++) {
          float xf[8];
          qx8(xr[m], p * 8, xf);
#pragma unroll
          for (int j = 0; j < NPW; j++)
#pragma unroll
            for (int e = 0; e < 8; e++) acc[m][j] = fmaf(xf[e], wf[u][j][e], acc[m][j]);
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
        qstore(y, dty, (int64_t)m * ldy + n, bias, n, q.xsc ? acc[m][j] * q.xsc[m] : acc[m][j]);
      }
    }
  }
}

/* ---- decode, FP8_E4M3: M <= 8 ------------------------------------------------------------ */

/* x[k .. k + 16) as f32 (row and k 16-byte aligned). */
template <typename T>
static __device__ __forceinline__ void qx16(const T *x, int k, float f[16]) {
  qx8(x, k, f);
  qx8(x, k + 8, f + 8);
}

/* qgemv_kernel's shape with FP8's 1-byte codes: lane l owns pieces of 16 weights (one 16-byte
 * load per row at ALN 16); all UNROLL * NPW code loads (and their scales) are issued before any
 * decode. Any K: the K % 16 tail is one weight per lane.
 * KS: the warps of a block that share its NPW rows and split K between them (1, or all the
 * block's warps): warp ks of a row group takes pieces ks * WARP + lane, then every WARP * KS;
 * the KS partial sums meet in shared memory, added in warp order (deterministic), so narrow
 * layers (a few thousand rows: q/k/v, o_proj, down_proj) still put KS times the warps, and the
 * loads, in flight. Per-channel scales (G == 1): the products are taken on the codes' exact
 * values and the row's sum times s once at the end (one multiply per row, not per weight;
 * hal.h's freedom is the f32 accumulation, and e4m3(q) * x summed then scaled differs from the
 * sum of (e4m3(q) * s) * x by roundings of the same size as a change of order). Grid: one block
 * per NPW * (warps / KS) rows; x and ldx 16-byte aligned. */
template <int WARP, int MT, int NPW, int UNROLL, int KS, int ALN, typename T>
static __global__ void __launch_bounds__(QGEMV_THREADS)
    qgemv_fp8_kernel(const T *__restrict__ x, int64_t ldx, qgemm_w_t q, void *__restrict__ y,
                     int64_t ldy, int32_t dty, const void *__restrict__ bias, int M, int N,
                     int K) {
  constexpr int WPB = QGEMV_THREADS / WARP;
  static_assert(KS == 1 || KS == WPB, "KS: 1 or every warp of the block");
  const int lane = threadIdx.x % WARP, wi = threadIdx.x / WARP, ks = wi % KS;
  const int64_t n0 = ((int64_t)blockIdx.x * (WPB / KS) + wi / KS) * NPW;
  if (KS == 1 && n0 >= N) return; /* warp-uniform; with KS > 1 every warp reaches the barrier */

  const uint8_t *wr[NPW];
  const float *sr[NPW];
#pragma unroll
  for (int j = 0; j < NPW; j++) {
    const int64_t n = n0 + j < N ? n0 + j : (int64_t)N - 1;
    wr[j] = q.w + n * q.rs;
    sr[j] = q.fscales + n * q.lds;
  }
  const T *xr[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) xr[m] = x + (int64_t)(m < M ? m : M - 1) * ldx;
  const bool fold = q.G == 1; /* one scale per row, applied to the sum */

  float acc[MT][NPW];
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int j = 0; j < NPW; j++) acc[m][j] = 0.0f;

  const int K16 = K / 16;
  for (int base = ks * WARP + lane; base < K16; base += WARP * KS * UNROLL) {
    uint32_t c[UNROLL][NPW][4];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int p = base + u * WARP * KS;
      const int pk = (p < K16 ? p : K16 - 1) * 16; /* past the end: re-load the last piece */
#pragma unroll
      for (int j = 0; j < NPW; j++) ld16<ALN>(wr[j] + pk, c[u][j]);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int p = base + u * WARP * KS;
      if (p < K16) {
        float wf[NPW][16];
#pragma unroll
        for (int j = 0; j < NPW; j++) {
          if (fold)
            fp8_deq<16>(c[u][j], 1.0f, wf[j]); /* the codes' values, exact */
          else
            fp8_deq_piece<16>(q, sr[j], p * 16, c[u][j], wf[j]);
        }
#pragma unroll
        for (int m = 0; m < MT; m++) {
          float xf[16];
          qx16(xr[m], p * 16, xf);
#pragma unroll
          for (int j = 0; j < NPW; j++)
#pragma unroll
            for (int e = 0; e < 16; e++) acc[m][j] = fmaf(xf[e], wf[j][e], acc[m][j]);
        }
      }
    }
  }
  const int kt = K16 * 16 + lane; /* the tail: K % 16 < WARP weights, one per lane of split 0 */
  if (ks == 0 && kt < K) {
    float wt[NPW];
#pragma unroll
    for (int j = 0; j < NPW; j++)
      wt[j] = fold ? fp8_e4m3(qb(wr[j] + kt))
                   : fp8_e4m3(qb(wr[j] + kt)) * __ldg(sr[j] + fp8_group(q, kt));
#pragma unroll
    for (int m = 0; m < MT; m++) {
      const float xv = to_f32(xr[m][kt]);
#pragma unroll
      for (int j = 0; j < NPW; j++) acc[m][j] = fmaf(xv, wt[j], acc[m][j]);
    }
  }

#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int j = 0; j < NPW; j++) acc[m][j] = warp_sum<WARP>(acc[m][j]);

  if constexpr (KS > 1) {
    __shared__ float part[WPB][MT][NPW];
    if (lane == 0)
#pragma unroll
      for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NPW; j++) part[wi][m][j] = acc[m][j];
    __syncthreads();
    if (ks != 0 || n0 >= N) return;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
      for (int j = 0; j < NPW; j++) {
        float v = part[wi][m][j];
#pragma unroll
        for (int t = 1; t < KS; t++) v += part[wi + t][m][j];
        acc[m][j] = v;
      }
  }

  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < MT; m++) {
      if (m >= M) break;
#pragma unroll
      for (int j = 0; j < NPW; j++) {
        const int64_t n = n0 + j;
        if (n >= N) break;
        float v = fold ? acc[m][j] * __ldg(sr[j]) : acc[m][j];
        qstore(y, dty, (int64_t)m * ldy + n, bias, n, q.xsc ? v * q.xsc[m] : v);
      }
    }
  }
}

/* ---- everything else: the tiled kernel -------------------------------------------------- */

/* Grid: x = ceil(N / 64), y = min(ceil(M / 64), QGEMM_MAX_GRID_Y), looping over the rest of
 * M. Any x row stride and alignment, any K (a group format's tail handled weight by weight). */
template <int FMT>
static __global__ void __launch_bounds__(QGEMM_THREADS)
    qgemm_kernel(const void *__restrict__ x, int32_t dtx, int64_t ldx, qgemm_w_t q,
                 void *__restrict__ y, int64_t ldy, int32_t dty, const void *__restrict__ bias,
                 int M, int N, int K) {
  constexpr int ALN = 1; /* any row alignment: weights read byte by byte (see the launchers) */
  __shared__ float xs[QGEMM_BK][QGEMM_BM + 4];
  __shared__ float ws[QGEMM_BK][QGEMM_BN + 4];
  const int t = threadIdx.x;
  const int ty = t / 16, tx = t % 16;     /* compute: rows ty*4.., columns tx*4.. */
  const int lr = t / 4, lk = (t % 4) * 8; /* staging: row lr of the tile, k piece lk.. */
  const int64_t nb = (int64_t)blockIdx.x * QGEMM_BN;
  const int64_t nl = nb + lr < N ? nb + lr : (int64_t)N - 1; /* the row of W this thread stages */

  for (int64_t mb = (int64_t)blockIdx.y * QGEMM_BM; mb < M;
       mb += (int64_t)gridDim.y * QGEMM_BM) {
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    const int64_t ml = mb + lr;
    const int64_t xrow = (ml < M ? ml : 0) * ldx;

    for (int k0 = 0; k0 < K; k0 += QGEMM_BK) {
      const int k = k0 + lk;
      float xv[8], wv[8];
      if (k + 8 <= K) {
        qdeq8<FMT, ALN>(q, nl, k, wv);
#pragma unroll
        for (int e = 0; e < 8; e++) xv[e] = ml < M ? qxload(x, dtx, xrow + k + e) : 0.0f;
      } else {
#pragma unroll
        for (int e = 0; e < 8; e++) {
          if constexpr (FMT == KILN_HAL_QFMT_INT4_G || FMT == KILN_HAL_QFMT_INT8_G ||
                        FMT == KILN_HAL_QFMT_FP8_E4M3) {
            wv[e] = k + e < K ? qdeq1_group<FMT>(q, nl, k + e) : 0.0f;
          } else {
            wv[e] = 0.0f; /* not reached: the block formats' K is a multiple of 32 */
          }
          xv[e] = ml < M && k + e < K ? qxload(x, dtx, xrow + k + e) : 0.0f;
        }
      }
      __syncthreads(); /* the previous step's reads are done */
#pragma unroll
      for (int e = 0; e < 8; e++) {
        xs[lk + e][lr] = xv[e];
        ws[lk + e][lr] = wv[e];
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < QGEMM_BK; kk++) {
        float a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = xs[kk][ty * 4 + i];
#pragma unroll
        for (int j = 0; j < 4; j++) b[j] = ws[kk][tx * 4 + j];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
          for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }

#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int64_t m = mb + ty * 4 + i;
      if (m >= M) break;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const int64_t n = nb + tx * 4 + j;
        if (n < N) qstore(y, dty, m * ldy + n, bias, n, q.xsc ? acc[i][j] * q.xsc[m] : acc[i][j]);
      }
    }
  }
}

/* ---- launchers -------------------------------------------------------------------------- */

static qgemm_w_t qgemm_w_of(const cuda_qgemm_params_t *p) {
  qgemm_w_t q;
  q.w = (const uint8_t *)p->w;
  q.rs = p->row_stride;
  q.scales = (const unsigned short *)p->scales;
  q.lds = p->lds;
  q.zeros = (const uint8_t *)p->zeros;
  q.ldz = p->ldz;
  q.g_idx = p->g_idx;
  q.group_size = p->group_size;
  q.G = p->G;
  q.fscales = (const float *)p->scales;
  q.xsc = p->xscale;
  q.gshift = -1;
  if (p->format == KILN_HAL_QFMT_FP8_E4M3) {
    if (p->G == 1) q.gshift = 31; /* every k < K is group 0 */
    for (int sh = 0; sh < 31 && q.gshift < 0; sh++)
      if (p->group_size == 1 << sh) q.gshift = sh;
  }
  return q;
}

/* Rows per warp and pieces in flight per (lane, row). */
template <int WARP, int MT, int FMT, int ALN, typename T>
static cudaError_t qgemv_launch(cudaStream_t st, const cuda_qgemm_params_t *p) {
  constexpr int NPW = MT <= 2 ? 2 : 4;
  constexpr int UNROLL = MT <= 2 ? 2 : 1;
  constexpr int rows_per_block = NPW * (QGEMV_THREADS / WARP);
  const int64_t blocks = ((int64_t)p->N + rows_per_block - 1) / rows_per_block;
  qgemv_kernel<WARP, MT, NPW, UNROLL, FMT, ALN, T><<<(unsigned)blocks, QGEMV_THREADS, 0, st>>>(
      (const T *)p->x, p->ldx, qgemm_w_of(p), p->y, p->ldy, p->dtype_y, p->bias, p->M, p->N,
      p->K);
  return cudaGetLastError();
}

/* FP8. Wide layers (at least CUDA_FP8_GEMV_SPLIT_WARPS row groups of warps): KS 1, MT 1 with
 * NPW 4 rows x UNROLL 2 pieces (8 code loads in flight per lane, x widened once for 4 rows),
 * MT 2 two rows x two pieces, MT 4 and 8 four rows x one piece. Narrower ones split K over the
 * block's warps (KS = warps per block, 2 rows per group at MT <= 2, 4 above) when K gives every
 * split at least a piece per lane, and at MT > 2 only for K of 4 pieces per lane and split
 * (their 32 accumulators per lane leave no registers for more rows in flight, so a split only
 * pays where K is long). Measured on an H200 (kiln-bench-ops --only fp8, both ways forced; M = 1
 * of Qwen2-7B): q/k/v 10.8 -> 10.3 us, o_proj 10.0 -> 8.8, down_proj (K 18944) 39.4 -> 25.3 with
 * the split; gate_up (N 37888) 45.0 against 48.9 and the lm_head 146 against 178 without it.
 * At M = 8 the split won only for down_proj (77.8 -> 66.4 us) and lost elsewhere (gate_up
 * 106 -> 176). p->fp8_ks (KILN_CUDA_FP8_GEMV=split|nosplit, for benchmarks and tests) forces
 * either. */
#define CUDA_FP8_GEMV_SPLIT_WARPS 8192
template <int WARP, int MT, int NPW, int UNROLL, int KS, int ALN, typename T>
static cudaError_t qgemv_fp8_go(cudaStream_t st, const cuda_qgemm_params_t *p) {
  constexpr int rows_per_block = NPW * (QGEMV_THREADS / WARP / KS);
  const int64_t blocks = ((int64_t)p->N + rows_per_block - 1) / rows_per_block;
  qgemv_fp8_kernel<WARP, MT, NPW, UNROLL, KS, ALN, T><<<(unsigned)blocks, QGEMV_THREADS, 0, st>>>(
      (const T *)p->x, p->ldx, qgemm_w_of(p), p->y, p->ldy, p->dtype_y, p->bias, p->M, p->N,
      p->K);
  return cudaGetLastError();
}

template <int WARP, int MT, int ALN, typename T>
static cudaError_t qgemv_fp8_launch(cudaStream_t st, const cuda_qgemm_params_t *p) {
  constexpr int WPB = QGEMV_THREADS / WARP;
  constexpr int NPW = MT == 1 ? 4 : MT == 2 ? 2 : 4;
  constexpr int UNROLL = MT <= 2 ? 2 : 1;
  constexpr int SNPW = MT <= 2 ? 2 : 4; /* the split variant's rows per row group */
  bool split = ((int64_t)p->N + NPW - 1) / NPW < CUDA_FP8_GEMV_SPLIT_WARPS &&
               p->K / 16 >= (MT <= 2 ? 1 : 4) * WPB * WARP;
  if (p->fp8_ks == 1) split = false;
  if (p->fp8_ks > 1) split = true;
  if (split) return qgemv_fp8_go<WARP, MT, SNPW, UNROLL, WPB, ALN, T>(st, p);
  return qgemv_fp8_go<WARP, MT, NPW, UNROLL, 1, ALN, T>(st, p);
}

template <int FMT>
static cudaError_t qgemm_launch(cudaStream_t st, const cuda_qgemm_params_t *p) {
  const int64_t gx = ((int64_t)p->N + QGEMM_BN - 1) / QGEMM_BN;
  int64_t gy = ((int64_t)p->M + QGEMM_BM - 1) / QGEMM_BM;
  if (gy > QGEMM_MAX_GRID_Y) gy = QGEMM_MAX_GRID_Y;
  dim3 grid((unsigned)gx, (unsigned)gy);
  qgemm_kernel<FMT><<<grid, QGEMM_THREADS, 0, st>>>(p->x, p->dtype_x, p->ldx, qgemm_w_of(p), p->y,
                                                    p->ldy, p->dtype_y, p->bias, p->M, p->N,
                                                    p->K);
  return cudaGetLastError();
}

/* The decode kernels for f16/bf16 x rows 16-byte aligned, weights at the format's natural
 * alignment (FP8: 16 bytes, any K; the others K % 8 == 0), M <= 8; everything else (f32 x, odd
 * alignments, M > 8) the tiled kernel. Few instantiations on purpose: every (format, M, dtype,
 * alignment) variant is a kernel per GPU architecture, and nvcc/hipcc build times grow with
 * them (a variant per alignment and per x dtype on both paths made this file several minutes
 * of compiler time per architecture); f32 activations and unaligned weight views are the
 * conformance suite's cases, not the serving path. */
template <int WARP, int FMT, typename T>
static cudaError_t qgemm_pick_kernel(cudaStream_t st, const cuda_qgemm_params_t *p) {
  constexpr int NAT = FMT == KILN_HAL_QFMT_FP8_E4M3 ? 16
                      : FMT == KILN_HAL_QFMT_Q4_K || FMT == KILN_HAL_QFMT_Q5_K ||
                              FMT == KILN_HAL_QFMT_INT4_G || FMT == KILN_HAL_QFMT_INT8_G
                          ? 8
                          : 2;
  const int esz = (int)sizeof(T);
  const bool x_aligned = ((uintptr_t)p->x % 16 == 0) && (p->M == 1 || (p->ldx * esz) % 16 == 0);
  const bool w_aligned = (uintptr_t)p->w % (uintptr_t)NAT == 0 && p->row_stride % NAT == 0;
  if constexpr (FMT == KILN_HAL_QFMT_FP8_E4M3) {
    if (p->M <= CUDA_QGEMV_MAX_M && x_aligned && w_aligned && !p->force_tiled) {
      if (p->M <= 1) return qgemv_fp8_launch<WARP, 1, NAT, T>(st, p);
      if (p->M <= 2) return qgemv_fp8_launch<WARP, 2, NAT, T>(st, p);
      if (p->M <= 4) return qgemv_fp8_launch<WARP, 4, NAT, T>(st, p);
      return qgemv_fp8_launch<WARP, 8, NAT, T>(st, p);
    }
    return qgemm_launch<FMT>(st, p);
  } else {
    if (p->M <= CUDA_QGEMV_MAX_M && p->K % 8 == 0 && x_aligned && w_aligned && !p->force_tiled) {
      if (p->M <= 1) return qgemv_launch<WARP, 1, FMT, NAT, T>(st, p);
      if (p->M <= 2) return qgemv_launch<WARP, 2, FMT, NAT, T>(st, p);
      if (p->M <= 4) return qgemv_launch<WARP, 4, FMT, NAT, T>(st, p);
      return qgemv_launch<WARP, 8, FMT, NAT, T>(st, p);
    }
    return qgemm_launch<FMT>(st, p);
  }
}

template <int WARP, int FMT>
static cudaError_t qgemm_pick_dtype(cudaStream_t st, const cuda_qgemm_params_t *p) {
  switch (p->dtype_x) {
    case KILN_HAL_F16: return qgemm_pick_kernel<WARP, FMT, kiln_f16>(st, p);
    case KILN_HAL_BF16: return qgemm_pick_kernel<WARP, FMT, kiln_bf16>(st, p);
    case KILN_HAL_F32: return qgemm_launch<FMT>(st, p);
    default: return cudaErrorInvalidValue;
  }
}

template <int WARP>
static cudaError_t qgemm_pick_fmt(cudaStream_t st, const cuda_qgemm_params_t *p) {
  switch (p->format) {
    case KILN_HAL_QFMT_Q4_0: return qgemm_pick_dtype<WARP, KILN_HAL_QFMT_Q4_0>(st, p);
    case KILN_HAL_QFMT_Q8_0: return qgemm_pick_dtype<WARP, KILN_HAL_QFMT_Q8_0>(st, p);
    case KILN_HAL_QFMT_Q4_K: return qgemm_pick_dtype<WARP, KILN_HAL_QFMT_Q4_K>(st, p);
    case KILN_HAL_QFMT_Q5_K: return qgemm_pick_dtype<WARP, KILN_HAL_QFMT_Q5_K>(st, p);
    case KILN_HAL_QFMT_Q6_K: return qgemm_pick_dtype<WARP, KILN_HAL_QFMT_Q6_K>(st, p);
    case KILN_HAL_QFMT_INT4_G: return qgemm_pick_dtype<WARP, KILN_HAL_QFMT_INT4_G>(st, p);
    case KILN_HAL_QFMT_INT8_G: return qgemm_pick_dtype<WARP, KILN_HAL_QFMT_INT8_G>(st, p);
    case KILN_HAL_QFMT_FP8_E4M3: return qgemm_pick_dtype<WARP, KILN_HAL_QFMT_FP8_E4M3>(st, p);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t cuda_launch_qgemm(cudaStream_t st, int warp, const cuda_qgemm_params_t *p) {
  if (p->M < 1 || p->N < 1 || p->K < 1) return cudaErrorInvalidValue;
  if (p->dtype_y != KILN_HAL_F32 && p->dtype_y != p->dtype_x) return cudaErrorInvalidValue;
  const bool group = p->format == KILN_HAL_QFMT_INT4_G || p->format == KILN_HAL_QFMT_INT8_G ||
                     p->format == KILN_HAL_QFMT_FP8_E4M3;
  if (group && (!p->scales || p->group_size < 1 || p->G < 1)) return cudaErrorInvalidValue;
  KILN_WARP_DISPATCH(warp, return qgemm_pick_fmt<WARP_>(st, p));
  return cudaSuccess; /* not reached */
}

/* ---- x_quant = FP8_TOKEN: the activations' per-row FP8 quantization (ABI 1.6) ------------
 * One block of 256 threads per row: the row's absmax (f32, a block reduction), s = a / 448
 * (1 when 0), then each code = e4m3_rne_satfinite(x / s) with IEEE f32 division (__fdiv_rn,
 * whatever the compiler flags), written as the code byte (fp8 != 0: the FP8 matrix units'
 * operand) or as the code's f16 value (exact; the GEMV's and the tiled kernel's x), and s to
 * scales[m]. Bit for bit kiln_hal_fp8_xquant_row (kiln/hal_quant.h). */
#define XQ_THREADS 256

/* f32_to_e4m3_code: cuda_common.cuh. */

template <typename T>
static __global__ void __launch_bounds__(XQ_THREADS)
    fp8_xquant_kernel(const T *__restrict__ x, int64_t ldx, int K, void *__restrict__ out,
                      int64_t ldo, int mode, float *__restrict__ scales) {
  const int64_t m = blockIdx.x;
  const T *xr = x + m * ldx;
  float a = 0.0f;
  for (int k = threadIdx.x; k < K; k += XQ_THREADS) a = fmaxf(a, fabsf(to_f32(xr[k])));
  __shared__ float red[XQ_THREADS]; /* a tree in shared memory: any warp size (ROCm: 64) */
  red[threadIdx.x] = a;
  __syncthreads();
  for (int h = XQ_THREADS / 2; h > 0; h >>= 1) {
    if ((int)threadIdx.x < h) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + h]);
    __syncthreads();
  }
  a = red[0];
  float s = __fdiv_rn(a, 448.0f);
  if (s == 0.0f) s = 1.0f;
  if (threadIdx.x == 0) scales[m] = s;
  for (int k = threadIdx.x; k < K; k += XQ_THREADS) {
    const uint32_t c = f32_to_e4m3_code(__fdiv_rn(to_f32(xr[k]), s));
    if (mode == CUDA_XQ_FP8)
      ((uint8_t *)out)[m * ldo + k] = (uint8_t)c;
    else if (mode == CUDA_XQ_F16)
      ((kiln_f16 *)out)[m * ldo + k] = from_f32<kiln_f16>(fp8_e4m3(c));
    else
      ((kiln_bf16 *)out)[m * ldo + k] = from_f32<kiln_bf16>(fp8_e4m3(c));
  }
}

cudaError_t cuda_launch_fp8_xquant(cudaStream_t st, const void *x, int32_t dtype_x, int64_t ldx,
                                   int32_t M, int32_t K, void *out, int64_t ldo, int mode,
                                   float *scales) {
  if (M <= 0) return cudaSuccess;
  switch (dtype_x) {
    case KILN_HAL_F32:
      fp8_xquant_kernel<float><<<(unsigned)M, XQ_THREADS, 0, st>>>((const float *)x, ldx, K, out,
                                                                  ldo, mode, scales);
      break;
    case KILN_HAL_F16:
      fp8_xquant_kernel<kiln_f16><<<(unsigned)M, XQ_THREADS, 0, st>>>((const kiln_f16 *)x, ldx,
                                                                     K, out, ldo, mode, scales);
      break;
    default:
      fp8_xquant_kernel<kiln_bf16><<<(unsigned)M, XQ_THREADS, 0, st>>>((const kiln_bf16 *)x, ldx,
                                                                      K, out, ldo, mode, scales);
      break;
  }
  return cudaGetLastError();
}
