// Host-side interface of the CUDA kernels. This header is the one source of truth for the launchers'
// signatures: both the .cu files that define them and the torch binding include it, so a mismatch
// between declaration and definition is a compile error, not a link-time surprise.
//
// It is deliberately free of torch types: the .cu files compile with nvcc alone (fast, and the same
// under kernel-builder and the local build).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace attention_int8 {

enum class ElemType { kFloat16, kBFloat16 };

// Row padding of the quantized workspaces, which the binding allocates. The portable kernel's query
// tile divides kQueryPad and every key tile divides kKeyPad (kernel_traits.cuh static_asserts both),
// so the kernels read whole tiles of Q and K without bounds checks. (The sm90 kernel reads Q unquantized.)
constexpr int kQueryPad = 128;
constexpr int kKeyPad = 128;

// K shares one scale per block of this many keys: both kernels' key tiles lie inside one block, so a
// tile's logits of one query row share one dequantization scale (quant_math.cuh says why that matters).
constexpr int kKeyScaleTokens = 64;
static_assert(kKeyPad % kKeyScaleTokens == 0, "K's padding holds whole scale blocks");

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The head dims both kernels are built for (dispatch_head_dim lists the same; _checks.py's SUPPORTED_HEAD_DIMS too).
constexpr int kSupportedHeadDims[] = {64, 80, 96, 128, 256};
constexpr bool head_dim_supported(int d) {
  for (int supported : kSupportedHeadDims)
    if (d == supported) return true;
  return false;
}

// Which attention kernel runs, decided here alone: the Hopper kernel (wgmma, built for sm_90a) on compute
// capability 9.0 for every supported head dim, the portable kernel everywhere else and whenever force_portable is
// set (the tests' hook to hold both kernels to the reference on one GPU).
enum class AttentionKernel { kPortable, kSm90 };
constexpr AttentionKernel choose_attention_kernel(int cc_major, int cc_minor, bool force_portable) {
  return cc_major == 9 && cc_minor == 0 && !force_portable ? AttentionKernel::kSm90 : AttentionKernel::kPortable;
}

// The Hopper kernel's INT8 rows (K's workspace, Q's shared-memory tile) are one 64- or 128-byte swizzle row, so
// D = 80 and 96 run on rows padded with zeros to 128 bytes: zeros add nothing to Q.K^T, and V's and O's channels past D
// are zeros that are never stored. D = 256 rows are two 128-byte panels in each tile of kSm90TileRows rows
// (swizzle.cuh): a K tile, a consumer's Q tile, and the block of K the quantizer writes as one.
constexpr int sm90_row_bytes(int head_dim) { return head_dim <= 64 ? 64 : (head_dim <= 128 ? 128 : 256); }
constexpr int kSm90TileRows = 64;

// Rows of an [B, H, N, D] tensor addressed by strides (in elements; the D stride must be 1).
struct RowMajorView {
  int64_t batch_stride;
  int64_t head_stride;
  int64_t row_stride;
};

// A batch of sequences of different lengths packed one after the other (FlashAttention's varlen form): sequence b
// is rows cu_seqlens[b] .. cu_seqlens[b + 1] of a [total_rows, H, D] tensor, seen through a view whose batch stride
// is 0. The params' seqlen is then the longest sequence's, which sizes the grids and the padded workspaces, and each
// CTA first narrows its params to its own sequence (packed_sequences.cuh).
struct PackedSequences {
  const int* cu_seqlens = nullptr;  // [batch + 1] int32 on the device; nullptr: a dense batch
  int total_rows = 0;
};

// Symmetric INT8 quantization of Q (or K) read from the user's layout, one scale per group of
// `tokens_per_scale` consecutive tokens (1: per token, for Q; kKeyScaleTokens: per key block, for K):
//   x_q[b,h,n,:] = round(x[b,h,n,:] * 127 / amax),   scale[b,h,n / tokens_per_scale] = amax / 127 * out_scale,
// where amax = max |x[b,h,n',d] - mean[b,h,d]| over the group's tokens n' and all d (mean optional: the K
// smoothing). Output is dense [B, H, n_pad, D] int8 and [B, H, ceil_div(n_pad, tokens_per_scale)] fp32;
// rows in [n, n_pad) are zero (and so count as zeros in their group's amax). A group holding a non-finite
// value gets a NaN scale (and zeros), so NaN propagates to the attention output.
struct QuantizeParams {
  const void* x;
  RowMajorView x_view;
  const float* mean;  // [B, H, D] fp32 contiguous, or nullptr
  int8_t* x_q;
  float* scale;
  // Optional, from the unquantized row: row_dot[b, h, n] = x[b, h, n, :] . dot_vec[b, h / head_group, :].
  // Q rows dotted with K's centre give the logit shift that K smoothing removed, which the LSE needs.
  const float* dot_vec;  // [B, H / head_group, D] fp32 contiguous, or nullptr
  float* row_dot;        // [B, H, seqlen_pad]
  // Optional, channel balancing: channel d of every row is multiplied by channel_scale[b, h / head_group, d] after
  // the mean's subtraction and before the amax (Q: the factors s, K: 1 / s; KeyCenterParams). row_dot is unscaled.
  const float* channel_scale;  // [B, H / head_group, D] fp32 contiguous, or nullptr
  int head_group;  // rows of H per row of dot_vec and channel_scale: Q heads per K/V head for Q, 1 for K
  // Optional, K's launch under Q smoothing (KeyCenterParams): for each of the query_group Q heads g of K/V head h whose
  // query_smoothed flag is set, key_bias[b, h * query_group + g, n] = (x[b, h, n, :] - mean) . query_shift[.., g, :]
  // * bias_scale (the smoothed, unbalanced key against Q's centre, in base-2 logit units), and key_bias_max[.., n / 64]
  // the max of those over the key's block of kKeyScaleTokens keys (rows past seqlen left out).
  const float* query_shift;   // [B, H * query_group, D], or nullptr (no Q smoothing)
  const int* query_smoothed;  // [B, H * query_group]
  float* key_bias;            // [B, H * query_group, seqlen_pad]
  float* key_bias_max;        // [B, H * query_group, seqlen_pad / kKeyScaleTokens]
  int query_group;
  float bias_scale;  // sm_scale * log2(e)
  int batch, heads, seqlen, seqlen_pad, head_dim;
  int tokens_per_scale;  // 1 or kKeyScaleTokens
  float out_scale;
  ElemType dtype;
  // For the sm90 kernel: store each row's 16-byte chunks in the K-major swizzled order of swizzle.cuh, in rows
  // of sm90_row_bytes(D) bytes (D = 96: zeros after the data; D = 256: two panels a tile), the shared-memory image
  // the sm90 kernel's wgmma reads, so it loads tiles with plain contiguous copies. x_q is then
  // [B, H, n_pad, sm90_row_bytes(D)].
  bool sm90_layout;
  // Launched as a programmatic dependent of the stream's previous kernel (sm_90+, dispatch.cuh): K's
  // centre's, whose output is `mean`.
  bool programmatic_launch;
  // The device's SM count: under programmatic launch each block also asks L2 for the rows of the block one
  // wave later (quantize.cu, prefetch_block_ahead).
  int sm_count;
};

// Division by a divisor fixed at launch, for the CTA-index decode that runs ahead of a CTA's first loads: for
// 0 <= n < 2^31, n / divisor = (umulhi(n, multiplier) + n) >> shift (round-up reciprocal; the device side is
// fast_div in sm90_tile_scheduler.cuh). A run-time integer division is ~20 dependent instructions, a 64-bit one
// a subroutine call.
struct FastDivisor {
  uint32_t divisor = 1, multiplier = 1, shift = 0;
  FastDivisor() = default;
  explicit FastDivisor(uint32_t d) : divisor(d) {
    if (d == 0) return;  // an empty grid: never divided by
    while ((uint64_t(1) << shift) < d) ++shift;
    multiplier = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1);
  }
};

