// INT8 attention forward, Hopper kernel (sm_90a): the scheme of attention_fwd.cu with both matrix products on
// warpgroup MMAs (wgmma.mma_async), composed from its units:
//   sm90_tile_scheduler.cuh  which (batch, head, query block, key range) a CTA computes, and the grid
//   sm90_q_tile.cuh          each consumer's Q rows, quantized per token into a shared-memory tile
//   sm90_mainloop.cuh        the producer's K/V stream and the consumers' key loop:
//                              S = Q_q K_q^T : m64n64k32 s8 x s8 -> s32, Q and K from shared memory;
//                              O += P V      : m64n(D'+8)k16 f16/bf16 -> f32, P from registers, V MN-major from
//                                              shared memory, then 8 columns of ones for P's row sums
//   sm90_softmax.cuh         the mask, the integer tile max, the lazy running max and the exponentials (with Q
//                              smoothing's key biases in the heads that have them)
//   sm90_epilogue.cuh        O and the LSE, or a split tile's partials
//   sm90_combine.cuh         the split-KV combine kernel
// D' = D for D = 64 and 128; D = 96 runs as D' = 128 on rows padded with zeros (Traits::kMmaDim). Warp
// specialization (kernel_traits.cuh): one producer thread streams K/V tiles of 64 keys through kStages stages on
// transaction barriers; three (D' = 128) or four (D = 64) consumer warpgroups own 64 query rows each.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <mutex>
#include <type_traits>

#include "attention_common.cuh"
#include "attention_int8.h"
#include "dispatch.cuh"
#include "kernel_traits.cuh"
#include "packed_sequences.cuh"
#include "ptx.cuh"
#include "sm90_combine.cuh"
#include "sm90_epilogue.cuh"
#include "sm90_mainloop.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_q_tile.cuh"
#include "sm90_softmax.cuh"
#include "sm90_tile_scheduler.cuh"

