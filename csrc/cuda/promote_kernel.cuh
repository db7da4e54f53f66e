// The promotion pass of the certified decode on CUDA: the outputs of triton_kernels/phase2.py::_promote_kernel (read
// its docstring first), with the key pages streamed through a cp.async ring per warp.
//
// Work: one CUDA block per (row, KV head, split), grid (R·H_kv, S), NW warps. The split's block columns are taken
// LIST at a time:
//
//   1. scan: each thread reads the bitmask word of one column (all threads at once), folds the INT8 block maxima
//      m8 of the heads whose keys stay INT8 into its running maxima, and appends the needed columns (keys promoted
//      for some head, or any bit with the canary on) to a shared list with their key page's device address: the
//      layer's promotion pool or the step prefetch's staging where the slot map has a slot, else the pinned
//      shadow (zero-copy);
//   2. visit: warp w takes list entries w, w + NW, …, one per iteration, and keeps STAGES − 1 pages in flight in
//      its ring (16-byte cp.async.cg of the page's 16 rows, swizzled in shared memory so that the reads below
//      are free of bank conflicts); lane (t, half) = (lane / 2, lane % 2) computes the exact score of token t for
//      every query head over its half of the channels (float32 FMAs, two chains per head), and the two halves
//      are added with one shuffle. Any summation order is covered by γ_D (docs/certification.md §5.1, the
//      exact-scores row);
//   3. per block: the canary |s − s̃⁸| ≤ (Δ_b + 2R)(1 + 2⁻¹⁰) on every head of a needed block (the INT8 score
//      is read before the exact one is written over it), the exact scores written over the INT8 ones where the
//      head's key bit is set, and the running maximum score and largest finite |exact score| of those heads.
//
// The split's maxima are reduced over the CUDA block at the end and written per (row, KV head, head, split); the
// canary sets the row's flag with one atomic per thread that saw a violation. An inactive group writes only its
// maxima of no block (−inf and 0), as the Triton kernel does.
//
// Shared memory: the rings [NW][STAGES][16·D] 16-bit, the query [GP][2][D/2 + 4] float32, the list (LIST entries
// of position, bitmask word and source address) and the reduction scratch.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "attend_kernel.cuh"

