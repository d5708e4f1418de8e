// Hopper (sm_90a) warpgroup MMA wrappers: wgmma.mma_async with shared-memory descriptors.
//
// Shared-memory operand layout used throughout: "K-major, 128-byte swizzle". A tile of R rows whose
// K extent is 128 bytes is stored row after row (128 B each); the 16-byte chunk c of row r sits at
// chunk position c ^ (r % 8), so the 8 rows of a core-matrix group read distinct banks. Groups of
// 8 rows are 1024 B apart (the descriptor's stride byte offset), and the tile starts 1024 B-aligned.
// A K step inside the 128-byte row is a plain start-address offset: the hardware applies the XOR.
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

constexpr int kSwizzleBytes = 128;
constexpr int kCoreGroupBytes = 8 * kSwizzleBytes;  // 8 rows of 128 B

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a K-major 128B-swizzled tile.
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  return row * kSwizzleBytes + ((chunk ^ (row % 8)) * 16);
}

// Matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading byte offset
// (unused for swizzled K-major, set to 1), stride byte offset 1024 B, swizzle mode 1 = 128 B.
__device__ __forceinline__ uint64_t make_desc(const void* smem) {
  const uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(kCoreGroupBytes >> 4) << 32) | (uint64_t(1) << 62);
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

// Fence for shared memory written through the generic proxy (cp.async, st.shared) that wgmma,
// which reads through the async proxy, consumes next. Each writing thread issues it before the barrier.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (+)= a * b^T for one k32 step of S = Q K^T: a = 64x32 s8 in registers (per warp the m16n8k32 A
// fragment: a[0] = row g, bytes 4t..4t+3; a[1] = row g + 8; a[2], a[3] the same at bytes 16 + 4t),
// b = kN x 32 s8 (descriptor, K-major), kN / 2 int32 accumulators. scale_d == 0 overwrites d.
template <int kN>
__device__ __forceinline__ void mma_qk_s8(int32_t (&d)[kN / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d);

template <>
__device__ __forceinline__ void mma_qk_s8<64>(int32_t (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p;\n"
      "}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mma_qk_s8<128>(int32_t (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p;\n"
      "}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
        "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
        "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
        "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
        "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// d += a * b: a = 64x16 fp16/bf16 in registers (the m16n8k16 A layout per warp), b = 16x128 (descriptor,
// K-major), fp32 m64n128 accumulators.
template <typename Elem>
__device__ __forceinline__ void mma_m64n128k16_f32(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b);

#define AI8_WGMMA_M64N128K16_F32(ELEM, PTX_TYPE)                                                            \
  template <>                                                                                               \
  __device__ __forceinline__ void mma_m64n128k16_f32<ELEM>(float (&d)[64], const uint32_t (&a)[4],          \
                                                           uint64_t desc_b) {                               \
    asm volatile(                                                                                           \
        "{\n"                                                                                               \
        ".reg .pred p;\n"                                                                                   \
        "setp.ne.b32 p, %69, 0;\n"                                                                          \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " {"                           \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "\
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "\
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "\
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                                                                                           \
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"                                                       \
        "}\n"                                                                                               \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                             \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));                                 \
  }
AI8_WGMMA_M64N128K16_F32(__half, "f16")
AI8_WGMMA_M64N128K16_F32(__nv_bfloat16, "bf16")
#undef AI8_WGMMA_M64N128K16_F32

}  // namespace wgmma
}  // namespace attention_int8
