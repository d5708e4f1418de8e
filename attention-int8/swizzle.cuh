// The K-major swizzled shared-memory layout of Hopper's wgmma (and of TMA's swizzle modes): the
// quantizer writes INT8 K rows in this order to global memory, and the Hopper kernel copies them
// verbatim into shared memory, where its wgmma descriptors (wgmma.cuh) expect this layout.
//
// A tile of rows whose K extent is kRowBytes (64 or 128) is stored row after row; the 16-byte chunk c
// of row r sits at chunk position c ^ phase(r), where the phase cycles over the rows of one
// 512- or 1024-byte swizzle atom (8 rows). The XOR spreads the 8 rows of a core matrix, which the
// tensor cores read at one K offset, over distinct banks.
#pragma once

namespace attention_int8 {
namespace swizzle {

// Swizzle<log2(kRowBytes / 16), 4, 3>: byte-address bits 7.. (the row within the atom, in 128-byte
// units) XORed into bits 4.. (the 16-byte chunk).
template <int kRowBytes>
__host__ __device__ __forceinline__ constexpr int chunk_position(int row, int chunk) {
  static_assert(kRowBytes == 64 || kRowBytes == 128, "wgmma's K-major swizzle atoms are 64 or 128 bytes wide here");
  return chunk ^ ((row * kRowBytes / 128) % (kRowBytes / 16));
}

}  // namespace swizzle
}  // namespace attention_int8
