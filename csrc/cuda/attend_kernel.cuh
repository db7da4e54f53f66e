// The attend pass of the certified decode on CUDA: the outputs of triton_kernels/phase2.py::_attend_kernel
// (read its docstring first), computed by independent warps that stream their pages through a cp.async ring.
//
// Work: one CUDA block per (row, KV head, channel part, split), grid (R·H_kv·CS, S). Each of its NW warps takes
// the blocks ib = i·NW + warp (i = 0, 1, …) of the split, one 16-token block per iteration, and keeps its own
// float64 accumulators; the warps meet once, at the end, to add their partial sums. Per iteration a warp
//
//   1. issues the asynchronous copy of the block STAGES − 1 iterations ahead into its ring of shared-memory
//      stages (16-byte cp.async.cg: the page's value codes, scales and zeros, which are one contiguous span of the
//      page, the block's G·16 phase-2 scores and the page header with η); block ids and promotion bits come from
//      two registers per lane that hold the next 32 iterations' table entries (loaded one chunk ahead, handed out
//      by warp shuffles), so no dependent load of the table sits in front of a copy;
//   2. waits for the oldest stage, computes the block's weights w = expf(fl(s − m)) once per (head, token) and
//      den_b = Σ_t w (a 16-term float32 sum, in a shuffle tree), and puts the weights in shared memory, with the
//      block's value scales and zeros widened to float32 (exact) once per warp rather than once per lane and token;
//   3. for its lane's CPL channels and every query head: v̂ = fma(c, s, z) (rounded once: the code c is made a
//      float with an OR into the bits of 2^23 and one exact subtraction, not an int→float conversion, which
//      runs at 1/8 of the FMA rate), and num = Σ_t w·v̂ as a chain of FMAs in token order;
//   4. converts num and den_b exactly to float64 and adds them to its accumulators, with
//      aval += den_b·η_b (INT4-value heads) and atail += den_b (INT8-key heads), and stores
//      exact_lm = m + log den_b on key-promoted heads.
//
// The float32 sums are over the 16 tokens of one block in any order (docs/certification.md §5.1 bounds them by
// γ_16 whatever the order), everything after them is float64: the certificate's arithmetic model is the Triton
// and Gluon kernels' one. Value-promoted heads (bit G + g) take their values unquantized from the pinned shadow
// (zero-copy), with the same FMA chain: a lane reads each token's channels once for all promoted heads of the
// block, four tokens' reads in flight together (PCIe latency, not bytes, is what these reads cost).
//
// Shared memory per warp: STAGES stages of [value span | scores GP·16 float32 | header 16 B | slot 16 B: bits
// int32, block id int32], the weights [16][GP] float32 and (GP ≤ 4) the block's (scale, zero) pairs [16][D/16]
// float32; after the loop the same memory holds the warps' float64 partial sums [NW][GP][DPART] and [NW][GP][3].
//
// Build: torch's extension tools compile attend.cu (the binding and the dispatch) and one translation unit per head
// dimension (attend_d64.cu, attend_d128.cu, attend_d256.cu: the kernels, compiled in parallel) on first use
// (certvllm/triton_kernels/attend_cuda.py). tests/triton_kernels/test_cuda_compile.py compiles the per-dimension
// units offline with nvcc and reads their registers and spills.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace certvllm {

constexpr int kTokens = 16;           // tokens per block (formats.layout.BLOCK_SIZE)
constexpr int kGroup = 16;            // value group size g compiled (other sizes run the Triton kernel)
constexpr unsigned kFull = 0xffffffffu;

