/* cuda_attention_mma.cuh - the tensor-core paged attention of the CUDA backend (f16 and bf16,
 * head dims 64, 80, 96, 128, 256 at compile time), included by one cuda_attention_dNNN.cu per
 * head dim so that the instantiations build in parallel.
 *
 * One kernel template, two configurations of it; a call launches one of them for the whole
 * batch, chosen from max_query_len (att_mma_plan):
 *   decode  (max_query_len * G <= 64): one CTA per (sequence, KV head, 16-row tile, split). Its
 *           WN warps share the same 16 rows and split every K/V tile between them; their states
 *           are merged in shared memory at the end. When the (sequence, KV head) pairs cannot
 *           fill the GPU the context is split over nsplit CTAs that write partial (m, l, acc)
 *           states to the stream's scratch, merged by att_combine_kernel.
 *   prefill (the other calls, decodes of a mixed batch included): one CTA per (sequence, KV
 *           head, 64-row tile); each of its 4 warps owns 16 rows and walks every K/V tile
 *           (FlashAttention-2's work split); warps without rows only help with the copies.
 * Rows. The query heads that share a KV head (the GQA group of G heads) are packed into the
 * row dimension: row r of a (sequence, KV head) is query i = r / G of the sequence, head
 * kvh * G + r % G. Each K/V tile is thus read once for the whole group, and decode (q_len = 1)
 * still gives the tensor cores up to 16 rows.
 * Per tile of TK keys: the block table is looked up once per key (one tile ahead, into a small
 * ring of row offsets), K and V rows are copied with 16-byte cp.async into shared memory (rows
 * padded by 16 bytes so ldmatrix is conflict-free), STAGES tiles in flight. S = Q K^T and
 * O += P V run on mma.sync m16n8k16 with f32 accumulation; the online softmax works in base 2
 * on f32 scores. Keys outside the CTA's visible range or in a block outside [0, NB) are never
 * read (their shared rows are zeroed, so a NaN left in an unused cache slot cannot leak into
 * P V) and are masked per row (causal, sliding window, seq_len).
 * Splits are relative to each sequence's own visible tiles (split k of n takes the k-th
 * ceil(tiles / n) of them), so a launch sized for max_seq_len stays correct for any shorter
 * sequence: the splits past its tiles skip all work and record an empty state (m = -inf).
 * FP8 caches (ABI 1.7; the kernel's KV8 parameter): a K/V row chunk of 8 codes is read with one
 * 8-byte load into registers, decoded exactly to 8 values of T (att_fp8x8) and stored to the
 * same shared tile the cp.async path fills, so the math is unchanged; k_scale is in
 * p.scale (the host folded it) and the outputs are multiplied by p.v_scale. The loads are
 * synchronous (no cp.async staging of the codes): the other warps and CTAs of the SM hide their
 * latency. Only the 4-warp prefill shape is instantiated for KV8 (the 8-warp one is a speed
 * variant), to keep the compile time of these files down. */
#ifndef KILN_CUDA_ATTENTION_MMA_CUH
#define KILN_CUDA_ATTENTION_MMA_CUH

#include <limits.h>
#include <string.h>

#include "cuda_attention_args.cuh"
#include "cuda_common.cuh"

#if !defined(__HIP_PLATFORM_AMD__)

/* KILN_ATT_EMU: a host build of these kernels (one thread per lane, not part of the build; used
 * to check their indexing without a GPU) supplies its own PTX wrappers and launch. */
#if defined(KILN_ATT_EMU)
#define ATT_LAUNCH(k, grid, nt, smem, st, ...) att_emu_launch((grid), (nt), [&] { k(__VA_ARGS__); })
#else
#define ATT_LAUNCH(k, grid, nt, smem, st, ...) k<<<(grid), (nt), (smem), (st)>>>(__VA_ARGS__)

/* ---- PTX wrappers (sm_80+) ----------------------------------------------------------------- */

static __device__ __forceinline__ uint32_t att_smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void att_cp_async16(void *dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(att_smem_addr(dst)), "l"(src));
}

static __device__ __forceinline__ void att_cp_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
static __device__ __forceinline__ void att_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

static __device__ __forceinline__ void att_ldsm_x4(uint32_t r[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(att_smem_addr(p)));
}

static __device__ __forceinline__ void att_ldsm_x4_t(uint32_t r[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(att_smem_addr(p)));
}

