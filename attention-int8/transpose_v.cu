// V [B, H, N, D] (any row/head/batch strides) -> V^T [B, H, D, n_pad], keys [N, n_pad) zero-filled.
// The sm90 kernel's P.V wgmma reads its B operand K-major (keys contiguous) from shared memory, so V
// is transposed once here, through a shared-memory tile so that both the reads (along D) and the
// writes (along N) are coalesced. Zero padding matters: P is 0 there, but 0 * NaN garbage would not be.
// The copy moves 16-bit words, so one kernel serves fp16 and bf16 (all-zero bits are +0 in both).
#include <cstdint>

#include "attention_int8.h"

namespace attention_int8 {
namespace {

constexpr int kTile = 32;      // 32 x 32 elements per block
constexpr int kTileRows = 8;   // blockDim = (32, 8): each thread moves 4 elements

__global__ void __launch_bounds__(kTile * kTileRows) transpose_v_kernel(const TransposeParams p) {
  __shared__ uint16_t tile[kTile][kTile + 1];  // +1: column reads hit 32 distinct banks
  const int n0 = blockIdx.x * kTile, d0 = blockIdx.y * kTile;
  const int64_t bh = blockIdx.z, b = bh / p.heads, h = bh % p.heads;
  const uint16_t* v = static_cast<const uint16_t*>(p.v) + b * p.v_view.batch_stride + h * p.v_view.head_stride;
  uint16_t* v_t = static_cast<uint16_t*>(p.v_t) + bh * p.head_dim * int64_t(p.seqlen_pad);

  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int n = n0 + i;
    tile[i][threadIdx.x] = n < p.seqlen ? v[int64_t(n) * p.v_view.row_stride + d0 + threadIdx.x] : uint16_t(0);
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kTileRows)
    v_t[int64_t(d0 + i) * p.seqlen_pad + n0 + threadIdx.x] = tile[threadIdx.x][i];
}

}  // namespace

cudaError_t launch_transpose_v(const TransposeParams& p, cudaStream_t stream) {
  if (int64_t(p.batch) * p.heads == 0 || p.seqlen_pad == 0) return cudaSuccess;
  if (p.seqlen_pad % kTile != 0 || p.head_dim % kTile != 0 || int64_t(p.batch) * p.heads > 65535)
    return cudaErrorInvalidValue;
  const dim3 grid(p.seqlen_pad / kTile, p.head_dim / kTile, p.batch * p.heads);
  transpose_v_kernel<<<grid, dim3(kTile, kTileRows), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attention_int8
