// The Hopper kernel's online softmax, per consumer thread over its two accumulator rows: the mask on S, the tile
// max on the integer logits, the lazy running max, the exponentials, and the rescale of O.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "ptx.cuh"
#include "quant_math.cuh"
#include "wgmma.cuh"

namespace attention_int8 {

// v[0] = the max of v[0 .. kWidth), in a tree of three-input maxima (one VIMNMX3 each on sm_90): a width of n
// takes about n / 2 instructions in log3(n) levels, where two-input maxima take n - 1 in log2(n).
template <int kWidth>
__device__ __forceinline__ void fold_thirds(int32_t* v) {
  if constexpr (kWidth == 2) {
    v[0] = max(v[0], v[1]);
  } else if constexpr (kWidth > 2) {
#pragma unroll
    for (int i = 0; i < kWidth / 3; ++i) v[i] = __vimax3_s32(v[3 * i], v[3 * i + 1], v[3 * i + 2]);
#pragma unroll
    for (int j = 0; j < kWidth % 3; ++j) v[kWidth / 3 + j] = v[kWidth / 3 * 3 + j];
    fold_thirds<kWidth / 3 + kWidth % 3>(v);
  }
}

// The max of row r's accumulator registers (2r + 4c and 2r + 4c + 1) of an m64nN int32 fragment (N / 4 of them).
template <int r, int kRegs>
__device__ __forceinline__ int32_t accumulator_row_max(const int32_t (&s)[kRegs]) {
  int32_t v[kRegs / 2];
#pragma unroll
  for (int c = 0; c < kRegs / 4; ++c) v[2 * c] = s[2 * r + 4 * c], v[2 * c + 1] = s[2 * r + 4 * c + 1];
  fold_thirds<kRegs / 2>(v);
  return v[0];
}

// Below any S: a masked logit only ever meets the tile max.
constexpr int32_t kMaskedLogit = INT32_MIN;

// Masks the logits of keys that rows[] do not see (key_hidden), in a tile whose first key is key0.
template <int kSRegs>
__device__ __forceinline__ void mask_logits(const AttentionParams& p, int32_t (&s_int)[kSRegs], int key0,
                                            const int (&rows)[2]) {
#pragma unroll
  for (int i = 0; i < kSRegs; ++i)
    if (key_hidden(p, key0 + wgmma::accumulator_col(i), rows[wgmma::accumulator_row(i)])) s_int[i] = kMaskedLogit;
}

// Online softmax in base 2 with a lazy maximum: the running max m only moves when a tile's max exceeds it by more
// than kRescaleSlack, so P = 2^(l - m) <= 2^kRescaleSlack stays well inside fp16/bf16 and the fp32 sums, and O
// with its sums is rescaled only in the rare tiles where m moved. The sums add the fp16/bf16 P that multiplies V
// (the sum columns of P.V).
//
// All logits a thread holds of one row share one scale c (the row's against this key block, quant_math.cuh), so
// the tile max is taken on the exact integers S, and each exponent is one FMA:
//   l - m = (S - S_max) * c + (t - m),   t = S_max * c (rounded) the tile max, the row's logit max here.
// S - S_max is exact (an integer add, then 1.5 * 2^23 + (S - S_max) is that float exactly, see
// ptx::SmallIntScale), and so is -1.5 * 2^23 * c; the FMA rounds once. At the tile holding the row's max,
// t - m = 0 and P of the max is exactly 1, even at the ~1e10 logits of fp16 extremes, where rounding the max's
// logit on its own would leave a residual of 2^13 in the exponent. In other tiles, t - m rides on
// -1.5 * 2^23 * c and is resolved to within 0.75 c, one integer step of S: negligible at ordinary logits
// (c ~ 1e-5), but at fp16 extremes (c ~ 1e4) a key less than a step below the row's max may weigh 1 instead of
// 2^-gap ~ 0, well inside the INT8 logits' own uncertainty of many steps. Where S - S_max can exceed 2^22 in
// magnitude (D' = 256, Traits::kGapFitsMagic), its float comes from the conversion unit instead, exact below
// 2^24, and the FMA's addend is t - m alone, which makes the other tiles' exponents exact too.
// Maxima are balanced trees, both rows side by side: while the other warpgroups' wgmmas run, this warp is often
// its scheduler's only eligible one.
//
// A tile's exponent for the thread's two rows: the logit scale c, the FMA's bias, the rescale factor of O, and
// magic - S_max (S plus this is the bit pattern of 1.5 * 2^23 + (S - S_max); -S_max without the magic). A value of
// one step, so that its registers are free once the step's exponentials are done.
struct TileExponent {
  float c[2], bias[2], alpha[2];
  uint32_t minus_max_bits[2];
};

template <typename Traits>
struct Sm90Softmax {
  static constexpr int kSRegs = Traits::kSAccRegs, kORegs = Traits::kOAccRegs;
  // log2 units: the running max lags the true max by at most this, so P <= 2^8.
  static constexpr float kRescaleSlack = 8.f;

