// Per-token symmetric INT8 quantization of Q and K (see QuantizeParams in attention_int8.h).
//
// Why per token: the logit S[i,j] = q_i . k_j is then dequantized with exactly the scales of the two
// rows it came from, s_q[i] * s_k[j], so no tile ever mixes scales (the original kernel's bug), and one
// outlier token costs precision only in its own row. Why symmetric [-127, 127]: zero maps to zero and
// the range is the same on both sides, so x_q * scale is an unbiased reconstruction.
// K arrives with its token mean subtracted (smoothing): channel-wise offsets shared by all keys would
// otherwise dominate amax and leave few INT8 levels for the part of K that differs between keys.
#include <cmath>
#include <cstdint>

#include "attention_int8.h"
#include "dispatch.cuh"

namespace attention_int8 {
namespace {

constexpr int kQuantRowsPerBlock = 8;  // one warp per token row
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <int kHeadDim, typename Elem>
__global__ void __launch_bounds__(kQuantRowsPerBlock * 32) quantize_per_token_kernel(const QuantizeParams p) {
  constexpr int kPerLane = kHeadDim / 32;  // lane l holds columns l, l + 32, ...: coalesced per step
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kQuantRowsPerBlock + threadIdx.x / 32;  // over [B, H, seqlen_pad]
  if (row >= int64_t(p.batch) * p.heads * p.seqlen_pad) return;

  const int n = static_cast<int>(row % p.seqlen_pad);
  const int64_t bh = row / p.seqlen_pad;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  int8_t* x_q = p.x_q + row * kHeadDim;

  if (n >= p.seqlen) {  // padding rows: zero values and zero scale, so they contribute nothing
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x_q[i * 32 + lane] = 0;
    if (lane == 0) p.scale[row] = 0.f;
    return;
  }

  const Elem* x = static_cast<const Elem*>(p.x) + b * p.x_view.batch_stride + h * p.x_view.head_stride +
                  int64_t(n) * p.x_view.row_stride;
  const float* mean = p.mean == nullptr ? nullptr : p.mean + bh * kHeadDim;

  float v[kPerLane];
  float amax = 0.f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = i * 32 + lane;
    v[i] = to_float(x[d]);
    if (mean != nullptr) v[i] -= mean[d];
    amax = fmaxf(amax, fabsf(v[i]));
    finite = finite && isfinite(v[i]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
  finite = __all_sync(kFullMask, finite);

  // IEEE fp32 division and round-half-even: the PyTorch reference reproduces these bit for bit.
  const float inv_scale = amax > 0.f ? 127.f / amax : 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int q = __float2int_rn(v[i] * inv_scale);
    x_q[i * 32 + lane] = static_cast<int8_t>(max(-127, min(127, q)));
  }
  // A non-finite input poisons the row's scale so NaN reaches the output instead of being clamped away.
  if (lane == 0) p.scale[row] = finite ? amax / 127.f * p.out_scale : NAN;
}

}  // namespace

cudaError_t launch_quantize_per_token(const QuantizeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.heads * p.seqlen_pad;
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kQuantRowsPerBlock - 1) / kQuantRowsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    return dispatch_elem(p.dtype, [&](auto elem) {
      using Elem = decltype(elem);
      quantize_per_token_kernel<decltype(head_dim)::value, Elem>
          <<<static_cast<unsigned>(blocks), kQuantRowsPerBlock * 32, 0, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

}  // namespace attention_int8
