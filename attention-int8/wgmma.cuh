// Hopper (sm_90a) warpgroup MMA wrappers: wgmma.mma_async with shared-memory descriptors.
//
// Shared-memory operand layouts (swizzle.cuh gives the chunk order):
//  - K-major (Q, K: INT8 rows of 64 or 128 bytes, Traits::kMmaDim): rows of kRowBytes, swizzled in atoms of 8
//    rows; the descriptor's stride byte offset (SBO) is the atom, 8 * kRowBytes. A K step inside the
//    row is a plain start-address offset: the hardware applies the XOR. 256-byte rows are two panels of
//    128-byte rows (swizzle.cuh), and a K step in the second panel starts there.
//  - MN-major (V, the B operand of P.V, read transposed): TMA boxes of 64 keys x 64 channels (128 B of
//    16-bit channels per key row), 128-byte swizzle. SBO steps 8 keys (1024 B), the leading byte offset
//    (LBO) steps to the box of the next 64 channels (after V's last box: the box of ones whose first 8
//    channels give the P.V wgmma its row-sum columns).
// Every tile starts on a multiple of its atom.
//
// Accumulator fragment of an m64nN wgmma (fp32 or int32), for thread t of the warpgroup, with
// warp = t / 32, group = (t % 32) / 4, tig = t % 4, register i in [0, N/2):
//   row = 16 * warp + group + 8 * ((i / 2) % 2),   col = 8 * (i / 4) + 2 * tig + (i % 2)
// i.e. per warp exactly the mma.sync m16n8 accumulator layout, repeated over n8 column chunks.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