// The sm90 kernel's grid: one CTA per work tile (block_m query rows of one (batch, head)), except for split-KV at
// the end. Tiles are numbered in chunks of chunk_heads consecutive (batch, head) pairs; inside a chunk the query
// block is the slower index, counted down from the last, and the chunk's heads the faster one:
//   tile = (chunk * query_blocks + (query_blocks - 1 - query block)) * chunk_heads + head in chunk.
// The GPU starts CTAs in index order. Under the causal mask a tile's length grows with its query block, so each
// chunk runs longest first and a grid ends in its shortest tiles; with the heads of a chunk chosen so that their
// K and V fit in half the L2, the CTAs running at once share them there. Without the mask chunk_heads is 1: the
// query block is the fastest index. A grid of `tiles` CTAs on
// S SMs ends in a wave of tiles % S of them that leaves the other SMs idle for a whole tile's time; the last
// `split_tiles` tiles are then cut into `splits` ranges of key tiles each, run as separate CTAs that write their
// normalized fp32 O and row statistics to partial buffers, and a combine kernel merges a row's splits s: with
// l_s the sum of 2^(logit - m_s) over split s's keys (m_s its running max, log2 units), M = max_s m_s and
// w_s = 2^(m_s - M) l_s,
//   O = sum_s w_s O_s / sum_s w_s,   LSE = (M + log2 sum_s w_s) ln 2 + shift,
// the unsplit kernel's formulas over the union of the keys. (Keeping m and l apart, rather than one LSE per
// split, loses nothing at huge logits, where log2 l would vanish in m's rounding.)
// Non-causal only: causal grids already end in their shortest tiles.
constexpr int kMaxKvSplits = 4;

