// Symmetric INT8 quantization of Q (one scale per token) and K (one per block of kKeyScaleTokens keys),
// see QuantizeParams in attention_int8.h; the arithmetic, and why these granularities, in quant_math.cuh.
// Scales of whole rows (or row blocks) are what fixed the original kernel's bug: no scale is shared by
// rows whose logits do not share it in the kernels.
// K arrives with its centre subtracted (smoothing; key_center_kernel below): channel-wise offsets shared by
// all keys would otherwise dominate amax and leave few INT8 levels for the part of K that differs between keys.
#include <cmath>
#include <cstdint>

#include "attention_int8.h"
#include "dispatch.cuh"
#include "packed_sequences.cuh"
#include "ptx.cuh"
#include "quant_math.cuh"
#include "swizzle.cuh"

namespace attention_int8 {
namespace {

constexpr int kQuantWarps = 8;  // per block, unless a K scale block needs more (QuantRowShape)
constexpr int kChunkElems = 8;  // each lane owns 8 consecutive elements: one 16-byte load
constexpr int kRowIters = 4;    // row groups per warp
// Quantizer warps per SM, in blocks of QuantRowShape::kWarps: holds its two paths (quantize_kernel) to 64 registers;
// unbounded they took 77.
constexpr int kQuantWarpsPerSm = 4 * kQuantWarps;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kCenterThreads = 4 * kCenterSampleKeys;  // 4 sample rows a thread at D = 128; the first
                                                       // kCenterSampleKeys threads rank one row each

// A row of kHeadDim elements spreads over a power-of-two group of lanes (idle lanes past the row's
// end for D = 96), so one warp quantizes 32 / kLanes rows at once with 16-byte loads. A block has kQuantWarps warps,
// or at D = 256 (a row a warp) the 16 that make one K scale block.
template <int kHeadDim>
struct QuantRowShape {
  static constexpr int kChunks = kHeadDim / kChunkElems;
  static constexpr int kLanes = kChunks <= 8 ? 8 : (kChunks <= 16 ? 16 : 32);
  static constexpr int kRowsPerWarp = 32 / kLanes;
  static constexpr int kRowsPerWarpPass = kRowsPerWarp * kRowIters;  // consecutive rows
  static constexpr int kWarps = kKeyScaleTokens / kRowsPerWarpPass > kQuantWarps ? kKeyScaleTokens / kRowsPerWarpPass
                                                                                  : kQuantWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlocksPerSm = kQuantWarpsPerSm / kWarps;
  static constexpr int kRowsPerBlock = kWarps * kRowsPerWarpPass;
  static_assert(kHeadDim % kChunkElems == 0 && kChunks <= 32, "unsupported head dim");
  // A K scale block is whole warps of one CTA: its amax is a max over warps through shared memory.
  static_assert(kKeyScaleTokens % kRowsPerWarpPass == 0 && kRowsPerBlock % kKeyScaleTokens == 0,
                "K scale blocks must be whole warps of one CTA");
};

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Reduction over each group of kLanes lanes (a row's; 32: the warp): xor offsets below kLanes stay inside it.
template <int kLanes, typename T, typename Op>
__device__ __forceinline__ T group_reduce(T x, Op op) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// Where one lane's part of a row lives, and whether it holds data. The grid is (row blocks, heads,
// batch), so no index needs a 64-bit division.
struct RowChunk {
  int64_t row;  // over [B, H, seqlen_pad]
  int b, h, n;
  bool active;    // a row below seqlen_pad, and a lane inside it (D = 96 leaves lanes idle)
  bool has_data;  // rows in [seqlen, seqlen_pad) are padding: zeros, scale 0
};

// kPartial: the block may hold padding rows or idle lanes. Otherwise active and has_data are compile-time
// true, and every check on them folds away.
template <int kHeadDim, bool kPartial>
__device__ __forceinline__ RowChunk locate(const QuantizeParams& p, int n, int chunk) {
  const int b = blockIdx.z, h = blockIdx.y;
  RowChunk r{(int64_t(b) * p.heads + h) * p.seqlen_pad + n, b, h, n, true, true};
  if constexpr (kPartial) {
    r.active = n < p.seqlen_pad && chunk < QuantRowShape<kHeadDim>::kChunks;
    r.has_data = r.active && n < p.seqlen;
  }
  return r;
}

// Element `chunk * 8` of row n of head (b, h) of a strided [B, H, N, D] tensor.
template <typename Elem>
__device__ __forceinline__ const Elem* chunk_ptr(const void* base, const RowMajorView& view, int b, int h, int n, int chunk) {
  return static_cast<const Elem*>(base) + b * view.batch_stride + h * view.head_stride + int64_t(n) * view.row_stride +
         chunk * kChunkElems;
}

// Whether every row of a view starts on a 16-byte boundary: one uniform test, so the common case loads
// rows by 16-byte vector loads without a check per row.
template <typename Elem>
__device__ __forceinline__ bool rows_aligned(const void* x, const RowMajorView& v) {
  constexpr int64_t kAlign = 16 / sizeof(Elem);
  return reinterpret_cast<uintptr_t>(x) % 16 == 0 && v.batch_stride % kAlign == 0 && v.head_stride % kAlign == 0 &&
         v.row_stride % kAlign == 0;
}

template <bool kAligned, typename Elem>
__device__ __forceinline__ void load8(const Elem* x, Elem (&e8)[kChunkElems]) {
  if constexpr (kAligned) {
    *reinterpret_cast<uint4*>(e8) = *reinterpret_cast<const uint4*>(x);
  } else {  // a strided view whose rows are not 16-byte aligned
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) e8[e] = x[e];
  }
}

template <bool kAligned, typename Elem>
__device__ __forceinline__ void load_chunk(const QuantizeParams& p, const RowChunk& r, int chunk, Elem (&e8)[kChunkElems]) {
  if (r.has_data) load8<kAligned>(chunk_ptr<Elem>(p.x, p.x_view, r.b, r.h, r.n, chunk), e8);
}

// The lane's 8 channels of a per-head fp32 vector (K's centre or the row_dot weights): loaded once
// per lane, since the lane's channels are the same in all its rows.
__device__ __forceinline__ void load_channels(const float* x, float (&c8)[kChunkElems]) {
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const float4 lo = reinterpret_cast<const float4*>(x)[0], hi = reinterpret_cast<const float4*>(x)[1];
    c8[0] = lo.x, c8[1] = lo.y, c8[2] = lo.z, c8[3] = lo.w, c8[4] = hi.x, c8[5] = hi.y, c8[6] = hi.z, c8[7] = hi.w;
  } else {  // a user's mean that starts off a 16-byte boundary
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) c8[e] = x[e];
  }
}

