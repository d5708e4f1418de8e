// Run-time -> compile-time dispatch shared by the launchers: head dim and element type become
// template arguments, so every kernel sees its shapes as constants.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

#include "attention_int8.h"

namespace attention_int8 {

// The cases must list exactly the head dims head_dim_supported() accepts.
template <typename F>
cudaError_t dispatch_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 96: return f(std::integral_constant<int, 96>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: return cudaErrorInvalidValue;
  }
}

template <typename F>
cudaError_t dispatch_elem(ElemType dtype, F&& f) {
  switch (dtype) {
    case ElemType::kFloat16: return f(__half{});
    case ElemType::kBFloat16: return f(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the stream's previous kernel
// when `dependent` (sm_90+ only: it may then start early and must call ptx::wait_for_predecessor()).
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool dependent,
                   const Args&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = dependent ? &attribute : nullptr;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Launches an attention kernel over `grid` with the dynamic shared memory its traits ask for (above 48 KB only
// after cudaFuncSetAttribute raises the kernel's limit). Both kernels take query blocks as the fastest index, so
// the CTAs running at one time share one or two heads, whose K and V stay in L2 (a persistent variant of the
// Hopper kernel that took heads fastest was 8-13% slower at N >= 8192: benchmarks/RESULTS.md, v18).
// `extra` are further kernel arguments after the params (the sm90 kernel's TMA descriptor).
template <typename Traits, typename Kernel, typename... Extra>
cudaError_t launch_attention_kernel(Kernel kernel, dim3 grid, const AttentionParams& p, cudaStream_t stream,
                                    const Extra&... extra) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  return launch(kernel, grid, Traits::kThreads, Traits::kSmemBytes, stream, p.programmatic_launch, p, extra...);
}

}  // namespace attention_int8