struct SplitRowStats {
  float max_log2;   // m_s
  float sum;        // l_s
  float lse_shift;  // the LSE's smoothing shift sm_scale * (q_row . k_center), 0 without it
};

struct TileSchedule {
  int64_t tiles = 0;        // work tiles
  int64_t split_tiles = 0;  // the last split_tiles of them are split (0: none)
  FastDivisor splits;       // ways each split tile is split (1: none)
  FastDivisor query_blocks, heads, head_group;  // the decode's divisors; head_group = q heads per k/v head
  FastDivisor chunk_heads, chunk_tiles;           // chunk_tiles = chunk_heads * query_blocks
  int block_m = 0;          // query rows of a work tile
  int row_shift = 0;        // query block b holds rows b * block_m - row_shift .. (row_shift_of)
  __host__ __device__ int block_row0(int m_block) const { return m_block * block_m - row_shift; }
  // Under the causal mask the query blocks end at seqlen_q: row_shift is the rows seqlen_q leaves empty in its last
  // block, in whole groups of group_rows (a consumer's), so the block whose consumers partly have no rows is block 0,
  // which sees 1-3 key tiles, rather than the last, which sees all of them. Without the
  // mask every block sees the same keys and row_shift is 0.
  static constexpr int row_shift_of(bool causal, int seqlen_q, int block_m, int group_rows) {
    return causal ? int(ceil_div(seqlen_q, block_m) * block_m - seqlen_q) / group_rows * group_rows : 0;
  }
  __host__ __device__ int64_t full_tiles() const { return tiles - split_tiles; }
  __host__ __device__ int64_t ctas() const { return full_tiles() + split_tiles * splits.divisor; }
  // Rows of the partial buffers: split CTA u (counted from the first split one) owns rows u * block_m ..
  __host__ __device__ int64_t partial_rows() const { return split_tiles * splits.divisor * block_m; }
};