// Element e of the lane's part of a row, as fp32 with the mean subtracted.
template <typename Elem>
__device__ __forceinline__ float centered(const RowChunk& r, const Elem (&e8)[kChunkElems], const float (&mean)[kChunkElems], int e) {
  return r.has_data ? to_float(e8[e]) - mean[e] : 0.f;
}

// What the quantizer rounds: the 8 centered values times their channels' balancing factors (1 without balancing).
struct ChannelShift {
  float mean[kChunkElems], scale[kChunkElems];
};

template <typename Elem>
__device__ __forceinline__ void centered_chunk(const RowChunk& r, const Elem (&e8)[kChunkElems], const ChannelShift& c,
                                               float (&x)[kChunkElems]) {
#pragma unroll
  for (int e = 0; e < kChunkElems; ++e) x[e] = centered(r, e8, c.mean, e) * c.scale[e];
}

// The max |x| bits of 8 values, and of the lane's part of a row.
__device__ __forceinline__ uint32_t values_max_bits(const float (&x)[kChunkElems]) {
  uint32_t bits = 0;
#pragma unroll
  for (int e = 0; e < kChunkElems; ++e) bits = max(bits, quant::abs_bits(x[e]));
  return bits;
}

template <typename Elem>
__device__ __forceinline__ uint32_t chunk_max_bits(const RowChunk& r, const Elem (&e8)[kChunkElems], const ChannelShift& c) {
  float x[kChunkElems];
  centered_chunk(r, e8, c, x);
  return values_max_bits(x);
}

// The dot product of the lane group's row, value(e) of the lane's 8 elements against w, on every lane of the group.
// Every lane takes part (warp-wide shuffles).
template <int kHeadDim, typename Value>
__device__ __forceinline__ float row_dot_product(Value value, const float (&w)[kChunkElems]) {
  float dot = 0.f;
#pragma unroll
  for (int e = 0; e < kChunkElems; ++e) dot += value(e) * w[e];
  return group_reduce<QuantRowShape<kHeadDim>::kLanes>(dot, [](float a, float b) { return a + b; });
}

// row_dot[row] = x . dot_w of the raw row (Q's against K's centre: the LSE's shift, which Q smoothing does not move).
template <int kHeadDim, typename Elem>
__device__ __forceinline__ void store_row_dot(const QuantizeParams& p, const RowChunk& r, int chunk, const Elem (&e8)[kChunkElems],
                                              const float (&dot_w)[kChunkElems]) {
  const float dot = row_dot_product<kHeadDim>([&](int e) { return r.has_data ? to_float(e8[e]) : 0.f; }, dot_w);
  if (r.active && chunk == 0) p.row_dot[r.row] = dot;
}