// The split-K arguments the phase-2 kernels share (triton_kernels/common.py): the block table, the rows' full
// blocks, the promotion bitmask, the active groups and the plan.
struct SplitArgs {
  const int64_t* tables;   // [R, ≥B] block ids, row stride tb_stride
  const int64_t* nfull;    // [R] full blocks per row
  const int32_t* bits;     // [R, H, B] promotion bitmask: bit g keys, bit G + g values of query head g
  const int32_t* active;   // [R, H] 0: the group is skipped and writes only what the kernel says
  int64_t num_blocks;      // 16-token blocks in the cache (ids are clamped to it)
  int64_t B;               // block-table columns
  int64_t tb_stride;       // row stride of tables
  int S;                   // splits
  int BPS;                 // blocks per split
  int H;                   // KV heads
  int G;                   // query heads per KV head (≤ GP)
  int M;                   // 16-token blocks per engine block
};

struct AttendArgs : SplitArgs {
  const float* scores;     // [R, H, B, G, 16] phase-2 scores
  const float* mmax;       // [R, H, G] global maximum score per query head
  const void* shadow;      // [E, H, 2, M·16, D] originals (fp16 or bf16), device-readable (pinned host under UVA)
  const uint8_t* pages;    // [E, H, M·page_bytes] tier-1 pages
  double* acc;             // out [R, H, S, G, D] Σ_b num_b
  double* den;             // out [R, H, S, G] Σ_b den_b
  double* aval;            // out [R, H, S, G] Σ den_b·η_b over INT4-value blocks
  double* atail;           // out [R, H, S, G] Σ den_b over INT8-key blocks
  float* exact_lm;         // out [R, H, G, B] m + log den_b on key-promoted blocks (others untouched)
  int page_bytes;          // bytes per page
  int v_codes;             // byte offset of the value codes; scales and zeros follow them contiguously
  int header;              // byte offset of the header (η float32 first)
  int shadow_bf16;         // the shadow's dtype: 1 bfloat16, 0 float16
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// A warp's cp.async ring: issue(j) queues the copies of iteration j into stage j % STAGES and commits them (a group,
// possibly empty, for every j), STAGES − 1 iterations ahead; body(i) runs once iteration i's copies have landed.
template <int STAGES, typename Issue, typename Body>
__device__ __forceinline__ void cp_async_ring(int niter, Issue&& issue, Body&& body) {
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) issue(j);
  for (int i = 0; i < niter; ++i) {
    issue(i + STAGES - 1);
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    body(i);
  }
}

// 4-bit code k of x (k-th nibble) as an exact float: the bits of 2^23 + code, minus 2^23.
__device__ __forceinline__ float nibble(uint32_t x, int k) {
  return __int_as_float(0x4B000000u | ((x >> (4 * k)) & 15u)) - 8388608.0f;
}

template <int CB>
__device__ __forceinline__ uint32_t load_codes(const uint8_t* p) {
  if constexpr (CB == 1) return *p;
  if constexpr (CB == 2) return *reinterpret_cast<const uint16_t*>(p);
  if constexpr (CB == 4) return *reinterpret_cast<const uint32_t*>(p);
  return 0;
}

