// Thin wrappers over the sm_80+ PTX instructions the kernels use: cp.async, ldmatrix and mma.sync.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k*"), with lane = 4 * group + tig:
//   accumulator C/D of m16n8 (int32 or fp32): c0,c1 = row group,     cols 2*tig, 2*tig+1
//                                             c2,c3 = row group + 8, same cols
//   A of m16n8k32 s8:   a0 = row group,   k bytes 4*tig..4*tig+3;  a1 = row group+8, same k
//                       a2 = row group,   k bytes 16+4*tig..;      a3 = row group+8, same k
//   B of m16n8k32 s8:   b0 = col group,   k bytes 4*tig..;         b1 = col group, k bytes 16+4*tig..
//   A of m16n8k16 f16:  a0 = row group, k 2*tig,2*tig+1; a1 = row group+8; a2/a3 the same with k + 8
//   B of m16n8k16 f16:  b0 = col group, k 2*tig,2*tig+1; b1 the same with k + 8
// An 8x8 b16 ldmatrix tile is 8 rows of 16 bytes and hands lane l the 4 bytes at row l/4, bytes 4*(l%4):
// exactly one register of the s8 A/B fragments above, and (with .trans) of the f16 B fragment.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace attention_int8 {
namespace ptx {

// Programmatic dependent launch (sm_90+; no-ops before): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization (launch() in dispatch.cuh) may start while the previous
// kernel in the stream is still running. wait_for_predecessor() returns once that kernel has completed and its
// writes are visible: a dependent calls it before reading the predecessor's output and before any global
// write (the caching allocator may have handed it memory the predecessor still reads). allow_dependents() lets
// the next kernel launch before this one has finished.
__device__ __forceinline__ void wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Asks L2 to fetch the `bytes` bytes at x (16-byte aligned, a multiple of 16) through the bulk copy engine
// (sm_90+; a no-op before): a hint, with nothing to wait for and no register or shared memory held.
__device__ __forceinline__ void prefetch_l2(const void* x, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(x), "r"(bytes) : "memory");
#endif
}

// op over the 4 lanes of the thread's quad (xor shuffles 1, then 2), which together hold the rows of an mma
// accumulator or fragment (the layouts above; wgmma's are the same per warp). The array form interleaves its
// values' shuffles, so none waits on another's.
template <typename T, typename Op>
__device__ __forceinline__ T quad_reduce(T x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return op(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

template <int kN, typename T, typename Op>
__device__ __forceinline__ void quad_reduce(T (&x)[kN], Op op) {
#pragma unroll
  for (int lanes = 1; lanes <= 2; lanes *= 2)
#pragma unroll
    for (int i = 0; i < kN; ++i) x[i] = op(x[i], __shfl_xor_sync(0xffffffffu, x[i], lanes));
}

// x, with its origin hidden from the compiler, which then keeps a loop-invariant value in a register instead of
// recomputing it from its inputs in every iteration (rematerialization).
__device__ __forceinline__ uint64_t keep_in_register(uint64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy that bypasses L1. With `valid == false` nothing is read and the
// destination is zero-filled, which is how rows past the end of a tensor enter shared memory.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}

// d += a * b on INT8 tensor cores: a 16x32 s8 (row), b 32x8 s8 (col), d 16x8 s32. Exact: |d| stays
// far below 2^31 (at most 128 * 127^2 per dot product for D = 128).
__device__ __forceinline__ void mma_s8_16832(int32_t (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a * b with 16-bit float operands (fp16 or bf16) and fp32 accumulation, m16n8k16.
template <typename Elem>
__device__ __forceinline__ void mma_f32_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_f32_16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_f32_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                             const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Exact int32 -> fp32 for |x| < 2^22 on the FP32/INT pipes instead of the 16-per-clock conversion
// unit: adding x to the bit pattern of 1.5 * 2^23 yields the float 1.5 * 2^23 + x exactly.
// Q.K^T dot products of int8 rows stay below 2^22 for head_dim < 260 (|x| <= D * 127^2).
constexpr int32_t kSmallIntMagicBits = 0x4B400000;  // 12582912.0f = 1.5 * 2^23
constexpr float kSmallIntMagic = 12582912.0f;

// A scale for small integers: c(x) = round(x * scale) in one integer add and one FFMA,
// (1.5 * 2^23 + x) * scale - 1.5 * 2^23 * scale, the product inside the FMA exact. Equal to fp32
// x * scale, bit for bit, when scale has at most 22 significant bits (quant::logit_scale): then
// neg_magic_scale = -1.5 * 2^23 * scale = -3 * 2^22 * scale is exact too, so the FMA rounds the exact
// x * scale once. The Hopper kernel folds more into that FMA's addend (its exponents).
struct SmallIntScale {
  float scale;
  float neg_magic_scale;
  __device__ __forceinline__ explicit SmallIntScale(float s) : scale(s), neg_magic_scale(-kSmallIntMagic * s) {}
  __device__ __forceinline__ float operator()(int32_t x) const {
    return fmaf(__int_as_float(kSmallIntMagicBits + x), scale, neg_magic_scale);
  }
};

// 2^x on the special-function unit (flush-to-zero: 2^-126 and below become 0, which softmax weights
// below 2^-126 of the row maximum can afford). 2^-inf = 0, NaN stays NaN.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two fp32 values rounded to nearest into one register of a 16-bit A fragment (lo in the low half).
template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

}  // namespace ptx
}  // namespace attention_int8
