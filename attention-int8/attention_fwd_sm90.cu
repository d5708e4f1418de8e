// INT8 attention forward, Hopper kernel (sm_90a): the same algorithm as attention_fwd.cu, with both
// matrix products on warpgroup MMAs (wgmma.mma_async):
//   S = Q_q K_q^T : m64n64k32 s8 x s8 -> s32, Q and K from shared memory by descriptor;
//   O += P V      : m64n(D'+8)k16 f16/bf16 -> f32, P straight from registers (the S accumulator layout
//                   is the A-register layout), V read transposed (MN-major) from shared memory and
//                   followed by 8 columns of ones: the row sums of P come out of the same wgmma.
// D' = D for D = 64 and 128; D = 96 runs as D' = 128 on rows padded with zeros (Traits::kMmaDim). Warp
// specialization (kernel_traits.cuh): a producer thread streams K/V tiles of 64 keys through kStages shared-memory
// stages with bulk and TMA copies on transaction barriers; three (D' = 128) or four (D = 64) consumer warpgroups own
// 64 query rows each. At D' = 128 without the causal mask named barriers
// make the consumers take turns issuing their wgmmas (round robin), so one warpgroup's softmax runs under the
// others' matrix products instead of all doing softmax at the same time (Traits::kTakeTurns). Inside a warpgroup, the P.V wgmma of
// tile j - 1 is issued with S_j and overlaps the softmax of tile j: ptxas waits for it partway through the
// exponentials (SASS), which it did at D = 128 only once Q moved from registers to shared memory
// (benchmarks/RESULTS.md, v14 and v43).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "attention_int8.h"
#include "dispatch.cuh"
#include "kernel_traits.cuh"
#include "ptx.cuh"
#include "quant_math.cuh"
#include "sm90_pipeline.cuh"
#include "swizzle.cuh"
#include "wgmma.cuh"

namespace attention_int8 {
namespace {

template <typename Traits>
struct Sm90Smem {
  char* stage_base;  // kStages stages, then the O staging tiles, then the barriers
  uint64_t* barriers;
  __device__ char* k(int stage) const { return stage_base + stage * Traits::kSmemStageBytes; }
  __device__ char* v(int stage) const { return k(stage) + Traits::kSmemKBytes; }
  __device__ char* ones(int stage) const { return v(stage) + Traits::kSmemVBytes; }  // the box after V's
  __device__ char* o_tile(int consumer_warp) const {
    return stage_base + Traits::kStages * Traits::kSmemStageBytes + consumer_warp * Traits::kSmemOWarpBytes;
  }
  // One full and one empty barrier per stage, for its K and V tiles together (why: the step comment in the kernel).
  __device__ uint64_t* full(int stage) const { return barriers + stage; }
  __device__ uint64_t* empty(int stage) const { return barriers + Traits::kStages + stage; }
};

// Accumulator register i of an m64nN fragment: which of the thread's two rows, and which column (wgmma.cuh).
__device__ __forceinline__ constexpr int row_of(int i) { return (i / 2) % 2; }
__device__ __forceinline__ int col_of(int i) { return 8 * (i / 4) + 2 * (threadIdx.x % 4) + (i % 2); }

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

// log2 units: the running max lags the true max by at most this, so P <= 2^8.
constexpr float kRescaleSlack = 8.f;

// Named barriers 1..kConsumers: consumer warpgroup w waits on 1 + w for its turn to issue wgmmas; its
// predecessor (w - 1, cyclically) arrives there. Each barrier phase counts both warpgroups' threads.
constexpr int kTurnBarrier = 1;
constexpr int kTurnThreads = 2 * 128;
// Named barriers kQTileBarrier + w, right after the turn barriers: consumer w's 128 threads, once its Q tile is
// in shared memory.
template <typename Traits>
constexpr int kQTileBarrier = kTurnBarrier + Traits::kConsumers;

// Tile j of the key loop lives in stage j % kStages; its barriers' phase flips on every pass over the stages.
// (Unsigned: a signed division would add its rounding fix-ups to every step.)
template <typename Traits>
__device__ __forceinline__ int stage_of(int n_block) { return int(uint32_t(n_block) % Traits::kStages); }
template <typename Traits>
__device__ __forceinline__ uint32_t phase_of(int n_block) { return (uint32_t(n_block) / Traits::kStages) & 1; }

// A consumer's 64 Q rows are quantized per token with the quantizer's arithmetic (quant_math.cuh) by its own
// threads, into a shared-memory tile in K's swizzled K-major layout (swizzle.cuh), which the S wgmma reads by
// descriptor for the whole key loop. (Kept in registers as the wgmma's A fragments, Q took 16 registers at
// D = 128 that ptxas then found by waiting for the previous tile's P.V ahead of the exponentials: RESULTS v43.)
// Thread (group, tig) of a warp holds rows group and group + 8 (its accumulator rows) and, of each 32 channels,
// the 8 at 8 tig: a quarter of each row, so a row's amax is a max over its quad. 16-byte loads: a warp's load
// instruction reads 64 contiguous bytes of each of its 8 rows, 2 sectors of one line, where 8-byte loads read 1.
struct QRowScales {
  float scale[2];     // per row, includes sm_scale * log2(e)
  float center_dot[2];  // q_row . k_center (the LSE's smoothing shift); 0 without p.k_center
};

__device__ __forceinline__ float2 to_float2(uint32_t bits, __half) {
  return __half22float2(*reinterpret_cast<__half2*>(&bits));
}
__device__ __forceinline__ float2 to_float2(uint32_t bits, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&bits));
}

// A query row of a tile: rows below 0 (block 0 under the causal row_shift) and from seqlen_q on hold no query.
__device__ __forceinline__ bool is_query_row(const AttentionParams& p, int row) {
  return uint32_t(row) < uint32_t(p.seqlen_q);
}