namespace certvllm {

struct PromoteArgs : SplitArgs {
  const float* qs;       // [R, H·G, D] float32 scaled queries
  const void* shadow;    // [E, H, 2, M·16, D] originals, token-major keys, device-readable (pinned host under UVA)
  const void* pool;      // [P, 16, D] promotion-pool key pages (kslot ≥ 0, < nslots), or null
  const void* stage;     // [Q, 16, D] step-prefetch staging pages (kslot ≥ nslots), or null
  const int32_t* kslot;  // [R, H, B] pool slot of each needed key page, −1: the shadow; null: the shadow for all
  int64_t nslots;        // pool slots
  float* scores;         // in/out [R, H, B, G, 16]: INT8 scores in, phase-2 scores out
  const float* m8;       // [R, H, G, B] block maximum of the INT8 scores
  const float* delta;    // [R, H, G, B] Δ_b
  const float* round1;   // [R, H, G] phase-1 rounding R
  int32_t* canary;       // in/out [R]: set to 1 when a needed block breaks the canary
  float* smax;           // out [R, H, G, S] the split's maximum phase-2 score
  float* sabs;           // out [R, H, G, S] the split's largest finite |exact score| on key-promoted heads
  int canary_on;         // run the canary (then value-only promoted blocks are read too)
  int shadow_bf16;       // the originals' dtype: 1 bfloat16, 0 float16
};

constexpr int kPromoteList = 256;  // block columns scanned per round
constexpr int kPromoteStages = 3;  // pages per warp ring (two in flight while one is scored)
constexpr int kQueryPad = 4;       // floats between the two channel halves of a query row (bank offset)

// Eight 16-bit originals (one 16-byte chunk) as floats (exact widenings).
__device__ __forceinline__ void widen8(const uint4 raw, int bf16, float* out) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (bf16) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

template <int D, int GP, int NW>
struct PromoteShape {
  static constexpr int N = kTokens;
  static constexpr int PAGE = N * D * 2;                  // bytes of one key page
  static constexpr int ROW_CHUNKS = D * 2 / 16;           // 16-byte chunks per token row
  static constexpr int HALF_CHUNKS = ROW_CHUNKS / 2;      // per half row (one lane's channels)
  static constexpr int SWIZZLE = HALF_CHUNKS >= 8 ? 7 : HALF_CHUNKS - 1;
  static constexpr int QHALF = D / 2 + kQueryPad;         // floats per query half row
  static constexpr int RING = NW * kPromoteStages * PAGE;
  static constexpr int QUERY = GP * 2 * QHALF * 4;
  static constexpr int LIST = kPromoteList * 16;          // int2 (position, bits) + uint64 source
  static constexpr int REDUCE = NW * GP * 2 * 4;
  static constexpr int SMEM = RING + QUERY + LIST + REDUCE + 16;
  static_assert(D % 32 == 0 && HALF_CHUNKS >= 2, "head dim must be a multiple of 32");
  // chunk j of token row t lives at chunk t·ROW_CHUNKS + swizzled(t, j): the XOR keeps j within its half row
  // and spreads the 8 lanes of a 128-byte shared-memory phase (tokens 4p…4p + 3, both halves) over 8 chunks
  __device__ static __forceinline__ int swizzled(int t, int j) {
    const int half = j / HALF_CHUNKS;
    return j ^ ((2 * t + half) & SWIZZLE);
  }
};

template <int D, int GP, int NW>
__global__ void __launch_bounds__(NW * 32) promote_kernel(const PromoteArgs a) {
  using P = PromoteShape<D, GP, NW>;
  constexpr int N = kTokens;
  constexpr int NT = NW * 32;
  constexpr int STAGES = kPromoteStages;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* ring = smem;
  float* qsm = reinterpret_cast<float*>(smem + P::RING);
  int2* list_pb = reinterpret_cast<int2*>(smem + P::RING + P::QUERY);
  uint64_t* list_src = reinterpret_cast<uint64_t*>(smem + P::RING + P::QUERY + kPromoteList * 8);
  float* red = reinterpret_cast<float*>(smem + P::RING + P::QUERY + P::LIST);
  int* counter = reinterpret_cast<int*>(smem + P::RING + P::QUERY + P::LIST + P::REDUCE);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t rk = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t r = rk / a.H;
  const int h = static_cast<int>(rk % a.H);
  const int G = a.G;
  if (a.active[rk] == 0) {  // an inactive group: the maxima of no block
    if (tid < G) {
      a.smax[(rk * G + tid) * a.S + split] = -INFINITY;
      a.sabs[(rk * G + tid) * a.S + split] = 0.0f;
    }
    return;
  }
  if (tid == 0) *counter = 0;
  // the group's queries, channel halves apart by kQueryPad floats
  for (int e = tid; e < G * D; e += NT) {
    const int g = e / D, c = e % D;
    qsm[(g * 2 + c / (D / 2)) * P::QHALF + c % (D / 2)] = a.qs[(r * a.H * G + static_cast<int64_t>(h) * G + g) * D + c];
  }
  const int64_t first = static_cast<int64_t>(split) * a.BPS;
  const int64_t lim = min(static_cast<int64_t>(a.BPS), min(a.B, a.nfull[r]) - first);
  const int nvalid = lim > 0 ? static_cast<int>(lim) : 0;
  const int key_bits = (1 << G) - 1;
  const int t = lane >> 1, half = lane & 1;
  float r1[GP];
#pragma unroll
  for (int g = 0; g < GP; ++g) r1[g] = g < G ? a.round1[rk * G + g] : 0.0f;
  float run_max[GP], run_abs[GP];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    run_max[g] = -INFINITY;
    run_abs[g] = 0.0f;
  }
  bool viol = false;
  const uint8_t* shadow = static_cast<const uint8_t*>(a.shadow);
  uint8_t* wring = ring + warp * STAGES * P::PAGE;

