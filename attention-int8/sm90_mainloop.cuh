// The Hopper kernel's pipeline: the shared-memory stages, the producer that streams K and V tiles into them, and
// the consumer warpgroups' key loop (S = Q K^T and O += P V on wgmma, with the softmax of sm90_softmax.cuh
// between them).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "attention_common.cuh"
#include "ptx.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_q_tile.cuh"
#include "sm90_softmax.cuh"
#include "swizzle.cuh"
#include "wgmma.cuh"

namespace attention_int8 {

template <typename Traits>
struct Sm90Smem {
  char* stage_base;  // the 1024-byte aligned base of Traits' layout
  __device__ char* k(int stage) const { return stage_base + stage * Traits::kSmemStageBytes; }
  __device__ char* v(int stage) const { return k(stage) + Traits::kSmemKBytes; }
  __device__ char* ones(int stage) const { return v(stage) + Traits::kSmemVBytes; }  // the box after V's
  __device__ char* o_tile(int consumer_warp) const {
    return stage_base + Traits::kSmemOOffset + consumer_warp * Traits::kSmemOWarpBytes;
  }
  __device__ float* key_bias(int stage) const {
    return reinterpret_cast<float*>(stage_base + Traits::kSmemBiasOffset + stage * Traits::kSmemBiasBytes);
  }
  // One full and one empty barrier per stage, for its K and V tiles together: each barrier test is a round trip
  // on the key loop's serial path, and tiles land long before they are needed.
  __device__ uint64_t* full(int stage) const { return barrier(stage); }
  __device__ uint64_t* empty(int stage) const { return barrier(Traits::kStages + stage); }
  __device__ uint64_t* barrier(int i) const {
    return reinterpret_cast<uint64_t*>(stage_base + Traits::kSmemBarrierOffset) + i;
  }
};

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

// Writes the sum columns of every stage once: the P.V wgmma reads channels 0-7 of the ones box, one 16-byte chunk
// of each key's 128-byte row, at its swizzled position (the V boxes' 128-byte swizzle); the rest stays unread.
template <typename Traits>
__device__ __forceinline__ void fill_sum_columns(const Sm90Smem<Traits>& smem) {
  using Elem = typename Traits::Elem;
  constexpr int BN = Traits::kBlockN;
  static_assert(Traits::kSumColumns * sizeof(Elem) == 16, "the sum columns are one 16-byte chunk a key");
  const uint32_t one2 = ptx::pack2<Elem>(1.f, 1.f);
  for (int i = threadIdx.x; i < Traits::kStages * BN; i += Traits::kThreads) {
    const int key = i % BN;
    *reinterpret_cast<uint4*>(smem.ones(i / BN) + key * 128 + swizzle::chunk_position<128>(key, 0) * 16) =
        make_uint4(one2, one2, one2, one2);
  }
}

// The producer: one thread issues every copy of the CTA (K and V per tile, and under Q smoothing the tile's key
// biases, key_bias_head non-null; consumers load K's scale). Tile j of the stream is key tile n_begin + j.
template <typename Traits>
__device__ __forceinline__ void produce_tiles(const Sm90Smem<Traits>& smem, const int8_t* k_head,
                                              const float* key_bias_head, const CUtensorMap* v_map, int v_key0,
                                              int head_kv, int v_batch, int n_begin, int n_blocks) {
  constexpr int BN = Traits::kBlockN;
  const int bias_bytes = key_bias_head != nullptr ? Traits::kSmemBiasBytes : 0;
  for (int n_block = 0; n_block < n_blocks; ++n_block) {
    const int stage = stage_of<Traits>(n_block);
    const uint32_t free_parity = phase_of<Traits>(n_block) ^ 1;
    const int64_t n0 = int64_t(n_begin + n_block) * BN;
    sm90::mbarrier_wait(smem.empty(stage), free_parity);
    sm90::mbarrier_arrive_expect_tx(smem.full(stage), Traits::kSmemKBytes + Traits::kSmemVBytes + bias_bytes);
    sm90::bulk_copy_g2s(smem.k(stage), k_head + n0 * Traits::kQKRowBytes, Traits::kSmemKBytes, smem.full(stage));
    if (bias_bytes > 0) sm90::bulk_copy_g2s(smem.key_bias(stage), key_bias_head + n0, bias_bytes, smem.full(stage));
    // Keys past seqlen_kv arrive as zeros (P is 0 there, and 0 * garbage could be NaN). Full boxes
    // count towards the transaction bytes either way.
#pragma unroll
    for (int box = 0; box < Traits::kVBoxes; ++box)
      sm90::tma_load_4d(smem.v(stage) + box * Traits::kSmemVBoxBytes, v_map, box * Traits::kVBoxChannels,
                        v_key0 + int(n0), head_kv, v_batch, smem.full(stage));
  }
}

// Tags of a key-loop step: the loop's first tile has no previous P.V to issue behind its S; a masked tile holds
// keys that some of the consumer's rows do not see. Tags of a key loop: whether its logits carry Q smoothing's key
// biases.
struct FirstTile {};
struct LaterTile {};
struct Unmasked {};
struct Masked {};
struct Unbiased {};
struct Biased {};

// One consumer warpgroup's key loop over the CTA's stream of key tiles. In step j, S_j = Q K_j^T and
// O += P_{j-1} V_{j-1} go to the tensor cores back to back, and the softmax of S_j runs while P_{j-1} V_{j-1} may
// still be computing. At D' = 128 without the mask the consumers take turns issuing their wgmmas (round robin on
// named barriers), so one warpgroup's softmax runs under the others' matrix products.
template <typename Traits>
struct Sm90Mainloop {
  using Elem = typename Traits::Elem;
  static constexpr int kSRegs = Traits::kSAccRegs, kORegs = Traits::kOAccRegs;