// The thread's raw Q: raw[r][c] holds Q[rows[r]][32 c + 8 tig + e], e < 8 (16 bytes); rows that hold no query, and
// channels from D on (D = 96's padding), are zeros. Loaded before the CTA's set-up, whose barrier wait then hides
// the latency.
template <typename Traits>
using QRowsRaw = uint4[2][Traits::kQKSteps];

template <typename Traits>
__device__ __forceinline__ void load_q_rows(const AttentionParams& p, int batch, int head, const int (&rows)[2], int tig,
                                            QRowsRaw<Traits>& raw) {
  using Elem = typename Traits::Elem;
  const Elem* q_head = static_cast<const Elem*>(p.q_input) + batch * p.q_view.batch_stride + head * p.q_view.head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const Elem* row = q_head + int64_t(rows[r]) * p.q_view.row_stride + 8 * tig;
#pragma unroll
    for (int c = 0; c < Traits::kQKSteps; ++c)
      raw[r][c] = 32 * c < Traits::kHeadDim && is_query_row(p, rows[r]) ? *reinterpret_cast<const uint4*>(row + 32 * c)
                                                                        : make_uint4(0, 0, 0, 0);
  }
}

// Quantizes the thread's share of the consumer's Q rows into q_tile (rows 16 warp_in_group + group and + 8).
// The caller makes the tile visible to the wgmmas (async proxy fence, then a barrier over the warpgroup).
template <typename Traits>
__device__ __forceinline__ QRowScales quantize_q_rows(const AttentionParams& p, int batch, int head_kv,
                                                      const QRowsRaw<Traits>& raw, char* q_tile, int warp_in_group,
                                                      int group, int tig) {
  using Elem = typename Traits::Elem;
  constexpr int kSteps = Traits::kQKSteps, kPerRow = kSteps * 8;
  // x[r][8 c + e] = Q[rows[r]][32 c + 8 tig + e]
  float x[2][kPerRow];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int c = 0; c < kSteps; ++c) {
      const uint32_t bits[4] = {raw[r][c].x, raw[r][c].y, raw[r][c].z, raw[r][c].w};
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const float2 pair = to_float2(bits[h], Elem{});
        x[r][8 * c + 2 * h] = pair.x, x[r][8 * c + 2 * h + 1] = pair.y;
      }
    }
  }
  QRowScales q;
  uint32_t amax_bits[2] = {0, 0};  // each row's amax and finiteness at once (quant::abs_bits)
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int i = 0; i < kPerRow; ++i) amax_bits[r] = max(amax_bits[r], quant::abs_bits(x[r][i]));
  ptx::quad_reduce(amax_bits, quant::UnsignedMax{});
  float inv_scale[2], prescale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float amax = __uint_as_float(amax_bits[r]);
    const bool finite = amax_bits[r] < quant::kInfBits;
    inv_scale[r] = quant::inv_scale_of(amax);
    prescale[r] = quant::prescale_of(amax);
    q.scale[r] = quant::scale_of(amax, p.q_out_scale, finite);
    q.center_dot[r] = 0.f;
  }
  if (p.lse != nullptr && p.k_center != nullptr) {
    const float* center = p.k_center + (int64_t(batch) * p.heads_kv + head_kv) * Traits::kHeadDim + 8 * tig;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < kPerRow; ++i)
        if (32 * (i / 8) < Traits::kHeadDim) q.center_dot[r] += x[r][i] * center[32 * (i / 8) + i % 8];
    ptx::quad_reduce(q.center_dot, [](float a, float b) { return a + b; });
  }
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (prescale[r] != 1.f) {  // rare (bf16 rows with amax below 2^-64): no multiply in the common case
#pragma unroll
      for (int i = 0; i < kPerRow; ++i) x[r][i] *= prescale[r];
    }
  constexpr int kRowBytes = Traits::kQKRowBytes;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int c = 0; c < kSteps; ++c) {  // bytes 32 c + 8 tig.. of the row: half of one 16-byte chunk
      const int row = warp_in_group * 16 + group + 8 * r, byte = 32 * c + 8 * tig;
      *reinterpret_cast<uint2*>(q_tile + row * kRowBytes + swizzle::chunk_position<kRowBytes>(row, byte / 16) * 16 +
                                byte % 16) = make_uint2(quant::quantize4(&x[r][8 * c], inv_scale[r]),
                                                        quant::quantize4(&x[r][8 * c + 4], inv_scale[r]));
    }
  return q;
}

// Key tiles that query rows below row_end see: all, or under the causal mask those up to the diagonal of
// row_end - 1 (rows past seqlen_q count as the last row).
template <typename Traits>
__device__ __forceinline__ int visible_key_blocks(const AttentionParams& p, int row_end) {
  int n_end = p.seqlen_kv;
  if (p.causal) n_end = max(0, min(n_end, min(row_end, p.seqlen_q) + p.seqlen_kv - p.seqlen_q));
  return (n_end + Traits::kBlockN - 1) / Traits::kBlockN;
}

// The CTA's work: a tile of kBlockM query rows of one (batch, head) against key tiles [n_begin, n_end), all
// it sees or, for a split tile, one range of them (TileSchedule). CTA i takes tile i as long as tiles are whole,
// then the splits of each remaining tile in turn.
struct WorkTile {
  int m_block, head, batch;
  int n_begin, n_end;
  int64_t partial_row0;  // the split's first row in o_partial / row_stats; -1 for a whole tile
};

// In 32-bit unsigned arithmetic (the launcher keeps the grid below 2^31 CTAs): 64-bit divisions are
// subroutine calls, and this runs ahead of the CTA's first Q loads.
__device__ __forceinline__ uint32_t fast_div(uint32_t n, const FastDivisor& d) {
  return (__umulhi(n, d.multiplier) + n) >> d.shift;
}