/* c += a (16x16, row-major) * b (16x8, column-major), f32 accumulators. */
template <typename T>
static __device__ __forceinline__ void att_mma(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1);
template <>
__device__ __forceinline__ void att_mma<kiln_bf16>(float c[4], const uint32_t a[4], uint32_t b0,
                                                   uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void att_mma<kiln_f16>(float c[4], const uint32_t a[4], uint32_t b0,
                                                  uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two f32 -> one register of two T (x in the low half), round to nearest even. */
template <typename T>
static __device__ __forceinline__ uint32_t att_pack(float x, float y);
template <>
__device__ __forceinline__ uint32_t att_pack<kiln_bf16>(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *(uint32_t *)&v;
}
template <>
__device__ __forceinline__ uint32_t att_pack<kiln_f16>(float x, float y) {
  __half2 v = __floats2half2_rn(x, y);
  return *(uint32_t *)&v;
}
#endif /* KILN_ATT_EMU */

/* f32 of the f16 whose bits are the low 16 of h (exact). */
static __device__ __forceinline__ float att_h2f(uint32_t h) {
  return __half2float(__ushort_as_half((unsigned short)(h & 0xffffu)));
}

/* Eight E4M3FN codes (little endian in c) as eight T, exactly (every e4m3 value is an f16 and a
 * bf16): the bits sign << 15 | (q & 0x7F) << 7 are the f16 worth e4m3(q) / 256 (exponent field
 * e: 2^(e - 15) (1 + m/8); e = 0: the f16 subnormal (m/8) 2^-14), widened to f32 and times
 * 256 (exact), then packed (exact). Integer steps on every architecture (sm_80 has no FP8
 * conversion). NaN codes (0x7F, 0xFF) read as +-480: hal.h leaves such rows unspecified. */
template <typename T>
static __device__ __forceinline__ uint4 att_fp8x8(uint2 c) {
  const uint32_t in[2] = {c.x, c.y};
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const uint32_t ev = ((in[i] << 7) & 0x3F803F80u) | ((in[i] << 8) & 0x80008000u); /* 0, 2 */
    const uint32_t od = ((in[i] >> 1) & 0x3F803F80u) | (in[i] & 0x80008000u);        /* 1, 3 */
    w[2 * i] = att_pack<T>(att_h2f(ev) * 256.0f, att_h2f(od) * 256.0f);
    w[2 * i + 1] = att_pack<T>(att_h2f(ev >> 16) * 256.0f, att_h2f(od >> 16) * 256.0f);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/* ---- configuration ------------------------------------------------------------------------- */

/* WM x WN warps: WM row tiles of 16 rows, WN warps splitting each K/V tile of TK keys. */
template <typename T, int D, int WM, int WN, int TK, int STAGES>
struct att_cfg {
  static constexpr int WN_ = WN, TK_ = TK, STAGES_ = STAGES;
  static constexpr int NT = WM * WN * 32; /* threads */
  static constexpr int BM = 16 * WM;      /* rows per CTA */
  static constexpr int KW = TK / WN;      /* keys per warp per tile */
  static constexpr int LD = D + 8;        /* shared row stride of Q, K, V (elements) */
  static constexpr int LDO = D + 8;       /* shared row stride of the f32 epilogue */
  static constexpr int CH = D / 8;        /* 16-byte chunks per row */
  static constexpr bool QREG = D <= 128;  /* Q fragments stay in registers */
  static constexpr size_t q_bytes = (size_t)BM * LD * sizeof(T);
  static constexpr size_t kv_bytes = 2 * (size_t)STAGES * TK * LD * sizeof(T);
  static constexpr size_t off_bytes = (size_t)STAGES * TK * sizeof(long long);
  static constexpr size_t valid_bytes = ((size_t)STAGES * TK + 15) / 16 * 16;
  static constexpr size_t loop_bytes = kv_bytes + off_bytes + valid_bytes;
  static constexpr size_t epi_bytes = (size_t)WN * BM * LDO * 4 + 2 * (size_t)WN * BM * 4;
  static constexpr size_t smem = q_bytes + (loop_bytes > epi_bytes ? loop_bytes : epi_bytes);
  static_assert(D % 16 == 0 && KW % 16 == 0 && (D / 8) % 2 == 0, "tile shape");
  static_assert(STAGES >= 2, "at least double buffering");
};

/* Decode: one 16-row tile per CTA, 4 warps on the keys (2 for D = 256, whose rows are long). */
template <typename T, int D>
struct att_decode_cfg : att_cfg<T, D, 1, D <= 128 ? 4 : 2, D <= 128 ? 64 : 32, 3> {};
/* Prefill: 64 rows per CTA, one 16-row tile per warp. */
template <typename T, int D>
struct att_prefill_cfg : att_cfg<T, D, 4, 1, D <= 128 ? 64 : 32, 2> {};

/* ---- the kernel ---------------------------------------------------------------------------- */

/* The block id holding key j of this sequence, or -1 when the key is outside [lo, hi) or its
 * block is missing (past the table) or out of range. */
static __device__ __forceinline__ int att_key_block(const att_mma_args_t &a, const int32_t *bt,
                                                    long long j, long long lo, long long hi) {
  if (j < lo || j >= hi) return -1;
  const int jj = (int)j; /* hi <= INT32_MAX */
  const int bi = a.bs_shift >= 0 ? jj >> a.bs_shift : jj / a.p.block_size;
  if (bi >= a.p.max_blocks) return -1;
  const int blk = __ldg(bt + bi);
  return blk >= 0 && blk < a.p.num_blocks ? blk : -1;
}

/* Row offset (elements) in the caches of key j in block blk (from att_key_block), or -1. */
static __device__ __forceinline__ long long att_key_offset(const att_mma_args_t &a, int blk,
                                                           long long j, int kvh) {
  if (blk < 0) return -1;
  const int jj = (int)j;
  const int in_blk = a.bs_shift >= 0 ? jj & (a.p.block_size - 1) : jj % a.p.block_size;
  return (((long long)blk * a.p.num_kv_heads + kvh) * a.p.block_size + in_blk) *
         (long long)a.p.q.shape[2];
}

template <typename T, int D, int WM, int WN, int TK, int STAGES, bool DECODE, bool KV8>
static __global__ void __launch_bounds__(WM *WN * 32)
    att_mma_kernel(att_mma_args_t a, int mtiles, int nsplit) {
  typedef att_cfg<T, D, WM, WN, TK, STAGES> C;
  constexpr int NT = C::NT, BM = C::BM, KW = C::KW, LD = C::LD, LDO = C::LDO, CH = C::CH;
  constexpr int KS = D / 16, DN = D / 8, NB = KW / 8;
  extern __shared__ uint4 att_smem[];
  T *sQ = (T *)att_smem;
  T *sK = (T *)((char *)att_smem + C::q_bytes);
  T *sV = sK + (size_t)STAGES * TK * LD;
  long long *sOff = (long long *)(sV + (size_t)STAGES * TK * LD);
  uint8_t *sValid = (uint8_t *)(sOff + STAGES * TK);

  const cuda_attention_params_t &p = a.p;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = DECODE ? 0 : warp, wn = DECODE ? warp : 0;
  const int NKV = p.num_kv_heads, G = a.group;

  /* Which (sequence, KV head, row tile, split) this CTA is. */
  long long idx = blockIdx.x;
  int split = 0, mt, kvh, s;
  if (DECODE) {
    split = (int)(idx % nsplit);
    idx /= nsplit;
    mt = (int)(idx % mtiles);
    idx /= mtiles;
    kvh = (int)(idx % NKV);
    s = a.seq_base + (int)(idx / NKV);
  } else {
    /* Heaviest (last) row tiles of every sequence first: causal work grows with the row. */
    const long long per = (long long)gridDim.x / mtiles;
    mt = mtiles - 1 - (int)(idx / per);
    idx %= per;
    kvh = (int)(idx % NKV);
    s = a.seq_base + (int)(idx / NKV);
  }
  const int32_t qs = p.qsl[(long long)s * p.qsl_stride];
  const int32_t qe = p.qsl[(long long)(s + 1) * p.qsl_stride];
  int32_t L = p.seq_lens[(long long)s * p.seq_lens_stride];
  if (L < 0) L = 0;
  const long long q_len = (long long)qe - qs;
  /* Decode takes 1 <= q_len <= qd, prefill the rest: each sequence is done by one of them. */
  if (q_len < 1 || qs < 0) return;
  if (DECODE ? q_len > a.qd : q_len <= a.qd) return;
  const long long row0 = (long long)mt * BM;
  const long long nrows_ll = q_len * G - row0;
  if (nrows_ll <= 0) return;
  const int nrows = nrows_ll < BM ? (int)nrows_ll : BM;
  const long long T_rows = p.q.shape[0];
  const long long NH = p.q.shape[1];

  /* Keys visible to query i: [lo(i), hi(i)), non-decreasing in i. */
  const long long first_i = row0 / G, last_i = (row0 + nrows - 1) / G;
  const long long pos0 = (long long)L - q_len;
  const long long table_keys = (long long)p.max_blocks * p.block_size;
  long long lo_cta = 0, hi_cta = L;
  if (p.causal) hi_cta = pos0 + last_i + 1 < L ? pos0 + last_i + 1 : L;
  if (hi_cta > table_keys) hi_cta = table_keys;
  if (p.sliding_window > 0) lo_cta = pos0 + first_i - p.sliding_window + 1;
  if (lo_cta < 0) lo_cta = 0;
  long long kb = 0, ke = 0; /* tile range of this CTA */
  if (hi_cta > lo_cta) {
    const long long t0 = lo_cta / TK, t1 = (hi_cta + TK - 1) / TK;
    const long long per = (t1 - t0 + nsplit - 1) / nsplit;
    kb = t0 + split * per;
    ke = kb + per < t1 ? kb + per : t1;
    if (kb > ke) kb = ke;
  }
  const int ntiles = (int)(ke - kb);

  const T *kc = (const T *)p.k_cache;
  const T *vc = (const T *)p.v_cache;
  const uint8_t *kc8 = (const uint8_t *)p.k_cache; /* KV8: codes, one byte per element */
  const uint8_t *vc8 = (const uint8_t *)p.v_cache;
  const int32_t *bt = p.block_table + (long long)s * p.bt_stride;

  /* Prologue: offsets of the first STAGES tiles, then Q. Thread tid < TK looks up key tid of
   * every tile; the block id of the tile after next is loaded one iteration ahead (nblk), so
   * the lookup's latency hides behind a tile of compute. */
  int nblk = -1;
  if (tid < TK) {
    for (int st = 0; st < STAGES; st++) {
      const long long j = (kb + st) * TK + tid;
      sOff[st * TK + tid] =
          st < ntiles ? att_key_offset(a, att_key_block(a, bt, j, lo_cta, hi_cta), j, kvh) : -1;
    }
    if (STAGES < ntiles) nblk = att_key_block(a, bt, (kb + STAGES) * TK + tid, lo_cta, hi_cta);
  }
  if (ntiles > 0) {
    const T *qb = (const T *)p.q.ptr;
    for (int c = tid; c < BM * CH; c += NT) {
      const int r = c / CH, ch = c % CH;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < nrows) {
        const long long pr = row0 + r, i = pr / G, t = qs + i;
        if (t < T_rows) {
          const T *src =
              qb + t * p.q.stride[0] + ((long long)kvh * G + pr % G) * p.q.stride[1] + ch * 8;
          if (a.q_vec) {
            v = *(const uint4 *)src;
          } else {
            const unsigned short *hw = (const unsigned short *)src;
            v.x = hw[0] | ((uint32_t)hw[1] << 16);
            v.y = hw[2] | ((uint32_t)hw[3] << 16);
            v.z = hw[4] | ((uint32_t)hw[5] << 16);
            v.w = hw[6] | ((uint32_t)hw[7] << 16);
          }
        }
      }
      *(uint4 *)(sQ + r * LD + ch * 8) = v;
    }
  }
  __syncthreads();

  /* Issues the copies of tile number `it` (relative) into its stage. */
  auto issue = [&](int it) {
    if (it < ntiles) {
      const int st = it % STAGES;
      const long long *off = sOff + st * TK;
      T *dk = sK + (size_t)st * TK * LD, *dv = sV + (size_t)st * TK * LD;
      for (int c = tid; c < TK * CH; c += NT) {
        const int k = c / CH, ch = c % CH;
        const long long o = off[k];
        T *pk = dk + k * LD + ch * 8, *pv = dv + k * LD + ch * 8;
        if (o >= 0) {
          if constexpr (KV8) {
            const uint2 ck = __ldg((const uint2 *)(kc8 + o + ch * 8));
            const uint2 cv = __ldg((const uint2 *)(vc8 + o + ch * 8));
            *(uint4 *)pk = att_fp8x8<T>(ck);
            *(uint4 *)pv = att_fp8x8<T>(cv);
          } else {
            att_cp_async16(pk, kc + o + ch * 8);
            att_cp_async16(pv, vc + o + ch * 8);
          }
        } else {
          *(uint4 *)pk = make_uint4(0, 0, 0, 0);
          *(uint4 *)pv = make_uint4(0, 0, 0, 0);
        }
        if (ch == 0) sValid[st * TK + k] = o >= 0;
      }
    }
    att_cp_commit();
  };
#pragma unroll
  for (int st = 0; st < STAGES - 1; st++) issue(st);

  /* This thread's two rows (CTA-local rA and rA + 8) and their visible ranges. */
  long long lo_r[2], hi_r[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int r = wm * 16 + lane / 4 + h * 8;
    lo_r[h] = 1;
    hi_r[h] = 0;
    if (r < nrows) {
      const long long pr = row0 + r, i = pr / G;
      if (qs + i < T_rows) {
        const long long pos = pos0 + i;
        hi_r[h] = p.causal ? (pos + 1 < L ? pos + 1 : L) : L;
        lo_r[h] = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
        if (lo_r[h] < 0) lo_r[h] = 0;
      }
    }
  }

  /* Keys in [lo_w, hi_w) are visible to every row of this warp that is written. Rows past the
   * sequence's rows (lo > hi) don't count: their (never written) results may use any key. */
  long long lo_w = -1, hi_w = LLONG_MAX;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    if (lo_r[h] > hi_r[h]) continue;
    lo_w = lo_r[h] > lo_w ? lo_r[h] : lo_w;
    hi_w = hi_r[h] < hi_w ? hi_r[h] : hi_w;
  }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long lo_o = __shfl_xor_sync(0xffffffffu, lo_w, o);
    const long long hi_o = __shfl_xor_sync(0xffffffffu, hi_w, o);
    lo_w = lo_o > lo_w ? lo_o : lo_w;
    hi_w = hi_o < hi_w ? hi_o : hi_w;
  }

  uint32_t qf[C::QREG ? KS : 1][4];
  const T *qwarp = sQ + (wm * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8;
  if (C::QREG && ntiles > 0) {
#pragma unroll
    for (int ks = 0; ks < (C::QREG ? KS : 1); ks++) att_ldsm_x4(qf[ks], qwarp + ks * 16);
  }

  const bool warp_active = wm * 16 < nrows;
  float acc[DN][4];
#pragma unroll
  for (int dn = 0; dn < DN; dn++) acc[dn][0] = acc[dn][1] = acc[dn][2] = acc[dn][3] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
  const float sl2 = a.scale_log2;
  const bool capped = p.softcap > 0.0f;
  const float cap_in = capped ? p.scale / p.softcap : 0.0f;
  const float cap_out = capped ? p.softcap * 1.4426950408889634f : 0.0f;

  for (int it = 0; it < ntiles; it++) {
    att_cp_wait<STAGES - 2>();
    __syncthreads();
    issue(it + STAGES - 1);
    if (tid < TK) {
      const int nx = it + STAGES;
      if (nx < ntiles)
        sOff[(nx % STAGES) * TK + tid] = att_key_offset(a, nblk, (kb + nx) * TK + tid, kvh);
      if (nx + 1 < ntiles) nblk = att_key_block(a, bt, (kb + nx + 1) * TK + tid, lo_cta, hi_cta);
    }
    /* A warp whose 16 rows are all past the sequence's rows only helps with the copies. */
    if (!warp_active) continue;
    const int st = it % STAGES;
    const T *tk = sK + (size_t)st * TK * LD + (size_t)(wn * KW) * LD;
    const T *tv = sV + (size_t)st * TK * LD + (size_t)(wn * KW) * LD;
    const uint8_t *tvalid = sValid + st * TK + wn * KW;

    /* S = Q K^T over this warp's KW keys. */
    float sc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; nb++) sc[nb][0] = sc[nb][1] = sc[nb][2] = sc[nb][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      uint32_t qa[4];
      if (C::QREG) {
#pragma unroll
        for (int e = 0; e < 4; e++) qa[e] = qf[C::QREG ? ks : 0][e];
      } else {
        att_ldsm_x4(qa, qwarp + ks * 16);
      }
#pragma unroll
      for (int nb2 = 0; nb2 < NB / 2; nb2++) {
        uint32_t b[4];
        att_ldsm_x4(b, tk + (nb2 * 16 + (lane % 8) + (lane / 16) * 8) * LD + ks * 16 +
                           ((lane / 8) % 2) * 8);
        att_mma<T>(sc[2 * nb2], qa, b[0], b[1]);
        att_mma<T>(sc[2 * nb2 + 1], qa, b[2], b[3]);
      }
    }

    /* Mask, scale (base 2), online softmax. A tile whose keys are all present and visible to
     * every row of the warp (most tiles of a long prefill) skips the per-key tests. */
    const long long kbase = (kb + it) * TK + wn * KW;
    const bool all_present = (lane >= KW || tvalid[lane]) && (lane + 32 >= KW || tvalid[lane + 32]);
    const bool full = __all_sync(0xffffffffu, kbase >= lo_w && kbase + KW <= hi_w && all_present);
    float mx[2] = {-INFINITY, -INFINITY};
    if (full) {
#pragma unroll
      for (int nb = 0; nb < NB; nb++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float x = sc[nb][e];
          x = capped ? cap_out * tanhf(x * cap_in) : x * sl2;
          sc[nb][e] = x;
          mx[e / 2] = fmaxf(mx[e / 2], x);
        }
      }
    } else {
      int lo_t[2], hi_t[2];
#pragma unroll
      for (int h = 0; h < 2; h++) {
        long long lo = lo_r[h] - kbase, hi = hi_r[h] - kbase;
        lo_t[h] = lo < 0 ? 0 : (lo > KW ? KW : (int)lo);
        hi_t[h] = hi < 0 ? 0 : (hi > KW ? KW : (int)hi);
      }
#pragma unroll
      for (int nb = 0; nb < NB; nb++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int h = e / 2, k = nb * 8 + (lane % 4) * 2 + (e % 2);
          float x = sc[nb][e];
          x = capped ? cap_out * tanhf(x * cap_in) : x * sl2;
          const bool vis = k >= lo_t[h] && k < hi_t[h] && tvalid[k];
          x = vis ? x : -INFINITY;
          sc[nb][e] = x;
          mx[h] = fmaxf(mx[h], x);
        }
      }
    }
    float ref[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float mn = fmaxf(m_r[h], mx[h]);
      ref[h] = mn == -INFINITY ? 0.0f : mn;
      const float corr = exp2f(m_r[h] - ref[h]);
      m_r[h] = mn;
      l_r[h] *= corr;
#pragma unroll
      for (int dn = 0; dn < DN; dn++) {
        acc[dn][2 * h] *= corr;
        acc[dn][2 * h + 1] *= corr;
      }
    }
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const float pe = exp2f(sc[nb][e] - ref[e / 2]);
        sc[nb][e] = pe;
        l_r[e / 2] += pe;
      }
    }

    /* O += P V: the S accumulators of two key blocks form one A fragment. */
