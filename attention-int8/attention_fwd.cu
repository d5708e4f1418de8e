// INT8 attention forward, portable kernel: S = Q_q K_q^T on INT8 tensor cores, online softmax in
// base 2, O += P V on FP16/BF16 tensor cores with FP32 accumulation (mma.sync, sm_80 and newer).
//
// One CTA computes kBlockM query rows of one (batch, head); each warp owns kMTiles x 16 of those rows
// for the whole key loop, so a row's softmax state (max m, sum l) stays in the 4 lanes of one quad.
// K/V tiles of kBlockN keys stream through a two-stage cp.async pipeline shared by all warps.
//
// Online softmax, per query row, in base 2 (the Q scale carries sm_scale * log2(e), so S is already
// the logit times log2(e) and exp2 replaces exp):
//   m_new = max(m, max_j S_j)            alpha = 2^(m - m_new)
//   P_j   = 2^(S_j - m_new)              l = alpha * l + sum_j P_j        O = alpha * O + P V
// and finally O / l and the LSE (attention_common.cuh has the rules both kernels share).
#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "attention_int8.h"
#include "dispatch.cuh"
#include "kernel_traits.cuh"
#include "packed_sequences.cuh"
#include "ptx.cuh"
#include "quant_math.cuh"

namespace attention_int8 {
namespace {

// Copies a kRows x kRowBytes tile from global memory (row pitch `gmem_pitch` bytes) into shared
// memory (row pitch kSmemPitch) in 16-byte cp.async chunks. Rows >= valid_rows are zero-filled:
// garbage there could be NaN, and 0 * NaN would leak into P V even though P is 0 for those keys.
template <int kRows, int kRowBytes, int kSmemPitch, int kThreads>
__device__ __forceinline__ void load_tile_async(char* smem, const char* gmem, int64_t gmem_pitch, int valid_rows,
                                                int tid) {
  constexpr int kChunksPerRow = kRowBytes / 16;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int chunk = tid + i * kThreads;
    if (kChunks % kThreads == 0 || chunk < kChunks) {
      const int row = chunk / kChunksPerRow, col = chunk % kChunksPerRow;
      const bool valid = row < valid_rows;
      const char* src = gmem + (valid ? row : 0) * gmem_pitch + col * 16;
      ptx::cp_async_16(smem + row * kSmemPitch + col * 16, src, valid);
    }
  }
}

// The CTA's query block: the grid's x index counted down, so the longest causal rows start first (better tail
// balance).
__device__ __forceinline__ int query_block() { return gridDim.x - 1 - blockIdx.x; }

template <typename Traits>
struct SmemLayout {
  char* q;
  char* stage_base;
  __device__ char* k(int stage) const { return stage_base + stage * Traits::kSmemStageBytes; }
  __device__ char* v(int stage) const { return k(stage) + Traits::kSmemKBytes; }
};

// Rows whose head dim the s8 MMA does not step through whole (D = 80, read as kQKDim = 96): the bytes past D of every
// Q and K row in shared memory, which no copy writes, are zeroed once, and zeros add nothing to Q.K^T.
template <typename Traits>
__device__ __forceinline__ void zero_qk_padding(const SmemLayout<Traits>& smem, int tid) {
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN;
  constexpr int kPadChunks = (Traits::kQKDim - D) / 16, kRows = BM + Traits::kStages * BN;
  if constexpr (kPadChunks > 0) {
    for (int i = tid; i < kRows * kPadChunks; i += Traits::kThreads) {
      const int row = i / kPadChunks, key = row - BM;
      char* row_start =
          row < BM ? smem.q + row * Traits::kQKRowBytes : smem.k(key / BN) + key % BN * Traits::kQKRowBytes;
      *reinterpret_cast<uint4*>(row_start + D + i % kPadChunks * 16) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Issues the cp.async copies of key tile `n_block` (int8 K, V) into `stage`.
template <typename Traits>
__device__ __forceinline__ void load_kv_tile_async(const SmemLayout<Traits>& smem, int stage, int n_block,
                                                   const int8_t* k_head, const typename Traits::Elem* v_head,
                                                   int64_t v_row_stride, int seqlen_kv, int tid) {
  using Elem = typename Traits::Elem;
  constexpr int D = Traits::kHeadDim, BN = Traits::kBlockN, T = Traits::kThreads;
  const int n0 = n_block * BN;
  // K is padded to a multiple of kKeyPad by the quantizer: no bounds to check.
  load_tile_async<BN, D, Traits::kQKRowBytes, T>(smem.k(stage), reinterpret_cast<const char*>(k_head + int64_t(n0) * D),
                                                 D, BN, tid);
  load_tile_async<BN, D * 2, Traits::kVRowBytes, T>(
      smem.v(stage), reinterpret_cast<const char*>(v_head + int64_t(n0) * v_row_stride),
      v_row_stride * int64_t(sizeof(Elem)), seqlen_kv - n0, tid);
}

// The CTA's query block of its (batch, head): kBlockM rows against every key they see.
template <typename Traits>
__device__ __forceinline__ void attention_tile(const AttentionParams& p) {
  using Elem = typename Traits::Elem;
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN, T = Traits::kThreads;

  extern __shared__ __align__(16) char smem_raw[];
  const SmemLayout<Traits> smem{smem_raw, smem_raw + Traits::kSmemQBytes};

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator row group and thread-in-group
  const int m_block = query_block();
  const int head = blockIdx.y, batch = blockIdx.z;
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const int m0 = m_block * BM;

  const int64_t bh_q = int64_t(batch) * p.heads_q + head;
  const int64_t bh_kv = int64_t(batch) * p.heads_kv + head_kv;
  const int8_t* q_tile = p.q + (bh_q * p.seqlen_q_pad + m0) * D;
  const int8_t* k_head = p.k + bh_kv * p.seqlen_kv_pad * D;
  const float* k_scale_head = p.k_scale + bh_kv * (p.seqlen_kv_pad / kKeyScaleTokens);
  // Q smoothing, chosen per head (KeyCenterParams): the quantizer took Q's shift out of q_q, the logits get the key
  // biases back.
  const float* key_bias = head_is_smoothed(p, bh_q) ? p.key_bias + bh_q * p.seqlen_kv_pad : nullptr;
  const Elem* v_head = static_cast<const Elem*>(p.v) + batch * p.v_view.batch_stride + head_kv * p.v_view.head_stride;

  // Keys this CTA must visit: all of them, or under the causal mask up to the last key its last row sees.
  const int n_blocks = visible_key_blocks(p, m0 + BM, BN);

  // Prologue: Q tile (group 0) and the first K/V tile (group 1) in flight together; the barrier after them also
  // publishes the zeroed padding.
  zero_qk_padding(smem, tid);
  load_tile_async<BM, D, Traits::kQKRowBytes, T>(smem.q, reinterpret_cast<const char*>(q_tile), D, BM, tid);
  ptx::cp_async_commit();
  if (n_blocks > 0) load_kv_tile_async<Traits>(smem, 0, 0, k_head, v_head, p.v_view.row_stride, p.seqlen_kv, tid);
  ptx::cp_async_commit();
  ptx::cp_async_wait<1>();
  __syncthreads();

  constexpr int MT = Traits::kMTiles;
  float q_scale[MT][2];
  int row_in_tile[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_in_tile[mt][r] = warp * Traits::kWarpRows + mt * 16 + group + 8 * r;
      q_scale[mt][r] = p.q_scale[bh_q * p.seqlen_q_pad + m0 + row_in_tile[mt][r]];
    }

  float o_acc[MT][Traits::kOTiles][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < Traits::kOTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][t][e] = 0.f;
  float row_max[MT][2], row_sum[MT][2];  // row_sum: this thread's share; the quad is summed at the end
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mt][r] = -INFINITY;
      row_sum[mt][r] = 0.f;
    }

  for (int n_block = 0; n_block < n_blocks; ++n_block) {
    const int stage = n_block % Traits::kStages;
    const float k_scale = __ldg(k_scale_head + n_block * BN / kKeyScaleTokens);  // the tile's key block
    if (n_block + 1 < n_blocks)
      load_kv_tile_async<Traits>(smem, stage ^ 1, n_block + 1, k_head, v_head, p.v_view.row_stride, p.seqlen_kv,
                                 tid);
    ptx::cp_async_commit();  // possibly empty: keeps "all but the newest group" = this tile
    ptx::cp_async_wait<1>();
    __syncthreads();

    // S = Q K^T: exact int32 dot products of the quantized rows.
    int32_t s_int[MT][Traits::kSTiles][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < Traits::kSTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) s_int[mt][t][e] = 0;
    const char* k_smem = smem.k(stage);
#pragma unroll
    for (int ks = 0; ks < Traits::kQKSteps; ++ks) {
      // x4 tiles: (rows 0-7, k 0-15), (rows 8-15, k 0-15), (rows 0-7, k 16-31), (rows 8-15, k 16-31)
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int row = warp * Traits::kWarpRows + mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ptx::ldmatrix_x4(a[mt], smem.q + row * Traits::kQKRowBytes + ks * 32 + (lane / 16) * 16);
      }
#pragma unroll
      for (int pair = 0; pair < Traits::kSTiles / 2; ++pair) {
        // x4 tiles: (keys 0-7, k 0-15), (keys 0-7, k 16-31), (keys 8-15, k 0-15), (keys 8-15, k 16-31)
        const int key = pair * 16 + (lane % 8) + (lane / 16) * 8;
        uint32_t b[4];
        ptx::ldmatrix_x4(b, k_smem + key * Traits::kQKRowBytes + ks * 32 + ((lane / 8) % 2) * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::mma_s8_16832(s_int[mt][2 * pair], a[mt], {b[0], b[1]});
          ptx::mma_s8_16832(s_int[mt][2 * pair + 1], a[mt], {b[2], b[3]});
        }
      }
    }

    // Dequantize with the row's scale against the tile's key block (quant_math.cuh), exactly S * c; a key bias is then
    // added with one rounding, as the reference's FMA does.
    float s[MT][Traits::kSTiles][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const ptx::SmallIntScale c(quant::logit_scale(q_scale[mt][r], k_scale));
#pragma unroll
        for (int t = 0; t < Traits::kSTiles; ++t)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) s[mt][t][e] = c(s_int[mt][t][e]);
      }
    const int n0 = n_block * BN;
    if (key_bias != nullptr) {
#pragma unroll
      for (int t = 0; t < Traits::kSTiles; ++t) {
        const float2 bias = __ldg(reinterpret_cast<const float2*>(key_bias + n0 + t * 8 + 2 * tig));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][t][e] += e % 2 == 0 ? bias.x : bias.y;
      }
    }