// Query block, head and batch of tile `tile` (TileSchedule's numbering: chunks of heads, in a chunk the query
// block counted down and the heads fastest).
struct TileCoords {
  int m_block, head, batch;
};
__device__ __forceinline__ TileCoords tile_coords(const TileSchedule& sched, uint32_t tile) {
  const uint32_t chunk = fast_div(tile, sched.chunk_tiles), in_chunk = tile - chunk * sched.chunk_tiles.divisor;
  const uint32_t level = fast_div(in_chunk, sched.chunk_heads);  // query blocks counted down
  const uint32_t bh = chunk * sched.chunk_heads.divisor + (in_chunk - level * sched.chunk_heads.divisor);
  const uint32_t batch = fast_div(bh, sched.heads);
  return {int(sched.query_blocks.divisor - 1 - level), int(bh - batch * sched.heads.divisor), int(batch)};
}

template <typename Traits>
__device__ __forceinline__ WorkTile work_tile(const AttentionParams& p, uint32_t cta) {
  const TileSchedule& sched = p.schedule;
  const uint32_t full_tiles = uint32_t(sched.full_tiles());
  const bool split = cta >= full_tiles;
  const uint32_t unit = cta - full_tiles, tile_of_unit = full_tiles + fast_div(unit, sched.splits);
  const TileCoords c = tile_coords(sched, split ? tile_of_unit : cta);
  WorkTile w;
  w.m_block = c.m_block, w.head = c.head, w.batch = c.batch;
  w.n_begin = 0;
  w.n_end = visible_key_blocks<Traits>(p, sched.block_row0(w.m_block + 1));
  w.partial_row0 = -1;
  if (split) {  // never under the causal mask: the split's range is all its rows see
    const uint32_t n_total = (uint32_t(p.seqlen_kv) + Traits::kBlockN - 1) / Traits::kBlockN;
    const uint32_t s = unit - (tile_of_unit - full_tiles) * sched.splits.divisor;
    w.n_begin = int(s * n_total / sched.splits.divisor);
    w.n_end = int((s + 1) * n_total / sched.splits.divisor);
    w.partial_row0 = int64_t(unit) * Traits::kBlockM;
  }
  return w;
}