// Q smoothing's key biases (QuantizeParams::key_bias) of the thread's rows for each smoothed Q head of this K/V head,
// and their max over each K scale block. The flags are the same for the whole block, and every thread takes part
// (shuffles and barriers).
template <int kHeadDim, typename Elem>
__device__ __forceinline__ void store_key_biases(const QuantizeParams& p, const RowChunk (&rows)[kRowIters], int chunk,
                                                 const Elem (&e8)[kRowIters][kChunkElems], const float (&mean)[kChunkElems]) {
  using Shape = QuantRowShape<kHeadDim>;
  constexpr int kWarpsPerScale = kKeyScaleTokens / Shape::kRowsPerWarpPass;
  __shared__ float warp_max[2][Shape::kWarps];  // alternate between smoothed heads: one barrier a head
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t blocks = p.seqlen_pad / kKeyScaleTokens;
  int buffer = 0;
  for (int g = 0; g < p.query_group; ++g) {
    const int64_t q_head = (int64_t(blockIdx.z) * p.heads + blockIdx.y) * p.query_group + g;
    if (!p.query_smoothed[q_head]) continue;
    float shift[kChunkElems] = {};
    if (chunk < Shape::kChunks) load_channels(p.query_shift + q_head * kHeadDim + chunk * kChunkElems, shift);
    float block_max = -INFINITY;
#pragma unroll
    for (int it = 0; it < kRowIters; ++it) {
      const RowChunk& r = rows[it];
      const float bias = row_dot_product<kHeadDim>([&](int e) { return centered(r, e8[it], mean, e); }, shift) *
                         p.bias_scale;
      if (r.active && chunk == 0) p.key_bias[q_head * p.seqlen_pad + r.n] = bias;
      if (r.has_data) block_max = fmaxf(block_max, bias);
    }
    block_max = group_reduce<32>(block_max, [](float a, float b) { return fmaxf(a, b); });
    if (lane == 0) warp_max[buffer][warp] = block_max;
    __syncthreads();
    if (lane == 0 && warp % kWarpsPerScale == 0 && rows[0].active) {  // the scale block's first row
#pragma unroll
      for (int w = 1; w < kWarpsPerScale; ++w) block_max = fmaxf(block_max, warp_max[buffer][warp + w]);
      p.key_bias_max[q_head * blocks + rows[0].n / kKeyScaleTokens] = block_max;
    }
    buffer ^= 1;
  }
}

// K's scale blocks: every row's max |x| bits become its block's. All rows of a warp lie in one block
// (QuantRowShape), so: over the thread's rows, over the whole warp, then over the block's warps through
// shared memory. Padding rows hold zeros and take part harmlessly.
template <int kHeadDim>
__device__ __forceinline__ uint32_t reduce_over_scale_block(const uint32_t (&max_bits)[kRowIters]) {
  constexpr int kWarpsPerScale = kKeyScaleTokens / QuantRowShape<kHeadDim>::kRowsPerWarpPass;
  uint32_t bits = 0;
#pragma unroll
  for (int it = 0; it < kRowIters; ++it) bits = max(bits, max_bits[it]);
  bits = group_reduce<32>(bits, quant::UnsignedMax{});
  __shared__ uint32_t warp_max_bits[QuantRowShape<kHeadDim>::kWarps];
  const int warp = threadIdx.x / 32, first = warp / kWarpsPerScale * kWarpsPerScale;
  if (threadIdx.x % 32 == 0) warp_max_bits[warp] = bits;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarpsPerScale; ++w) bits = max(bits, warp_max_bits[first + w]);
  return bits;
}

// What a group's elements are multiplied by, from the group's amax as |x| bits (reduce_over_scale_block):
// computed once per group, which in K's blocks is once per thread for all its rows.
struct GroupScale {
  float inv_scale;
  bool finite, prescaled;
};

__device__ __forceinline__ GroupScale group_scale(uint32_t amax_bits) {
  const float amax = __uint_as_float(amax_bits);
  return {quant::inv_scale_of(amax), amax_bits < quant::kInfBits, quant::prescale_of(amax) != 1.f};
}

// Groups with amax below 2^-64 (bf16 only) are quantized from x * 2^64 (quant_math.cuh). Rare: a branch, so
// the common case issues no multiply.
template <int kRows>
__device__ __forceinline__ void apply_prescale(const GroupScale& g, float (&x)[kRows][kChunkElems]) {
  if (!g.prescaled) return;
#pragma unroll
  for (int it = 0; it < kRows; ++it)
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) x[it][e] *= quant::kPrescale;
}

// Quantizes the lane's 8 centered (and prescaled) values x with its group's scale and stores them.
template <int kHeadDim>
__device__ __forceinline__ void store_values(const QuantizeParams& p, const RowChunk& r, int chunk, const float (&x)[kChunkElems],
                                             const GroupScale& g) {
  constexpr int kSm90RowBytes = sm90_row_bytes(kHeadDim);
  // D = 96 in the sm90 layout: the lanes past the row's data, idle otherwise, store the zeros of its padding (their
  // x are zeros, as in the rows past seqlen).
  const bool padding = kSm90RowBytes > kHeadDim && p.sm90_layout && r.n < p.seqlen_pad && chunk * kChunkElems < kSm90RowBytes;
  if (!r.active && !padding) return;
  // A group holding a non-finite value stores zeros (its scale is NaN), as reference.py does.
  const uint2 q8 = g.finite ? make_uint2(quant::quantize4(x, g.inv_scale), quant::quantize4(x + 4, g.inv_scale)) : make_uint2(0, 0);
  // This lane's 8 bytes are half of 16-byte chunk chunk / 2, which the swizzle moves within the row (at D = 256,
  // within its tile's panel).
  int row_bytes = kHeadDim, byte_in_row = chunk * kChunkElems;
  if (p.sm90_layout)
    row_bytes = kSm90RowBytes,
    byte_in_row = swizzle::chunk_offset<kSm90RowBytes, kSm90TileRows>(r.n, chunk / 2) + (chunk % 2) * 8;
  *reinterpret_cast<uint2*>(p.x_q + r.row * row_bytes + byte_in_row) = q8;
}

