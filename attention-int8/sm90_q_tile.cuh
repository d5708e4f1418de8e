// The Hopper kernel's Q tile: each consumer warpgroup loads its 64 raw Q rows and quantizes them per token, with
// the quantizer's arithmetic (quant_math.cuh), into a shared-memory tile that the S wgmma reads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention_common.cuh"
#include "attention_int8.h"
#include "ptx.cuh"
#include "quant_math.cuh"
#include "swizzle.cuh"

namespace attention_int8 {

// A consumer's 64 Q rows are quantized per token with the quantizer's arithmetic (quant_math.cuh) by its own
// threads, into a shared-memory tile in K's swizzled K-major layout (swizzle.cuh), which the S wgmma reads by
// descriptor for the whole key loop (in shared memory rather than registers, so that the registers stay with the
// softmax: docs/DESIGN.md, rationale).
// Thread (group, tig) of a warp holds rows group and group + 8 (its accumulator rows) and, of each 32 channels,
// the 8 at 8 tig: a quarter of each row, so a row's amax is a max over its quad. 16-byte loads: a warp's load
// instruction reads 64 contiguous bytes of each of its 8 rows, 2 sectors of one line, where 8-byte loads read 1.
struct QRowScales {
  float scale[2];     // per row, includes sm_scale * log2(e)
  float center_dot[2];  // q_row . k_center (the LSE's smoothing shift); 0 without p.k_center
};

__device__ __forceinline__ float2 to_float2(uint32_t bits, __half) {
  return __half22float2(*reinterpret_cast<__half2*>(&bits));
}
__device__ __forceinline__ float2 to_float2(uint32_t bits, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&bits));
}

// The thread's raw Q: raw[r][c] holds Q[rows[r]][32 c + 8 tig + e], e < 8 (16 bytes); rows that hold no query, and
// channels from D on (D = 80's and 96's padding), are zeros. Loaded before the CTA's set-up, whose barrier wait then
// hides the latency.
template <typename Traits>
using QRowsRaw = uint4[2][Traits::kQKSteps];

// Whether the thread's 8 channels from 32 c + 8 tig hold data (D = 80 ends inside a 32-channel step).
template <typename Traits>
__device__ __forceinline__ bool holds_channels(int c, int tig) {
  return 32 * c + (Traits::kHeadDim % 32 == 0 ? 0 : 8 * tig) < Traits::kHeadDim;
}

template <typename Traits>
__device__ __forceinline__ void load_q_rows(const AttentionParams& p, int batch, int head, const int (&rows)[2], int tig,
                                            QRowsRaw<Traits>& raw) {
  using Elem = typename Traits::Elem;
  const Elem* q_head = static_cast<const Elem*>(p.q_input) + batch * p.q_view.batch_stride + head * p.q_view.head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const Elem* row = q_head + int64_t(rows[r]) * p.q_view.row_stride + 8 * tig;
#pragma unroll
    for (int c = 0; c < Traits::kQKSteps; ++c)
      raw[r][c] = holds_channels<Traits>(c, tig) && is_query_row(p, rows[r])
                      ? *reinterpret_cast<const uint4*>(row + 32 * c)
                      : make_uint4(0, 0, 0, 0);
  }
}

