// The Hopper kernel's tile scheduler: which work tile each CTA computes (device side) and the grid that
// covers a problem, with its split-KV tail and causal head chunks (host side). TileSchedule in
// attention_int8.h is the numbering both sides share.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention_common.cuh"
#include "attention_int8.h"

namespace attention_int8 {

// The CTA's work: a tile of kBlockM query rows of one (batch, head) against key tiles [n_begin, n_end), all
// it sees or, for a split tile, one range of them. CTA i takes tile i as long as tiles are whole, then the
// splits of each remaining tile in turn.
struct WorkTile {
  int m_block, head, batch;
  int n_begin, n_end;
  int64_t partial_row0;  // the split's first row in o_partial / row_stats; -1 for a whole tile
};

// In 32-bit unsigned arithmetic (the launcher keeps the grid below 2^31 CTAs): 64-bit divisions are
// subroutine calls, and this runs ahead of the CTA's first Q loads.
__device__ __forceinline__ uint32_t fast_div(uint32_t n, const FastDivisor& d) {
  return (__umulhi(n, d.multiplier) + n) >> d.shift;
}

struct TileCoords {
  int m_block, head, batch;
};

// Query block, head and batch of tile `tile` (chunks of heads; in a chunk the query block counted down and the
// heads fastest).
__device__ __forceinline__ TileCoords tile_coords(const TileSchedule& sched, uint32_t tile) {
  const uint32_t chunk = fast_div(tile, sched.chunk_tiles), in_chunk = tile - chunk * sched.chunk_tiles.divisor;
  const uint32_t level = fast_div(in_chunk, sched.chunk_heads);  // query blocks counted down
  const uint32_t bh = chunk * sched.chunk_heads.divisor + (in_chunk - level * sched.chunk_heads.divisor);
  const uint32_t batch = fast_div(bh, sched.heads);
  return {int(sched.query_blocks.divisor - 1 - level), int(bh - batch * sched.heads.divisor), int(batch)};
}

template <typename Traits>
__device__ __forceinline__ WorkTile work_tile(const AttentionParams& p, uint32_t cta) {
  const TileSchedule& sched = p.schedule;
  const uint32_t full_tiles = uint32_t(sched.full_tiles());
  const bool split = cta >= full_tiles;
  const uint32_t unit = cta - full_tiles, tile_of_unit = full_tiles + fast_div(unit, sched.splits);
  const TileCoords c = tile_coords(sched, split ? tile_of_unit : cta);
  WorkTile w;
  w.m_block = c.m_block, w.head = c.head, w.batch = c.batch;
  w.n_begin = 0;
  w.n_end = visible_key_blocks(p, sched.block_row0(w.m_block + 1), Traits::kBlockN);
  w.partial_row0 = -1;
  if (split) {  // never under the causal mask: the split's range is all its rows see
    const uint32_t n_total = (uint32_t(p.seqlen_kv) + Traits::kBlockN - 1) / Traits::kBlockN;
    const uint32_t s = unit - (tile_of_unit - full_tiles) * sched.splits.divisor;
    w.n_begin = int(s * n_total / sched.splits.divisor);
    w.n_end = int((s + 1) * n_total / sched.splits.divisor);
    w.partial_row0 = int64_t(unit) * Traits::kBlockM;
  }
  return w;
}

// Causal tiles are not split but ordered longest first, in chunks of heads: this many heads, the most whose K
// and V take at most half the L2 and that divide the grid's heads evenly.
inline int causal_chunk_heads(const AttentionParams& p, int head_dim, int64_t l2_bytes) {
  const int64_t bh = int64_t(p.batch) * p.heads_q;
  const int64_t kv_head_bytes = int64_t(p.seqlen_kv) * head_dim * (1 + 2);  // INT8 K and 16-bit V
  const int64_t fit = std::max<int64_t>(1, l2_bytes / 2 * (p.heads_q / p.heads_kv) / std::max<int64_t>(1, kv_head_bytes));
  int64_t heads = std::min(bh, fit);
  while (bh % heads != 0) --heads;  // whole chunks: the decode divides by one chunk size
  return int(heads);
}

// Only the tail, the tiles % S tiles of the last, partial wave on S SMs, is split: s ways, it runs in
// ceil(tail * s / S) waves of 1 / s of a tile's time each (plus each split's fixed cost: Q, set-up, epilogue,
// and the combine). The smallest s with the shortest such time wins, so a tail of at most S / 2 tiles takes 1/2
// (s = 2) or less, one of at most 2S / 3 takes 2/3 (s = 3), and a fuller one is not split. Each split keeps at
// least kMinKeyTilesPerSplit key tiles, so that the fixed cost stays a small part of it.
template <typename Traits>
TileSchedule make_tile_schedule(const AttentionParams& p, int sm_count, int64_t l2_bytes, int forced_splits) {
  constexpr int kMinKeyTilesPerSplit = 8;
  TileSchedule sched;
  sched.block_m = Traits::kBlockM;
  const int query_blocks = int(ceil_div(p.seqlen_q, Traits::kBlockM));
  sched.row_shift = TileSchedule::row_shift_of(p.causal, p.seqlen_q, Traits::kBlockM, Traits::kConsumerRows);
  sched.tiles = int64_t(query_blocks) * p.heads_q * p.batch;
  sched.query_blocks = FastDivisor(uint32_t(query_blocks));
  sched.heads = FastDivisor(uint32_t(p.heads_q));
  sched.head_group = FastDivisor(uint32_t(p.heads_q / p.heads_kv));
  const int chunk_heads = p.causal && sched.tiles > 0 ? causal_chunk_heads(p, Traits::kHeadDim, l2_bytes) : 1;
  sched.chunk_heads = FastDivisor(uint32_t(chunk_heads));
  sched.chunk_tiles = FastDivisor(uint32_t(int64_t(chunk_heads) * query_blocks));  // <= tiles (the launcher caps)
  const int key_tiles = int(ceil_div(p.seqlen_kv, Traits::kBlockN));
  const bool packed = p.packed_q.cu_seqlens != nullptr;  // the tail's tiles are of unknown lengths
  if (p.causal || packed || sched.tiles == 0 || key_tiles < 2 || sm_count < 1) return sched;
  int splits = 1;
  int64_t split_tiles = sched.tiles;
  if (forced_splits > 0) {
    splits = std::min({forced_splits, kMaxKvSplits, key_tiles});
  } else {
    split_tiles = sched.tiles % sm_count;
    const int max_splits = std::min(kMaxKvSplits, key_tiles / kMinKeyTilesPerSplit);
    int64_t best_waves = 1;  // ceil(tail * splits / S): the time is best_waves / splits tiles
    for (int s = 2; s <= max_splits && split_tiles > 0; ++s) {
      const int64_t waves = ceil_div(split_tiles * s, sm_count);
      if (waves * splits < best_waves * s) splits = s, best_waves = waves;
    }
  }
  if (splits >= 2) sched.splits = FastDivisor(uint32_t(splits)), sched.split_tiles = split_tiles;
  return sched;
}

// Whether p.schedule is make_tile_schedule's for these params and traits, with its buffers: the launcher's
// guard against a schedule built for other shapes.
template <typename Traits>
bool schedule_fits(const AttentionParams& p) {
  const TileSchedule& sched = p.schedule;
  const int64_t query_blocks = ceil_div(p.seqlen_q, Traits::kBlockM);
  return sched.block_m == Traits::kBlockM && sched.tiles == query_blocks * p.heads_q * p.batch &&
         sched.query_blocks.divisor == query_blocks && sched.heads.divisor == uint32_t(p.heads_q) &&
         sched.row_shift == TileSchedule::row_shift_of(p.causal, p.seqlen_q, Traits::kBlockM, Traits::kConsumerRows) &&
         sched.head_group.divisor == uint32_t(p.heads_q / p.heads_kv) && sched.chunk_heads.divisor >= 1 &&
         (p.batch * p.heads_q) % sched.chunk_heads.divisor == 0 && (p.causal || sched.chunk_heads.divisor == 1) &&
         sched.chunk_tiles.divisor == sched.chunk_heads.divisor * sched.query_blocks.divisor &&
         sched.splits.divisor >= 1 && sched.splits.divisor <= kMaxKvSplits && sched.split_tiles >= 0 &&
         sched.split_tiles <= sched.tiles && sched.ctas() <= INT32_MAX &&
         (sched.split_tiles == 0 || (p.o_partial != nullptr && p.row_stats != nullptr));
}

}  // namespace attention_int8