// The group's first row stores its scale (one lane of it).
template <int kTokensPerScale>
__device__ __forceinline__ void store_scale(const QuantizeParams& p, const RowChunk& r, int chunk, uint32_t amax_bits) {
  if (!r.active || chunk != 0 || r.n % kTokensPerScale != 0) return;
  const int64_t groups = ceil_div(p.seqlen_pad, kTokensPerScale);
  p.scale[(int64_t(r.b) * p.heads + r.h) * groups + r.n / kTokensPerScale] =
      quant::scale_of(__uint_as_float(amax_bits), p.out_scale, amax_bits < quant::kInfBits);
}

// While K's centre is computed (programmatic launch), the blocks of the first wave have loaded their rows and
// wait, and HBM is mostly idle: thread 0 asks L2 for the rows of the block one wave later, so that block reads
// them from L2 once the centre is there. One bulk prefetch of a block's rows, so only where they are one
// contiguous range (rows of exactly D elements, 16-byte aligned).
template <int kHeadDim, typename Elem>
__device__ __forceinline__ void prefetch_block_ahead(const QuantizeParams& p, bool aligned) {
  constexpr int kRows = QuantRowShape<kHeadDim>::kRowsPerBlock;
  if (!p.programmatic_launch || threadIdx.x != 0 || !aligned || p.x_view.row_stride != kHeadDim) return;
  // Blocks start in linear order, x fastest: that order's block one wave (the blocks all SMs hold at once)
  // later. 32 bits hold the index: a block is 64 rows of at least 128 bytes, so 2^32 of them would be 32 TiB.
  const uint32_t per_batch = gridDim.x * gridDim.y;
  const uint32_t ahead =
      blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z) + p.sm_count * QuantRowShape<kHeadDim>::kBlocksPerSm;
  if (ahead >= per_batch * gridDim.z) return;
  const uint32_t in_batch = ahead % per_batch;
  const int b = ahead / per_batch, h = in_batch / gridDim.x, n = (in_batch % gridDim.x) * kRows;
  const int rows = min(kRows, p.seqlen - n);
  if (rows > 0) ptx::prefetch_l2(chunk_ptr<Elem>(p.x, p.x_view, b, h, n, 0), rows * kHeadDim * sizeof(Elem));
}

// Each warp takes kRowIters groups of rows and issues all their loads before quantizing any: a
// memory-bound kernel needs those bytes in flight, and it keeps them as raw 16-byte chunks (4 registers a
// row, against 8 as fp32). The rows are the user's input, so they load before the wait for the
// predecessor (under programmatic launch, while K's centre is still being computed). Packed sequences skip the
// prefetch: the block one wave later is another sequence's, at offsets this block does not know.
template <int kHeadDim, typename Elem, int kTokensPerScale, bool kPartial, bool kPacked, bool kRemedies>
__device__ __forceinline__ void quantize_block(const QuantizeParams& p) {
  using Shape = QuantRowShape<kHeadDim>;
  const int lane = threadIdx.x % 32, chunk = lane % Shape::kLanes;
  const int first_n = (blockIdx.x * Shape::kWarps + threadIdx.x / 32) * Shape::kRowsPerWarpPass + lane / Shape::kLanes;
  RowChunk rows[kRowIters];
  alignas(16) Elem e8[kRowIters][kChunkElems];
#pragma unroll
  for (int it = 0; it < kRowIters; ++it) rows[it] = locate<kHeadDim, kPartial>(p, first_n + it * Shape::kRowsPerWarp, chunk);
  const bool aligned = rows_aligned<Elem>(p.x, p.x_view);
  if (aligned) {
#pragma unroll
    for (int it = 0; it < kRowIters; ++it) load_chunk<true>(p, rows[it], chunk, e8[it]);
  } else {
#pragma unroll
    for (int it = 0; it < kRowIters; ++it) load_chunk<false>(p, rows[it], chunk, e8[it]);
  }
  if constexpr (!kPacked) prefetch_block_ahead<kHeadDim, Elem>(p, aligned);
  ptx::wait_for_predecessor();  // K's centre (a no-op unless launched as its dependent)
  ChannelShift shift{};
  float dot_w[kChunkElems] = {};
#pragma unroll
  for (int e = 0; e < kChunkElems; ++e) shift.scale[e] = 1.f;
  if (chunk < Shape::kChunks) {
    const int b = blockIdx.z, h = blockIdx.y, first = chunk * kChunkElems;
    const int64_t head_row = int64_t(b) * (p.heads / p.head_group) + h / p.head_group;  // of dot_vec, channel_scale
    if (p.mean != nullptr) load_channels(p.mean + (int64_t(b) * p.heads + h) * kHeadDim + first, shift.mean);
    if (kRemedies && p.channel_scale != nullptr) load_channels(p.channel_scale + head_row * kHeadDim + first, shift.scale);
    if (kTokensPerScale == 1 && p.dot_vec != nullptr) load_channels(p.dot_vec + head_row * kHeadDim + first, dot_w);
  }
  if constexpr (kTokensPerScale == 1) {  // per token: one scale per row, over the row's lanes
    uint32_t max_bits[kRowIters];
#pragma unroll
    for (int it = 0; it < kRowIters; ++it) {
      if (p.dot_vec != nullptr) store_row_dot<kHeadDim>(p, rows[it], chunk, e8[it], dot_w);  // uniform
      max_bits[it] = chunk_max_bits(rows[it], e8[it], shift);
    }
#pragma unroll
    for (int it = 0; it < kRowIters; ++it) max_bits[it] = group_reduce<Shape::kLanes>(max_bits[it], quant::UnsignedMax{});
#pragma unroll
    for (int it = 0; it < kRowIters; ++it) {
      const GroupScale g = group_scale(max_bits[it]);
      float x[1][kChunkElems];
      centered_chunk(rows[it], e8[it], shift, x[0]);
      apply_prescale(g, x);
      store_values<kHeadDim>(p, rows[it], chunk, x[0], g);
      store_scale<kTokensPerScale>(p, rows[it], chunk, max_bits[it]);
    }
  } else {  // per key block: one scale for all the thread's rows, whose fp32 values (computed once) replace
            // the raw chunks and the mean in registers
    if (kRemedies && p.query_shift != nullptr) store_key_biases<kHeadDim>(p, rows, chunk, e8, shift.mean);  // uniform
    float x[kRowIters][kChunkElems];
    uint32_t max_bits[kRowIters];
#pragma unroll
    for (int it = 0; it < kRowIters; ++it) {
      centered_chunk(rows[it], e8[it], shift, x[it]);
      max_bits[it] = values_max_bits(x[it]);
    }
    const uint32_t bits = reduce_over_scale_block<kHeadDim>(max_bits);
    const GroupScale g = group_scale(bits);
    apply_prescale(g, x);
#pragma unroll
    for (int it = 0; it < kRowIters; ++it) {
      store_values<kHeadDim>(p, rows[it], chunk, x[it], g);
      store_scale<kTokensPerScale>(p, rows[it], chunk, bits);
    }
  }
}

