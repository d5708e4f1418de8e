// Hopper (sm_90) producer/consumer primitives: transaction barriers (mbarrier), bulk and TMA
// global->shared copies that complete on them, named barriers between warpgroups, and register reallocation.
//
// The protocol of a pipeline stage: the producer arms the stage's "full" barrier with the number of
// bytes it will copy (arrive_expect_tx) and issues bulk copies that count those bytes down; the phase
// completes when all bytes landed. Consumers wait on "full", use the stage, then arrive on the stage's
// "empty" barrier; the producer waits on "empty" before it overwrites the stage. Waits name the parity
// of the phase to wait for: a freshly initialized barrier is in phase 0, so a wait for parity 1
// returns at once, which lets the producer's first pass over the stages start without a handshake.
#pragma once

#include <cstdint>

namespace attention_int8 {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes initialized barriers visible to the async proxy (the bulk copies) and to the other threads,
// together with the __syncthreads that must follow.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Orders this thread's ordinary shared-memory stores before later reads through the async proxy (wgmma
// operands), together with a barrier between the writers and the readers.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Returns once the phase of `parity` has completed (try_wait itself waits a system-dependent time per test).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory on
// the copy engine; completion counts down `bar`'s transaction bytes. A plain byte copy: layouts that
// wgmma needs (the 128-byte swizzle) must already be in global memory.
__device__ __forceinline__ void bulk_copy_g2s(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Copies one box of a 4-D tensor (coordinates innermost first, in elements) from global to shared
// memory through its TMA descriptor, which sets the box shape and the swizzle; elements outside the
// tensor arrive as zeros. `tensor_map` must live in kernel-parameter, constant or global memory.
__device__ __forceinline__ void tma_load_4d(void* smem, const void* tensor_map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::
          "r"(smem_addr(smem)),
      "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

// Named barriers (ids 1..15; 0 is __syncthreads) over `threads` threads: sync waits, arrive does not.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Moves registers between warpgroups: the copy issuer needs few, the MMA warpgroups as many as fit.
template <int kRegs>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace sm90
}  // namespace attention_int8