  for (int c0 = 0; c0 < nvalid; c0 += kPromoteList) {
    const int cend = min(nvalid, c0 + kPromoteList);
    __syncthreads();  // the counter is 0 and the query stored
    // 1. scan: the round's columns, NT at a time, appended warp by warp
    for (int p0 = c0; p0 < cend; p0 += NT) {
      const int p = p0 + tid;
      int bt = 0;
      bool need = false;
      uint64_t src = 0;
      if (p < cend) {
        const int64_t col = first + p;
        bt = a.bits[rk * a.B + col];
#pragma unroll
        for (int g = 0; g < GP; ++g)
          if (g < G && !((bt >> g) & 1)) run_max[g] = fmaxf(run_max[g], a.m8[(rk * G + g) * a.B + col]);
        need = a.canary_on ? bt != 0 : (bt & key_bits) != 0;
        if (need) {
          const int64_t bid = min(max(a.tables[r * a.tb_stride + col], static_cast<int64_t>(0)), a.num_blocks - 1);
          const int ks = a.kslot != nullptr ? a.kslot[rk * a.B + col] : -1;
          if (ks >= 0) {
            const uint8_t* base = static_cast<const uint8_t*>(ks >= a.nslots ? a.stage : a.pool);
            const int64_t slot = ks >= a.nslots ? ks - a.nslots : ks;
            src = reinterpret_cast<uint64_t>(base + slot * P::PAGE);
          } else {
            const int64_t eb = bid / a.M, sb = bid - eb * a.M;
            src = reinterpret_cast<uint64_t>(shadow + ((eb * a.H + h) * 2 * (static_cast<int64_t>(a.M) * N) + sb * N) *
                                                          (static_cast<int64_t>(D) * 2));
          }
        }
      }
      const unsigned ballot = __ballot_sync(kFull, need);
      int base = 0;
      if (lane == 0 && ballot != 0) base = atomicAdd(counter, __popc(ballot));
      base = __shfl_sync(kFull, base, 0);
      if (need) {
        const int at = base + __popc(ballot & ((1u << lane) - 1));
        list_pb[at] = make_int2(p, bt);
        list_src[at] = src;
      }
    }
    __syncthreads();
    const int count = *counter;

    // 2. visit: the warp's entries warp, warp + NW, …, pages in flight STAGES − 1 ahead
    const int niter = count > warp ? (count - warp + NW - 1) / NW : 0;
    auto issue = [&](int j) {
      if (j < niter) {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(list_src[j * NW + warp]);
        uint8_t* st = wring + (j % STAGES) * P::PAGE;
#pragma unroll
        for (int k = lane; k < N * P::ROW_CHUNKS; k += 32) {
          const int row = k / P::ROW_CHUNKS, jj = k % P::ROW_CHUNKS;
          cp_async16(st + (row * P::ROW_CHUNKS + P::swizzled(row, jj)) * 16, src + 16 * k);
        }
      }
      cp_async_commit();
    };
    cp_async_ring<STAGES>(niter, issue, [&](int i) {
      const uint8_t* st = wring + (i % STAGES) * P::PAGE;
      const int2 pb = list_pb[i * NW + warp];
      const int64_t col = first + pb.x;
      const int bt = pb.y;
      // exact scores of token t, half `half` of the channels, every head: two FMA chains per head
      float s0[GP], s1[GP];
#pragma unroll
      for (int g = 0; g < GP; ++g) s0[g] = s1[g] = 0.0f;
#pragma unroll
      for (int jj = 0; jj < P::HALF_CHUNKS; ++jj) {
        const int j = half * P::HALF_CHUNKS + jj;
        const uint4 raw = *reinterpret_cast<const uint4*>(st + (t * P::ROW_CHUNKS + P::swizzled(t, j)) * 16);
        float k8[8];
        widen8(raw, a.shadow_bf16, k8);
#pragma unroll
        for (int g = 0; g < GP; ++g) {
          if (g < G) {
            const float* qg = qsm + (g * 2 + half) * P::QHALF + jj * 8;
            const float4 qa = *reinterpret_cast<const float4*>(qg);
            const float4 qb = *reinterpret_cast<const float4*>(qg + 4);
            s0[g] = __fmaf_rn(qa.x, k8[0], s0[g]);
            s1[g] = __fmaf_rn(qa.y, k8[1], s1[g]);
            s0[g] = __fmaf_rn(qa.z, k8[2], s0[g]);
            s1[g] = __fmaf_rn(qa.w, k8[3], s1[g]);
            s0[g] = __fmaf_rn(qb.x, k8[4], s0[g]);
            s1[g] = __fmaf_rn(qb.y, k8[5], s1[g]);
            s0[g] = __fmaf_rn(qb.z, k8[6], s0[g]);
            s1[g] = __fmaf_rn(qb.w, k8[7], s1[g]);
          }
        }
      }
      float se[GP];
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        const float own = __fadd_rn(s0[g], s1[g]);
        se[g] = __fadd_rn(own, __shfl_xor_sync(kFull, own, 1));
      }
      // 3. canary (INT8 scores read before any exact score of this block is written), scores, maxima
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        if (g >= G) continue;
        float* srow = a.scores + ((rk * a.B + col) * G + g) * N + t;
        if (a.canary_on) {
          const float s8 = *srow;
          const float allowed = (a.delta[(rk * G + g) * a.B + col] + 2.0f * r1[g]) * (1.0f + 0x1p-10f);
          const float diff = fabsf(se[g] - s8);
          viol |= (diff > allowed) || !(diff < INFINITY);
        }
        if ((bt >> g) & 1) {
          run_max[g] = fmaxf(run_max[g], se[g]);
          if (fabsf(se[g]) < INFINITY) run_abs[g] = fmaxf(run_abs[g], fabsf(se[g]));
        }
      }
      __syncwarp();  // every lane has read its INT8 scores before one is overwritten
      if (half == 0) {
#pragma unroll
        for (int g = 0; g < GP; ++g)
          if (g < G && ((bt >> g) & 1)) a.scores[((rk * a.B + col) * G + g) * N + t] = se[g];
      }
      __syncwarp();  // every lane is done with this stage before it is refilled
    });
    cp_async_wait<0>();
    __syncthreads();  // every thread has read the count and is done with the list
    if (tid == 0) *counter = 0;
  }

  if (viol) atomicMax(a.canary + r, 1);
  // the split's maxima over the CUDA block