namespace attention_int8 {
namespace {

// The CTA's work tile (sm90_tile_scheduler.cuh). The sequence's keys start at row v_key0 of v_map (packed sequences;
// 0 for a dense batch).
template <typename Traits>
__device__ __forceinline__ void attention_work_tile(const AttentionParams& p, const CUtensorMap* v_map, int v_key0) {
  constexpr int kRows = Traits::kConsumerRows, kORegs = Traits::kOAccRegs;
  static_assert(kQTileBarrier<Traits> + Traits::kConsumers <= 16, "named barrier ids run out");

  extern __shared__ char smem_raw[];
  // The swizzle atoms (at most 1024 bytes) are anchored at 1024-byte boundaries. Offsetting smem_raw (rather than
  // rounding an integer address) keeps the pointers visibly in shared memory: LDS, not generic loads.
  char* smem_base = smem_raw + (1024 - sm90::smem_addr(smem_raw) % 1024) % 1024;
  const Sm90Smem<Traits> smem{smem_base};

  const int tid = threadIdx.x, lane = tid % 32;
  // Broadcast from lane 0 so the compiler sees a warp-uniform value: wgmma under a branch it thinks
  // divergent gets serialized (ptxas C7520).
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  const WorkTile work = work_tile<Traits>(p, blockIdx.x);
  // The combine kernel (split tiles only) may take the SMs this grid's last wave frees.
  if (p.schedule.split_tiles > 0) ptx::allow_dependents();
  const int head = work.head, batch = work.batch, v_batch = Traits::kPacked ? 0 : batch;
  const int head_kv = int(fast_div(uint32_t(head), p.schedule.head_group));
  const int m0 = p.schedule.block_row0(work.m_block);  // negative in block 0 under the causal row_shift
  const int64_t bh_kv = int64_t(batch) * p.heads_kv + head_kv;
  // The producer streams key tiles n_begin .. n_begin + n_blocks; the key loop counts them from 0 (stages and
  // phases), absolute key positions only enter the mask and the addresses.
  const int n_begin = work.n_begin, n_blocks = max(0, work.n_end - n_begin);

  // A consumer warp owns 16 query rows from warp_row0; a thread, rows group and group + 8 of them (its
  // accumulator rows). Their Q loads go out first, so the set-up below runs under their latency.
  const int consumer = warpgroup - 1;
  const int warp_in_group = (tid % 128) / 32, group = lane / 4, tig = lane % 4;
  const int first_row = m0 + consumer * kRows;
  const int warp_row0 = first_row + warp_in_group * 16;
  int rows[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) rows[r] = warp_row0 + group + 8 * r;
  QRowsRaw<Traits> q_raw;
  if (warpgroup > 0) load_q_rows<Traits>(p, batch, head, rows, tig, q_raw);

  // The consumers with query rows, [first_row_consumer, end_row_consumer): the last query block may leave the later
  // ones without rows, block 0 under the causal row_shift the first ones (whole consumers: row_shift is a multiple
  // of kConsumerRows), and they skip the key loop. A stage is free once every warp of these has released it.
  const int first_row_consumer = max(0, -m0 / kRows);
  const int end_row_consumer = min(Traits::kConsumers, int(ceil_div(p.seqlen_q - m0, kRows)));
  const int row_consumers = end_row_consumer - first_row_consumer;
  if (tid == 0) {
    constexpr int kWarpsPerConsumer = Traits::kConsumerWarps / Traits::kConsumers;
    for (int s = 0; s < Traits::kStages; ++s) {
      sm90::mbarrier_init(smem.full(s), 1);  // the producer's arrive_expect_tx; the bytes do the rest
      sm90::mbarrier_init(smem.empty(s), kWarpsPerConsumer * row_consumers);  // one arrival per consumer warp
    }
    sm90::fence_barrier_init();
  }
  fill_sum_columns(smem);
  sm90::fence_proxy_async_smem();
  __syncthreads();

  const int64_t bh_q = int64_t(batch) * p.heads_q + head;
  if (warpgroup == 0) {
    sm90::release_registers<Traits::kProducerRegs>();
    if (tid == 0) {
      ptx::wait_for_predecessor();  // K, its scales and biases come from the quantizer
      const bool smoothed = head_is_smoothed(p, bh_q);
      produce_tiles<Traits>(smem, p.k + bh_kv * p.seqlen_kv_pad * Traits::kQKRowBytes,
                            smoothed ? p.key_bias + bh_q * p.seqlen_kv_pad : nullptr, v_map, v_key0, head_kv, v_batch,
                            n_begin, n_blocks);
    }
    return;
  }
  sm90::claim_registers<Traits::kConsumerRegs>();

  ptx::wait_for_predecessor();  // before k_center, K's scales and any global write (dispatch.cuh's launch())
  // Q smoothing is chosen per head (KeyCenterParams): one flag for the CTA, broadcast so that it is warp-uniform.
  const bool smoothed = __shfl_sync(0xffffffffu, head_is_smoothed(p, bh_q), 0);
  // The Q tile lives in the consumer's O staging tiles, which the epilogue uses only after the last wgmma.
  char* q_tile = smem.o_tile(consumer * 4);
  const QRowScales q =
      quantize_q_rows<Traits>(p, batch, head, head_kv, smoothed, q_raw, q_tile, warp_in_group, group, tig);
  sm90::fence_proxy_async_smem();  // the generic-proxy stores, before the wgmmas read them
  sm90::named_barrier_sync(kQTileBarrier<Traits> + consumer, 128);

  const bool has_rows = consumer >= first_row_consumer && consumer < end_row_consumer;
  const int n_own =
      has_rows ? max(0, min(work.n_end, visible_key_blocks(p, first_row + kRows, Traits::kBlockN)) - n_begin) : 0;
  const int n_unmasked = max(0, min(n_own, unmasked_key_blocks(p, first_row, Traits::kBlockN) - n_begin));
  const int64_t key_blocks = p.seqlen_kv_pad / kKeyScaleTokens;
  // The key loop and the epilogue, once with Q smoothing's key biases and once without, so that the unsmoothed heads
  // run without their cost. Nothing of the loop is live across the branch: ptxas serializes the wgmmas otherwise.
  const auto consume = [&](auto biasing) {
    constexpr bool kBiased = std::is_same_v<decltype(biasing), Biased>;
    Sm90Mainloop<Traits> mainloop(smem, q_tile, consumer, n_begin, p.k_scale + bh_kv * key_blocks,
                                  kBiased ? p.key_bias_max + bh_q * key_blocks : nullptr);
    float o_acc[kORegs];
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o_acc[i] = 0.f;
    Sm90Softmax<Traits> softmax;
    mainloop.run(biasing, o_acc, softmax, q, rows, p, n_blocks, n_own, n_unmasked);
    const Sm90Epilogue<Traits> epilogue{p, batch, head, m0, warp_row0, rows, group, tig, lane};
    epilogue.store(o_acc, softmax.row_max, q, work.partial_row0, smem.o_tile(consumer * 4 + warp_in_group));
  };
  if (smoothed) {
    consume(Biased{});
  } else {
    consume(Unbiased{});
  }
}

// Packed sequences: the grid covers the longest sequence, and the causal row_shift is each sequence's own. The
// V map spans the packed rows as one batch.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    attention_fwd_sm90_kernel(const AttentionParams p, const __grid_constant__ CUtensorMap v_map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (Traits::kPacked) {
    const TileCoords tile = tile_coords(p.schedule, blockIdx.x);
    AttentionParams sequence = narrow_to_sequence<typename Traits::Elem>(p, tile.batch);
    sequence.schedule.row_shift =
        TileSchedule::row_shift_of(p.causal, sequence.seqlen_q, Traits::kBlockM, Traits::kConsumerRows);
    if (sequence.schedule.block_row0(tile.m_block) >= sequence.seqlen_q) return;
    attention_work_tile<Traits>(sequence, &v_map, sequence_span(p.packed_kv, tile.batch, p.seqlen_kv).start);
  } else {
    attention_work_tile<Traits>(p, &v_map, 0);
  }
#else
  __trap();  // only the sm_90a build has wgmma; the host launches this kernel only on compute capability 9.0
#endif
}