// All blocks but a head's last hold whole rows of data (and D = 64 / 128 leave no lane idle): they take
// the path without per-row checks, which saves selects on every element of an issue-bound kernel.
template <int kHeadDim, typename Elem, int kTokensPerScale, bool kPacked, bool kRemedies>
__device__ __forceinline__ void quantize_rows(const QuantizeParams& p) {
  using Shape = QuantRowShape<kHeadDim>;
  const bool whole = Shape::kChunks == Shape::kLanes && (blockIdx.x + 1) * Shape::kRowsPerBlock <= p.seqlen;
  ptx::allow_dependents();  // the attention kernel may take the SMs this grid's last wave frees
  if (whole) {
    quantize_block<kHeadDim, Elem, kTokensPerScale, false, kPacked, kRemedies>(p);
  } else {
    quantize_block<kHeadDim, Elem, kTokensPerScale, true, kPacked, kRemedies>(p);
  }
}

// kRemedies: channel balancing's factors or Q smoothing's key biases may be given (QuantizeParams); without them the
// instance carries none of their multiplies and branches, which an issue-bound kernel would pay for.
template <int kHeadDim, typename Elem, int kTokensPerScale, bool kPacked, bool kRemedies>
__global__ void __launch_bounds__(QuantRowShape<kHeadDim>::kThreads, QuantRowShape<kHeadDim>::kBlocksPerSm)
    quantize_kernel(const QuantizeParams p, const PackedSequences packed) {
  if constexpr (kPacked) {  // one block of rows per sequence, as long as the longest
    quantize_rows<kHeadDim, Elem, kTokensPerScale, true, kRemedies>(narrow_rows_to_sequence<Elem>(p, packed, blockIdx.z));
  } else {
    quantize_rows<kHeadDim, Elem, kTokensPerScale, false, kRemedies>(p);
  }
}

// A reduction of the centre kernel's sample rows `use` per channel: value(i, e) of the thread's row i and channel
// chunk * 8 + e, combined with op (whose identity is T{}) over the thread's rows, then over the row groups through
// shared memory, so that thread d < kHeadDim returns channel d's result.
template <int kHeadDim, int kRowGroups, int kRows, typename T, typename Value, typename Op>
__device__ __forceinline__ T channel_reduce(const bool (&use)[kRows], T (&group_acc)[kRowGroups][kHeadDim], Value value,
                                            Op op) {
  using Shape = QuantRowShape<kHeadDim>;
  const int chunk = threadIdx.x % Shape::kLanes, group = threadIdx.x / Shape::kLanes;
  T acc[kChunkElems] = {};
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e)
      if (use[i]) acc[e] = op(acc[e], value(i, e));
  if (chunk < Shape::kChunks) {
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) group_acc[group][chunk * kChunkElems + e] = acc[e];
  }
  __syncthreads();
  T total{};
  if (threadIdx.x < kHeadDim) {
#pragma unroll 8
    for (int g = 0; g < kRowGroups; ++g) total = op(total, group_acc[g][threadIdx.x]);
  }
  __syncthreads();  // group_acc is reused
  return total;
}