  float row_max[2] = {-INFINITY, -INFINITY};  // m of the thread's two rows

  // Takes the tile's row maxima of S, moves the running max where the lazy rule says so, and returns the tile's
  // exponent. A masked tile can be all masked; before it, unmasked tiles have made every row max finite.
  template <bool kMasked>
  __device__ __forceinline__ TileExponent update_max(const int32_t (&s_int)[kSRegs], const float (&q_scale)[2],
                                                     float k_scale) {
    int32_t tile_max_int[2] = {accumulator_row_max<0>(s_int), accumulator_row_max<1>(s_int)};
    ptx::quad_reduce(tile_max_int, [](int32_t a, int32_t b) { return max(a, b); });
    TileExponent e;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const ptx::SmallIntScale logit(quant::logit_scale(q_scale[r], k_scale));
      e.c[r] = logit.scale;
      const float tile_max = kMasked && tile_max_int[r] == kMaskedLogit ? -INFINITY : logit(tile_max_int[r]);
      const float m_new = tile_max > row_max[r] + kRescaleSlack ? tile_max : row_max[r];
      const float base = kMasked ? exponent_base(m_new) : m_new;
      e.alpha[r] = rescale_factor(row_max[r], base);
      row_max[r] = m_new;
      if constexpr (Traits::kGapFitsMagic) {
        e.bias[r] = logit.neg_magic_scale + (tile_max - base);
        e.minus_max_bits[r] = uint32_t(ptx::kSmallIntMagicBits) - uint32_t(tile_max_int[r]);
      } else {
        e.bias[r] = tile_max - base;
        e.minus_max_bits[r] = 0u - uint32_t(tile_max_int[r]);
      }
    }
    return e;
  }

  // P = 2^(l - m) of every logit (masked keys: 0).
  template <bool kMasked>
  __device__ __forceinline__ static void exponentiate(const TileExponent& e, const int32_t (&s_int)[kSRegs],
                                                      float (&p)[kSRegs]) {
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) {
      const int r = wgmma::accumulator_row(i);
      const uint32_t gap = uint32_t(s_int[i]) + e.minus_max_bits[r];  // S - S_max, or its magic float's bits
      const float gap_float = Traits::kGapFitsMagic ? __uint_as_float(gap) : __int2float_rn(int32_t(gap));
      p[i] = ptx::exp2_approx(fmaf(gap_float, e.c[r], e.bias[r]));
      if constexpr (kMasked) p[i] = s_int[i] == kMaskedLogit ? 0.f : p[i];
    }
  }

  // O (with its sum columns) follows a moved max; a warp where no row's max moved skips the multiplies.
  __device__ __forceinline__ static void rescale_output(const TileExponent& e, float (&o_acc)[kORegs]) {
    if (__any_sync(0xffffffffu, e.alpha[0] != 1.f || e.alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o_acc[i] *= e.alpha[wgmma::accumulator_row(i)];
    }
  }
};

}  // namespace attention_int8
