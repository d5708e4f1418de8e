// The split-KV combine: merges the splits of the Hopper kernel's split tiles with TileSchedule's formulas
// (attention_int8.h), into O and the LSE.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "attention_int8.h"
#include "ptx.cuh"
#include "sm90_tile_scheduler.cuh"

namespace attention_int8 {

constexpr int kCombineThreads = 128;

// D / 4 consecutive threads a query row, 4 channels each (at D = 96 a row may straddle two blocks). A NaN reaches
// O through l_s and O_s (fmaxf skips a NaN m, but l is NaN then too); a row without any visible key gets zeros and
// -inf, as unsplit. Reads what the attention kernel just wrote, so through L2 (ld.global.cg), after waiting for it.
template <typename Traits>
__global__ void __launch_bounds__(kCombineThreads) combine_kv_splits_kernel(const AttentionParams p) {
  using Elem = typename Traits::Elem;
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, kRowThreads = Traits::kCombineRowThreads;
  const TileSchedule& sched = p.schedule;
  const int64_t thread = int64_t(blockIdx.x) * kCombineThreads + threadIdx.x;
  const int64_t row = thread / kRowThreads;  // of split_tiles * BM
  const int col = int(thread % kRowThreads) * 4;
  if (row >= sched.split_tiles * BM) return;
  const int splits = int(sched.splits.divisor), row_in_tile = int(row % BM);
  const TileCoords tile = tile_coords(sched, uint32_t(sched.full_tiles() + row / BM));
  const int q_row = sched.block_row0(tile.m_block) + row_in_tile, head = tile.head, batch = tile.batch;
  if (!is_query_row(p, q_row)) return;
  const int64_t partial_row0 = row / BM * splits * BM + row_in_tile;  // split s: + s * BM

  ptx::wait_for_predecessor();
  SplitRowStats stats[kMaxKvSplits];
  float max_log2 = -INFINITY;
#pragma unroll
  for (int s = 0; s < kMaxKvSplits; ++s) {
    if (s < splits) {
      const float* st = reinterpret_cast<const float*>(p.row_stats + partial_row0 + s * BM);
      stats[s] = SplitRowStats{__ldcg(st), __ldcg(st + 1), __ldcg(st + 2)};
    } else {
      stats[s] = SplitRowStats{-INFINITY, 0.f, 0.f};
    }
    max_log2 = fmaxf(max_log2, stats[s].max_log2);
  }
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float weight_sum = 0.f;
#pragma unroll
  for (int s = 0; s < kMaxKvSplits; ++s) {
    if (s >= splits) break;
    // A split without a visible key has l = 0 and m = -inf (M may be -inf as well).
    const float w = stats[s].sum == 0.f ? 0.f : exp2f(stats[s].max_log2 - max_log2) * stats[s].sum;
    const float4 o = __ldcg(reinterpret_cast<const float4*>(p.o_partial + (partial_row0 + s * BM) * D + col));
    acc.x += w * o.x, acc.y += w * o.y, acc.z += w * o.z, acc.w += w * o.w;
    weight_sum += w;
  }
  const float inv = inverse_row_sum(weight_sum);
  Elem* o_row = static_cast<Elem*>(p.o) + batch * p.o_view.batch_stride + head * p.o_view.head_stride +
                int64_t(q_row) * p.o_view.row_stride;
  *reinterpret_cast<uint2*>(o_row + col) =
      make_uint2(ptx::pack2<Elem>(acc.x * inv, acc.y * inv), ptx::pack2<Elem>(acc.z * inv, acc.w * inv));
  if (p.lse != nullptr && col == 0)
    *lse_slot<false>(p, int64_t(batch) * p.heads_q + head, head, q_row) =
        natural_lse(max_log2, weight_sum, stats[0].lse_shift);
}

}  // namespace attention_int8
