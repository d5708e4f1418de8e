// The torch-facing functions of attention_int8. Every function defined in torch_binding.cpp with
// external linkage is declared here (the build enforces it with -Wmissing-declarations -Werror).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

// CUDA implementations (also registered for CPU tensors, where their device check raises a clear error).
at::Tensor int8_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                                  std::optional<double> sm_scale, c10::string_view tensor_layout, bool smooth_k,
                                  bool balance_channels, bool smooth_q);

std::tuple<at::Tensor, at::Tensor> int8_attention_forward_with_lse(const at::Tensor& q, const at::Tensor& k,
                                                                   const at::Tensor& v, bool is_causal,
                                                                   std::optional<double> sm_scale,
                                                                   c10::string_view tensor_layout, bool smooth_k,
                                                                   bool balance_channels, bool smooth_q);

at::Tensor int8_attention_varlen_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                         int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
                                         std::optional<double> sm_scale, bool smooth_k, bool balance_channels, bool smooth_q);

std::tuple<at::Tensor, at::Tensor> int8_attention_varlen_forward_with_lse(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
    std::optional<double> sm_scale, bool smooth_k, bool balance_channels, bool smooth_q);

std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& x, const std::optional<at::Tensor>& mean,
                                                 double out_scale, c10::string_view tensor_layout,
                                                 int64_t tokens_per_scale);

at::Tensor key_center(const at::Tensor& k, c10::string_view tensor_layout);

// Meta implementations: shapes only, with symbolic sizes, for FakeTensor / torch.compile.
at::Tensor int8_attention_forward_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                                       std::optional<double> sm_scale, c10::string_view tensor_layout, bool smooth_k,
                                       bool balance_channels, bool smooth_q);

std::tuple<at::Tensor, at::Tensor> int8_attention_forward_with_lse_meta(const at::Tensor& q, const at::Tensor& k,
                                                                        const at::Tensor& v, bool is_causal,
                                                                        std::optional<double> sm_scale,
                                                                        c10::string_view tensor_layout, bool smooth_k,
                                                                        bool balance_channels, bool smooth_q);

at::Tensor int8_attention_varlen_forward_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                              int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
                                              std::optional<double> sm_scale, bool smooth_k, bool balance_channels, bool smooth_q);

std::tuple<at::Tensor, at::Tensor> int8_attention_varlen_forward_with_lse_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
    std::optional<double> sm_scale, bool smooth_k, bool balance_channels, bool smooth_q);

std::tuple<at::Tensor, at::Tensor> quantize_int8_meta(const at::Tensor& x, const std::optional<at::Tensor>& mean,
                                                      double out_scale, c10::string_view tensor_layout,
                                                      int64_t tokens_per_scale);

at::Tensor key_center_meta(const at::Tensor& k, c10::string_view tensor_layout);