// O = softmax(dequant(Q_q K_q^T)) V with an online base-2 softmax. K comes from the quantizer above
// (dense, padded); V and O are read/written through strides. Causal masking is bottom-right aligned:
// query i sees key j iff j <= i + (seqlen_kv - seqlen_q).
// Q: the portable kernel reads it quantized (q, q_scale); the sm90 kernel quantizes its Q tile itself,
// with the same arithmetic (quant_math.cuh), from q_input.
struct AttentionParams {
  const int8_t* q;        // portable: [B, Hq, seqlen_q_pad, D] from the quantizer
  const float* q_scale;   // portable: [B, Hq, seqlen_q_pad], includes sm_scale * log2(e)
  const void* q_input;    // sm90: Q as given; base and strides 16-byte aligned
  RowMajorView q_view;
  float q_out_scale;      // sm90: sm_scale * log2(e), the quantizer's out_scale for Q
  const int8_t* k;        // [B, Hkv, seqlen_kv_pad, D]; sm90: rows of sm90_row_bytes(D) (QuantizeParams)
  const float* k_scale;   // [B, Hkv, seqlen_kv_pad / kKeyScaleTokens]
  const void* v;          // the sm90 kernel reads V by TMA: base and strides 16-byte aligned, none 0
  RowMajorView v_view;
  void* o;                // rows 16-byte aligned (the binding allocates O dense)
  RowMajorView o_view;
  float* lse;             // natural-log log-sum-exp, or nullptr: [B, Hq, seqlen_q], packed [Hq, total_q] (lse_slot)
  // With lse and a smoothed K, both kernels' epilogues add the shift sm_scale * (q_i . k_center) that smoothing
  // took out of row i's logits back to its LSE. The sm90 kernel dots its raw Q rows with K's centre k_center
  // ([B, Hkv, D] fp32); the portable kernel reads q_center_dot ([B, Hq, seqlen_q_pad] fp32, the Q quantizer's
  // row_dot). Both nullptr otherwise.
  const float* k_center;
  const float* q_center_dot;
  const float* q_balance;  // sm90: channel balancing's factors s ([B, Hkv, D] fp32) for the Q tiles, or nullptr
  // Q smoothing (KeyCenterParams), or all nullptr: in the heads whose query_smoothed[b, h] is set, the sm90 kernel's Q
  // tiles subtract query_shift[b, h, :] (the portable kernel's quantizer did already), and every logit of key j gains
  // key_bias[b, h, j]. The sm90 kernel keeps its integer tile max and takes t + key_bias_max of the tile's block as
  // the tile's max, an upper bound of its biased logits.
  const int* query_smoothed;  // [B, Hq] int32
  const float* query_shift;   // sm90: [B, Hq, D] fp32
  const float* key_bias;      // [B, Hq, seqlen_kv_pad] fp32
  const float* key_bias_max;  // sm90: [B, Hq, seqlen_kv_pad / kKeyScaleTokens] fp32
  float sm_scale;
  int batch, heads_q, heads_kv, seqlen_q, seqlen_kv, seqlen_q_pad, seqlen_kv_pad, head_dim;
  bool causal;
  AttentionKernel kernel;  // kSm90: K quantized with sm90_layout, Q in q_input
  TileSchedule schedule;  // sm90: tile_schedule_sm90 for these params
  float* o_partial;       // [schedule.partial_rows(), head_dim] fp32, when schedule.split_tiles > 0
  SplitRowStats* row_stats;  // [schedule.partial_rows()]
  bool programmatic_launch;  // start under the K quantizer's tail (sm_90+, dispatch.cuh)
  ElemType dtype;
  // Packed sequences: Q, O and LSE rows by packed_q, V rows by packed_kv (both set or neither); the quantized Q and
  // K stay padded per sequence, and no tile is split. (Last in the struct: fields before them keep their offsets,
  // and the dense kernels their code.)
  PackedSequences packed_q, packed_kv;
};

// K's smoothing centre, center[b, h, :]: the mean of a sample of K's rows (keys) without the sample's outliers.
// Any vector subtracted from every key shifts each logit row by a constant, so only K's INT8 range depends
// on the centre; the token mean would do, but it is a whole extra pass over K.
// - The sample: every key up to kCenterSampleKeys, else one in each stratum of seqlen / kCenterSampleKeys keys
//   at a hashed offset (center_sample_key; a fixed stride can alias with periodic structure such as the
//   rows of an image's tokens).
// - Its plain mean m0, then each sample key's distance max_d |k_d - m0_d| (fp32, NaN if any term is);
//   the kCenterSampleKeys / kCenterTrimDivisor farthest keys (or more, where distances tie) are left out,
//   since one attention-sink key, many times the others' size, would move a sample's mean by 1/128 of
//   itself (benchmarks/smoothing_center.py). More NaN distances than that leave no key: centre NaN.
// - The centre is the kept keys' mean. The sums are fp64 and exact for fp16 data (and for ordinarily ranged
//   bf16), so the order of summation does not matter and reference.py's key_center matches bit for bit.
//
// Channel balancing (issue 46) takes its ranges from the same sample: channel_range[b, h, d] = max |x_d - center_d|
// over the sample rows (fp32). Channel d of Q is then multiplied by s_d and of K by 1 / s_d, which keeps q . k and
// gives both quantizers the range sqrt(q_range k_range), so no outlier channel of K owns its INT8 range:
//   s_d = sqrt(k_range_d / q_range_d), q_range_d the max over the query heads that share the K/V head,
// or 1 where s_d is not finite, 0, or within a factor kBalanceMinFactor of 1 (reference.py: balance_factors). Q or K
// of fewer than kCenterSampleKeys rows reports ranges of 0, so factors of 1: a few rows' max is far below 128's.
// Q's launch writes channel_range alone; K's launch, which runs after it (as its programmatic dependent on sm_90),
// reads Q's ranges as query_range and writes s and 1 / s to balance and balance_inverse.
//
// Q smoothing (issue 46) is chosen per query head by K's launch, from Q's centre mu (query_center) and ranges: a head
// is smoothed when max_d |mu_d| exceeds kQueryShiftMinRatio times max_d range_d (query_smoothing_pays). Its Q rows are
// then quantized as q - mu, and every logit of key j gains the exact fp32 bias mu . (k_j - k_center) * sm_scale *
// log2(e), which the K quantizer computes (QuantizeParams::key_bias): q . k is unchanged, and a shared Q offset no
// longer owns Q's INT8 range. Heads below that ratio are not worth the bias's cost in the key loop. K's launch writes
// query_smoothed (0 or 1) and query_shift (mu where smoothed, else zeros) for each of its query_group Q heads.
struct KeyCenterParams {
  const void* x;
  RowMajorView x_view;
  float* center;  // [B, H, D]; a packed sequence (launch_key_center) without keys gets zeros
  int batch, heads, seqlen, head_dim;
  ElemType dtype;
  float* channel_range;      // [B, H, D], or nullptr (no balancing)
  const float* query_range;  // K's launch: [B, H * query_group, D] from Q's launch, or nullptr (no factors)
  int query_group;
  float* balance;            // [B, H, D]: s
  float* balance_inverse;    // [B, H, D]: 1 / s, or both nullptr (no balancing)
  const float* query_center;  // K's launch, Q smoothing: [B, H * query_group, D] from Q's launch, or nullptr
  float* query_shift;         // [B, H * query_group, D]
  int* query_smoothed;        // [B, H * query_group]
  bool programmatic_launch;  // K's launch, as the dependent of Q's (sm_90+)
};