// The centre's fp64 sums of the sample rows `use`, per channel. Exact for fp16 data (KeyCenterParams): the order of
// the additions does not change the result.
template <int kHeadDim, int kRowGroups, int kRows, typename Elem>
__device__ __forceinline__ double channel_total(const Elem (&e8)[kRows][kChunkElems], const bool (&use)[kRows],
                                                double (&group_sums)[kRowGroups][kHeadDim]) {
  return channel_reduce<kHeadDim>(use, group_sums, [&](int i, int e) { return double(to_float(e8[i][e])); },
                                  [](double a, double b) { return a + b; });
}

// Channel balancing's factor of one channel from Q's and K's ranges (KeyCenterParams).
__device__ __forceinline__ float balance_factor(float q_range, float k_range) {
  const float s = sqrtf(k_range / q_range);
  return isfinite(s) && s > 0.f && (s >= kBalanceMinFactor || s <= 1.f / kBalanceMinFactor) ? s : 1.f;
}

// The channel ranges max |x_d - center_d| over the sample rows `use`, as |x| bits (whose unsigned max propagates
// NaN), per channel.
template <int kHeadDim, int kRowGroups, int kRows, typename Elem>
__device__ __forceinline__ uint32_t channel_range_bits(const Elem (&e8)[kRows][kChunkElems], const bool (&use)[kRows],
                                                       const float* center,
                                                       uint32_t (&group_bits)[kRowGroups][kHeadDim]) {
  const int first = threadIdx.x % QuantRowShape<kHeadDim>::kLanes * kChunkElems;
  return channel_reduce<kHeadDim>(
      use, group_bits, [&](int i, int e) { return quant::abs_bits(to_float(e8[i][e]) - center[first + e]); },
      quant::UnsignedMax{});
}