    // Mask keys past the end and, under the causal mask, keys after the row's diagonal. Only tiles
    // that cross either boundary pay for it.
    if (keys_need_mask(p, n0, BN, m0)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < Traits::kSTiles; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n0 + t * 8 + 2 * tig + (e % 2);
            const int row = m0 + row_in_tile[mt][e / 2];
            if (key_hidden(p, col, row)) s[mt][t][e] = -INFINITY;
          }
    }

    // Online softmax update (base 2), then P overwrites S in place.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int t = 0; t < Traits::kSTiles; ++t)
          tile_max = fmaxf(tile_max, fmaxf(s[mt][t][2 * r], s[mt][t][2 * r + 1]));
        tile_max = ptx::quad_reduce(tile_max, [](float a, float b) { return fmaxf(a, b); });
        const float m_new = fmaxf(row_max[mt][r], tile_max);
        const float base = exponent_base(m_new);
        const float alpha = rescale_factor(row_max[mt][r], base);
        row_max[mt][r] = m_new;
        row_sum[mt][r] *= alpha;
#pragma unroll
        for (int t = 0; t < Traits::kOTiles; ++t) {
          o_acc[mt][t][2 * r] *= alpha;
          o_acc[mt][t][2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int t = 0; t < Traits::kSTiles; ++t)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[mt][t][e] = ptx::exp2_approx(s[mt][t][e] - base);
            row_sum[mt][r] += s[mt][t][e];
          }
      }

    // O += P V. The accumulator layout of two adjacent n8 S tiles is exactly the A fragment of one
    // k16 step, so P goes from registers to the tensor cores without touching shared memory.
    const char* v_smem = smem.v(stage);
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = ptx::pack2<Elem>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = ptx::pack2<Elem>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = ptx::pack2<Elem>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = ptx::pack2<Elem>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int pair = 0; pair < Traits::kOTiles / 2; ++pair) {
        // x4.trans tiles: (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15)
        const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        const int d = pair * 16 + (lane / 16) * 8;
        uint32_t b[4];
        ptx::ldmatrix_x4_trans(b, v_smem + key * Traits::kVRowBytes + d * 2);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::mma_f32_16816<Elem>(o_acc[mt][2 * pair], a[mt], {b[0], b[1]});
          ptx::mma_f32_16816<Elem>(o_acc[mt][2 * pair + 1], a[mt], {b[2], b[3]});
        }
      }
    }
    __syncthreads();  // every warp is done with `stage` before the next iteration refills it
  }

  // Epilogue: normalize, store O in the input dtype, and the natural-log LSE.
  Elem* o_head = static_cast<Elem*>(p.o) + batch * p.o_view.batch_stride + head * p.o_view.head_stride;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = ptx::quad_reduce(row_sum[mt][r], [](float a, float b) { return a + b; });
      const float inv_sum = inverse_row_sum(sum);
      const int row = m0 + row_in_tile[mt][r];
      if (row >= p.seqlen_q) continue;
      Elem* o_row = o_head + int64_t(row) * p.o_view.row_stride;