  const Sm90Smem<Traits> smem;  // by value: its two pointers stay in registers, with no reload through a reference
  const int consumer, next_consumer, lane;
  const int n_begin;        // the stream's first key tile
  const float* k_scales;    // one per key tile of the stream
  const float* key_bias_maxima;  // Q smoothing: one per key tile of the stream (read by Biased loops only)
  const uint64_t q_desc, k_desc, v_desc;  // of the Q tile and of stage 0's K and V
  // P of the previous tile in k16 A-fragment order (registers 8kk..8kk+7 of an S accumulator hold keys
  // 16kk..16kk+15). It feeds the P.V wgmma issued with this tile's S, so it must stay untouched until that
  // wgmma completes.
  uint32_t p_frag[Traits::kPVSteps][4];

  // Descriptors are built once and kept in registers for the whole loop: ptxas would otherwise rebuild them from
  // the shared-window base in every step.
  __device__ __forceinline__ Sm90Mainloop(const Sm90Smem<Traits>& smem_, const char* q_tile, int consumer_, int n_begin_,
                                          const float* k_scales_head, const float* key_bias_max_head)
      : smem(smem_),
        consumer(consumer_),
        next_consumer((consumer_ + 1) % Traits::kConsumers),
        lane(threadIdx.x % 32),
        n_begin(n_begin_),
        k_scales(k_scales_head + n_begin_),
        key_bias_maxima(key_bias_max_head + n_begin_),
        q_desc(ptx::keep_in_register(wgmma::make_desc_k_major<Traits::kQKAtomBytes>(q_tile))),
        k_desc(ptx::keep_in_register(wgmma::make_desc_k_major<Traits::kQKAtomBytes>(smem_.k(0)))),
        v_desc(ptx::keep_in_register(wgmma::make_desc<128>(smem_.v(0), Traits::kSmemVBoxBytes, 8 * 128))) {}

  // Where k32 step ks of S starts in a Q or K tile (in the second panel from step 4 on at D' = 256).
  __device__ __forceinline__ static constexpr uint32_t k_step_bytes(int ks) {
    return swizzle::chunk_offset<Traits::kQKRowBytes, kSm90TileRows>(0, 2 * ks);
  }

  // This consumer's turn to issue wgmmas, and handing it on (no-ops without turn-taking).
  __device__ __forceinline__ void take_turn() const {
    if constexpr (Traits::kTakeTurns) sm90::named_barrier_sync(kTurnBarrier + consumer, kTurnThreads);
  }
  __device__ __forceinline__ void pass_turn() const {
    if constexpr (Traits::kTakeTurns) sm90::named_barrier_arrive(kTurnBarrier + next_consumer, kTurnThreads);
  }

  // Hands tile n_block's stage back to the producer (one arrival per consumer warp).
  __device__ __forceinline__ void release_stage(int n_block) const {
    __syncwarp();
    if (lane == 0) sm90::mbarrier_arrive(smem.empty(stage_of<Traits>(n_block)));
  }