#pragma unroll
    for (int kk = 0; kk < KW / 16; kk++) {
      uint32_t pa[4];
      pa[0] = att_pack<T>(sc[2 * kk][0], sc[2 * kk][1]);
      pa[1] = att_pack<T>(sc[2 * kk][2], sc[2 * kk][3]);
      pa[2] = att_pack<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      pa[3] = att_pack<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
      for (int dn2 = 0; dn2 < DN / 2; dn2++) {
        uint32_t b[4];
        att_ldsm_x4_t(b, tv + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LD + dn2 * 16 +
                             (lane / 16) * 8);
        att_mma<T>(acc[2 * dn2], pa, b[0], b[1]);
        att_mma<T>(acc[2 * dn2 + 1], pa, b[2], b[3]);
      }
    }
  }

  /* Epilogue: the warps' states go to shared memory (reusing the K/V stages), then every row
   * is merged over the WN warps and written: to out, or as this split's partial state. */
#pragma unroll
  for (int h = 0; h < 2; h++) {
    l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 1);
    l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 2);
  }
  att_cp_wait<0>();
  __syncthreads();
  float *sO = (float *)sK;        /* [WN][BM][LDO] */
  float *sM = sO + WN * BM * LDO; /* [WN][BM] */
  float *sL = sM + WN * BM;       /* [WN][BM] */
  {
    const int rA = wm * 16 + lane / 4;
    float *o = sO + (wn * BM + rA) * LDO + (lane % 4) * 2;
#pragma unroll
    for (int dn = 0; dn < DN; dn++) {
      *(float2 *)(o + dn * 8) = make_float2(acc[dn][0], acc[dn][1]);
      *(float2 *)(o + 8 * LDO + dn * 8) = make_float2(acc[dn][2], acc[dn][3]);
    }
    if (lane % 4 == 0) {
      sM[wn * BM + rA] = m_r[0];
      sL[wn * BM + rA] = l_r[0];
      sM[wn * BM + rA + 8] = m_r[1];
      sL[wn * BM + rA + 8] = l_r[1];
    }
  }
  __syncthreads();

  const bool partial = DECODE && nsplit > 1;
  for (int c = tid; c < nrows * CH; c += NT) {
    const int r = c / CH, ch = c % CH;
    const long long pr = row0 + r, i = pr / G, t = qs + i;
    if (t >= T_rows) continue;
    const long long h = (long long)kvh * G + pr % G;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < WN; w++) M = fmaxf(M, sM[w * BM + r]);
    float Ls = 0.0f, o[8];