// CPL consecutive 16-bit originals from element i of the shadow (i a multiple of CPL: one aligned vector load).
template <int CPL>
struct ShadowVec {
  static_assert(CPL == 2 || CPL == 4 || CPL == 8, "2, 4 or 8 channels per lane");
  using Raw = typename std::conditional<CPL == 2, uint32_t, typename std::conditional<CPL == 4, uint2, uint4>::type>::type;
  Raw raw;
  __device__ __forceinline__ void load(const void* shadow, int64_t i) {
    raw = *reinterpret_cast<const Raw*>(static_cast<const uint16_t*>(shadow) + i);
  }
  // channel c as a float (exact: a 16-bit float widens without rounding)
  __device__ __forceinline__ float at(int c, int bf16) const {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
    const uint32_t bits = (w[c >> 1] >> (16 * (c & 1))) & 0xffffu;
    if (bf16) return __uint_as_float(bits << 16);
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
};

// Whether the kernel widens a block's value scales and zeros to float32 pairs once per warp (else each lane
// widens its group's, per token).
__host__ __device__ constexpr bool attend_scale_pairs(int GP) { return GP <= 4; }

// D head dim, GP query heads per KV head rounded up to a power of two, CPL channels per lane (the CUDA block
// takes a part of DPART = 32·CPL channels), NW warps, STAGES ring depth.
template <int D, int GP, int CPL, int NW, int STAGES>
__global__ void __launch_bounds__(NW * 32) attend_kernel(const AttendArgs a) {
  constexpr int N = kTokens;
  constexpr int DPART = 32 * CPL;
  constexpr int CS = D / DPART;
  constexpr int CB = CPL / 2;                           // code bytes per lane and token
  constexpr int ROUNDS = (GP * N + 31) / 32;            // (head, token) weights per lane
  constexpr int NG = D / kGroup;                        // value groups per token
  constexpr int VSPAN = N * D / 2 + 4 * N * NG;         // codes [16][D/2] u8, scales [16][NG] f16, zeros [16][NG] f16
  constexpr int VCHUNKS = VSPAN / 16;
  constexpr int SC_BYTES = GP * N * 4;                  // room for the scores [G][16] float32
  constexpr int STAGE = VSPAN + SC_BYTES + 32;          // + header 16 B + slot (bits int32, block id int32)
  constexpr bool kPairs = attend_scale_pairs(GP);       // the (scale, zero) pairs' buffer
  static_assert(CS * DPART == D && CPL % 2 == 0 && CPL <= 8 && kGroup % CPL == 0, "channels per lane must split D");
  static_assert(VSPAN % 16 == 0, "the value span is copied in 16-byte chunks");
  extern __shared__ __align__(16) uint8_t smem[];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int rk32 = blockIdx.x / CS;
  const int64_t rk = rk32;
  const int part = blockIdx.x % CS;
  const int split = blockIdx.y;
  const int64_t r = rk32 / a.H;
  const int h = rk32 % a.H;
  const int G = a.G;
  if (a.active[rk] == 0) return;  // an inactive group writes nothing

  // this split's full blocks: columns split·BPS + ib with ib < nvalid
  const int64_t first = static_cast<int64_t>(split) * a.BPS;
  const int64_t lim = min(static_cast<int64_t>(a.BPS), min(a.B, a.nfull[r]) - first);
  const int nvalid = lim > 0 ? static_cast<int>(lim) : 0;
  const int niter = nvalid > warp ? (nvalid - warp + NW - 1) / NW : 0;

  uint8_t* wbase = smem + warp * (STAGES * STAGE + N * GP * 4 + (kPairs ? N * NG * 8 : 0));
  float* wbuf = reinterpret_cast<float*>(wbase + STAGES * STAGE);  // [16][GP]
  float2* szbuf = reinterpret_cast<float2*>(wbuf + N * GP);      // [16][NG] (scale, zero) as float32

  const int64_t* trow = a.tables + r * a.tb_stride + first;
  const int32_t* brow = a.bits + rk * a.B + first;
  // lane l holds the table entry and bits of iteration 32·c + l of chunk c (cur: the chunk being issued)
  int cur_bid = 0, nxt_bid = 0;  // block ids fit int32 (the launcher checks num_blocks)
  int cur_bits = 0, nxt_bits = 0;
  auto load_chunk = [&](int c, int& bid, int& bt) {
    const int i = 32 * c + lane;
    bid = 0;
    bt = 0;
    if (i < niter) {
      const int ib = i * NW + warp;
      bid = static_cast<int>(min(max(trow[ib], static_cast<int64_t>(0)), a.num_blocks - 1));
      bt = brow[ib];
    }
  };
  load_chunk(0, cur_bid, cur_bits);
  load_chunk(1, nxt_bid, nxt_bits);

  auto issue = [&](int j) {  // called with j = 0, 1, 2, … by every lane of the warp
    if ((j & 31) == 0 && j > 0) {
      cur_bid = nxt_bid;
      cur_bits = nxt_bits;
      load_chunk((j >> 5) + 1, nxt_bid, nxt_bits);
    }
    const int bid = __shfl_sync(kFull, cur_bid, j & 31);
    const int bt = __shfl_sync(kFull, cur_bits, j & 31);
    if (j < niter) {
      const int eb = bid / a.M, sb = bid - eb * a.M;
      const uint8_t* page = a.pages + (static_cast<int64_t>(eb) * a.H + h) * (static_cast<int64_t>(a.M) * a.page_bytes) +
                            static_cast<int64_t>(sb) * a.page_bytes;
      uint8_t* st = wbase + (j % STAGES) * STAGE;
      const uint8_t* vsrc = page + a.v_codes;
#pragma unroll
      for (int k = 0; k < (VCHUNKS + 31) / 32; ++k) {
        const int c = lane + 32 * k;
        if (c < VCHUNKS) cp_async16(st + 16 * c, vsrc + 16 * c);
      }
      const int64_t bb = first + static_cast<int64_t>(j) * NW + warp;
      const uint8_t* ssrc = reinterpret_cast<const uint8_t*>(a.scores + (rk * a.B + bb) * G * N);
#pragma unroll
      for (int k = 0; k < (GP * 4 + 31) / 32; ++k) {
        const int c = lane + 32 * k;
        if (c < G * 4) cp_async16(st + VSPAN + 16 * c, ssrc + 16 * c);
      }
      if (lane == 31) {
        cp_async16(st + VSPAN + SC_BYTES, page + a.header);
        *reinterpret_cast<int2*>(st + VSPAN + SC_BYTES + 16) = make_int2(bt, bid);
      }
    }
    cp_async_commit();
  };

  // the maximum m of the head whose weights this lane computes in each round, and of head `lane` (its den terms)
  float m_round[ROUNDS];
#pragma unroll
  for (int q = 0; q < ROUNDS; ++q) {
    const int g = (q * 32 + lane) / N;
    m_round[q] = g < G ? a.mmax[rk * G + g] : 0.0f;
  }
  const float m_lane = lane < G ? a.mmax[rk * G + lane] : 0.0f;

  const int ch0 = part * DPART + lane * CPL;  // the lane's first channel
  const int gi = ch0 / kGroup;                // its value group
  double acc64[GP][CPL];
#pragma unroll
  for (int g = 0; g < GP; ++g)
#pragma unroll
    for (int c = 0; c < CPL; ++c) acc64[g][c] = 0.0;
  double den64 = 0.0, av64 = 0.0, at64 = 0.0;  // head `lane`'s terms

  cp_async_ring<STAGES>(niter, issue, [&](int i) {
    const uint8_t* st = wbase + (i % STAGES) * STAGE;
    const float* ssc = reinterpret_cast<const float*>(st + VSPAN);
    const float eta = *reinterpret_cast<const float*>(st + VSPAN + SC_BYTES);
    const int2 slot = *reinterpret_cast<const int2*>(st + VSPAN + SC_BYTES + 16);
    const int bt = slot.x, bid = slot.y;
    const int64_t bb = first + static_cast<int64_t>(i) * NW + warp;

    // the block's value scales and zeros widened to float32 once per warp (exact), as (scale, zero) pairs: two
    // tokens' or groups' pairs per lane and round, read back below as one 8-byte load per token (GP ≤ 4: with
    // more heads per value the widening is a smaller share of the work, and at D = 64, GP = 8 the buffer makes
    // the kernel spill, which tests/triton_kernels/test_cuda_compile.py forbids)
    if constexpr (kPairs) {
      const __half2* scl2 = reinterpret_cast<const __half2*>(st + N * D / 2);
      const __half2* zer2 = reinterpret_cast<const __half2*>(st + N * D / 2 + 2 * N * NG);
#pragma unroll
      for (int k = 0; k < (N * NG / 2 + 31) / 32; ++k) {
        const int p2 = lane + 32 * k;  // pairs 2·p2 and 2·p2 + 1 of [16][NG]
        if (p2 < N * NG / 2) {
          const float2 sc = __half22float2(scl2[p2]);
          const float2 ze = __half22float2(zer2[p2]);
          szbuf[2 * p2] = make_float2(sc.x, ze.x);
          szbuf[2 * p2 + 1] = make_float2(sc.y, ze.y);
        }
      }
    }
    // 2. weights, once per (head, token); den_b by a shuffle tree over the 16 lanes of a head
    float red[ROUNDS];
#pragma unroll
    for (int q = 0; q < ROUNDS; ++q) {
      const int p = q * 32 + lane;
      const int g = p / N, t = p % N;
      float w = 0.0f;
      if (g < G) w = expf(__fsub_rn(ssc[g * N + t], m_round[q]));
      if (p < GP * N) wbuf[t * GP + g] = w;
      float s = w;
#pragma unroll
      for (int o = N / 2; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(kFull, s, o));
      red[q] = s;
    }
    float den_b = 0.0f;  // head `lane`'s (lanes < G)
#pragma unroll
    for (int q = 0; q < ROUNDS; ++q) {
      const float v = __shfl_sync(kFull, red[q], (lane & 1) * N);
      if ((lane >> 1) == q) den_b = v;
    }
    __syncwarp();

    // 3. num = Σ_t w·v̂ per head and channel, an FMA chain in token order
    float num[GP][CPL];
#pragma unroll
    for (int g = 0; g < GP; ++g)
#pragma unroll
      for (int c = 0; c < CPL; ++c) num[g][c] = 0.0f;
    const uint8_t* codes = st + ch0 / 2;
    const __half* scl = reinterpret_cast<const __half*>(st + N * D / 2) + gi;
    const __half* zer = reinterpret_cast<const __half*>(st + N * D / 2 + 2 * N * NG) + gi;
#pragma unroll
    for (int t = 0; t < N; ++t) {
      const uint32_t x = load_codes<CB>(codes + t * (D / 2));
      float s, z;
      if constexpr (kPairs) {
        const float2 sz = szbuf[t * NG + gi];
        s = sz.x;
        z = sz.y;
      } else {
        s = __half2float(scl[t * NG]);
        z = __half2float(zer[t * NG]);
      }
      float v[CPL];
#pragma unroll
      for (int c = 0; c < CPL; ++c) v[c] = __fmaf_rn(nibble(x, c), s, z);
      float w[GP];
#pragma unroll
      for (int g = 0; g < GP; g += 4) {
        if constexpr (GP >= 4) {
          const float4 w4 = *reinterpret_cast<const float4*>(wbuf + t * GP + g);
          w[g] = w4.x; w[g + 1] = w4.y; w[g + 2] = w4.z; w[g + 3] = w4.w;
        }
      }
      if constexpr (GP < 4) {
#pragma unroll
        for (int g = 0; g < GP; ++g) w[g] = wbuf[t * GP + g];
      }
#pragma unroll
      for (int g = 0; g < GP; ++g)
#pragma unroll
        for (int c = 0; c < CPL; ++c) num[g][c] = __fmaf_rn(w[g], v[c], num[g][c]);
    }

    // value-promoted heads: their values unquantized from the shadow (zero-copy over PCIe). The block's values
    // are the same for every head of the group: each token's CPL channels are read once, as one vector, four
    // tokens' reads in flight at a time (four PCIe round trips per block, not one per token and promoted head).
    // Each head's sum is the same FMA chain in token order as num's.
    const int vbits = (bt >> G) & ((1 << G) - 1);
    if (vbits != 0) {
      constexpr int TV = 4;  // tokens whose reads are in flight together
      const int eb = bid / a.M, sb = bid - eb * a.M;
      const int64_t vbase = ((static_cast<int64_t>(eb) * a.H + h) * 2 + 1) * (static_cast<int64_t>(a.M) * N * D) +
                            static_cast<int64_t>(sb) * (N * D) + ch0;
#pragma unroll
      for (int g = 0; g < GP; ++g)  // a promoted head's INT4 sum is replaced: its chain starts again from 0
        if ((vbits >> g) & 1)
#pragma unroll
          for (int c = 0; c < CPL; ++c) num[g][c] = 0.0f;
#pragma unroll 1
      for (int t0 = 0; t0 < N; t0 += TV) {
        ShadowVec<CPL> vx[TV];
#pragma unroll
        for (int k = 0; k < TV; ++k) vx[k].load(a.shadow, vbase + (t0 + k) * D);
#pragma unroll
        for (int k = 0; k < TV; ++k) {
#pragma unroll
          for (int g = 0; g < GP; ++g) {
            if ((vbits >> g) & 1) {
              const float wt = wbuf[(t0 + k) * GP + g];
#pragma unroll
              for (int c = 0; c < CPL; ++c) num[g][c] = __fmaf_rn(wt, vx[k].at(c, a.shadow_bf16), num[g][c]);
            }
          }
        }
      }
    }

    // 4. float64 accumulation (exact conversions), the head terms, exact_lm
#pragma unroll
    for (int g = 0; g < GP; ++g)
#pragma unroll
      for (int c = 0; c < CPL; ++c) acc64[g][c] += static_cast<double>(num[g][c]);
    if (lane < G) {
      const double d64 = static_cast<double>(den_b);
      den64 += d64;
      if (!((bt >> (G + lane)) & 1)) av64 += d64 * static_cast<double>(eta);
      if (!((bt >> lane) & 1)) {
        at64 += d64;
      } else if (part == 0) {
        a.exact_lm[(rk * G + lane) * a.B + bb] = den_b > 0.0f ? m_lane + logf(den_b) : -INFINITY;
      }
    }
    __syncwarp();  // every lane is done with this stage and the weights before they are overwritten
  });

  // the warps' partial sums, added in float64
  cp_async_wait<0>();
  __syncthreads();
  double* red_acc = reinterpret_cast<double*>(smem);  // [NW][GP][DPART]
  double* red_h = red_acc + NW * GP * DPART;          // [NW][GP][3]
#pragma unroll
  for (int g = 0; g < GP; ++g)
#pragma unroll
    for (int c = 0; c < CPL; ++c) red_acc[(warp * GP + g) * DPART + lane * CPL + c] = acc64[g][c];
  if (lane < GP) {
    red_h[(warp * GP + lane) * 3 + 0] = den64;
    red_h[(warp * GP + lane) * 3 + 1] = av64;
    red_h[(warp * GP + lane) * 3 + 2] = at64;
  }
  __syncthreads();
  const int64_t orow = (rk * a.S + split) * G;
  for (int e = threadIdx.x; e < G * DPART; e += NW * 32) {
    const int g = e / DPART, c = e % DPART;
    double s = 0.0;
#pragma unroll
    for (int w = 0; w < NW; ++w) s += red_acc[(w * GP + g) * DPART + c];
    a.acc[(orow + g) * D + part * DPART + c] = s;
  }
  if (part == 0) {
    for (int e = threadIdx.x; e < 3 * G; e += NW * 32) {
      const int g = e / 3, k = e % 3;
      double s = 0.0;
#pragma unroll
      for (int w = 0; w < NW; ++w) s += red_h[(w * GP + g) * 3 + k];
      (k == 0 ? a.den : k == 1 ? a.aval : a.atail)[orow + g] = s;
    }
  }
}

// Dynamic shared memory of one CUDA block (bytes).
template <int D, int GP, int CPL, int NW, int STAGES>
constexpr int attend_smem_bytes() {
  constexpr int stage = kTokens * D / 2 + 4 * kTokens * (D / kGroup) + GP * kTokens * 4 + 32;
  constexpr int pairs = attend_scale_pairs(GP) ? kTokens * (D / kGroup) * 8 : 0;
  constexpr int ring = NW * (STAGES * stage + kTokens * GP * 4 + pairs);
  constexpr int reduce = NW * GP * (32 * CPL + 3) * 8;
  return ring > reduce ? ring : reduce;
}

}  // namespace certvllm