// The producer: one thread issues every copy of the CTA (K and V per tile; consumers load K's scale). Tile j of
// the stream is key tile n_begin + j.
template <typename Traits>
__device__ __forceinline__ void produce_tiles(const Sm90Smem<Traits>& smem, const int8_t* k_head,
                                              const CUtensorMap* v_map, int head_kv, int batch, int n_begin,
                                              int n_blocks) {
  constexpr int BN = Traits::kBlockN;
  for (int n_block = 0; n_block < n_blocks; ++n_block) {
    const int stage = stage_of<Traits>(n_block);
    const uint32_t free_parity = phase_of<Traits>(n_block) ^ 1;
    const int64_t n0 = int64_t(n_begin + n_block) * BN;
    sm90::mbarrier_wait(smem.empty(stage), free_parity);
    sm90::mbarrier_arrive_expect_tx(smem.full(stage), Traits::kSmemKBytes + Traits::kSmemVBytes);
    sm90::bulk_copy_g2s(smem.k(stage), k_head + n0 * Traits::kQKRowBytes, Traits::kSmemKBytes, smem.full(stage));
    // Keys past seqlen_kv arrive as zeros (P is 0 there, and 0 * garbage could be NaN). Full boxes
    // count towards the transaction bytes either way.
#pragma unroll
    for (int box = 0; box < Traits::kVBoxes; ++box)
      sm90::tma_load_4d(smem.v(stage) + box * Traits::kSmemVBoxBytes, v_map, box * Traits::kVBoxChannels, int(n0),
                        head_kv, batch, smem.full(stage));
  }
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    attention_fwd_sm90_kernel(const AttentionParams p, const __grid_constant__ CUtensorMap v_map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr float kLn2 = 0.6931471805599453f;
  using Elem = typename Traits::Elem;
  constexpr int D = Traits::kHeadDim, BN = Traits::kBlockN;
  constexpr int kSRegs = Traits::kSAccRegs, kORegs = Traits::kOAccRegs;
  static_assert(kQTileBarrier<Traits> + Traits::kConsumers <= 16, "named barrier ids run out");

  extern __shared__ char smem_raw[];
  // The swizzle atoms (at most 1024 bytes) are anchored at 1024-byte boundaries. Offsetting smem_raw (rather than
  // rounding an integer address) keeps the pointers visibly in shared memory: LDS, not generic loads.
  char* smem_base = smem_raw + (1024 - sm90::smem_addr(smem_raw) % 1024) % 1024;
  const Sm90Smem<Traits> smem{
      smem_base, reinterpret_cast<uint64_t*>(smem_base + Traits::kStages * Traits::kSmemStageBytes + Traits::kSmemOBytes)};

  const int tid = threadIdx.x, lane = tid % 32;
  // Broadcast from lane 0 so the compiler sees a warp-uniform value: wgmma under a branch it thinks
  // divergent gets serialized (ptxas C7520).
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  const WorkTile work = work_tile<Traits>(p, blockIdx.x);
  // The combine kernel (split tiles only) may take the SMs this grid's last wave frees.
  if (p.schedule.split_tiles > 0) ptx::allow_dependents();
  const int head = work.head, batch = work.batch;
  const int head_kv = int(fast_div(uint32_t(head), p.schedule.head_group));
  const int m0 = p.schedule.block_row0(work.m_block);  // negative in block 0 under the causal row_shift
  const int64_t bh_q = int64_t(batch) * p.heads_q + head;
  const int64_t bh_kv = int64_t(batch) * p.heads_kv + head_kv;

  const int causal_offset = p.seqlen_kv - p.seqlen_q;  // query i sees key j iff j <= i + causal_offset
  // The producer streams key tiles n_begin .. n_begin + n_blocks; the loop below counts them from 0 (stages
  // and phases), absolute key positions only enter the mask and the addresses.
  const int n_begin = work.n_begin, n_blocks = max(0, work.n_end - n_begin);

  // A consumer warp owns 16 query rows from warp_row0; a thread, rows group and group + 8 of them (its
  // accumulator rows). Their Q loads go out first, so the set-up below runs under their latency.
  const int consumer = warpgroup - 1, next_consumer = (consumer + 1) % Traits::kConsumers;
  const int warp_in_group = (tid % 128) / 32, group = lane / 4, tig = lane % 4;
  constexpr int kRows = Traits::kConsumerRows;
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
  // The sum columns of every stage: the P.V wgmma reads channels 0-7 of the ones box, one 16-byte chunk of each
  // key's 128-byte row, at its swizzled position (the V boxes' 128-byte swizzle); the rest of the box stays unread.
  static_assert(Traits::kSumColumns * sizeof(Elem) == 16, "the sum columns are one 16-byte chunk a key");
  const uint32_t one2 = ptx::pack2<Elem>(1.f, 1.f);
  for (int i = tid; i < Traits::kStages * BN; i += Traits::kThreads) {
    const int key = i % BN;
    *reinterpret_cast<uint4*>(smem.ones(i / BN) + key * 128 + swizzle::chunk_position<128>(key, 0) * 16) =
        make_uint4(one2, one2, one2, one2);
  }
  sm90::fence_proxy_async_smem();
  __syncthreads();

  if (warpgroup == 0) {
    sm90::release_registers<Traits::kProducerRegs>();
    if (tid == 0) {
      ptx::wait_for_predecessor();  // K and its scales come from the quantizer
      produce_tiles<Traits>(smem, p.k + bh_kv * p.seqlen_kv_pad * Traits::kQKRowBytes, &v_map, head_kv, batch, n_begin,
                            n_blocks);
    }
    return;
  }
  sm90::claim_registers<Traits::kConsumerRegs>();

  ptx::wait_for_predecessor();  // before k_center, K's scales and any global write (dispatch.cuh's launch())
  // The Q tile lives in the consumer's O staging tiles, which the epilogue uses only after the last wgmma.
  char* q_tile = smem.o_tile(consumer * 4);
  const QRowScales q = quantize_q_rows<Traits>(p, batch, head_kv, q_raw, q_tile, warp_in_group, group, tig);
  sm90::fence_proxy_async_smem();  // the generic-proxy stores, before the wgmmas read them
  sm90::named_barrier_sync(kQTileBarrier<Traits> + consumer, 128);
  const uint64_t q_desc = ptx::keep_in_register(wgmma::make_desc_k_major<Traits::kQKRowBytes>(q_tile));
  const float* k_scales = p.k_scale + bh_kv * (p.seqlen_kv_pad / kKeyScaleTokens) + n_begin;  // one per key tile
  // Operand descriptors of stage 0; steps and stages are offsets from them. Kept in registers for the whole
  // loop: ptxas would otherwise rebuild both from the shared-window base in every step (16 instructions).
  const uint64_t k_desc = ptx::keep_in_register(wgmma::make_desc_k_major<Traits::kQKRowBytes>(smem.k(0)));
  const uint64_t v_desc = ptx::keep_in_register(wgmma::make_desc<128>(smem.v(0), Traits::kSmemVBoxBytes, 8 * 128));

  float o_acc[kORegs];
#pragma unroll
  for (int i = 0; i < kORegs; ++i) o_acc[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  // P of the previous tile in k16 A-fragment order (registers 8kk..8kk+7 of an S accumulator hold
  // keys 16kk..16kk+15). It feeds the P.V wgmma issued with this tile's S, so it must stay untouched
  // until that wgmma completes.
  uint32_t p_frag[Traits::kPVSteps][4];

  // Issues O += P V-tile for tile `n_block` (asynchronous; one commit group). Its V has landed: the step of
  // that tile waited for its stage.
  auto issue_pv = [&](int n_block) {
    const uint64_t v_stage_desc = wgmma::advance_desc(v_desc, stage_of<Traits>(n_block) * Traits::kSmemStageBytes);
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk)  // keys 16 kk.. are 128-byte rows 16 kk.. of every box
      wgmma::mma_pv<Traits::kPVN, Elem>(o_acc, p_frag[kk], wgmma::advance_desc(v_stage_desc, kk * 16 * 128));
    wgmma::commit_group();
  };
  // This consumer's turn to issue wgmmas, and handing it on (no-ops without turn-taking).
  auto take_turn = [&] {
    if constexpr (Traits::kTakeTurns) sm90::named_barrier_sync(kTurnBarrier + consumer, kTurnThreads);
  };
  auto pass_turn = [&] {
    if constexpr (Traits::kTakeTurns) sm90::named_barrier_arrive(kTurnBarrier + next_consumer, kTurnThreads);
  };
  auto release = [&](uint64_t* empty) {
    __syncwarp();
    if (lane == 0) sm90::mbarrier_arrive(empty);
  };

  // One step of the key loop, for tile j. It waits for tile j's stage, K_j and V_j on one barrier: V_j is needed
  // only in the next step, but tiles land long before they are needed, and each barrier test is a round trip of
  // ~80 SM cycles on the step's serial path (separate K and V barriers cost two a step).
  // S_j = Q K_j^T and O += P_{j-1} V_{j-1} go to the tensor cores
  // back to back; the softmax of S_j needs only S_j, P_{j-1} V_{j-1} may still be computing. Between the
  // wgmma fence and the final wait the body must be branch-free: ptxas serializes the wgmmas
  // otherwise. Hence compile-time flags for the first tile (no P.V yet) and for masked tiles.
  auto step = [&](int n_block, auto is_first, auto is_masked) {
    constexpr bool kFirst = decltype(is_first)::value, kMasked = decltype(is_masked)::value;
    const int stage = stage_of<Traits>(n_block);
    const float k_scale = __ldg(k_scales + n_block);  // needed after the wgmma: its latency hides there
    sm90::mbarrier_wait(smem.full(stage), phase_of<Traits>(n_block));
    take_turn();
    int32_t s_int[kSRegs];
    wgmma::fence_operands(s_int);
    wgmma::fence_operands(o_acc);
    wgmma::fence();
    const uint64_t k_stage_desc = wgmma::advance_desc(k_desc, stage * Traits::kSmemStageBytes);
#pragma unroll
    for (int ks = 0; ks < Traits::kQKSteps; ++ks)
      wgmma::mma_qk_s8<BN>(s_int, wgmma::advance_desc(q_desc, ks * 32), wgmma::advance_desc(k_stage_desc, ks * 32), ks);
    wgmma::commit_group();
    if constexpr (!kFirst) issue_pv(n_block - 1);
    pass_turn();
    wgmma::wait_group<kFirst ? 0 : 1>();  // S_j done (groups retire in order); P_{j-1} V_{j-1} may still run
    wgmma::fence_operands(s_int);

    // Online softmax (base 2) with a lazy maximum: the running max m only moves when a tile's max exceeds
    // it by more than kRescaleSlack, so P = 2^(l - m) <= 2^kRescaleSlack stays well inside fp16/bf16 and
    // the fp32 sums, and O with its sums (kORegs multiplies per thread) is rescaled only in the rare tiles
    // where m moved. The sums add the fp16/bf16 P that multiplies V (the sum columns of P.V).
    // All logits a thread holds of one row share one scale c (the row's against this key block,
    // quant_math.cuh), so the tile max is taken on the exact integers S, and each exponent is one FMA:
    //   l - m = (S - S_max) * c + (t - m),   t = S_max * c (rounded) the tile max, the row's logit max here.
    // S - S_max is exact (an integer add, then 1.5 * 2^23 + (S - S_max) is that float exactly, see
    // ptx::SmallIntScale), and so is -1.5 * 2^23 * c; the FMA rounds once. At the tile holding the row's
    // max, t - m = 0 and P of the max is exactly 1, even at the ~1e10 logits of fp16 extremes, where
    // rounding the max's logit on its own would leave a residual of 2^13 in the exponent. In other tiles,
    // t - m rides on -1.5 * 2^23 * c and is resolved to within 0.75 c, one integer step of S: negligible at
    // ordinary logits (c ~ 1e-5), but at fp16 extremes (c ~ 1e4) a key less than a step below the row's max
    // may weigh 1 instead of 2^-gap ~ 0, well inside the INT8 logits' own uncertainty of many steps.
    // Maxima are balanced trees (not 16-long dependency chains), both rows side by side: while the other
    // warpgroups' wgmmas run, this warp is often its scheduler's only eligible one.
    constexpr int32_t kMaskedLogit = INT32_MIN;  // below any S; only the tile max sees it
    if constexpr (kMasked) {
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) {
        const int key = (n_begin + n_block) * BN + col_of(i), row = rows[row_of(i)];
        if (key >= p.seqlen_kv || (p.causal && key > row + causal_offset)) s_int[i] = kMaskedLogit;
      }
    }
    int32_t tile_max_int[2] = {accumulator_row_max<0>(s_int), accumulator_row_max<1>(s_int)};
    ptx::quad_reduce(tile_max_int, [](int32_t a, int32_t b) { return max(a, b); });
    float c[2], bias[2], alpha[2];
    uint32_t minus_max_bits[2];  // magic - S_max: S + this is the bit pattern of 1.5 * 2^23 + (S - S_max)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const ptx::SmallIntScale logit(quant::logit_scale(q.scale[r], k_scale));
      c[r] = logit.scale;
      // Only a masked tile can be all masked; before it, unmasked tiles have made every row max finite.
      const float tile_max = kMasked && tile_max_int[r] == kMaskedLogit ? -INFINITY : logit(tile_max_int[r]);
      const float m_new = tile_max > row_max[r] + kRescaleSlack ? tile_max : row_max[r];
      const float base = kMasked && m_new == -INFINITY ? 0.f : m_new;  // no key seen yet: 2^(-inf - 0) = 0, not NaN
      alpha[r] = ptx::exp2_approx(row_max[r] - base);
      row_max[r] = m_new;
      bias[r] = logit.neg_magic_scale + (tile_max - base);
      minus_max_bits[r] = uint32_t(ptx::kSmallIntMagicBits) - uint32_t(tile_max_int[r]);
    }
    // P overwrites S (masked keys: 0).
    float s[kSRegs];
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) {
      const int r = row_of(i);
      s[i] = ptx::exp2_approx(fmaf(__uint_as_float(uint32_t(s_int[i]) + minus_max_bits[r]), c[r], bias[r]));
      if constexpr (kMasked) s[i] = s_int[i] == kMaskedLogit ? 0.f : s[i];
    }

    // O and P_{j-1} are free once P_{j-1} V_{j-1} has retired: rescale O to the new max, stage P_j.
    // Pinning P first keeps NVVM from sinking the softmax below the wait (ptxas may still hoist the wait).
    wgmma::fence_operands(s);
    wgmma::wait_group<0>();
    wgmma::fence_operands(o_acc);
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk) wgmma::fence_operands(p_frag[kk]);
    if constexpr (!kFirst) release(smem.empty(stage_of<Traits>(n_block - 1)));  // K_j-1 and V_j-1 are consumed
    if constexpr (!kFirst) {  // on the first tile O is still 0
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < kORegs; ++i) o_acc[i] *= alpha[row_of(i)];
      }
    }
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) p_frag[kk][j] = ptx::pack2<Elem>(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
  };

  // This warpgroup's own tiles: none without query rows, under the causal mask up to its last row's
  // diagonal (the CTA streams up to the last consumer's, up to kConsumers - 1 tiles more). Tiles that need no
  // mask come first, up to its first row's diagonal: the key-length tail and the causal diagonal are at the end.
  const int n_own = consumer < first_row_consumer || consumer >= end_row_consumer
                        ? 0
                        : max(0, min(work.n_end, visible_key_blocks<Traits>(p, first_row + kRows)) - n_begin);
  int n_unmasked = p.seqlen_kv / BN;
  if (p.causal) n_unmasked = min(n_unmasked, max(0, (first_row + causal_offset + 1) / BN));
  n_unmasked = max(0, min(n_own, n_unmasked - n_begin));
  using True = std::true_type;
  using False = std::false_type;

  if (n_blocks > 0) {
    // Turn-taking (D = 128), round robin from consumer 0: every step waits for its own turn and then hands the
    // turn to the next consumer. The last consumer opens consumer 0's first turn and consumer 0 takes
    // one last turn at the end, so arrivals and waits match on every barrier.
    if (Traits::kTakeTurns && consumer == Traits::kConsumers - 1) sm90::named_barrier_arrive(kTurnBarrier, kTurnThreads);
    if (n_own > 0) {
      if (n_unmasked > 0) {
        step(0, True{}, False{});
      } else {
        step(0, True{}, True{});
      }
    }
    for (int n_block = 1; n_block < n_unmasked; ++n_block) step(n_block, False{}, False{});
    for (int n_block = max(1, n_unmasked); n_block < n_own; ++n_block) step(n_block, False{}, True{});
    // The tiles past this warpgroup's rows are masked for all of them: only its turns, so the others get
    // the tensor cores sooner. Nothing to release: a stage is reused kStages tiles later, past n_blocks (and a
    // consumer without rows is not counted by the empty barriers).
    static_assert(Traits::kStages >= Traits::kConsumers, "stages past a consumer's own tiles are never reused");
    if constexpr (Traits::kTakeTurns) {
      for (int n_block = n_own; n_block < n_blocks; ++n_block) take_turn(), pass_turn();
    }

    if (n_own > 0) {  // the last own tile's P V (its stage needs no release either)
      wgmma::fence_operands(o_acc);
      wgmma::fence();
      issue_pv(n_own - 1);
      wgmma::wait_group<0>();
      wgmma::fence_operands(o_acc);
    }
    if (Traits::kTakeTurns && consumer == 0) sm90::named_barrier_sync(kTurnBarrier, kTurnThreads);
  }

  // Epilogue: normalize, store O in the input dtype, and the natural-log LSE. Every thread holds its rows'
  // sums: the accumulators of the ones columns (register kOutRegs + 2r is row r, column kMmaDim + 2 tig).
  // O goes through the warp's staging tile: straight from the accumulators, a warp's store would write
  // 16 bytes in each of 8 rows (4x the store instructions of whole 16-byte chunks, in half sectors),
  // and at short sequences that epilogue took ~5% of a CTA's time (RESULTS v19).
  // A split tile's CTA writes its rows' fp32 O and statistics to the partial buffers instead, for the combine kernel
  // (a quad's 8-byte stores fill whole 32-byte sectors there).
  const bool partial = work.partial_row0 >= 0;
  char* o_tile = smem.o_tile(consumer * 4 + warp_in_group);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = o_acc[Traits::kOutRegs + 2 * r];
    const float inv_sum = sum == 0.f ? 0.f : 1.f / sum;  // no visible key: zeros; NaN stays NaN
    const float lse_shift = p.sm_scale * q.center_dot[r];
    if (partial) {
      if (is_query_row(p, rows[r])) {
        const int64_t partial_row = work.partial_row0 + (rows[r] - m0);
        float* o_row = p.o_partial + partial_row * D;
#pragma unroll
        for (int i = 2 * r; i < Traits::kOutRegs; i += 4)
          if (8 * (i / 4) < D)  // D = 96: the padding channels stay behind
            *reinterpret_cast<float2*>(o_row + 8 * (i / 4) + 2 * tig) = make_float2(o_acc[i] * inv_sum, o_acc[i + 1] * inv_sum);
        if (tig == 0) p.row_stats[partial_row] = SplitRowStats{row_max[r], sum, lse_shift};
      }
      continue;
    }
    char* tile_row = o_tile + (group + 8 * r) * Traits::kOStageRowBytes;