  // Packed sequences: the V rows after a sequence's last key are the next sequence's (TMA zeroes only rows past the
  // tensor), and one non-finite value there would turn P's zeros into NaN. Each consumer that reads the sequence's
  // last tile clears them (the same zeros, whichever consumer stores them last) before its P.V reads the tile.
  __device__ __forceinline__ void clear_keys_past_end(int stage, int keys) const {
    if (keys >= Traits::kBlockN) return;
    constexpr int kRowChunks = 128 / 16;  // a key's row of a V box
#pragma unroll
    for (int box = 0; box < Traits::kVBoxes; ++box)
      for (int i = keys * kRowChunks + int(threadIdx.x % 128); i < Traits::kBlockN * kRowChunks; i += 128)
        reinterpret_cast<uint4*>(smem.v(stage) + box * Traits::kSmemVBoxBytes)[i] = make_uint4(0, 0, 0, 0);
    sm90::fence_proxy_async_smem();  // the generic-proxy stores, before the wgmmas read them
    sm90::named_barrier_sync(kQTileBarrier<Traits> + consumer, 128);
  }

  // Issues O += P V-tile for tile n_block (asynchronous; one commit group). Its V has landed: the step of that
  // tile waited for its stage.
  __device__ __forceinline__ void issue_pv(float (&o_acc)[kORegs], int n_block) {
    constexpr int kFirstN = Traits::kPVFirstN, kSecondN = Traits::kPVSecondN;
    const uint64_t v_stage_desc = wgmma::advance_desc(v_desc, stage_of<Traits>(n_block) * Traits::kSmemStageBytes);
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk) {  // keys 16 kk.. are 128-byte rows 16 kk.. of every box
      const uint64_t desc = wgmma::advance_desc(v_stage_desc, kk * 16 * 128);
      if constexpr (kSecondN == 0) {
        wgmma::mma_pv<kFirstN, Elem>(o_acc, p_frag[kk], desc);
      } else {  // the second wgmma's channels start kFirstN in: at that box, and at that accumulator register
        constexpr int kSecondBoxBytes = kFirstN / Traits::kVBoxChannels * Traits::kSmemVBoxBytes;
        wgmma::mma_pv<kFirstN, Elem>(*reinterpret_cast<float(*)[kFirstN / 2]>(o_acc), p_frag[kk], desc);
        wgmma::mma_pv<kSecondN, Elem>(*reinterpret_cast<float(*)[kSecondN / 2]>(o_acc + kFirstN / 2), p_frag[kk],
                                      wgmma::advance_desc(desc, kSecondBoxBytes));
      }
    }
    wgmma::commit_group();
  }

