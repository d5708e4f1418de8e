// The rules both attention kernels (and the split-KV combine) share: which keys a query row sees, the online
// softmax's exponent base and rescale, the output normalization and the natural-log LSE.
#pragma once

#include <cmath>

#include "attention_int8.h"
#include "ptx.cuh"

namespace attention_int8 {

constexpr float kLn2 = 0.6931471805599453f;

// Bottom-right aligned causal masking (FlashAttention's convention): query i sees key j iff j < seqlen_kv and,
// under the mask, j <= i + causal_offset. (Free functions of the params, read in place: held in a struct, the
// flag and lengths would leave the kernel-parameter bank for registers and per-key selects.)
__device__ __forceinline__ int causal_offset(const AttentionParams& p) { return p.seqlen_kv - p.seqlen_q; }

__device__ __forceinline__ bool key_hidden(const AttentionParams& p, int key, int row) {
  const int last_visible = row + causal_offset(p);  // outside the short circuit, so it is computed once per row
  return key >= p.seqlen_kv || (p.causal && key > last_visible);
}

// Whether keys [key0, key0 + keys) hold one that a row from first_row on does not see.
__device__ __forceinline__ bool keys_need_mask(const AttentionParams& p, int key0, int keys, int first_row) {
  return key0 + keys > p.seqlen_kv || (p.causal && key0 + keys - 1 > first_row + causal_offset(p));
}

// A query row of a tile: rows below 0 (the Hopper kernel's block 0 under the causal row_shift) and from seqlen_q on
// hold no query.
__device__ __forceinline__ bool is_query_row(const AttentionParams& p, int row) {
  return uint32_t(row) < uint32_t(p.seqlen_q);
}

// Key tiles of block_n keys that query rows below row_end see (rows past seqlen_q count as the last row).
__device__ __forceinline__ int visible_key_blocks(const AttentionParams& p, int row_end, int block_n) {
  int key_end = p.seqlen_kv;
  if (p.causal) key_end = max(0, min(key_end, min(row_end, p.seqlen_q) + causal_offset(p)));
  return (key_end + block_n - 1) / block_n;
}

// Key tiles that row first_row and every row after it see whole: the tiles before the first keys_need_mask one.
__device__ __forceinline__ int unmasked_key_blocks(const AttentionParams& p, int first_row, int block_n) {
  int whole = p.seqlen_kv / block_n;
  if (p.causal) whole = min(whole, max(0, (first_row + causal_offset(p) + 1) / block_n));
  return whole;
}

// Whether K's centre pass chose Q smoothing for query head batch_head = batch * heads_q + head (KeyCenterParams). Read
// only after the kernel's wait for its predecessors.
__device__ __forceinline__ bool head_is_smoothed(const AttentionParams& p, int64_t batch_head) {
  return p.query_smoothed != nullptr && p.query_smoothed[batch_head] != 0;
}

// The online softmax in base 2 keeps a running max m per row; until the row has seen a key m is -inf, and the
// exponents are then taken against 0, so that 2^(-inf - 0) = 0 rather than NaN.
__device__ __forceinline__ float exponent_base(float m) { return m == -INFINITY ? 0.f : m; }

// The factor that moves a row's sums and output from max m_old to the new base.
__device__ __forceinline__ float rescale_factor(float m_old, float base) { return ptx::exp2_approx(m_old - base); }

// 1 / l for the output's normalization: a row that saw no key (l = 0) writes zeros, and a NaN sum stays NaN.
__device__ __forceinline__ float inverse_row_sum(float sum) { return sum == 0.f ? 0.f : 1.f / sum; }

// Where query row `row` of query head `head` of a batch keeps its LSE, with batch_head = batch * heads_q + head:
// [B, Hq, seqlen_q], or for packed sequences [Hq, total_q] from the sequence's first row (narrow_to_sequence moves
// p.lse there).
template <bool kPacked>
__device__ __forceinline__ float* lse_slot(const AttentionParams& p, int64_t batch_head, int head, int row) {
  if constexpr (kPacked) return p.lse + (int64_t(head) * p.packed_q.total_rows + row);
  return p.lse + (batch_head * p.seqlen_q + row);
}

// The natural-log log-sum-exp of a row from its base-2 max and sum, plus the logit shift K smoothing took out of
// the row (sm_scale * q_row . k_centre, 0 without smoothing): -inf for a row that saw no key.
__device__ __forceinline__ float natural_lse(float max_log2, float sum, float smoothing_shift) {
  return sum == 0.f ? -INFINITY : (max_log2 + log2f(sum)) * kLn2 + smoothing_shift;
}

}  // namespace attention_int8
