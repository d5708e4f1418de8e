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

constexpr int kTile = 64;      // 64 x 64 elements per block ...
static_assert(kTile * sizeof(uint16_t) == 128, "a V^T tile row of 64 keys is one 128-byte swizzle row");
constexpr int kTileRows = 8;   // ... moved by 32 x 8 threads, 16 elements each: enough bytes in flight

// Position of key c (0..63) in row d of a V^T tile: 16-byte chunk c / 8 moves to (c / 8) ^ (d % 8).
__device__ __forceinline__ int swizzled_key(int d, int c) { return (((c / 8) ^ (d % 8)) * 8) + c % 8; }

__device__ __forceinline__ void transpose_tile(const TransposeParams& p, int64_t bh, int n0, int d0) {
  __shared__ uint16_t tile[kTile][kTile + 2];  // +2 (one 4-byte bank): column reads hit distinct banks
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const uint16_t* v = static_cast<const uint16_t*>(p.v) + b * p.v_view.batch_stride + h * p.v_view.head_stride;
  // This block's 64 keys are one V^T tile: D rows of 64 keys.
  uint16_t* v_t = static_cast<uint16_t*>(p.v_t) + (bh * p.seqlen_pad + n0) * p.head_dim;
  __syncthreads();  // the previous (batch, head) of this block is done reading the tile
#pragma unroll
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int n = n0 + i;
#pragma unroll
    for (int c = threadIdx.x; c < kTile; c += 32)
      tile[i][c] = n < p.seqlen ? v[int64_t(n) * p.v_view.row_stride + d0 + c] : uint16_t(0);
  }
  __syncthreads();
#pragma unroll
  for (int i = threadIdx.y; i < kTile; i += kTileRows)
#pragma unroll
    for (int c = threadIdx.x; c < kTile; c += 32) v_t[(d0 + i) * kTile + swizzled_key(d0 + i, c)] = tile[c][i];
}

__global__ void __launch_bounds__(32 * kTileRows) transpose_v_kernel(const TransposeParams p) {
  const int n0 = blockIdx.x * kTile, d0 = blockIdx.y * kTile;
  // B * H can exceed gridDim.z's 65535: the z blocks stride over (batch, head).
  for (int64_t bh = blockIdx.z; bh < int64_t(p.batch) * p.heads; bh += gridDim.z) {
    transpose_tile(p, bh, n0, d0);
  }
}

}  // namespace

cudaError_t launch_transpose_v(const TransposeParams& p, cudaStream_t stream) {
  if (int64_t(p.batch) * p.heads == 0 || p.seqlen_pad == 0) return cudaSuccess;
  if (p.seqlen_pad % kTile != 0 || p.head_dim % kTile != 0 || p.seqlen_pad / kTile > 0x7fffffff)
    return cudaErrorInvalidValue;
  const int64_t heads = int64_t(p.batch) * p.heads;  // gridDim.z is capped; the kernel strides over the rest
  const dim3 grid(p.seqlen_pad / kTile, p.head_dim / kTile, static_cast<unsigned>(std::min<int64_t>(heads, 65535)));
  transpose_v_kernel<<<grid, dim3(32, kTileRows), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attention_int8