#pragma unroll
    for (int i = 2 * r; i < Traits::kOutRegs; i += 4) {
      const int col = 8 * (i / 4) + 2 * tig;
      *reinterpret_cast<uint32_t*>(tile_row + col * sizeof(Elem)) =
          ptx::pack2<Elem>(o_acc[i] * inv_sum, o_acc[i + 1] * inv_sum);
    }
    if (p.lse != nullptr && tig == 0 && is_query_row(p, rows[r]))
      p.lse[bh_q * p.seqlen_q + rows[r]] = sum == 0.f ? -INFINITY : (row_max[r] + log2f(sum)) * kLn2 + lse_shift;
  }
  if (partial) return;
  __syncwarp();
  constexpr int kRowChunks = Traits::kORowBytes / 16;
  Elem* o_head = static_cast<Elem*>(p.o) + batch * p.o_view.batch_stride + head * p.o_view.head_stride;
#pragma unroll
  for (int c = lane; c < 16 * kRowChunks; c += 32) {  // consecutive lanes: consecutive chunks of a row
    const int tile_row = c / kRowChunks, chunk = c % kRowChunks;
    if (is_query_row(p, warp_row0 + tile_row))
      *reinterpret_cast<uint4*>(o_head + int64_t(warp_row0 + tile_row) * p.o_view.row_stride + chunk * (16 / sizeof(Elem))) =
          *reinterpret_cast<const uint4*>(o_tile + tile_row * Traits::kOStageRowBytes + chunk * 16);
  }