#pragma unroll
      for (int t = 0; t < Traits::kOTiles; ++t) {
        *reinterpret_cast<uint32_t*>(o_row + t * 8 + 2 * tig) =
            ptx::pack2<Elem>(o_acc[mt][t][2 * r] * inv_sum, o_acc[mt][t][2 * r + 1] * inv_sum);
      }
      if (p.lse != nullptr && tig == 0) {
        const float shift = p.q_center_dot != nullptr ? p.sm_scale * p.q_center_dot[bh_q * p.seqlen_q_pad + row] : 0.f;
        *lse_slot<Traits::kPacked>(p, bh_q, head, row) = natural_lse(row_max[mt][r], sum, shift);
      }
    }
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads) attention_fwd_kernel(const AttentionParams p) {
  if constexpr (Traits::kPacked) {  // the grid covers the longest sequence
    const AttentionParams sequence = narrow_to_sequence<typename Traits::Elem>(p, blockIdx.z);
    if (query_block() * Traits::kBlockM < sequence.seqlen_q) attention_tile<Traits>(sequence);
  } else {
    attention_tile<Traits>(p);
  }
}

}  // namespace

// Query blocks are the fastest grid index, so the CTAs running at one time share one or two heads, whose K and V
// stay in L2.
cudaError_t launch_attention_forward_portable(const AttentionParams& p, cudaStream_t stream) {
  return dispatch_portable_traits(p, [&](auto traits) {
    using Traits = decltype(traits);
    const dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch);
    return launch_attention_kernel<Traits>(attention_fwd_kernel<Traits>, grid, p, stream);
  });
}

}  // namespace attention_int8
