// INT8 attention forward, Hopper kernel (sm_90a): the same algorithm as attention_fwd.cu, with both
// matrix products on warpgroup MMAs (wgmma.mma_async):
//   S = Q_q K_q^T : m64n128k32 s8 x s8 -> s32, Q and K read from shared memory by descriptor;
//   O += P V      : m64n128k16 f16/bf16 -> f32, P straight from registers (the S accumulator layout
//                   is the A-register layout), V^T read from shared memory by descriptor.
// Each of the two warpgroups owns 64 query rows; K/V^T tiles of 128 keys stream through a three-stage
// cp.async pipeline shared by both. Within a warpgroup the softmax of tile j overlaps the P.V wgmma of
// tile j - 1 (see the main loop); across warpgroups the hardware interleaves the two streams.
#include <cmath>
#include <cstdint>

#include "attention_int8.h"
#include "dispatch.cuh"
#include "kernel_traits.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

namespace attention_int8 {
namespace {

template <typename Traits>
struct Sm90Smem {
  char* q;
  char* stage_base;
  __device__ char* k(int stage) const { return stage_base + stage * Traits::kSmemStageBytes; }
  __device__ char* v_t(int stage) const { return k(stage) + Traits::kSmemKBytes; }
  __device__ char* k_scale(int stage) const { return v_t(stage) + Traits::kSmemVtBytes; }
};

// cp.async of a [rows x 128 B] global tile (row pitch `pitch` bytes) into the swizzled smem layout.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_swizzled_rows_async(char* smem, const char* gmem, int64_t pitch, int tid) {
  constexpr int kChunks = kRows * 8;
  static_assert(kChunks % kThreads == 0, "tile loads must split evenly");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int chunk = tid + i * kThreads;
    const int row = chunk / 8, col = chunk % 8;
    ptx::cp_async_16(smem + wgmma::swizzled_offset(row, col), gmem + row * pitch + col * 16, true);
  }
}

template <typename Traits>
__device__ __forceinline__ void load_kv_tile_async(const Sm90Smem<Traits>& smem, int stage, int n_block,
                                                   const int8_t* k_head, const float* k_scale_head,
                                                   const char* v_t_head, int64_t v_t_pitch, int tid) {
  using Elem = typename Traits::Elem;
  constexpr int D = Traits::kHeadDim, BN = Traits::kBlockN, T = Traits::kThreads;
  const int n0 = n_block * BN;
  load_swizzled_rows_async<BN, T>(smem.k(stage), reinterpret_cast<const char*>(k_head + int64_t(n0) * D), D, tid);
  // V^T: D rows of BN keys, stored as BN / 64 column chunks of [D rows x 128 B].
#pragma unroll
  for (int c = 0; c < BN / Traits::kKeysPerSwizzleRow; ++c)
    load_swizzled_rows_async<D, T>(smem.v_t(stage) + c * Traits::kSmemVtChunkBytes,
                                   v_t_head + (int64_t(n0) + c * Traits::kKeysPerSwizzleRow) * sizeof(Elem),
                                   v_t_pitch, tid);
  if (tid < BN * 4 / 16)
    ptx::cp_async_16(smem.k_scale(stage) + tid * 16, reinterpret_cast<const char*>(k_scale_head + n0) + tid * 16, true);
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm) attention_fwd_sm90_kernel(const AttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr float kLn2 = 0.6931471805599453f;
  using Elem = typename Traits::Elem;
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, BN = Traits::kBlockN, T = Traits::kThreads;
  constexpr int kRegs = Traits::kAccRegs;

  extern __shared__ char smem_raw[];
  // wgmma's 128-byte swizzle is anchored at 1024-byte boundaries.
  char* smem_base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const Sm90Smem<Traits> smem{smem_base, smem_base + Traits::kSmemQBytes};

  const int tid = threadIdx.x, warpgroup = tid / 128, lane = tid % 32;
  const int warp_in_group = (tid % 128) / 32, group = lane / 4, tig = lane % 4;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // longest causal rows first: better tail balance
  const int head = blockIdx.y, batch = blockIdx.z;
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const int m0 = m_block * BM;

  const int64_t bh_q = int64_t(batch) * p.heads_q + head;
  const int64_t bh_kv = int64_t(batch) * p.heads_kv + head_kv;
  const int8_t* q_tile = p.q + (bh_q * p.seqlen_q_pad + m0) * D;
  const int8_t* k_head = p.k + bh_kv * p.seqlen_kv_pad * D;
  const float* k_scale_head = p.k_scale + bh_kv * p.seqlen_kv_pad;
  const int64_t v_t_pitch = int64_t(p.seqlen_kv_pad) * sizeof(Elem);
  const char* v_t_head = static_cast<const char*>(p.v_t) + bh_kv * D * v_t_pitch;

  const int causal_offset = p.seqlen_kv - p.seqlen_q;  // query i sees key j iff j <= i + causal_offset
  int n_end = p.seqlen_kv;
  if (p.causal) n_end = max(0, min(n_end, min(m0 + BM, p.seqlen_q) + causal_offset));
  const int n_blocks = (n_end + BN - 1) / BN;

  load_swizzled_rows_async<BM, T>(smem.q, reinterpret_cast<const char*>(q_tile), D, tid);
  if (n_blocks > 0) load_kv_tile_async<Traits>(smem, 0, 0, k_head, k_scale_head, v_t_head, v_t_pitch, tid);
  ptx::cp_async_commit();

  // This thread's two rows (accumulator rows group and group + 8 of its warp).
  int row_in_tile[2];
  float q_scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_in_tile[r] = warpgroup * 64 + warp_in_group * 16 + group + 8 * r;
    q_scale[r] = p.q_scale[bh_q * p.seqlen_q_pad + m0 + row_in_tile[r]];
  }
  const char* q_smem = smem.q + warpgroup * 64 * D;

  float o_acc[kRegs];
