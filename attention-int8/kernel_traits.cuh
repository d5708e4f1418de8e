// Compile-time shape of the attention kernel: tile sizes, thread layout, shared-memory layout and
// the per-warp fragment counts derived from them. Everything the kernel indexes comes from here.
#pragma once

#include <cstdint>

#include "attention_int8.h"
#include "swizzle.cuh"

namespace attention_int8 {

// Portable kernel (mma.sync, sm_80+). Two m16 tiles per warp, the fastest measured for every head dim up to 128
// (docs/DESIGN.md, rationale); 32-key tiles keep the D = 96/128 accumulators in registers, and at D = 256, where O
// alone takes 128 registers a tile, one m16 tile a warp does. kPacked: the params describe packed sequences
// (PackedSequences), to which each CTA first narrows them.
template <int kHeadDim_, typename Elem_, bool kPacked_ = false, int kMTiles_ = (kHeadDim_ <= 128 ? 2 : 1),
          int kBlockN_ = (kHeadDim_ <= 64 ? 64 : 32)>
struct AttentionKernelTraits {
  using Elem = Elem_;  // __half or __nv_bfloat16: V, P and O
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kPacked = kPacked_;
  static constexpr int kBlockM = 128;
  static_assert(kQueryPad % kBlockM == 0, "Q is padded to kQueryPad rows");
  static constexpr int kBlockN = kBlockN_;
  // The s8 MMA consumes the head dim 32 at a time: D = 80 runs as 96 on INT8 rows whose bytes past D are zeros in
  // shared memory (zero_qk_padding), so Q and K stay D bytes a row in global memory.
  static constexpr int kQKDim = (kHeadDim + 31) / 32 * 32;
  static_assert(kQKDim * 127 * 127 < (1 << 22), "S accumulators must stay exact in ptx::SmallIntScale");
  static_assert(kKeyPad % kBlockN == 0, "K is padded to kKeyPad rows");
  static_assert(kKeyScaleTokens % kBlockN == 0, "a key tile lies inside one K scale block");

  // Each warp owns kMTiles m16 tiles of query rows for the whole key loop: the softmax state of a
  // row never leaves its warp (a row lives in one quad of 4 lanes), and every K/V fragment a warp
  // reads from shared memory feeds kMTiles MMAs (shared-memory traffic per FLOP / kMTiles).
  static constexpr int kMTiles = kMTiles_;
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kWarps = kBlockM / kWarpRows;
  static constexpr int kThreads = kWarps * 32;
  static_assert(kBlockM % kWarpRows == 0, "warps must tile the query block");
  static constexpr int kStages = 2;  // K/V double buffering with cp.async

  static_assert(kHeadDim % 16 == 0, "rows are whole 16-byte chunks, and O whole pairs of n8 tiles");
  static_assert(kBlockN % 16 == 0, "P.V consumes keys 16 at a time");

  // Fragment counts per warp.
  static constexpr int kQKSteps = kQKDim / 32;    // m16n8k32 steps along D for S = Q K^T
  static constexpr int kSTiles = kBlockN / 8;     // n8 tiles of S (keys)
  static constexpr int kPVSteps = kBlockN / 16;   // m16n8k16 steps along keys for O += P V
  static constexpr int kOTiles = kHeadDim / 8;    // n8 tiles of O (head dim)
  static_assert(kSTiles % 2 == 0 && kOTiles % 2 == 0, "ldmatrix.x4 loads n8 tiles in pairs");

  // Shared memory. Rows are padded by 16 bytes: ldmatrix reads 8 rows at the same column, and a row
  // pitch of 16 * odd bytes puts those 8 16-byte reads in 8 distinct bank groups (no conflicts).
  static constexpr int kQKRowBytes = kQKDim + 16;  // int8 Q and K rows
  static constexpr int kVRowBytes = kHeadDim * 2 + 16;
  static_assert((kQKRowBytes / 16) % 2 == 1 && (kVRowBytes / 16) % 2 == 1, "pitch must be an odd multiple of 16 B");