#pragma unroll
    for (int e = 0; e < 8; e++) o[e] = 0.0f;
#pragma unroll
    for (int w = 0; w < WN; w++) {
      const float mw = sM[w * BM + r];
      if (mw == -INFINITY) continue;
      const float f = exp2f(mw - M);
      Ls += f * sL[w * BM + r];
      const float *src = sO + (w * BM + r) * LDO + ch * 8;
#pragma unroll
      for (int e = 0; e < 8; e++) o[e] += f * src[e];
    }
    if (partial) {
      const long long prow = ((long long)s * a.qd + i) * NH + h;
      const long long at = (long long)split * a.part_rows + prow;
      float4 *dst = (float4 *)(a.part_acc + at * D + ch * 8);
      dst[0] = make_float4(o[0], o[1], o[2], o[3]);
      dst[1] = make_float4(o[4], o[5], o[6], o[7]);
      if (ch == 0) *(float2 *)(a.part_ml + at * 2) = make_float2(M, Ls);
    } else {
      const float inv = Ls > 0.0f ? p.v_scale / Ls : 0.0f; /* no visible key: zeros */
      T *dst = (T *)p.out.ptr + t * p.out.stride[0] + h * p.out.stride[1] + ch * 8;
      if (a.o_vec) {
        uint4 v;
        v.x = att_pack<T>(o[0] * inv, o[1] * inv);
        v.y = att_pack<T>(o[2] * inv, o[3] * inv);
        v.z = att_pack<T>(o[4] * inv, o[5] * inv);
        v.w = att_pack<T>(o[6] * inv, o[7] * inv);
        *(uint4 *)dst = v;
      } else {
#pragma unroll
        for (int e = 0; e < 8; e++) dst[e] = from_f32<T>(o[e] * inv);
      }
    }
  }
}

