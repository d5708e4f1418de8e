// The dispatch layer: run-time head dim, element type and masking become each kernel's traits (kernel_traits.cuh),
// so every kernel sees its shapes as constants; and the launch helpers both kernels share.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

#include "attention_int8.h"
#include "kernel_traits.cuh"

namespace attention_int8 {

// The cases must list exactly the head dims head_dim_supported() accepts.
template <typename F>
cudaError_t dispatch_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 80: return f(std::integral_constant<int, 80>{});
    case 96: return f(std::integral_constant<int, 96>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
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

// f(std::true_type{}) or f(std::false_type{}): a run-time flag as a compile-time one.
template <typename F>
cudaError_t dispatch_bool(bool flag, F&& f) {
  return flag ? f(std::true_type{}) : f(std::false_type{});
}

// f(std::true_type{}) for packed sequences, f(std::false_type{}) for a dense batch.
template <typename F>
cudaError_t dispatch_packed(const PackedSequences& packed, F&& f) {
  return dispatch_bool(packed.cu_seqlens != nullptr, f);
}

// The portable kernel's traits for p: f(Traits{}).
template <typename F>
cudaError_t dispatch_portable_traits(const AttentionParams& p, F&& f) {
  return dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    return dispatch_elem(p.dtype, [&](auto elem) {
      return dispatch_packed(p.packed_q, [&](auto packed) {
        return f(AttentionKernelTraits<decltype(head_dim)::value, decltype(elem), decltype(packed)::value>{});
      });
    });
  });
}

// The Hopper kernel's traits for p: f(Traits{}). The consumers take turns issuing their wgmmas only at D' = 128
// without the causal mask (Sm90AttentionKernelTraits::kTakeTurns says why).
template <typename F>
cudaError_t dispatch_sm90_traits(const AttentionParams& p, F&& f) {
  return dispatch_head_dim(p.head_dim, [&](auto head_dim) {
    return dispatch_elem(p.dtype, [&](auto elem) {
      return dispatch_packed(p.packed_q, [&](auto packed) {
        constexpr int D = decltype(head_dim)::value;
        constexpr bool kPacked = decltype(packed)::value;
        using Elem = decltype(elem);
        if constexpr (Sm90AttentionKernelTraits<D, Elem>::kMmaDim == 128) {
          if (!p.causal) return f(Sm90AttentionKernelTraits<D, Elem, /*kTakeTurns=*/true, kPacked>{});
        }
        return f(Sm90AttentionKernelTraits<D, Elem, /*kTakeTurns=*/false, kPacked>{});
      });
    });
  });
}

// Launches an attention kernel over `grid` with the dynamic shared memory its traits ask for (above 48 KB only
// after cudaFuncSetAttribute raises the kernel's limit). `extra` are further kernel arguments after the params
// (the sm90 kernel's TMA descriptor).
template <typename Traits, typename Kernel, typename... Extra>
cudaError_t launch_attention_kernel(Kernel kernel, dim3 grid, const AttentionParams& p, cudaStream_t stream,
                                    const Extra&... extra) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  return launch(kernel, grid, Traits::kThreads, Traits::kSmemBytes, stream, p.programmatic_launch, p, extra...);
}

}  // namespace attention_int8