// K's smoothing centre (KeyCenterParams), one block per head. The sample rows spread over groups of kLanes
// lanes as in the quantizer; each thread keeps its rows' raw chunks for the passes over them: the plain
// mean, each row's distance from it, and the sum of the rows left out, which the total less it gives the
// kept rows' sum (a second pass over all rows only where a total is not finite); then, for channel balancing,
// the channel ranges about the centre. Returns channel threadIdx.x's range as |x| bits (0 without balancing).
template <int kHeadDim, typename Elem, bool kRemedies>
__device__ __forceinline__ uint32_t key_center_block(const KeyCenterParams& p) {
  using Shape = QuantRowShape<kHeadDim>;
  constexpr int kRowGroups = kCenterThreads / Shape::kLanes;
  constexpr int kRows = kCenterSampleKeys / kRowGroups;  // a thread's sample rows: group + kRowGroups * i
  __shared__ double group_sums[kRowGroups][kHeadDim];
  __shared__ float plain_mean[kHeadDim];
  __shared__ alignas(16) uint32_t distance_bits[kCenterSampleKeys];
  __shared__ bool kept_row[kCenterSampleKeys];
  const int b = blockIdx.z, h = blockIdx.y, chunk = threadIdx.x % Shape::kLanes, group = threadIdx.x / Shape::kLanes;
  const int n = min(p.seqlen, kCenterSampleKeys), trim = n / kCenterTrimDivisor;
  const bool aligned = rows_aligned<Elem>(p.x, p.x_view);
  alignas(16) Elem e8[kRows][kChunkElems];
  bool use[kRows], sampled[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {  // idle lanes (D = 96) take no part
    const int row = group + kRowGroups * i;
    use[i] = sampled[i] = row < n && chunk < Shape::kChunks;
    if (use[i]) {
      const Elem* x = chunk_ptr<Elem>(p.x, p.x_view, b, h, int(center_sample_key(row, p.seqlen)), chunk);
      if (aligned) {
        load8<true>(x, e8[i]);
      } else {
        load8<false>(x, e8[i]);
      }
    }
  }
  const double total = channel_total(e8, use, group_sums);
  if (threadIdx.x < kHeadDim) plain_mean[threadIdx.x] = __double2float_rn(total / n);
  if (threadIdx.x < kCenterSampleKeys) distance_bits[threadIdx.x] = ~0u;  // past n: never closer than a row
  __syncthreads();

  // Distance of each row from the plain mean: max_d |k_d - m0_d| in fp32 as |x| bits, whose unsigned max
  // is the float max with NaN above infinity (NaN propagates, as in reference.py's amax).
  float m0[kChunkElems] = {};
  if (chunk < Shape::kChunks) {
#pragma unroll
    for (int e = 0; e < kChunkElems; ++e) m0[e] = plain_mean[chunk * kChunkElems + e];
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    uint32_t bits = 0;
    if (use[i]) {
#pragma unroll
      for (int e = 0; e < kChunkElems; ++e) bits = max(bits, quant::abs_bits(to_float(e8[i][e]) - m0[e]));
    }
    bits = group_reduce<Shape::kLanes>(bits, quant::UnsignedMax{});
    if (use[i] && chunk == 0) distance_bits[group + kRowGroups * i] = bits;
  }
  __syncthreads();

  // Thread t < n ranks sample row t: kept if fewer than n - trim rows lie strictly closer, i.e. its distance
  // is at most the (n - trim)-th smallest. NaN distances sort last; more of them than `trim` leave no row.
  const bool ranks = threadIdx.x < n;
  const uint32_t own = ranks ? distance_bits[threadIdx.x] : 0;
  const int nan_rows = __syncthreads_count(ranks && own > quant::kInfBits);
  int closer = 0;
#pragma unroll 8
  for (int j = 0; j < kCenterSampleKeys; j += 4) {
    const uint4 d4 = *reinterpret_cast<const uint4*>(&distance_bits[j]);
    closer += (d4.x < own) + (d4.y < own) + (d4.z < own) + (d4.w < own);
  }
  const bool kept = ranks && nan_rows <= trim && closer < n - trim;
  if (threadIdx.x < kCenterSampleKeys) kept_row[threadIdx.x] = kept;
  const int kept_rows = __syncthreads_count(kept);

  // The kept rows' sum: the total less the rows left out (none of them in most threads), unless a total
  // is not finite: an infinity left out must not stay in the sum.
  bool left_out[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) left_out[i] = use[i] && !kept_row[group + kRowGroups * i];
  const bool finite_totals = !__syncthreads_or(threadIdx.x < kHeadDim && !isfinite(total));
  double kept_sum;
  if (finite_totals) {
    kept_sum = total - channel_total(e8, left_out, group_sums);
  } else {
#pragma unroll
    for (int i = 0; i < kRows; ++i) use[i] = use[i] && !left_out[i];
    kept_sum = channel_total(e8, use, group_sums);
  }
  const int64_t out = (int64_t(b) * p.heads + h) * kHeadDim + threadIdx.x;
  const float center = threadIdx.x < kHeadDim ? __double2float_rn(kept_sum / kept_rows) : 0.f;  // 0 / 0 = NaN: none kept
  if (threadIdx.x < kHeadDim) p.center[out] = center;
  if (!kRemedies || p.channel_range == nullptr) return 0;
  if (threadIdx.x < kHeadDim) plain_mean[threadIdx.x] = center;  // read last before the distances' barrier
  __syncthreads();
  uint32_t range = channel_range_bits(e8, sampled, plain_mean,
                                      *reinterpret_cast<uint32_t(*)[kRowGroups][kHeadDim]>(&group_sums));
  if (p.seqlen < kCenterSampleKeys) range = 0;  // too few rows to tell an outlier channel from noise: no factors
  if (threadIdx.x < kHeadDim) p.channel_range[out] = __uint_as_float(range);
  return range;
}

// K's launch with Q's ranges: thread d < kHeadDim writes channel d's balancing factors, from its K range (|x| bits).
template <int kHeadDim>
__device__ __forceinline__ void store_balance(const KeyCenterParams& p, int64_t head, uint32_t k_range_bits) {
  if (threadIdx.x >= kHeadDim) return;
  uint32_t q_range_bits = 0;
  for (int g = 0; g < p.query_group; ++g)
    q_range_bits = max(q_range_bits, __float_as_uint(p.query_range[(head * p.query_group + g) * kHeadDim + threadIdx.x]));
  const float s = balance_factor(__uint_as_float(q_range_bits), __uint_as_float(k_range_bits));
  p.balance[head * kHeadDim + threadIdx.x] = s;
  p.balance_inverse[head * kHeadDim + threadIdx.x] = 1.f / s;
}

// K's launch with Q's centres and ranges: warp w decides Q smoothing for query heads w, w + warps, .. of this K/V head
// (query_smoothing_pays) and writes their flags and shifts.
template <int kHeadDim>
__device__ __forceinline__ void store_query_shifts(const KeyCenterParams& p, int64_t head) {
  constexpr int kWarps = kCenterThreads / 32;
  const int lane = threadIdx.x % 32;
  for (int g = threadIdx.x / 32; g < p.query_group; g += kWarps) {
    const int64_t q_head = head * p.query_group + g;
    const float* center = p.query_center + q_head * kHeadDim;
    uint32_t offset_bits = 0, spread_bits = 0;  // |x| bits: their unsigned max is the float max, NaN above all
    for (int d = lane; d < kHeadDim; d += 32) {
      offset_bits = max(offset_bits, quant::abs_bits(center[d]));
      spread_bits = max(spread_bits, __float_as_uint(p.query_range[q_head * kHeadDim + d]));
    }
    offset_bits = group_reduce<32>(offset_bits, quant::UnsignedMax{});
    spread_bits = group_reduce<32>(spread_bits, quant::UnsignedMax{});
    const bool smoothed = query_smoothing_pays(__uint_as_float(offset_bits), __uint_as_float(spread_bits));
    for (int d = lane; d < kHeadDim; d += 32) p.query_shift[q_head * kHeadDim + d] = smoothed ? center[d] : 0.f;
    if (lane == 0) p.query_smoothed[q_head] = smoothed;
  }
}

// What K's launch derives from Q's (balancing factors, Q smoothing), once Q's launch is done.
template <int kHeadDim>
__device__ __forceinline__ void store_query_factors(const KeyCenterParams& p, uint32_t k_range_bits) {
  if (p.query_range == nullptr) return;
  ptx::wait_for_predecessor();  // Q's centres and ranges (a no-op unless launched as the dependent of Q's launch)
  const int64_t head = int64_t(blockIdx.z) * p.heads + blockIdx.y;
  if (p.balance != nullptr) store_balance<kHeadDim>(p, head, k_range_bits);
  if (p.query_center != nullptr) store_query_shifts<kHeadDim>(p, head);
}

// kRemedies: the launch computes channel ranges or reads Q's (KeyCenterParams); the plain K centre's instance keeps no
// sample rows live for a range pass and has no branch to one.
template <int kHeadDim, typename Elem, bool kPacked, bool kRemedies>
__global__ void __launch_bounds__(kCenterThreads, 1)
    key_center_kernel(const KeyCenterParams p, const PackedSequences packed) {
  ptx::allow_dependents();  // K's launch after Q's, or the K quantizer, launches now and loads its rows while this runs
  uint32_t range_bits = 0;
  if constexpr (kPacked) {
    const KeyCenterParams sequence = narrow_rows_to_sequence<Elem>(p, packed, blockIdx.z);
    if (sequence.seqlen > 0) {
      range_bits = key_center_block<kHeadDim, Elem, kRemedies>(sequence);
    } else if (threadIdx.x < kHeadDim) {  // no row: nothing to centre, nothing the centre could move, no range
      const int64_t out = (int64_t(blockIdx.z) * p.heads + blockIdx.y) * kHeadDim + threadIdx.x;
      p.center[out] = 0.f;
      if (kRemedies && p.channel_range != nullptr) p.channel_range[out] = 0.f;
    }
  } else {
    range_bits = key_center_block<kHeadDim, Elem, kRemedies>(p);
  }
  if constexpr (kRemedies) store_query_factors<kHeadDim>(p, range_bits);
}

}  // namespace

