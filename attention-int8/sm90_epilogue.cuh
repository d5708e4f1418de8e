// The Hopper kernel's epilogue: each consumer thread normalizes its two rows of O and writes them with their LSE,
// or, in a split tile, writes the unnormalized statistics and fp32 O that the combine kernel merges.
#pragma once

#include <cstdint>

#include "attention_common.cuh"
#include "attention_int8.h"
#include "ptx.cuh"
#include "sm90_q_tile.cuh"

namespace attention_int8 {

// A consumer thread's place in the output: its two rows (its accumulator rows) and its warp's 16 from warp_row0.
// Every thread holds its rows' sums: the accumulators of the ones columns (register kOutRegs + 2r is row r,
// column kMmaDim + 2 tig).
template <typename Traits>
struct Sm90Epilogue {
  static constexpr int kORegs = Traits::kOAccRegs;
  using Elem = typename Traits::Elem;

  const AttentionParams& p;
  int batch, head, m0, warp_row0;
  const int (&rows)[2];
  int group, tig, lane;

  // Row r of a split tile: fp32 O normalized by the split's own sum, and the split's max, sum and LSE shift (a
  // quad's 8-byte stores fill whole 32-byte sectors).
  __device__ __forceinline__ void store_partial_row(const float (&o_acc)[kORegs], int r, float row_max, float sum,
                                                    float inv_sum, float shift, int64_t partial_row0) const {
    constexpr int D = Traits::kHeadDim;
    if (!is_query_row(p, rows[r])) return;
    const int64_t partial_row = partial_row0 + (rows[r] - m0);
    float* o_row = p.o_partial + partial_row * D;
#pragma unroll
    for (int i = 2 * r; i < Traits::kOutRegs; i += 4)
      if (8 * (i / 4) < D)  // D = 96: the padding channels stay behind
        *reinterpret_cast<float2*>(o_row + 8 * (i / 4) + 2 * tig) = make_float2(o_acc[i] * inv_sum, o_acc[i + 1] * inv_sum);
    if (tig == 0) p.row_stats[partial_row] = SplitRowStats{row_max, sum, shift};
  }

  // Row r of O in the input dtype into the warp's staging tile, and its natural-log LSE.
  __device__ __forceinline__ void stage_row(const float (&o_acc)[kORegs], int r, float row_max, float sum, float inv_sum,
                                            float shift, char* o_tile) const {
    char* tile_row = o_tile + (group + 8 * r) * Traits::kOStageRowBytes;
#pragma unroll
    for (int i = 2 * r; i < Traits::kOutRegs; i += 4) {
      const int col = 8 * (i / 4) + 2 * tig;
      *reinterpret_cast<uint32_t*>(tile_row + col * sizeof(Elem)) = ptx::pack2<Elem>(o_acc[i] * inv_sum, o_acc[i + 1] * inv_sum);
    }
    if (p.lse != nullptr && tig == 0 && is_query_row(p, rows[r]))
      *lse_slot<Traits::kPacked>(p, int64_t(batch) * p.heads_q + head, head, rows[r]) =
          natural_lse(row_max, sum, shift);
  }

  // The warp's staged 16 rows to global memory as whole 16-byte chunks of a row (straight from the accumulators a
  // warp would store 4-byte pieces of 8 rows).
  __device__ __forceinline__ void store_staged_rows(const char* o_tile) const {
    constexpr int kRowChunks = Traits::kORowBytes / 16;
    Elem* o_head = static_cast<Elem*>(p.o) + batch * p.o_view.batch_stride + head * p.o_view.head_stride;
#pragma unroll
    for (int c = lane; c < 16 * kRowChunks; c += 32) {  // consecutive lanes: consecutive chunks of a row
      const int tile_row = c / kRowChunks, chunk = c % kRowChunks;
      if (is_query_row(p, warp_row0 + tile_row))
        *reinterpret_cast<uint4*>(o_head + int64_t(warp_row0 + tile_row) * p.o_view.row_stride + chunk * (16 / sizeof(Elem))) =
            *reinterpret_cast<const uint4*>(o_tile + tile_row * Traits::kOStageRowBytes + chunk * 16);
    }
  }

  // The epilogue of a whole tile (partial_row0 < 0) or of a split (its first row in the partial buffers).
  __device__ __forceinline__ void store(const float (&o_acc)[kORegs], const float (&row_max)[2], const QRowScales& q,
                                        int64_t partial_row0, char* o_tile) const {
    const bool partial = partial_row0 >= 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = o_acc[Traits::kOutRegs + 2 * r], inv_sum = inverse_row_sum(sum);
      const float shift = p.sm_scale * q.center_dot[r];
      if (partial) {
        store_partial_row(o_acc, r, row_max[r], sum, inv_sum, shift, partial_row0);
      } else {
        stage_row(o_acc, r, row_max[r], sum, inv_sum, shift, o_tile);
      }
    }
    if (partial) return;
    __syncwarp();
    store_staged_rows(o_tile);
  }
};

}  // namespace attention_int8