// cuTensorMapEncodeTiled is a driver API function: taken through the runtime's entry-point query, so
// the library links against the runtime alone.
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  });
  return encode;
}

// V [B, Hkv, seqlen_kv, D] through its strides as a 4-D TMA tensor (innermost first: channel, key,
// head, batch), read in boxes of 64 keys x kVBoxChannels channels with the 128-byte swizzle. Packed sequences are
// one batch of all the packed keys (TMA takes no zero stride).
template <typename Traits>
cudaError_t encode_v_map(const AttentionParams& p, CUtensorMap* map) {
  *map = CUtensorMap{};
  if (p.seqlen_kv == 0) return cudaSuccess;  // no key tile: the map is never read
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  constexpr uint64_t kElemBytes = sizeof(typename Traits::Elem);
  const bool packed = p.packed_kv.cu_seqlens != nullptr;
  const int64_t keys = packed ? p.packed_kv.total_rows : p.seqlen_kv;
  const cuuint64_t dims[4] = {cuuint64_t(p.head_dim), cuuint64_t(keys), cuuint64_t(p.heads_kv),
                              cuuint64_t(packed ? 1 : p.batch)};
  const cuuint64_t strides[3] = {cuuint64_t(p.v_view.row_stride) * kElemBytes,
                                 cuuint64_t(p.v_view.head_stride) * kElemBytes,
                                 cuuint64_t(packed ? keys * p.v_view.row_stride : p.v_view.batch_stride) * kElemBytes};
  const cuuint32_t box[4] = {Traits::kVBoxChannels, Traits::kBlockN, 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult res = encode(map,
                              std::is_same_v<typename Traits::Elem, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                            : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                              4, const_cast<void*>(p.v), dims, strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}


}  // namespace

TileSchedule tile_schedule_sm90(const AttentionParams& p, int sm_count, int64_t l2_bytes, int forced_splits) {
  TileSchedule sched;
  dispatch_sm90_traits(p, [&](auto traits) {
    sched = make_tile_schedule<decltype(traits)>(p, sm_count, l2_bytes, forced_splits);
    return cudaSuccess;
  });
  return sched;
}

// Checks the schedule against the traits' tile shapes and launches the kernel (and the combine of a split tail).
template <typename Traits>
static cudaError_t launch_sm90(const AttentionParams& p, cudaStream_t stream) {
  if (!schedule_fits<Traits>(p)) return cudaErrorInvalidValue;
  CUtensorMap v_map;
  cudaError_t err = encode_v_map<Traits>(p, &v_map);
  if (err == cudaSuccess)
    err = launch_attention_kernel<Traits>(attention_fwd_sm90_kernel<Traits>, dim3(p.schedule.ctas()), p, stream, v_map);
  if (err != cudaSuccess || p.schedule.split_tiles == 0) return err;
  // The combine depends on the tile shapes only: one instance per head dim and element type.
  using CombineTraits = Sm90AttentionKernelTraits<Traits::kHeadDim, typename Traits::Elem>;
  return launch(combine_kv_splits_kernel<CombineTraits>,
                dim3(ceil_div(p.schedule.split_tiles * Traits::kBlockM * Traits::kCombineRowThreads, kCombineThreads)),
                kCombineThreads, 0, stream, /*dependent=*/true, p);
}

cudaError_t launch_attention_forward_sm90(const AttentionParams& p, cudaStream_t stream) {
  return dispatch_sm90_traits(p, [&](auto traits) { return launch_sm90<decltype(traits)>(p, stream); });
}

}  // namespace attention_int8