cudaError_t launch_key_center(const KeyCenterParams& p, const PackedSequences& packed, cudaStream_t stream) {
  if (int64_t(p.batch) * p.heads == 0 || p.seqlen == 0) return cudaErrorInvalidValue;
  if (p.batch > 65535 || p.heads > 65535) return cudaErrorInvalidConfiguration;  // gridDim.z / gridDim.y
  return dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    return dispatch_elem(p.dtype, [&](auto elem) {
      return dispatch_packed(packed, [&](auto is_packed) {
        return dispatch_bool(p.channel_range != nullptr || p.query_range != nullptr, [&](auto remedies) {
          return launch(key_center_kernel<decltype(head_dim)::value, decltype(elem), decltype(is_packed)::value,
                                          decltype(remedies)::value>,
                        dim3(1, p.heads, p.batch), kCenterThreads, 0, stream, p.programmatic_launch, p, packed);
        });
      });
    });
  });
}

cudaError_t launch_quantize(const QuantizeParams& p, const PackedSequences& packed, cudaStream_t stream) {
  if (int64_t(p.batch) * p.heads * p.seqlen_pad == 0) return cudaSuccess;
  if (p.tokens_per_scale != 1 && p.tokens_per_scale != kKeyScaleTokens) return cudaErrorInvalidValue;
  if (p.tokens_per_scale != 1 && p.dot_vec != nullptr) return cudaErrorInvalidValue;  // row_dot is per token
  if (p.tokens_per_scale == 1 && p.query_shift != nullptr) return cudaErrorInvalidValue;  // key biases are K's
  if (p.batch > 65535 || p.heads > 65535) return cudaErrorInvalidConfiguration;  // gridDim.z / gridDim.y
  return dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    const dim3 grid(ceil_div(p.seqlen_pad, QuantRowShape<kHeadDim>::kRowsPerBlock), p.heads, p.batch);
    return dispatch_elem(p.dtype, [&](auto elem) {
      return dispatch_packed(packed, [&](auto is_packed) {
        return dispatch_bool(p.channel_scale != nullptr || p.query_shift != nullptr, [&](auto remedies) {
          using Elem = decltype(elem);
          constexpr bool kPacked = decltype(is_packed)::value, kRemedies = decltype(remedies)::value;
          const auto kernel = p.tokens_per_scale == 1
                                  ? quantize_kernel<kHeadDim, Elem, 1, kPacked, kRemedies>
                                  : quantize_kernel<kHeadDim, Elem, kKeyScaleTokens, kPacked, kRemedies>;
          return launch(kernel, grid, QuantRowShape<kHeadDim>::kThreads, 0, stream, p.programmatic_launch, p, packed);
        });
      });
    });
  });
}

}  // namespace attention_int8
