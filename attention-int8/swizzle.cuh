// The K-major swizzled shared-memory layout of Hopper's wgmma (and of TMA's swizzle modes): the
// quantizer writes INT8 K rows in this order to global memory, and the Hopper kernel copies them
// verbatim into shared memory, where its wgmma descriptors (wgmma.cuh) expect this layout.
//
// A tile of rows whose K extent is kRowBytes (64 or 128) is stored row after row; the 16-byte chunk c
// of row r sits at chunk position c ^ phase(r), where the phase cycles over the rows of one
// 512- or 1024-byte swizzle atom (8 rows). The XOR spreads the 8 rows of a core matrix, which the
// tensor cores read at one K offset, over distinct banks. Rows of 256 bytes are wider than any swizzle
// atom: a tile of them is two 128-byte panels, all its rows' first halves and then their second halves,
// and a wgmma's 32-byte K step never crosses a panel.
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

// The swizzle width of K-major rows of kRowBytes: one row, or a 128-byte panel of a 256-byte row.
template <int kRowBytes>
constexpr int kAtomRowBytes = kRowBytes < 128 ? kRowBytes : 128;

// Where 16-byte chunk `chunk` of row `row` lies in a K-major image of kRowBytes-wide rows, relative to the row's
// unswizzled start row * kRowBytes (so rows up to 128 bytes only move within themselves); 256-byte rows are
// panelled per tile of kTileRows rows, which starts on a multiple of kTileRows.
template <int kRowBytes, int kTileRows>
__host__ __device__ __forceinline__ constexpr int chunk_offset(int row, int chunk) {
  static_assert(kRowBytes <= 128 || kRowBytes == 256, "rows of 64, 128 or 256 bytes");
  if constexpr (kRowBytes <= 128) {
    return chunk_position<kRowBytes>(row, chunk) * 16;
  } else {
    constexpr int kAtom = kAtomRowBytes<kRowBytes>, kAtomChunks = kAtom / 16;
    const int row_in_tile = row % kTileRows;
    return chunk / kAtomChunks * kTileRows * kAtom + row_in_tile * (kAtom - kRowBytes) +
           chunk_position<kAtom>(row, chunk % kAtomChunks) * 16;
  }
}

}  // namespace swizzle
}  // namespace attention_int8
