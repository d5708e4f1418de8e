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
  float previous_max[2];  // the running max before this tile (for tighten_bound)
};

template <typename Traits>
struct Sm90Softmax {
  static constexpr int kSRegs = Traits::kSAccRegs, kORegs = Traits::kOAccRegs;
  // log2 units: the running max lags the true max by at most this, so P <= 2^8.
  static constexpr float kRescaleSlack = 8.f;

  float row_max[2] = {-INFINITY, -INFINITY};  // m of the thread's two rows

  // Takes the tile's row maxima of S, moves the running max where the lazy rule says so, and returns the tile's
  // exponent. A masked tile can be all masked; before it, unmasked tiles have made every row max finite. kBiased:
  // Q smoothing adds a key bias to every logit, and t + bias_max (the max of the tile's biases) stands in for the
  // tile's max, an upper bound of its logits that keeps the max on the integers; P of the tile's largest logit is then
  // 2^-(the bound's excess) rather than 1, which tighten_bound corrects where fp16 could not hold it.
  template <bool kMasked, bool kBiased>
  __device__ __forceinline__ TileExponent update_max(const int32_t (&s_int)[kSRegs], const float (&q_scale)[2],
                                                     float k_scale, float bias_max) {
    int32_t tile_max_int[2] = {accumulator_row_max<0>(s_int), accumulator_row_max<1>(s_int)};
    ptx::quad_reduce(tile_max_int, [](int32_t a, int32_t b) { return max(a, b); });
    TileExponent e;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const ptx::SmallIntScale logit(quant::logit_scale(q_scale[r], k_scale));
      e.c[r] = logit.scale;
      const float tile_max = kMasked && tile_max_int[r] == kMaskedLogit ? -INFINITY : logit(tile_max_int[r]);
      const float tile_bound = kBiased ? tile_max + bias_max : tile_max;
      const float m_new = tile_bound > row_max[r] + kRescaleSlack ? tile_bound : row_max[r];
      const float base = kMasked ? exponent_base(m_new) : m_new;
      e.alpha[r] = rescale_factor(row_max[r], base);
      e.previous_max[r] = row_max[r];
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

  // P = 2^(l - m) of every logit (masked keys: 0). kBiased: l includes the key biases of the tile, key_bias[j] for its
  // key j (shared memory), added to the exponent after the FMA so that they keep their own precision.
  template <bool kMasked, bool kBiased>
  __device__ __forceinline__ static void exponentiate(const TileExponent& e, const int32_t (&s_int)[kSRegs],
                                                      const float* key_bias, float (&p)[kSRegs]) {
#pragma unroll
    for (int i = 0; i < kSRegs; i += 4) {  // registers i .. i + 3: keys accumulator_col(i) and the next, both rows
      float2 bias = make_float2(0.f, 0.f);
      if constexpr (kBiased) bias = *reinterpret_cast<const float2*>(key_bias + wgmma::accumulator_col(i));
#pragma unroll
      for (int j = i; j < i + 4; ++j) {
        const int r = wgmma::accumulator_row(j);
        const uint32_t gap = uint32_t(s_int[j]) + e.minus_max_bits[r];  // S - S_max, or its magic float's bits
        const float gap_float = Traits::kGapFitsMagic ? __uint_as_float(gap) : __int2float_rn(int32_t(gap));
        float exponent = fmaf(gap_float, e.c[r], e.bias[r]);
        if constexpr (kBiased) exponent += j % 2 == 0 ? bias.x : bias.y;
        p[j] = ptx::exp2_approx(exponent);
        if constexpr (kMasked) p[j] = s_int[j] == kMaskedLogit ? 0.f : p[j];
      }
    }
  }

  // kBiased: the bound t + bias_max can exceed the tile's largest logit by more than fp16's range holds where the
  // biases span tens of log2 units (a Q offset against K outlier channels), so P of the whole tile would underflow
  // once rounded for the P.V. The largest fp32 P of each row tells (bits of P >= 0 order like P: integer maxima);
  // in the rare warps with a row whose max moved to a bound more than kRescaleSlack above its largest logit, that
  // row's max is lowered to its largest logit (rounded down to a power of two of P), its P scaled up to match, and
  // O's rescale factor recomputed. Called after the P.V has retired, so that the rare branch serializes no wgmma.
  __device__ __forceinline__ static void row_max_bits_of(const float (&p)[kSRegs], uint32_t (&bits)[2]) {
    int32_t p_bits[kSRegs];
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) p_bits[i] = __float_as_int(p[i]);
    int32_t m[2] = {accumulator_row_max<0>(p_bits), accumulator_row_max<1>(p_bits)};
    ptx::quad_reduce(m, [](int32_t a, int32_t b) { return max(a, b); });
    bits[0] = uint32_t(m[0]), bits[1] = uint32_t(m[1]);
  }

  __device__ __forceinline__ void tighten_bound(TileExponent& e, const uint32_t (&p_max_bits)[2], float (&p)[kSRegs]) {
    constexpr uint32_t kLooseBits = uint32_t(127 - int(kRescaleSlack)) << 23;  // 2^-kRescaleSlack
    bool loose[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
      loose[r] = p_max_bits[r] != 0u && p_max_bits[r] < kLooseBits && row_max[r] != e.previous_max[r];
    if (!__any_sync(0xffffffffu, loose[0] || loose[1])) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!loose[r]) continue;
      const int log2_p_max = int(p_max_bits[r] >> 23) - 127;  // floor(log2) of the row's largest P (a normal)
      const float tight = fmaxf(e.previous_max[r], row_max[r] + float(log2_p_max));
      const float scale = ptx::exp2_approx(row_max[r] - tight);
#pragma unroll
      for (int i = 0; i < kSRegs; ++i)
        if (wgmma::accumulator_row(i) == r) p[i] *= scale;
      e.alpha[r] = rescale_factor(e.previous_max[r], tight);
      row_max[r] = tight;
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
