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

}  // namespace attention_int8