// Quantizes the thread's share of the consumer's Q rows into q_tile (rows 16 warp_in_group + group and + 8).
// The caller makes the tile visible to the wgmmas (async proxy fence, then a barrier over the warpgroup).
// smoothed: the head's Q smoothing (AttentionParams::query_smoothed), whose shift the rows lose before balancing.
template <typename Traits>
__device__ __forceinline__ QRowScales quantize_q_rows(const AttentionParams& p, int batch, int head, int head_kv,
                                                      bool smoothed, const QRowsRaw<Traits>& raw, char* q_tile,
                                                      int warp_in_group, int group, int tig) {
  using Elem = typename Traits::Elem;
  constexpr int kSteps = Traits::kQKSteps, kPerRow = kSteps * 8;
  // x[r][8 c + e] = Q[rows[r]][32 c + 8 tig + e]
  float x[2][kPerRow];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int c = 0; c < kSteps; ++c) {
      const uint32_t bits[4] = {raw[r][c].x, raw[r][c].y, raw[r][c].z, raw[r][c].w};
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const float2 pair = to_float2(bits[h], Elem{});
        x[r][8 * c + 2 * h] = pair.x, x[r][8 * c + 2 * h + 1] = pair.y;
      }
    }
  }
  QRowScales q;
  const int64_t head_kv_row = (int64_t(batch) * p.heads_kv + head_kv) * Traits::kHeadDim + 8 * tig;
  q.center_dot[0] = q.center_dot[1] = 0.f;
  if (p.lse != nullptr && p.k_center != nullptr) {  // of the raw rows: balancing keeps q . k
    const float* center = p.k_center + head_kv_row;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < kPerRow; ++i)
        if (holds_channels<Traits>(i / 8, tig)) q.center_dot[r] += x[r][i] * center[32 * (i / 8) + i % 8];
    ptx::quad_reduce(q.center_dot, [](float a, float b) { return a + b; });
  }
  if (smoothed) {  // Q smoothing: q - mu (rows without a query too: their results are never stored)
    const float* shift = p.query_shift + (int64_t(batch) * p.heads_q + head) * Traits::kHeadDim + 8 * tig;
#pragma unroll
    for (int i = 0; i < kPerRow; ++i) {
      const float mu = holds_channels<Traits>(i / 8, tig) ? shift[32 * (i / 8) + i % 8] : 0.f;
#pragma unroll
      for (int r = 0; r < 2; ++r) x[r][i] -= mu;
    }
  }
  if (p.q_balance != nullptr) {  // channel balancing's factors, before the amax (KeyCenterParams)
    const float* balance = p.q_balance + head_kv_row;
#pragma unroll
    for (int i = 0; i < kPerRow; ++i) {
      const float s = holds_channels<Traits>(i / 8, tig) ? balance[32 * (i / 8) + i % 8] : 1.f;
#pragma unroll
      for (int r = 0; r < 2; ++r) x[r][i] *= s;
    }
  }
  uint32_t amax_bits[2] = {0, 0};  // each row's amax and finiteness at once (quant::abs_bits)
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int i = 0; i < kPerRow; ++i) amax_bits[r] = max(amax_bits[r], quant::abs_bits(x[r][i]));
  ptx::quad_reduce(amax_bits, quant::UnsignedMax{});
  float inv_scale[2], prescale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float amax = __uint_as_float(amax_bits[r]);
    const bool finite = amax_bits[r] < quant::kInfBits;
    inv_scale[r] = quant::inv_scale_of(amax);
    prescale[r] = quant::prescale_of(amax);
    q.scale[r] = quant::scale_of(amax, p.q_out_scale, finite);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (prescale[r] != 1.f) {  // rare (bf16 rows with amax below 2^-64): no multiply in the common case
#pragma unroll
      for (int i = 0; i < kPerRow; ++i) x[r][i] *= prescale[r];
    }
  constexpr int kRowBytes = Traits::kQKRowBytes;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int c = 0; c < kSteps; ++c) {  // bytes 32 c + 8 tig.. of the row: half of one 16-byte chunk
      const int row = warp_in_group * 16 + group + 8 * r, byte = 32 * c + 8 * tig;
      char* chunk = q_tile + row * kRowBytes + swizzle::chunk_offset<kRowBytes, kSm90TileRows>(row, byte / 16);
      *reinterpret_cast<uint2*>(chunk + byte % 16) = make_uint2(quant::quantize4(&x[r][8 * c], inv_scale[r]),
                                                                quant::quantize4(&x[r][8 * c + 4], inv_scale[r]));
    }
  return q;
}

}  // namespace attention_int8