#pragma unroll
  for (int g = 0; g < GP; ++g) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      run_max[g] = fmaxf(run_max[g], __shfl_xor_sync(kFull, run_max[g], o));
      run_abs[g] = fmaxf(run_abs[g], __shfl_xor_sync(kFull, run_abs[g], o));
    }
  }
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      red[(warp * GP + g) * 2] = run_max[g];
      red[(warp * GP + g) * 2 + 1] = run_abs[g];
    }
  }
  __syncthreads();
  if (tid < G) {
    float mx = -INFINITY, ab = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      mx = fmaxf(mx, red[(w * GP + tid) * 2]);
      ab = fmaxf(ab, red[(w * GP + tid) * 2 + 1]);
    }
    a.smax[(rk * G + tid) * a.S + split] = mx;
    a.sabs[(rk * G + tid) * a.S + split] = ab;
  }
}

template <int D, int GP, int NW>
cudaError_t launch_promote_nw(const PromoteArgs& a, int rows_heads, cudaStream_t stream) {
  static bool ready = false;
  return launch_with_smem(promote_kernel<D, GP, NW>, ready, PromoteShape<D, GP, NW>::SMEM, dim3(rows_heads, a.S),
                          NW * 32, stream, a);
}

// The compiled configurations: head dims 64/128/256, GP 1–16, 2 or 4 warps; cudaErrorInvalidValue otherwise.
template <int D>
cudaError_t launch_promote_dim(const PromoteArgs& a, int rows_heads, int GP, int warps, cudaStream_t stream) {
#define CERTVLLM_PROMOTE_GP(gp)                                                    \
  if (GP == gp) {                                                                  \
    if (warps == 2) return launch_promote_nw<D, gp, 2>(a, rows_heads, stream);    \
    if (warps == 4) return launch_promote_nw<D, gp, 4>(a, rows_heads, stream);    \
    return cudaErrorInvalidValue;                                                  \
  }
  CERTVLLM_PROMOTE_GP(1)
  CERTVLLM_PROMOTE_GP(2)
  CERTVLLM_PROMOTE_GP(4)
  CERTVLLM_PROMOTE_GP(8)
  CERTVLLM_PROMOTE_GP(16)
#undef CERTVLLM_PROMOTE_GP
  return cudaErrorInvalidValue;
}

#define CERTVLLM_PROMOTE_DIM(DIM) \
  template cudaError_t launch_promote_dim<DIM>(const PromoteArgs&, int, int, int, cudaStream_t);
#define CERTVLLM_PROMOTE_DIM_EXTERN(DIM) extern CERTVLLM_PROMOTE_DIM(DIM)
CERTVLLM_HEAD_DIMS(CERTVLLM_PROMOTE_DIM_EXTERN)

}  // namespace certvllm