namespace attention_int8 {
namespace wgmma {

// Accumulator register i of an m64nN fragment (the layout above): which of the thread's two rows, and its column.
__device__ __forceinline__ constexpr int accumulator_row(int i) { return (i / 2) % 2; }
__device__ __forceinline__ int accumulator_col(int i) { return 8 * (i / 4) + 2 * (threadIdx.x % 4) + (i % 2); }

// Matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, LBO and SBO in 16-byte
// units, and the swizzle mode in bits 62-63 (1 = 128 B, 2 = 64 B).
template <int kSwizzleBytes>
__device__ __forceinline__ uint64_t make_desc(const void* smem, uint32_t leading_bytes, uint32_t stride_bytes) {
  static_assert(kSwizzleBytes == 64 || kSwizzleBytes == 128, "64- or 128-byte swizzle");
  constexpr uint64_t kMode = kSwizzleBytes == 128 ? 1 : 2;
  const uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(leading_bytes >> 4) << 16) | (uint64_t(stride_bytes >> 4) << 32) |
         (kMode << 62);
}

// K-major rows of kRowBytes: LBO is unused by swizzled K-major layouts (by convention 1).
template <int kRowBytes>
__device__ __forceinline__ uint64_t make_desc_k_major(const void* smem) {
  return make_desc<kRowBytes>(smem, 16, 8 * kRowBytes);
}

// The descriptor of smem + bytes (bytes a multiple of 16): the start address is the low field, and
// shared-memory addresses (< 2^18) never carry out of it.
__device__ __forceinline__ uint64_t advance_desc(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pins accumulator registers around asynchronous MMAs so the compiler neither reads them early
// nor moves them while a wgmma is still writing them.
template <typename T, int N>
__device__ __forceinline__ void fence_operands(T (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if constexpr (sizeof(T) == 4 && std::is_floating_point_v<T>) {
      asm volatile("" : "+f"(regs[i])::"memory");
    } else {
      asm volatile("" : "+r"(regs[i])::"memory");
    }
  }
}

// Operand lists of the wgmmas below: accumulators first (32 for the m64n64 S, 36, 64 and 68 for the m64n72,
// m64n128 and m64n136 P.V), then the A registers (P.V) or descriptor (S), the B descriptor and the scale-d flag.
#define AI8_ACC_REGS_32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define AI8_ACC_REGS_36 AI8_ACC_REGS_32 ", %32, %33, %34, %35"
#define AI8_ACC_REGS_64 \
  AI8_ACC_REGS_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define AI8_ACC_REGS_68 AI8_ACC_REGS_64 ", %64, %65, %66, %67"
#define AI8_ACC_OPERANDS_32(c) \
    "+" c(d[0]), "+" c(d[1]), "+" c(d[2]), "+" c(d[3]), "+" c(d[4]), "+" c(d[5]), "+" c(d[6]), "+" c(d[7]), \
    "+" c(d[8]), "+" c(d[9]), "+" c(d[10]), "+" c(d[11]), "+" c(d[12]), "+" c(d[13]), "+" c(d[14]), "+" c(d[15]), \
    "+" c(d[16]), "+" c(d[17]), "+" c(d[18]), "+" c(d[19]), "+" c(d[20]), "+" c(d[21]), "+" c(d[22]), "+" c(d[23]), \
    "+" c(d[24]), "+" c(d[25]), "+" c(d[26]), "+" c(d[27]), "+" c(d[28]), "+" c(d[29]), "+" c(d[30]), "+" c(d[31])
#define AI8_ACC_OPERANDS_36(c) AI8_ACC_OPERANDS_32(c), "+" c(d[32]), "+" c(d[33]), "+" c(d[34]), "+" c(d[35])
#define AI8_ACC_OPERANDS_64(c) \
    AI8_ACC_OPERANDS_36(c), \
    "+" c(d[36]), "+" c(d[37]), "+" c(d[38]), "+" c(d[39]), \
    "+" c(d[40]), "+" c(d[41]), "+" c(d[42]), "+" c(d[43]), "+" c(d[44]), "+" c(d[45]), "+" c(d[46]), "+" c(d[47]), \
    "+" c(d[48]), "+" c(d[49]), "+" c(d[50]), "+" c(d[51]), "+" c(d[52]), "+" c(d[53]), "+" c(d[54]), "+" c(d[55]), \
    "+" c(d[56]), "+" c(d[57]), "+" c(d[58]), "+" c(d[59]), "+" c(d[60]), "+" c(d[61]), "+" c(d[62]), "+" c(d[63])
#define AI8_ACC_OPERANDS_68(c) AI8_ACC_OPERANDS_64(c), "+" c(d[64]), "+" c(d[65]), "+" c(d[66]), "+" c(d[67])

// d (+)= a * b^T for one k32 step of S = Q K^T: a = 64 x 32 s8 and b = kN x 32 s8, both K-major in shared
// memory (descriptors), kN / 2 int32 accumulators. scale_d == 0 overwrites d.
template <int kN>
__device__ __forceinline__ void mma_qk_s8(int32_t (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d);

// d += a * b for one k16 step of O += P V: a = 64x16 fp16/bf16 in registers (per warp the m16n8k16 A
// fragment), b = 16 x kN read MN-major (imm-trans-b = 1: V as stored, channels contiguous), kN / 2
// fp32 accumulators.
template <int kN, typename Elem>
__device__ __forceinline__ void mma_pv(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t desc_b);

template <>
__device__ __forceinline__ void mma_qk_s8<64>(int32_t (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {" AI8_ACC_REGS_32 "}, %32, %33, p;\n}\n"
               : AI8_ACC_OPERANDS_32("r")
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

#define AI8_WGMMA_PV(N, ELEM, PTX_TYPE, REGS, A_REGS, DESC, SCALE)                                            \
  template <>                                                                                                 \
  __device__ __forceinline__ void mma_pv<N, ELEM>(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                           \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " {" AI8_ACC_REGS_##REGS \
                 "}, {" A_REGS "}, " DESC ", p, 1, 1, 1;\n}\n"                                             \
                 : AI8_ACC_OPERANDS_##REGS("f")                                                              \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));                          \
  }
AI8_WGMMA_PV(72, __half, "f16", 36, "%36, %37, %38, %39", "%40", "%41")
AI8_WGMMA_PV(72, __nv_bfloat16, "bf16", 36, "%36, %37, %38, %39", "%40", "%41")
AI8_WGMMA_PV(128, __half, "f16", 64, "%64, %65, %66, %67", "%68", "%69")
AI8_WGMMA_PV(128, __nv_bfloat16, "bf16", 64, "%64, %65, %66, %67", "%68", "%69")
AI8_WGMMA_PV(136, __half, "f16", 68, "%68, %69, %70, %71", "%72", "%73")
AI8_WGMMA_PV(136, __nv_bfloat16, "bf16", 68, "%68, %69, %70, %71", "%72", "%73")
#undef AI8_WGMMA_PV
#undef AI8_ACC_REGS_32
#undef AI8_ACC_REGS_36
#undef AI8_ACC_REGS_64
#undef AI8_ACC_REGS_68
#undef AI8_ACC_OPERANDS_32
#undef AI8_ACC_OPERANDS_36
#undef AI8_ACC_OPERANDS_64
#undef AI8_ACC_OPERANDS_68

}  // namespace wgmma
}  // namespace attention_int8