/* Merges the nsplit (<= ATT_MAX_SPLITS) partial states of each decode row into out. One CTA
 * of 4 warps per row prow = (s * qd + i) * NH + h; rows the decode kernel did not own are
 * skipped by the same test it used. The split weights exp2(m - M) are formed once in shared
 * memory, then each warp sums a quarter of the splits' outputs (independent loads, so many are
 * in flight) and the four sums are added. */
#define ATT_MAX_SPLITS 256
#define ATT_COMBINE_SMEM(D) ((ATT_MAX_SPLITS + 4 + 4 * (D)) * sizeof(float))
template <typename T, int D>
static __global__ void __launch_bounds__(128) att_combine_kernel(att_mma_args_t a, int nsplit) {
  extern __shared__ uint4 att_smem[];
  float *s_w = (float *)att_smem;            /* [ATT_MAX_SPLITS] */
  float *s_red = s_w + ATT_MAX_SPLITS;       /* [4] */
  float(*s_o)[D] = (float(*)[D])(s_red + 4); /* [4][D] */
  const cuda_attention_params_t &p = a.p;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const long long prow = blockIdx.x;
  const long long NH = p.q.shape[1];
  const long long h = prow % NH, rest = prow / NH, i = rest % a.qd, s = rest / a.qd;
  const int32_t qs = p.qsl[s * p.qsl_stride], qe = p.qsl[(s + 1) * p.qsl_stride];
  const long long q_len = (long long)qe - qs;
  if (q_len < 1 || q_len > a.qd || qs < 0 || i >= q_len) return;
  const long long t = qs + i;
  if (t >= p.q.shape[0]) return;

  /* M = max over the splits' maxima. */
  float m = -INFINITY;
  for (int sp = tid; sp < nsplit; sp += 128) m = fmaxf(m, a.part_ml[(sp * a.part_rows + prow) * 2]);
  m = warp_max<32>(m);
  if (lane == 0) s_red[warp] = m;
  __syncthreads();
  const float M = fmaxf(fmaxf(s_red[0], s_red[1]), fmaxf(s_red[2], s_red[3]));
  __syncthreads();
  /* weights and L = sum of w * l */
  float l = 0.0f;
  for (int sp = tid; sp < nsplit; sp += 128) {
    const float2 ml = *(const float2 *)(a.part_ml + (sp * a.part_rows + prow) * 2);
    const float w = ml.x == -INFINITY ? 0.0f : exp2f(ml.x - M);
    s_w[sp] = w;
    l += w * ml.y;
  }
  l = warp_sum<32>(l);
  if (lane == 0) s_red[warp] = l;
  __syncthreads();
  const float Ls = s_red[0] + s_red[1] + s_red[2] + s_red[3];

  constexpr int E = (D + 31) / 32;
  float o[E];
#pragma unroll
  for (int e = 0; e < E; e++) o[e] = 0.0f;
#pragma unroll 4
  for (int sp = warp; sp < nsplit; sp += 4) {
    const float w = s_w[sp];
    if (w == 0.0f) continue;
    const float *src = a.part_acc + (sp * a.part_rows + prow) * D;
#pragma unroll
    for (int e = 0; e < E; e++) {
      const int d = e * 32 + lane;
      if (d < D) o[e] += w * src[d];
    }
  }
#pragma unroll
  for (int e = 0; e < E; e++) {
    const int d = e * 32 + lane;
    if (d < D) s_o[warp][d] = o[e];
  }
  __syncthreads();
  const float inv = Ls > 0.0f ? p.v_scale / Ls : 0.0f; /* no visible key: zeros */
  T *dst = (T *)p.out.ptr + t * p.out.stride[0] + h * p.out.stride[1];
  for (int d = tid; d < D; d += 128)
    dst[d] = from_f32<T>((s_o[0][d] + s_o[1][d] + s_o[2][d] + s_o[3][d]) * inv);
}