  static constexpr int kSmemQBytes = kBlockM * kQKRowBytes;
  static constexpr int kSmemKBytes = kBlockN * kQKRowBytes;
  static constexpr int kSmemVBytes = kBlockN * kVRowBytes;
  static constexpr int kSmemStageBytes = kSmemKBytes + kSmemVBytes;
  static constexpr int kSmemBytes = kSmemQBytes + kStages * kSmemStageBytes;
  static_assert(kSmemStageBytes % 16 == 0 && kSmemQBytes % 16 == 0, "cp.async needs 16-byte aligned stages");
};

// Hopper kernel (wgmma, sm_90a), warp-specialized: one producer warpgroup whose single thread streams
// K and V into shared memory, and kConsumers MMA warpgroups of 64 query rows each over K/V tiles of
// kBlockN keys; each consumer quantizes its own Q rows into a shared-memory tile. K arrives as INT8 rows of
// kMmaDim bytes already in the K-major swizzled order of swizzle.cuh (the quantizer writes it), so a tile is
// one contiguous bulk copy; V is read from the user's tensor by TMA, which swizzles it into boxes of
// 64 keys x 64 channels (128 B per key) that the P.V wgmma reads MN-major (wgmma.cuh).
//
// Why several consumers of 64-key tiles: a warpgroup's softmax of one tile must finish while the other
// warpgroups' wgmmas keep the tensor cores busy, and on its scheduler a consumer warp is alone with
// one warp per other consumer. At D = 128 three consumers (160 registers a thread) fit 64-key S and P tiles
// next to O. At D = 64, whose wgmmas are half as long and whose O is half the size, a fourth consumer (112
// registers) keeps one more softmax in flight (docs/DESIGN.md, rationale). At D = 256 O and its sums alone are 132
// registers: two consumers (240 registers) hold them, and two 56 KB stages fit beside O's staging tiles.
// kPacked as in the portable kernel's traits.
template <int kHeadDim_, typename Elem_, bool kTakeTurns_ = false, bool kPacked_ = false,
          int kConsumers_ = (kHeadDim_ == 64 ? 4 : (kHeadDim_ <= 128 ? 3 : 2)), int kBlockN_ = 64,
          int kStages_ = (kHeadDim_ <= 128 ? 4 : 2)>
struct Sm90AttentionKernelTraits {
  using Elem = Elem_;
  static constexpr int kHeadDim = kHeadDim_;  // the data's: Q, V and O rows, K's centre
  static constexpr bool kPacked = kPacked_;
  // The matrix products' head dim: an INT8 row must be one 64- or 128-byte swizzle row or two 128-byte panels, so
  // D = 80 and 96 run as 128 on rows padded with zeros (sm90_row_bytes), for 8/5 and 4/3 of the matrix work.
  static constexpr int kMmaDim = sm90_row_bytes(kHeadDim);
  static_assert(kHeadDim == kMmaDim || (kMmaDim == 128 && kHeadDim % 16 == 0),
                "D = 64, 128 and 256, or 80 and 96 padded to 128");
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kConsumerRows = 64;  // a consumer's query rows: the m64 of its wgmmas
  static constexpr int kBlockM = kConsumerRows * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  static_assert(kKeyPad % kBlockN == 0, "K is padded to kKeyPad rows");
  static_assert(kBlockN == kKeyScaleTokens, "a key tile is one K scale block");
  static_assert(kBlockN == kSm90TileRows && kConsumerRows == kSm90TileRows, "K and Q tiles are panelled alike");
  // Whether S - max(S), down to -2 * D' * 127^2, stays exact as a float in ptx::SmallIntScale's integer add (below
  // 2^22 in magnitude); at D' = 256 it does not, and the softmax converts it instead (Sm90Softmax::exponentiate).
  static constexpr bool kGapFitsMagic = 2 * kMmaDim * 127 * 127 < (1 << 22);
  static constexpr int kThreads = (1 + kConsumers) * 128;
  static constexpr int kConsumerWarps = kConsumers * 4;
  static constexpr int kMinBlocksPerSm = 1;
  // setmaxnreg budget (multiples of 8): the producer keeps 24, the consumers share the rest of the CTA's pool,
  // which is what the launch allocated: kThreads x the per-thread count __launch_bounds__ allows (64K / kThreads
  // in steps of 8), not the SM's 64K. A claim beyond the pool never returns (setmaxnreg.inc waits for registers
  // that never free up): 640 threads get 96 a thread, 61440 in all, so four consumers can claim 112, not 120.
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = (kLaunchRegs * kThreads - 128 * kProducerRegs) / (kConsumers * 128) / 8 * 8;
  static_assert(kConsumerRegs <= 256, "setmaxnreg allows at most 256 registers");
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= kLaunchRegs * kThreads, "claims exceed the pool");
  static constexpr int kStages = kStages_;
  // Whether the consumers take turns issuing their wgmmas; the launcher sets it at kMmaDim = 128 (D = 96, 128)
  // without the causal mask only: under the mask the consumers' tile counts differ, and at D = 64 the shorter
  // matrix products leave less for a waiting consumer to hide behind (docs/DESIGN.md, rationale).
  static constexpr bool kTakeTurns = kTakeTurns_;
  static_assert(!kTakeTurns || kMmaDim == 128, "turns are measured slower at D = 64");