  // One step of the key loop, for tile n_block. It waits for the tile's stage, K and V on one barrier. Between the
  // wgmma fence and the final wait the body must be branch-free, since ptxas serializes the wgmmas otherwise:
  // hence compile-time tags for the first tile and for masked tiles.
  template <typename Order, typename Masking, typename Biasing>
  __device__ __forceinline__ void step(int n_block, Order, Masking, Biasing, float (&o_acc)[kORegs],
                                       Sm90Softmax<Traits>& softmax, const QRowScales& q, const int (&rows)[2],
                                       const AttentionParams& p) {
    constexpr bool kFirst = std::is_same_v<Order, FirstTile>, kMasked = std::is_same_v<Masking, Masked>;
    constexpr bool kBiased = std::is_same_v<Biasing, Biased>;
    const int stage = stage_of<Traits>(n_block);
    const float k_scale = __ldg(k_scales + n_block);  // needed after the wgmma: its latency hides there
    const float bias_max = kBiased ? __ldg(key_bias_maxima + n_block) : 0.f;
    sm90::mbarrier_wait(smem.full(stage), phase_of<Traits>(n_block));
    if constexpr (Traits::kPacked && kMasked)
      clear_keys_past_end(stage, p.seqlen_kv - (n_begin + n_block) * Traits::kBlockN);
    take_turn();
    int32_t s_int[kSRegs];
    wgmma::fence_operands(s_int);
    wgmma::fence_operands(o_acc);
    wgmma::fence();
    const uint64_t k_stage_desc = wgmma::advance_desc(k_desc, stage * Traits::kSmemStageBytes);
#pragma unroll
    for (int ks = 0; ks < Traits::kQKSteps; ++ks)
      wgmma::mma_qk_s8<Traits::kBlockN>(s_int, wgmma::advance_desc(q_desc, k_step_bytes(ks)),
                                        wgmma::advance_desc(k_stage_desc, k_step_bytes(ks)), ks);
    wgmma::commit_group();
    if constexpr (!kFirst) issue_pv(o_acc, n_block - 1);
    pass_turn();
    wgmma::wait_group<kFirst ? 0 : 1>();  // S_j done (groups retire in order); P_{j-1} V_{j-1} may still run
    wgmma::fence_operands(s_int);

    if constexpr (kMasked) mask_logits(p, s_int, (n_begin + n_block) * Traits::kBlockN, rows);
    TileExponent exponent = softmax.template update_max<kMasked, kBiased>(s_int, q.scale, k_scale, bias_max);
    float probs[kSRegs];  // P overwrites S
    Sm90Softmax<Traits>::template exponentiate<kMasked, kBiased>(exponent, s_int, smem.key_bias(stage), probs);
    uint32_t p_max_bits[2];
    if constexpr (kBiased) Sm90Softmax<Traits>::row_max_bits_of(probs, p_max_bits);

    // O and P_{j-1} are free once P_{j-1} V_{j-1} has retired: rescale O to the new max, stage P_j.
    // Pinning P first keeps NVVM from sinking the softmax below the wait (ptxas may still hoist the wait).
    wgmma::fence_operands(probs);
    wgmma::wait_group<0>();
    wgmma::fence_operands(o_acc);
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk) wgmma::fence_operands(p_frag[kk]);
    if constexpr (!kFirst) release_stage(n_block - 1);  // K_j-1 and V_j-1 are consumed
    if constexpr (kBiased) softmax.tighten_bound(exponent, p_max_bits, probs);
    if constexpr (!kFirst) Sm90Softmax<Traits>::rescale_output(exponent, o_acc);  // on the first tile O is still 0
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) p_frag[kk][j] = ptx::pack2<Elem>(probs[8 * kk + 2 * j], probs[8 * kk + 2 * j + 1]);
  }

  // The whole loop over the stream's n_blocks tiles. This warpgroup's own tiles are n_own of them (none without
  // query rows; under the causal mask up to its last row's diagonal, while the CTA streams up to the last
  // consumer's); the n_unmasked first ones need no mask, so the key-length tail and the causal diagonal come last.
  template <typename Biasing>
  __device__ __forceinline__ void run(Biasing biasing, float (&o_acc)[kORegs], Sm90Softmax<Traits>& softmax,
                                      const QRowScales& q, const int (&rows)[2], const AttentionParams& p, int n_blocks,
                                      int n_own, int n_unmasked) {
    if (n_blocks == 0) return;
    // Turn-taking, round robin from consumer 0: every step waits for its own turn and then hands the turn to the
    // next consumer. The last consumer opens consumer 0's first turn and consumer 0 takes one last turn at the end,
    // so arrivals and waits match on every barrier.
    if (Traits::kTakeTurns && consumer == Traits::kConsumers - 1) sm90::named_barrier_arrive(kTurnBarrier, kTurnThreads);
    if (n_own > 0) {
      if (n_unmasked > 0) {
        step(0, FirstTile{}, Unmasked{}, biasing, o_acc, softmax, q, rows, p);
      } else {
        step(0, FirstTile{}, Masked{}, biasing, o_acc, softmax, q, rows, p);
      }
    }
    for (int n_block = 1; n_block < n_unmasked; ++n_block)
      step(n_block, LaterTile{}, Unmasked{}, biasing, o_acc, softmax, q, rows, p);
    for (int n_block = max(1, n_unmasked); n_block < n_own; ++n_block)
      step(n_block, LaterTile{}, Masked{}, biasing, o_acc, softmax, q, rows, p);
    // The tiles past this warpgroup's rows are masked for all of them: only its turns, so the others get the
    // tensor cores sooner. Nothing to release: a stage is reused kStages tiles later, past n_blocks (and a
    // consumer without rows is not counted by the empty barriers).
    static_assert(Traits::kStages >= Traits::kConsumers, "stages past a consumer's own tiles are never reused");
    if constexpr (Traits::kTakeTurns) {
      for (int n_block = n_own; n_block < n_blocks; ++n_block) take_turn(), pass_turn();
    }

    if (n_own > 0) {  // the last own tile's P V (its stage needs no release either)
      wgmma::fence_operands(o_acc);
      wgmma::fence();
      issue_pv(o_acc, n_own - 1);
      wgmma::wait_group<0>();
      wgmma::fence_operands(o_acc);
    }
    if (Traits::kTakeTurns && consumer == 0) sm90::named_barrier_sync(kTurnBarrier, kTurnThreads);
  }
};

}  // namespace attention_int8