#else
  __trap();  // only the sm_90a build has wgmma; the host launches this kernel only on compute capability 9.0
#endif
}

// Merges the splits of the split tiles (TileSchedule's formulas): D / 4 consecutive threads a query row, 4 channels
// each (at D = 96 a row may straddle two blocks). A NaN reaches O through l_s and O_s (fmaxf skips a NaN m, but l is
// NaN then too); a row without any visible key gets zeros and -inf, as unsplit. Reads what the attention kernel just
// wrote, so through L2 (ld.global.cg), after waiting for it.
constexpr int kCombineThreads = 128;
template <typename Traits>
__global__ void __launch_bounds__(kCombineThreads) combine_kv_splits_kernel(const AttentionParams p) {
  using Elem = typename Traits::Elem;
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr int D = Traits::kHeadDim, BM = Traits::kBlockM, kRowThreads = Traits::kCombineRowThreads;
  const TileSchedule& sched = p.schedule;
  const int64_t thread = int64_t(blockIdx.x) * kCombineThreads + threadIdx.x;
  const int64_t row = thread / kRowThreads;  // of split_tiles * BM
  const int col = int(thread % kRowThreads) * 4;
  if (row >= sched.split_tiles * BM) return;
  const int splits = int(sched.splits.divisor), row_in_tile = int(row % BM);
  const TileCoords tile = tile_coords(sched, uint32_t(sched.full_tiles() + row / BM));
  const int q_row = sched.block_row0(tile.m_block) + row_in_tile, head = tile.head, batch = tile.batch;
  if (!is_query_row(p, q_row)) return;
  const int64_t partial_row0 = row / BM * splits * BM + row_in_tile;  // split s: + s * BM

  ptx::wait_for_predecessor();
  SplitRowStats stats[kMaxKvSplits];
  float max_log2 = -INFINITY;
#pragma unroll
  for (int s = 0; s < kMaxKvSplits; ++s) {
    if (s < splits) {
      const float* st = reinterpret_cast<const float*>(p.row_stats + partial_row0 + s * BM);
      stats[s] = SplitRowStats{__ldcg(st), __ldcg(st + 1), __ldcg(st + 2)};
    } else {
      stats[s] = SplitRowStats{-INFINITY, 0.f, 0.f};
    }
    max_log2 = fmaxf(max_log2, stats[s].max_log2);
  }
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float weight_sum = 0.f;
#pragma unroll
  for (int s = 0; s < kMaxKvSplits; ++s) {
    if (s >= splits) break;
    // A split without a visible key has l = 0 and m = -inf (M may be -inf as well).
    const float w = stats[s].sum == 0.f ? 0.f : exp2f(stats[s].max_log2 - max_log2) * stats[s].sum;
    const float4 o = __ldcg(reinterpret_cast<const float4*>(p.o_partial + (partial_row0 + s * BM) * D + col));
    acc.x += w * o.x, acc.y += w * o.y, acc.z += w * o.z, acc.w += w * o.w;
    weight_sum += w;
  }
  const float inv = weight_sum == 0.f ? 0.f : 1.f / weight_sum;
  Elem* o_row = static_cast<Elem*>(p.o) + batch * p.o_view.batch_stride + head * p.o_view.head_stride +
                int64_t(q_row) * p.o_view.row_stride;
  *reinterpret_cast<uint2*>(o_row + col) =
      make_uint2(ptx::pack2<Elem>(acc.x * inv, acc.y * inv), ptx::pack2<Elem>(acc.z * inv, acc.w * inv));
  if (p.lse != nullptr && col == 0)
    p.lse[(int64_t(batch) * p.heads_q + head) * p.seqlen_q + q_row] =
        weight_sum == 0.f ? -INFINITY : (max_log2 + log2f(weight_sum)) * kLn2 + stats[0].lse_shift;
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
// head, batch), read in boxes of 64 keys x kVBoxChannels channels with the 128-byte swizzle.
template <typename Traits>
cudaError_t encode_v_map(const AttentionParams& p, CUtensorMap* map) {
  *map = CUtensorMap{};
  if (p.seqlen_kv == 0) return cudaSuccess;  // no key tile: the map is never read
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  constexpr uint64_t kElemBytes = sizeof(typename Traits::Elem);
  const cuuint64_t dims[4] = {cuuint64_t(p.head_dim), cuuint64_t(p.seqlen_kv), cuuint64_t(p.heads_kv),
                              cuuint64_t(p.batch)};
  const cuuint64_t strides[3] = {cuuint64_t(p.v_view.row_stride) * kElemBytes,
                                 cuuint64_t(p.v_view.head_stride) * kElemBytes,
                                 cuuint64_t(p.v_view.batch_stride) * kElemBytes};
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

// Causal tiles are not split but ordered longest first, in chunks of heads (TileSchedule): this many heads, the
// most whose K and V take at most half the L2 and that divide the grid's heads evenly (benchmarks/RESULTS.md, v56).
static int causal_chunk_heads(const AttentionParams& p, int head_dim, int64_t l2_bytes) {
  const int64_t bh = int64_t(p.batch) * p.heads_q;
  const int64_t kv_head_bytes = int64_t(p.seqlen_kv) * head_dim * (1 + 2);  // INT8 K and 16-bit V
  const int64_t fit = std::max<int64_t>(1, l2_bytes / 2 * (p.heads_q / p.heads_kv) / std::max<int64_t>(1, kv_head_bytes));
  int64_t heads = std::min(bh, fit);
  while (bh % heads != 0) --heads;  // whole chunks: the decode divides by one chunk size
  return int(heads);
}

// Only the tail, the tiles % S tiles of the last, partial wave on S SMs, is split: s ways, it runs in
// ceil(tail * s / S) waves of 1 / s of a tile's time each (plus each split's fixed cost: Q, set-up, epilogue,
// ~10k cycles, and the combine). The smallest s with the shortest such time wins, so a tail of at most S / 2
// tiles takes 1/2 (s = 2) or less, one of at most 2S / 3 takes 2/3 (s = 3), and a fuller one is not split.
// Each split keeps at least kMinKeyTilesPerSplit key tiles, so that the fixed cost stays a small part of it.
template <typename Traits>
TileSchedule tile_schedule(const AttentionParams& p, int sm_count, int64_t l2_bytes, int forced_splits) {
  constexpr int kMinKeyTilesPerSplit = 8;
  TileSchedule sched;
  sched.block_m = Traits::kBlockM;
  const int query_blocks = int(ceil_div(p.seqlen_q, Traits::kBlockM));
  sched.row_shift = TileSchedule::row_shift_of(p.causal, p.seqlen_q, Traits::kBlockM, Traits::kConsumerRows);
  sched.tiles = int64_t(query_blocks) * p.heads_q * p.batch;
  sched.query_blocks = FastDivisor(uint32_t(query_blocks));
  sched.heads = FastDivisor(uint32_t(p.heads_q));
  sched.head_group = FastDivisor(uint32_t(p.heads_q / p.heads_kv));
  const int chunk_heads = p.causal && sched.tiles > 0 ? causal_chunk_heads(p, Traits::kHeadDim, l2_bytes) : 1;
  sched.chunk_heads = FastDivisor(uint32_t(chunk_heads));
  sched.chunk_tiles = FastDivisor(uint32_t(int64_t(chunk_heads) * query_blocks));  // <= tiles (the launcher caps)
  const int key_tiles = int(ceil_div(p.seqlen_kv, Traits::kBlockN));
  if (p.causal || sched.tiles == 0 || key_tiles < 2 || sm_count < 1) return sched;
  int splits = 1;
  int64_t split_tiles = sched.tiles;
  if (forced_splits > 0) {
    splits = std::min({forced_splits, kMaxKvSplits, key_tiles});
  } else {
    split_tiles = sched.tiles % sm_count;
    const int max_splits = std::min(kMaxKvSplits, key_tiles / kMinKeyTilesPerSplit);
    int64_t best_waves = 1;  // ceil(tail * splits / S): the time is best_waves / splits tiles
    for (int s = 2; s <= max_splits && split_tiles > 0; ++s) {
      const int64_t waves = ceil_div(split_tiles * s, sm_count);
      if (waves * splits < best_waves * s) splits = s, best_waves = waves;
    }
  }
  if (splits >= 2) sched.splits = FastDivisor(uint32_t(splits)), sched.split_tiles = split_tiles;
  return sched;
}

TileSchedule tile_schedule_sm90(const AttentionParams& p, int sm_count, int64_t l2_bytes, int forced_splits) {
  // Tile shapes do not depend on the element type.
  switch (p.head_dim) {
    case 64: return tile_schedule<Sm90AttentionKernelTraits<64, __half>>(p, sm_count, l2_bytes, forced_splits);
    case 96: return tile_schedule<Sm90AttentionKernelTraits<96, __half>>(p, sm_count, l2_bytes, forced_splits);
    default: return tile_schedule<Sm90AttentionKernelTraits<128, __half>>(p, sm_count, l2_bytes, forced_splits);
  }
}

// Checks the schedule against the traits' tile shapes and launches the kernel (and the combine of a split tail).
template <typename Traits>
static cudaError_t launch_sm90(const AttentionParams& p, cudaStream_t stream) {
  const TileSchedule& sched = p.schedule;
  // The schedule must be tile_schedule_sm90's for these params, with its buffers.
  if (sched.block_m != Traits::kBlockM || sched.tiles != ceil_div(p.seqlen_q, Traits::kBlockM) * p.heads_q * p.batch ||
      sched.query_blocks.divisor != ceil_div(p.seqlen_q, Traits::kBlockM) || sched.heads.divisor != uint32_t(p.heads_q) ||
      sched.row_shift != TileSchedule::row_shift_of(p.causal, p.seqlen_q, Traits::kBlockM, Traits::kConsumerRows) ||
      sched.head_group.divisor != uint32_t(p.heads_q / p.heads_kv) || sched.chunk_heads.divisor < 1 ||
      (p.batch * p.heads_q) % sched.chunk_heads.divisor != 0 || (!p.causal && sched.chunk_heads.divisor != 1) ||
      sched.chunk_tiles.divisor != sched.chunk_heads.divisor * sched.query_blocks.divisor ||
      sched.splits.divisor < 1 || sched.splits.divisor > kMaxKvSplits || sched.split_tiles < 0 || sched.split_tiles > sched.tiles ||
      sched.ctas() > INT32_MAX || (sched.split_tiles > 0 && (p.o_partial == nullptr || p.row_stats == nullptr)))
    return cudaErrorInvalidValue;
  CUtensorMap v_map;
  cudaError_t err = encode_v_map<Traits>(p, &v_map);
  if (err == cudaSuccess)
    err = launch_attention_kernel<Traits>(attention_fwd_sm90_kernel<Traits>, dim3(sched.ctas()), p, stream, v_map);
  if (err != cudaSuccess || sched.split_tiles == 0) return err;
  // The combine depends on the tile shapes only: one instance per head dim and element type.
  using CombineTraits = Sm90AttentionKernelTraits<Traits::kHeadDim, typename Traits::Elem>;
  return launch(combine_kv_splits_kernel<CombineTraits>,
                dim3(ceil_div(sched.split_tiles * Traits::kBlockM * Traits::kCombineRowThreads, kCombineThreads)),
                kCombineThreads, 0, stream, /*dependent=*/true, p);
}

cudaError_t launch_attention_forward_sm90(const AttentionParams& p, cudaStream_t stream) {
  return dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    constexpr int D = decltype(head_dim)::value;
    if constexpr (!sm90_kernel_supported(9, 0, D)) {
      return cudaErrorInvalidValue;
    } else {
      return dispatch_elem(p.dtype, [&](auto elem) {
        // Turn-taking only at D' = 128 without the causal mask (kernel_traits.cuh).
        const auto launch_with = [&](auto take_turns) {
          return launch_sm90<Sm90AttentionKernelTraits<D, decltype(elem), decltype(take_turns)::value>>(p, stream);
        };
        if constexpr (Sm90AttentionKernelTraits<D, decltype(elem)>::kMmaDim == 128) {
          if (!p.causal) return launch_with(std::true_type{});
        }
        return launch_with(std::false_type{});
      });
    }
  });
}

}  // namespace attention_int8