// ---------------------------------------------------------------------------------------------------------------
// The compiled configurations: X(D, GP, channels per lane), each with 2, 4 and 8 warps.

#define CERTVLLM_ATTEND_CONFIGS(X) \
  X(64, 1, 2) X(64, 2, 2) X(64, 4, 2) X(64, 8, 2) X(64, 16, 2) \
  X(128, 1, 4) X(128, 2, 4) X(128, 4, 4) X(128, 8, 4) X(128, 16, 2) \
  X(256, 1, 8) X(256, 2, 8) X(256, 4, 8) X(256, 8, 4) X(256, 16, 2)

namespace certvllm {

constexpr int kStages = 4;

// Channels per lane for (D, GP): the configuration table above (0: not compiled).
inline int attend_cpl(int D, int GP) {
#define CERTVLLM_CPL(d, gp, cpl) if (D == d && GP == gp) return cpl;
  CERTVLLM_ATTEND_CONFIGS(CERTVLLM_CPL)
#undef CERTVLLM_CPL
  return 0;
}

// Launch `kernel` (one configuration of a template) with `smem` bytes of dynamic shared memory; the attribute that
// admits more than 48 KiB is set on its first launch (`ready`: a static of the configuration's launcher).
template <typename Args>
cudaError_t launch_with_smem(void (*kernel)(Args), bool& ready, int smem, dim3 grid, int threads, cudaStream_t stream,
                             const Args& a) {
  if (!ready) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    ready = true;
  }
  kernel<<<grid, threads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <int D, int GP, int CPL, int NW>
cudaError_t launch_attend_nw(const AttendArgs& a, int rows_heads, cudaStream_t stream) {
  static bool ready = false;
  return launch_with_smem(attend_kernel<D, GP, CPL, NW, kStages>, ready, attend_smem_bytes<D, GP, CPL, NW, kStages>(),
                          dim3(rows_heads * (D / (32 * CPL)), a.S), NW * 32, stream, a);
}

template <int D, int GP, int CPL>
cudaError_t launch_attend_cfg(const AttendArgs& a, int rows_heads, int warps, cudaStream_t stream) {
  switch (warps) {
    case 2: return launch_attend_nw<D, GP, CPL, 2>(a, rows_heads, stream);
    case 4: return launch_attend_nw<D, GP, CPL, 4>(a, rows_heads, stream);
    case 8: return launch_attend_nw<D, GP, CPL, 8>(a, rows_heads, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The configurations of head dim DIM (defined in attend_d<DIM>.cu); cudaErrorInvalidValue for a GP or warps
// count that is not compiled.
template <int DIM>
cudaError_t launch_attend_dim(const AttendArgs& a, int rows_heads, int GP, int warps, cudaStream_t stream) {
#define CERTVLLM_LAUNCH(d, gp, cpl) \
  if constexpr (d == DIM) {         \
    if (GP == gp) return launch_attend_cfg<d, gp, cpl>(a, rows_heads, warps, stream); \
  }
  CERTVLLM_ATTEND_CONFIGS(CERTVLLM_LAUNCH)
#undef CERTVLLM_LAUNCH
  return cudaErrorInvalidValue;
}

// The head dims compiled, one translation unit each (attend_d<DIM>.cu instantiates its kernels; the other units
// see them declared extern).
#define CERTVLLM_HEAD_DIMS(X) X(64) X(128) X(256)
#define CERTVLLM_ATTEND_DIM(DIM) \
  template cudaError_t launch_attend_dim<DIM>(const AttendArgs&, int, int, int, cudaStream_t);
#define CERTVLLM_ATTEND_DIM_EXTERN(DIM) extern CERTVLLM_ATTEND_DIM(DIM)
CERTVLLM_HEAD_DIMS(CERTVLLM_ATTEND_DIM_EXTERN)

}  // namespace certvllm