constexpr float kBalanceMinFactor = 2.f;  // reweighting channels already balanced, by sampling noise, costs accuracy

// Q smoothing's rule (KeyCenterParams; reference.py: query_smoothing_heads): a Q centre offset of max |mu_d| against Q's
// largest channel range about it. Below a quarter the gain in accuracy does not pay for the bias (docs/DESIGN.md,
// rationale); a head without ranges (fewer than kCenterSampleKeys rows: range 0) or with a NaN is never smoothed.
constexpr float kQueryShiftMinRatio = 0.25f;
__host__ __device__ constexpr bool query_smoothing_pays(float offset, float spread) {
  return spread > 0.f && offset > kQueryShiftMinRatio * spread;
}

constexpr int kCenterSampleKeys = 128;
constexpr int kCenterTrimDivisor = 32;

// Sample key i < min(seqlen, kCenterSampleKeys): in stratum i, keys [i N / S, (i + 1) N / S) (integer
// quotients, so no two strata share a key), at the fraction of the stratum given by the upper 16 bits of a
// multiplicative hash of i (reference.py: center_sample).
__host__ __device__ constexpr int64_t center_sample_key(int64_t i, int64_t seqlen) {
  if (seqlen <= kCenterSampleKeys) return i;
  const int64_t first = i * seqlen / kCenterSampleKeys, end = (i + 1) * seqlen / kCenterSampleKeys;
  const int64_t fraction = ((i * 2654435761LL) & 0xffffffffLL) >> 16;
  return first + ((fraction * (end - first)) >> 16);
}

// `packed`: x's sequences, or none (cu_seqlens nullptr) for a dense batch. The quantizer's output stays padded: one
// seqlen_pad block of rows per sequence. (Beside the params rather than in them: a larger QuantizeParams changes
// the dense quantizer's code.)
cudaError_t launch_key_center(const KeyCenterParams& params, const PackedSequences& packed, cudaStream_t stream);
cudaError_t launch_quantize(const QuantizeParams& params, const PackedSequences& packed, cudaStream_t stream);
// Runs params.kernel (choose_attention_kernel); the two below are its cases.
cudaError_t launch_attention_forward(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_forward_portable(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_forward_sm90(const AttentionParams& params, cudaStream_t stream);
// The sm90 kernel's grid for `params` (its shape fields set) on a GPU of sm_count SMs and l2_bytes of L2: splits
// only the last, partial wave, unless forced_splits > 0 splits every tile that many ways (a test hook; capped by
// kMaxKvSplits and the key tiles). Never splits causal attention (it orders its tiles in chunks of heads instead)
// or packed sequences.
TileSchedule tile_schedule_sm90(const AttentionParams& params, int sm_count, int64_t l2_bytes, int forced_splits);

}  // namespace attention_int8