  static constexpr int kQKRowBytes = kMmaDim;    // INT8 Q and K rows
  static constexpr int kQKAtomBytes = swizzle::kAtomRowBytes<kQKRowBytes>;  // their K-major swizzle width
  static constexpr int kQKSteps = kMmaDim / 32;   // k32 wgmma steps for S = Q K^T
  static constexpr int kPVSteps = kBlockN / 16;   // k16 wgmma steps for O += P V
  static constexpr int kSAccRegs = kBlockN / 2;   // m64 x kBlockN accumulator registers per thread
  // The P.V wgmma is D + 8 wide: after V's D channels come 8 columns of ones, whose accumulators
  // collect the row sums of P (the same fp16/bf16 P that multiplies V) on the tensor cores.
  static constexpr int kSumColumns = 8;
  static constexpr int kPVN = kMmaDim + kSumColumns;
  static constexpr int kOAccRegs = kPVN / 2;      // m64 x (kMmaDim + 8): O, then the row sums
  // A wgmma is at most 256 wide: at D' = 256 the P.V runs as channels 0-127, then 128-255 with the sum columns.
  static constexpr int kPVFirstN = kPVN <= 256 ? kPVN : 128;
  static constexpr int kPVSecondN = kPVN - kPVFirstN;  // 0: one wgmma
  static constexpr int kOutRegs = kMmaDim / 2;    // the O part (D = 96: its last 32 channels are zeros)

  // V boxes: kBlockN keys x 64 channels, one 128-byte swizzle row per key. After them, each stage holds
  // one more box of ones (written once, never copied): the channels D.. of the P.V wgmma.
  static constexpr int kVBoxChannels = 128 / sizeof(Elem);
  static_assert(kMmaDim % kVBoxChannels == 0, "V tiles are whole 64-channel boxes (D = 96: TMA fills the rest with zeros)");
  static_assert(kSumColumns <= kVBoxChannels, "the sum columns fit one box");
  static constexpr int kVBoxes = kMmaDim / kVBoxChannels;
  static constexpr int kSmemVBoxBytes = kBlockN * 128;

  static constexpr int kSmemKBytes = kBlockN * kQKRowBytes;
  static constexpr int kSmemVBytes = kVBoxes * kSmemVBoxBytes;  // what the TMA copies per stage
  static_assert(kSmemKBytes % 1024 == 0, "V boxes start on 1024-byte swizzle atoms");
  static constexpr int kSmemStageBytes = kSmemKBytes + kSmemVBytes + kSmemVBoxBytes;
  static_assert(kSmemStageBytes % 1024 == 0, "stages start on 1024-byte swizzle atoms");
  // O leaves through shared memory: each consumer warp stages its 16 rows there (padded by 16 bytes, so the
  // accumulator layout's 4-byte writes hit 32 distinct banks) and stores them as whole 16-byte chunks.
  static constexpr int kORowBytes = kHeadDim * sizeof(Elem);  // what leaves for global memory
  static constexpr int kOStageRowBytes = kMmaDim * sizeof(Elem) + 16;
  static constexpr int kSmemOWarpBytes = 16 * kOStageRowBytes;
  static constexpr int kSmemOBytes = kConsumerWarps * kSmemOWarpBytes;
  // Until the epilogue, a consumer's four staging tiles hold its INT8 Q tile (64 rows), in K's swizzled layout.
  static_assert(4 * kSmemOWarpBytes % 1024 == 0 && 4 * kSmemOWarpBytes >= 64 * kQKRowBytes,
                "a consumer's staging tiles hold its Q tile, on a swizzle atom boundary");
  // The split-KV combine: this many consecutive threads merge a query row's fp32 partials, 4 channels each.
  static constexpr int kCombineRowThreads = kHeadDim / 4;
  // Q smoothing's key biases (AttentionParams::key_bias): the tile's kBlockN fp32 values per stage.
  static constexpr int kSmemBiasBytes = kBlockN * 4;
  // Barriers: full/empty per stage (K and V together).
  static constexpr int kBarriers = 2 * kStages;
  // The layout from the 1024-byte aligned base (Sm90Smem): the stages, O's staging tiles, the key biases' stages,
  // the barriers.
  static constexpr int kSmemOOffset = kStages * kSmemStageBytes;
  static constexpr int kSmemBiasOffset = kSmemOOffset + kSmemOBytes;
  static constexpr int kSmemBarrierOffset = kSmemBiasOffset + kStages * kSmemBiasBytes;
  static_assert(kSmemBiasOffset % 16 == 0 && kSmemBiasBytes % 16 == 0, "bulk copies land on 16-byte boundaries");
  static_assert(kSmemBarrierOffset % 8 == 0, "mbarriers are 8-byte aligned");
  static constexpr int kSmemBytes = 1024 /* base alignment slack */ + kSmemBarrierOffset + kBarriers * 8;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the opt-in shared memory of a Hopper CTA");
};

}  // namespace attention_int8
