// V [B, H, N, D] (any row/head/batch strides) -> V^T tiles [B, H, n_pad / 64, D, 64] in the sm90
// kernel's shared-memory image (attention_int8.h), keys [N, n_pad) zero-filled. The P.V wgmma reads
// its B operand K-major (keys contiguous), so V is transposed once here, through a shared-memory tile
// so that both the reads (along D) and the writes (128-byte rows of keys) are coalesced. Zero padding
// matters: P is 0 there, but 0 * NaN garbage would not be. The copy moves 16-bit words, so one kernel
// serves fp16 and bf16 (all-zero bits are +0 in both).
#include <algorithm>
#include <cstdint>

#include "attention_int8.h"

namespace attention_int8 {
namespace {

constexpr int kTile = 64;  // 64 keys x 64 channels per block
static_assert(kTile * sizeof(uint16_t) == 128, "a V^T tile row of 64 keys is one 128-byte swizzle row");
constexpr int kChunk = 8;  // 16-bit elements per 16-byte access
constexpr int kChunksPerRow = kTile / kChunk;
constexpr int kThreads = 256;
constexpr int kPasses = kTile * kChunksPerRow / kThreads;  // 16-byte chunks each thread moves, in and out

// One tile: every thread reads kPasses 16-byte chunks of V rows (8 channels of one key) and writes
// kPasses 16-byte chunks of V^T rows (8 keys of one channel), at the chunk position c ^ (d % 8) of
// the swizzle. kVector = false reads element by element, for views whose rows are not 16-byte aligned.
template <bool kVector>
__device__ __forceinline__ void transpose_tile(const TransposeParams& p, int64_t bh, int n0, int d0) {
  __shared__ uint16_t tile[kTile][kTile + 2];  // +2 (one 4-byte bank): column reads spread over banks
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const uint16_t* v = static_cast<const uint16_t*>(p.v) + b * p.v_view.batch_stride + h * p.v_view.head_stride;
  // This block's 64 keys are one V^T tile: D rows of 64 keys.
  uint16_t* v_t = static_cast<uint16_t*>(p.v_t) + (bh * p.seqlen_pad + n0) * p.head_dim;
  __syncthreads();  // the previous (batch, head) of this block is done reading the tile
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int chunk = threadIdx.x + pass * kThreads, key = chunk / kChunksPerRow, c = chunk % kChunksPerRow;
    const int n = n0 + key;
    alignas(16) uint16_t e[kChunk] = {};
    if (n < p.seqlen) {
      const uint16_t* src = v + int64_t(n) * p.v_view.row_stride + d0 + c * kChunk;
      if constexpr (kVector) {
        *reinterpret_cast<uint4*>(e) = *reinterpret_cast<const uint4*>(src);
      } else {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) e[i] = src[i];
      }
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) tile[key][c * kChunk + i] = e[i];
  }
  __syncthreads();
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int chunk = threadIdx.x + pass * kThreads, d = chunk / kChunksPerRow, c = chunk % kChunksPerRow;
    alignas(16) uint16_t e[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) e[i] = tile[c * kChunk + i][d];
    const int row = d0 + d;
    *reinterpret_cast<uint4*>(v_t + row * kTile + (c ^ (row % 8)) * kChunk) = *reinterpret_cast<const uint4*>(e);
  }
}

template <bool kVector>
__global__ void __launch_bounds__(kThreads) transpose_v_kernel(const TransposeParams p) {
  const int n0 = blockIdx.x * kTile, d0 = blockIdx.y * kTile;
  // B * H can exceed gridDim.z's 65535: the z blocks stride over (batch, head).
  for (int64_t bh = blockIdx.z; bh < int64_t(p.batch) * p.heads; bh += gridDim.z) {
    transpose_tile<kVector>(p, bh, n0, d0);
  }
}

}  // namespace

cudaError_t launch_transpose_v(const TransposeParams& p, cudaStream_t stream) {
  if (int64_t(p.batch) * p.heads == 0 || p.seqlen_pad == 0) return cudaSuccess;
  if (p.seqlen_pad % kTile != 0 || p.head_dim % kTile != 0 || p.seqlen_pad / kTile > 0x7fffffff)
    return cudaErrorInvalidValue;
  const int64_t heads = int64_t(p.batch) * p.heads;  // gridDim.z is capped; the kernel strides over the rest
  const dim3 grid(p.seqlen_pad / kTile, p.head_dim / kTile, static_cast<unsigned>(std::min<int64_t>(heads, 65535)));
  const bool aligned = reinterpret_cast<uintptr_t>(p.v) % 16 == 0 && p.v_view.batch_stride % kChunk == 0 &&
                       p.v_view.head_stride % kChunk == 0 && p.v_view.row_stride % kChunk == 0;
  if (aligned) {
    transpose_v_kernel<true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    transpose_v_kernel<false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace attention_int8