#pragma unroll
  for (int i = 0; i < kRegs; ++i) o_acc[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};  // this thread's share; the quad is summed at the end
  // P of the previous tile in k16 A-fragment order (registers 8kk..8kk+7 of an S accumulator hold
  // keys 16kk..16kk+15). It feeds the P.V wgmma that overlaps this tile's softmax, so it must stay
  // untouched until that wgmma completes.
  uint32_t p_frag[Traits::kPVSteps][4];

  // Issues O += P V^T-tile for the tile held in `stage` (asynchronous; one commit group).
  auto issue_pv = [&](int stage) {
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk) {
      const char* b = smem.v_t(stage) + (kk * 16 / Traits::kKeysPerSwizzleRow) * Traits::kSmemVtChunkBytes +
                      (kk * 16 % Traits::kKeysPerSwizzleRow) * int(sizeof(Elem));
      wgmma::mma_m64n128k16_f32<Elem>(o_acc, p_frag[kk], wgmma::make_desc(b));
    }
    wgmma::commit_group();
  };

  // Software pipeline, per iteration j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} go to the tensor cores
  // back to back; the softmax of S_j then runs while P_{j-1} V_{j-1} is still computing. Tiles j - 1,
  // j and j + 1 (in flight) occupy the three shared-memory stages.
  for (int n_block = 0; n_block < n_blocks; ++n_block) {
    const int stage = n_block % Traits::kStages;
    ptx::cp_async_wait<0>();      // tile j has landed (this thread's copies) ...
    wgmma::fence_async_shared();  // ... and is visible to the async proxy that wgmma reads through ...
    __syncthreads();              // ... for every thread; and all of iteration j - 1 is done, so
                                  // stage (j + 1) % 3, last read by P_{j-2} V_{j-2}, is free.
    if (n_block + 1 < n_blocks)
      load_kv_tile_async<Traits>(smem, (n_block + 1) % Traits::kStages, n_block + 1, k_head, k_scale_head, v_t_head,
                                 v_t_pitch, tid);
    ptx::cp_async_commit();

    int32_t s_int[kRegs];
    wgmma::fence_operands(s_int);
    wgmma::fence_operands(o_acc);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < Traits::kQKSteps; ++ks)
      wgmma::mma_m64n128k32_s8(s_int, wgmma::make_desc(q_smem + ks * 32), wgmma::make_desc(smem.k(stage) + ks * 32),
                               ks);
    wgmma::commit_group();
    if (n_block > 0) {
      issue_pv((n_block - 1) % Traits::kStages);
      wgmma::wait_group<1>();  // S_j done (groups retire in order); P_{j-1} V_{j-1} may still run
    } else {
      wgmma::wait_group<0>();
    }
    wgmma::fence_operands(s_int);

    // Dequantize with the scales of the exact row and column each logit came from; mask.
    const float* k_scale = reinterpret_cast<const float*>(smem.k_scale(stage));
    const int n0 = n_block * BN;
    const bool need_mask = n0 + BN > p.seqlen_kv || (p.causal && n0 + BN - 1 > m0 + causal_offset);
    float s[kRegs];
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int r = (i / 2) % 2, col = 8 * (i / 4) + 2 * tig + (i % 2);
      s[i] = ptx::small_int_to_float(s_int[i]) * q_scale[r] * k_scale[col];
      if (need_mask) {
        const int key = n0 + col, row = m0 + row_in_tile[r];
        if (key >= p.seqlen_kv || (p.causal && key > row + causal_offset)) s[i] = -INFINITY;
      }
    }

    // Online softmax update (base 2); P overwrites S.
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int i = 2 * r; i < kRegs; i += 4) tile_max = fmaxf(tile_max, fmaxf(s[i], s[i + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(row_max[r], tile_max);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = ptx::exp2_approx(row_max[r] - base);
      row_max[r] = m_new;
      row_sum[r] *= alpha[r];
#pragma unroll
      for (int i = 2 * r; i < kRegs; i += 4) {
        s[i] = ptx::exp2_approx(s[i] - base);
        s[i + 1] = ptx::exp2_approx(s[i + 1] - base);
        row_sum[r] += s[i] + s[i + 1];
      }
    }

    // O and P_{j-1} are free once P_{j-1} V_{j-1} has retired: rescale O to the new max, stage P_j.
    wgmma::wait_group<0>();
    wgmma::fence_operands(o_acc);
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk) wgmma::fence_operands(p_frag[kk]);
#pragma unroll
    for (int i = 0; i < kRegs; ++i) o_acc[i] *= alpha[(i / 2) % 2];
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) p_frag[kk][j] = ptx::pack2<Elem>(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
  }
  if (n_blocks > 0) {  // the last tile's P V
    wgmma::fence_operands(o_acc);
    wgmma::fence();
    issue_pv((n_blocks - 1) % Traits::kStages);
    wgmma::wait_group<0>();
    wgmma::fence_operands(o_acc);
  }

  // Epilogue: normalize, store O in the input dtype, and the natural-log LSE.
  Elem* o_head = static_cast<Elem*>(p.o) + batch * p.o_view.batch_stride + head * p.o_view.head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv_sum = sum == 0.f ? 0.f : 1.f / sum;  // no visible key: zeros; NaN stays NaN
    const int row = m0 + row_in_tile[r];
    if (row >= p.seqlen_q) continue;
    Elem* o_row = o_head + int64_t(row) * p.o_view.row_stride;
#pragma unroll
    for (int i = 2 * r; i < kRegs; i += 4) {
      const int col = 8 * (i / 4) + 2 * tig;
      *reinterpret_cast<uint32_t*>(o_row + col) = ptx::pack2<Elem>(o_acc[i] * inv_sum, o_acc[i + 1] * inv_sum);
    }
    if (p.lse != nullptr && tig == 0)
      p.lse[bh_q * p.seqlen_q + row] = sum == 0.f ? -INFINITY : (row_max[r] + log2f(sum)) * kLn2;
  }
#else
  __trap();  // only the sm_90a build has wgmma; the host launches this kernel only on compute capability 9.0
#endif
}

}  // namespace

cudaError_t launch_attention_forward_sm90(const AttentionParams& p, cudaStream_t stream) {
  if (p.head_dim != 128) return cudaErrorInvalidValue;
  return dispatch_elem(p.dtype, [&](auto elem) {
    using Traits = Sm90AttentionKernelTraits<decltype(elem)>;
    return launch_attention_kernel<Traits>(attention_fwd_sm90_kernel<Traits>, p, stream);
  });
}

}  // namespace attention_int8