/* ---- launcher ------------------------------------------------------------------------------ */

template <typename K>
static cudaError_t att_set_smem(K kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

/* Launches the grid of `per_seq` CTAs per sequence for all S sequences, in chunks of whole
 * sequences that keep gridDim.x within int32. */
template <typename K>
static cudaError_t att_launch_seqs(K kernel, cudaStream_t st, att_mma_args_t a, int per_seq, int nt,
                                   size_t smem, int mtiles, int nsplit) {
  const int S = a.p.num_seqs;
  const int chunk = (int)(INT32_MAX / per_seq) < S ? (int)(INT32_MAX / per_seq) : S;
  for (int base = 0; base < S; base += chunk) {
    const int n = S - base < chunk ? S - base : chunk;
    a.seq_base = base;
    ATT_LAUNCH(kernel, (unsigned)((long long)n * per_seq), nt, smem, st, a, mtiles, nsplit);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

/* The prefill kernel with WM 16-row warps per CTA and STG stages of K/V tiles. */
template <typename T, int D, int WM, int STG, bool KV8>
static cudaError_t att_prefill_run(cudaStream_t st, const att_mma_args_t &a) {
  typedef att_cfg<T, D, WM, 1, D <= 128 ? 64 : 32, STG> PC;
  if ((int64_t)PC::smem > a.p.smem_optin) return cudaErrorNotSupported;
  auto kp = att_mma_kernel<T, D, WM, 1, PC::TK_, PC::STAGES_, false, KV8>;
  cudaError_t e = att_set_smem(kp, PC::smem);
  if (e != cudaSuccess) return e;
  const int NKV = a.p.num_kv_heads;
  const long long G = a.group;
  const long long mtiles = ((long long)a.p.max_query_len * G + PC::BM - 1) / PC::BM;
  if (mtiles * NKV > INT32_MAX) return cudaErrorInvalidValue;
  return att_launch_seqs(kp, st, a, (int)(NKV * mtiles), PC::NT, PC::smem, (int)mtiles, 1);
}

template <typename T, int D, bool KV8>
static cudaError_t att_mma_launch_t(cudaStream_t st, const cuda_attention_params_t *p) {
  typedef att_decode_cfg<T, D> DC;
  typedef att_prefill_cfg<T, D> PC;
  if ((int64_t)DC::smem > p->smem_optin || (int64_t)PC::smem > p->smem_optin)
    return cudaErrorNotSupported;
  att_mma_args_t a;
  memset(&a, 0, sizeof(a));
  a.p = *p;
  auto kd = att_mma_kernel<T, D, 1, DC::WN_, DC::TK_, DC::STAGES_, true, KV8>;
  cudaError_t e;
  if ((e = att_set_smem(kd, DC::smem)) != cudaSuccess) return e;
  /* Decode CTAs that fit on one SM at once: the split count aims at one full wave. Asked once
   * per kernel (a heuristic only: the answer is the same on every device of one kind; one cache
   * per instantiation, KV8 included). */
  static int per_sm_cached = 0;
  int per_sm = per_sm_cached;
  if (per_sm < 1) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kd, DC::NT, DC::smem) !=
            cudaSuccess ||
        per_sm < 1) {
      (void)cudaGetLastError();
      per_sm = 1;
    }
    per_sm_cached = per_sm;
  }
  att_mma_plan(p, DC::TK_, D, per_sm, &a);
  const int NKV = p->num_kv_heads;
  if (a.qd > 0) {
    const int mtiles = a.decode_mtiles, nsplit = a.nsplit;
    e = att_launch_seqs(kd, st, a, NKV * mtiles * nsplit, DC::NT, DC::smem, mtiles, nsplit);
    if (e != cudaSuccess) return e;
    if (nsplit > 1) {
      auto kc = att_combine_kernel<T, D>;
      ATT_LAUNCH(kc, (unsigned)a.part_rows, 128, ATT_COMBINE_SMEM(D), st, a, nsplit);
      if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
  } else {
#if defined(KILN_CUDA_ATT_EXPERIMENT)
    /* Tuning builds only (-DKILN_CUDA_ATT_EXPERIMENT): KILN_CUDA_ATT_PREFILL picks the CTA
     * shape of the prefill kernel: 1 = 8 warps (128 rows), 2 = 3 stages, 3 = both. */
    static int var = -1;
    if (var < 0) {
      const char *v = getenv("KILN_CUDA_ATT_PREFILL");
      var = v ? atoi(v) : 0;
    }
    if (var == 1) return att_prefill_run<T, D, 8, 2, KV8>(st, a);
    if (var == 2) return att_prefill_run<T, D, 4, 3, KV8>(st, a);
    if (var == 3) return att_prefill_run<T, D, 8, 3, KV8>(st, a);
#endif
    /* 128-row CTAs (8 warps) when they still make two waves: each K/V tile then serves twice
     * the rows (H200, 2026-12-02: 2048-token prefill 137 -> 147 TFLOP/s, a 4,784-patch vision
     * block 1.006 -> 0.894 ms); a short prompt keeps 64-row CTAs, whose grid is twice as wide
     * (512 tokens: 0.044 ms against 0.046). From num_seqs and max_query_len only, like the rest
     * of the plan, so captured graphs replay correctly. */
    const long long G = a.group, nkv = p->num_kv_heads;
    const long long ctas128 =
        (long long)p->num_seqs * nkv * (((long long)p->max_query_len * G + 127) / 128);
    if (!KV8 && ctas128 >= 2LL * p->sm_count) {
      e = att_prefill_run<T, D, 8, PC::STAGES_, false>(st, a);
      if (e != cudaErrorNotSupported) return e;
      (void)cudaGetLastError(); /* not enough shared memory for 128 rows: 64 */
    }
    return att_prefill_run<T, D, 4, PC::STAGES_, KV8>(st, a);
  }
  return cudaSuccess;
}

/* The head-dim launchers (cuda_attention_dNNN.cu) are instantiated with this. */
#define KILN_ATT_MMA_LAUNCHER(DIM)                                                          \
  extern "C" cudaError_t cuda_attention_mma_d##DIM(cudaStream_t st,                         \
                                                   const cuda_attention_params_t *p) {      \
    if (p->q.dtype == KILN_HAL_BF16)                                                        \
      return p->kv_fp8 ? att_mma_launch_t<kiln_bf16, DIM, true>(st, p)                      \
                       : att_mma_launch_t<kiln_bf16, DIM, false>(st, p);                    \
    if (p->q.dtype == KILN_HAL_F16)                                                         \
      return p->kv_fp8 ? att_mma_launch_t<kiln_f16, DIM, true>(st, p)                       \
                       : att_mma_launch_t<kiln_f16, DIM, false>(st, p);                     \
    return cudaErrorNotSupported;                                                           \
  }

#endif /* !__HIP_PLATFORM_AMD__ */

#endif /* KILN_CUDA_ATTENTION_MMA_CUH */
