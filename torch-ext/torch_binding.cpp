// Op registration, argument checks and workspace management for attention_int8.
//
// The checks here repeat the Python API's on purpose: torch.ops.<namespace>.int8_attention_forward is
// public too, and no input it accepts may reach a kernel that would read or write out of bounds.
#include "torch_binding.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "../attention-int8/attention_int8.h"
#include "registration.h"

namespace {

namespace ai8 = attention_int8;

// Row indices are 32-bit inside the kernels (offsets are 64-bit): keep sequence lengths well inside.
constexpr int64_t kMaxSeqlen = int64_t(1) << 30;
constexpr int64_t kMaxGridDim = 65535;  // batch and heads index gridDim.z / gridDim.y
constexpr double kLog2e = 1.4426950408889634;

enum class Layout { kHND, kNHD };

Layout parse_layout(c10::string_view layout) {
  if (layout == "HND") return Layout::kHND;
  TORCH_CHECK_VALUE(layout == "NHD", "tensor_layout must be \"HND\" ([B, H, N, D]) or \"NHD\" ([B, N, H, D]), got \"",
                    layout, "\"");
  return Layout::kNHD;
}

int head_axis(Layout layout) { return layout == Layout::kHND ? 1 : 2; }
int seq_axis(Layout layout) { return layout == Layout::kHND ? 2 : 1; }

struct Shape {
  int64_t batch, heads, seqlen, head_dim;
};

Shape shape_of(const at::Tensor& t, Layout layout) {
  return {t.size(0), t.size(head_axis(layout)), t.size(seq_axis(layout)), t.size(3)};
}

ai8::RowMajorView view_of(const at::Tensor& t, Layout layout) {
  return {t.stride(0), t.stride(head_axis(layout)), t.stride(seq_axis(layout))};
}

ai8::ElemType elem_type_of(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf ? ai8::ElemType::kFloat16 : ai8::ElemType::kBFloat16;
}

void check_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 4, name, " must be a 4-D tensor ([B, H, N, D] for HND, [B, N, H, D] for NHD), got ",
                    t.dim(), " dims");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
                   name, " must be float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device(),
                    " (the CPU path is attention_int8.reference.int8_attention_reference)");
  TORCH_CHECK_VALUE(t.size(3) <= 1 || t.stride(3) == 1, name,
                    " must be contiguous in its last (head_dim) dimension, got stride ", t.stride(3));
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "attention_int8: ", what, " failed: ", cudaGetErrorString(err));
}

struct Capability {
  int major, minor;
};

Capability checked_capability(const at::Tensor& t) {
  Capability cc{};
  const int device = t.get_device();
  check_cuda(cudaDeviceGetAttribute(&cc.major, cudaDevAttrComputeCapabilityMajor, device), "reading the GPU's capability");
  check_cuda(cudaDeviceGetAttribute(&cc.minor, cudaDevAttrComputeCapabilityMinor, device), "reading the GPU's capability");
  TORCH_CHECK_VALUE(cc.major >= 8, "attention_int8 needs a GPU of compute capability 8.0 or newer (INT8 mma.sync), "
                                   "but ", t.device(), " is ", cc.major, ".", cc.minor);
  return cc;
}

// ATTENTION_INT8_FORCE_PORTABLE=1 routes every call to the portable mma.sync kernel, so the tests can
// hold both kernels to the reference on a Hopper GPU. Read per call: no global state.
ai8::AttentionKernel attention_kernel_for(Capability cc) {
  const char* force_portable = std::getenv("ATTENTION_INT8_FORCE_PORTABLE");
  return ai8::choose_attention_kernel(cc.major, cc.minor,
                                      force_portable != nullptr && std::string_view(force_portable) == "1");
}

// ATTENTION_INT8_KV_SPLITS=n (n >= 1, read per call) makes the Hopper kernel split every non-causal tile's keys
// n ways (at most kMaxKvSplits, one key tile each), so the tests reach the split path and its combine on any
// shape; unset, only the grid's last partial wave is split (tile_schedule_sm90).
int forced_kv_splits() {
  const char* value = std::getenv("ATTENTION_INT8_KV_SPLITS");
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  const long splits = std::strtol(value, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && splits >= 1, "ATTENTION_INT8_KV_SPLITS must be a positive integer, got \"", value,
                    "\"");
  return static_cast<int>(std::min<long>(splits, ai8::kMaxKvSplits));
}

void check_sizes(const Shape& s, const char* name) {
  TORCH_CHECK_VALUE(ai8::head_dim_supported(static_cast<int>(s.head_dim)), name, " has head_dim ", s.head_dim,
                    "; supported head dims are 64, 96 and 128");
  TORCH_CHECK_VALUE(s.seqlen <= kMaxSeqlen, name, " has sequence length ", s.seqlen, "; at most ", kMaxSeqlen,
                    " is supported");
  TORCH_CHECK_VALUE(s.batch <= kMaxGridDim && s.heads <= kMaxGridDim, name, " has batch ", s.batch, " and heads ",
                    s.heads, "; each must be at most ", kMaxGridDim);
}


int64_t round_up(int64_t x, int64_t multiple) { return ai8::ceil_div(x, multiple) * multiple; }

void check_tokens_per_scale(int64_t tokens_per_scale) {
  TORCH_CHECK_VALUE(tokens_per_scale == 1 || tokens_per_scale == ai8::kKeyScaleTokens,
                    "tokens_per_scale must be 1 (Q's per-token scales) or ", ai8::kKeyScaleTokens,
                    " (K's per-block scales), got ", tokens_per_scale);
}

// The kernels read V (and the sm90 kernel Q) in place with 16-byte or vector accesses, and the sm90
// kernel V by TMA: base and row/head/batch strides must be 16-byte aligned, and TMA also takes no zero
// stride (an expanded tensor). Anything else is copied once into a dense tensor (documented cost).
at::Tensor readable_in_place(const at::Tensor& x, Layout layout, bool sm90) {
  const int64_t align = 16 / x.element_size();
  const auto view = view_of(x, layout);
  bool usable = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && view.batch_stride % align == 0 &&
                view.head_stride % align == 0 && view.row_stride % align == 0;
  if (sm90) usable = usable && view.batch_stride > 0 && view.head_stride > 0 && view.row_stride > 0;
  return usable ? x : at::empty_like(x, at::MemoryFormat::Contiguous).copy_(x);
}

struct QuantizedRows {
  at::Tensor values;   // int8 [B, H, seqlen_pad, D] (sm90 layout: D -> sm90_row_bytes(D))
  at::Tensor scales;   // fp32 [B, H, ceil_div(seqlen_pad, tokens_per_scale)]
  at::Tensor row_dot;  // fp32 [B, H, seqlen_pad] (x . dot_vec), when a dot_vec was given
};

// Quantizes x with one scale per tokens_per_scale tokens (1 or kKeyScaleTokens), rows padded to a
// multiple of row_multiple.
QuantizedRows quantize(const at::Tensor& x, Layout layout, const std::optional<at::Tensor>& mean, double out_scale,
                       int64_t tokens_per_scale, int64_t row_multiple, cudaStream_t stream,
                       const std::optional<at::Tensor>& dot_vec = {}, bool sm90_layout = false,
                       bool programmatic_launch = false) {
  const Shape s = shape_of(x, layout);
  const int64_t seqlen_pad = round_up(s.seqlen, row_multiple);
  const auto f32 = x.options().dtype(at::kFloat);
  const int64_t row_bytes = sm90_layout ? ai8::sm90_row_bytes(static_cast<int>(s.head_dim)) : s.head_dim;
  QuantizedRows out{at::empty({s.batch, s.heads, seqlen_pad, row_bytes}, x.options().dtype(at::kChar)),
                    at::empty({s.batch, s.heads, ai8::ceil_div(seqlen_pad, tokens_per_scale)}, f32),
                    dot_vec.has_value() ? at::empty({s.batch, s.heads, seqlen_pad}, f32) : at::Tensor()};
  ai8::QuantizeParams params{};
  if (dot_vec.has_value()) {
    params.dot_vec = dot_vec->data_ptr<float>();
    params.dot_head_group = static_cast<int>(s.heads / dot_vec->size(1));
    params.row_dot = out.row_dot.data_ptr<float>();
  }
  params.x = x.data_ptr();
  params.x_view = view_of(x, layout);
  params.mean = mean.has_value() ? mean->data_ptr<float>() : nullptr;
  params.x_q = out.values.data_ptr<int8_t>();
  params.scale = out.scales.data_ptr<float>();
  params.batch = static_cast<int>(s.batch);
  params.heads = static_cast<int>(s.heads);
  params.seqlen = static_cast<int>(s.seqlen);
  params.seqlen_pad = static_cast<int>(seqlen_pad);
  params.head_dim = static_cast<int>(s.head_dim);
  params.tokens_per_scale = static_cast<int>(tokens_per_scale);
  params.out_scale = static_cast<float>(out_scale);
  params.dtype = elem_type_of(x);
  params.sm90_layout = sm90_layout;
  params.programmatic_launch = programmatic_launch;
  params.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  check_cuda(ai8::launch_quantize(params, stream), "launching quantize");
  return out;
}

// K's smoothing centre [B, H, D] fp32 (launch_key_center): the mean of a sample of its keys, outliers left out.
at::Tensor compute_key_center(const at::Tensor& x, Layout layout, cudaStream_t stream) {
  const Shape s = shape_of(x, layout);
  at::Tensor center = at::empty({s.batch, s.heads, s.head_dim}, x.options().dtype(at::kFloat));
  ai8::KeyCenterParams params{};
  params.x = x.data_ptr();
  params.x_view = view_of(x, layout);
  params.center = center.data_ptr<float>();
  params.batch = static_cast<int>(s.batch);
  params.heads = static_cast<int>(s.heads);
  params.seqlen = static_cast<int>(s.seqlen);
  params.head_dim = static_cast<int>(s.head_dim);
  params.dtype = elem_type_of(x);
  check_cuda(ai8::launch_key_center(params, stream), "launching key_center");
  return center;
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool is_causal, std::optional<double> sm_scale,
                                                     c10::string_view tensor_layout, bool smooth_k, bool with_lse) {
  check_input(q, "q");
  check_input(k, "k");
  check_input(v, "v");
  const Layout layout = parse_layout(tensor_layout);
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "q, k and v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), " and ",
                   v.scalar_type());
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), "q, k and v must be on one device, got ",
                    q.device(), ", ", k.device(), " and ", v.device());
  const Shape sq = shape_of(q, layout), sk = shape_of(k, layout);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(sk.batch == sq.batch, "k has batch ", sk.batch, " but q has batch ", sq.batch);
  TORCH_CHECK_VALUE(sk.head_dim == sq.head_dim, "k has head_dim ", sk.head_dim, " but q has head_dim ", sq.head_dim);
  TORCH_CHECK_VALUE(sq.heads == 0 || (sk.heads > 0 && sq.heads % sk.heads == 0),
                    "the number of q heads (", sq.heads, ") must be a multiple of the number of k/v heads (", sk.heads,
                    ")");
  check_sizes(sq, "q");
  check_sizes(sk, "k");
  const double scale = sm_scale.has_value() ? *sm_scale : 1.0 / std::sqrt(static_cast<double>(sq.head_dim));
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0.0, "sm_scale must be a finite positive number, got ", scale);
  const Capability cc = checked_capability(q);

  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor lse = with_lse ? at::empty({sq.batch, sq.heads, sq.seqlen}, q.options().dtype(at::kFloat)) : at::Tensor();
  if (out.numel() == 0) return {out, lse};

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ai8::AttentionKernel kernel = attention_kernel_for(cc);
  const bool sm90 = kernel == ai8::AttentionKernel::kSm90;
  const int kv_splits = forced_kv_splits();  // checked on every GPU, though only the sm90 kernel splits
  // Copies (if any) first: on Hopper the kernels after K's centre start under their predecessor's tail
  // (programmatic dependent launch), and the attention kernel reads Q and V before it waits for K.
  const at::Tensor v_rows = readable_in_place(v, layout, sm90);
  const at::Tensor q_rows = sm90 ? readable_in_place(q, layout, sm90) : q;
  // K smoothing: one centre is shared by every key, so subtracting it shifts each logit row by a
  // constant (softmax-invariant) while taking the channel offsets out of the INT8 range.
  std::optional<at::Tensor> k_center;
  if (smooth_k && sk.seqlen > 0) k_center = compute_key_center(k, layout, stream);
  // sm_scale and log2(e) ride on the Q scales: the kernel's dequantized S is the base-2 logit.
  // K smoothing moves logit row i by q_i . k_center: softmax ignores that, the LSE must add it back (each
  // kernel's epilogue does, from the inputs AttentionParams names).
  const bool lse_shift = with_lse && k_center.has_value();
  const double q_out_scale = scale * kLog2e;
  const QuantizedRows k_q = quantize(k, layout, k_center, 1.0, ai8::kKeyScaleTokens, ai8::kKeyPad, stream, std::nullopt,
                                     /*sm90_layout=*/sm90, /*programmatic_launch=*/sm90 && k_center.has_value());

  ai8::AttentionParams params{};
  QuantizedRows q_q;
  if (sm90) {  // the kernel quantizes its Q tiles itself
    params.q_input = q_rows.data_ptr();
    params.q_view = view_of(q_rows, layout);
    params.q_out_scale = static_cast<float>(q_out_scale);
    params.k_center = lse_shift ? k_center->data_ptr<float>() : nullptr;
  } else {
    q_q = quantize(q, layout, std::nullopt, q_out_scale, 1, ai8::kQueryPad, stream,
                   lse_shift ? k_center : std::nullopt);
    params.q = q_q.values.data_ptr<int8_t>();
    params.q_scale = q_q.scales.data_ptr<float>();
    params.q_center_dot = lse_shift ? q_q.row_dot.data_ptr<float>() : nullptr;
    params.seqlen_q_pad = static_cast<int>(q_q.values.size(2));
  }
  params.sm_scale = static_cast<float>(scale);
  params.k = k_q.values.data_ptr<int8_t>();
  params.k_scale = k_q.scales.data_ptr<float>();
  params.v = v_rows.data_ptr();
  params.v_view = view_of(v_rows, layout);
  params.o = out.data_ptr();
  params.o_view = view_of(out, layout);
  params.lse = with_lse ? lse.data_ptr<float>() : nullptr;
  params.batch = static_cast<int>(sq.batch);
  params.heads_q = static_cast<int>(sq.heads);
  params.heads_kv = static_cast<int>(sk.heads);
  params.seqlen_q = static_cast<int>(sq.seqlen);
  params.seqlen_kv = static_cast<int>(sk.seqlen);
  params.seqlen_kv_pad = static_cast<int>(k_q.values.size(2));
  params.head_dim = static_cast<int>(sq.head_dim);
  params.causal = is_causal;
  params.kernel = kernel;
  // The K quantizer ran just before (its launch is skipped only without keys).
  params.programmatic_launch = sm90 && sk.seqlen > 0;
  params.dtype = elem_type_of(q);
  at::Tensor o_partial, row_stats;
  if (sm90) {
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
    params.schedule = ai8::tile_schedule_sm90(params, props->multiProcessorCount, props->l2CacheSize, kv_splits);
    if (params.schedule.split_tiles > 0) {
      const auto f32 = q.options().dtype(at::kFloat);
      o_partial = at::empty({params.schedule.partial_rows(), sq.head_dim}, f32);
      static_assert(sizeof(ai8::SplitRowStats) == 3 * sizeof(float), "SplitRowStats is three fp32");
      row_stats = at::empty({params.schedule.partial_rows(), 3}, f32);
      params.o_partial = o_partial.data_ptr<float>();
      params.row_stats = reinterpret_cast<ai8::SplitRowStats*>(row_stats.data_ptr<float>());
    }
  }
  check_cuda(ai8::launch_attention_forward(params, stream), "launching attention_forward");
  return {out, lse};
}

at::Tensor lse_like(const at::Tensor& q, Layout layout) {
  return at::empty_symint({q.sym_size(0), q.sym_size(head_axis(layout)), q.sym_size(seq_axis(layout))},
                          q.options().dtype(at::kFloat));
}

}  // namespace

at::Tensor int8_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                                  std::optional<double> sm_scale, c10::string_view tensor_layout, bool smooth_k) {
  return std::get<0>(attention_forward(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k, /*with_lse=*/false));
}

std::tuple<at::Tensor, at::Tensor> int8_attention_forward_with_lse(const at::Tensor& q, const at::Tensor& k,
                                                                   const at::Tensor& v, bool is_causal,
                                                                   std::optional<double> sm_scale,
                                                                   c10::string_view tensor_layout, bool smooth_k) {
  return attention_forward(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k, /*with_lse=*/true);
}

std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& x, const std::optional<at::Tensor>& mean,
                                                 double out_scale, c10::string_view tensor_layout,
                                                 int64_t tokens_per_scale) {
  check_input(x, "x");
  const Layout layout = parse_layout(tensor_layout);
  const Shape s = shape_of(x, layout);
  check_sizes(s, "x");
  check_tokens_per_scale(tokens_per_scale);
  checked_capability(x);
  if (mean.has_value()) {
    TORCH_CHECK_TYPE(mean->scalar_type() == at::kFloat, "mean must be float32, got ", mean->scalar_type());
    TORCH_CHECK_VALUE(mean->device() == x.device(), "mean must be on ", x.device(), ", got ", mean->device());
    TORCH_CHECK_VALUE(mean->sizes() == at::IntArrayRef({s.batch, s.heads, s.head_dim}) && mean->is_contiguous(),
                      "mean must be a contiguous [B, H, D] = [", s.batch, ", ", s.heads, ", ", s.head_dim,
                      "] tensor, got ", mean->sizes());
  }
  const c10::cuda::CUDAGuard device_guard(x.device());
  const QuantizedRows rows =
      quantize(x, layout, mean, out_scale, tokens_per_scale, /*row_multiple=*/1, c10::cuda::getCurrentCUDAStream());
  return {rows.values, rows.scales};
}

at::Tensor key_center(const at::Tensor& k, c10::string_view tensor_layout) {
  check_input(k, "k");
  const Layout layout = parse_layout(tensor_layout);
  const Shape s = shape_of(k, layout);
  check_sizes(s, "k");
  TORCH_CHECK_VALUE(s.seqlen > 0, "k must hold at least one key, got ", s.seqlen);
  checked_capability(k);
  const c10::cuda::CUDAGuard device_guard(k.device());
  if (s.batch * s.heads == 0) return at::empty({s.batch, s.heads, s.head_dim}, k.options().dtype(at::kFloat));
  return compute_key_center(k, layout, c10::cuda::getCurrentCUDAStream());
}

at::Tensor int8_attention_forward_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, bool,
                                       std::optional<double>, c10::string_view, bool) {
  return at::empty_like(q, at::MemoryFormat::Contiguous);
}

std::tuple<at::Tensor, at::Tensor> int8_attention_forward_with_lse_meta(const at::Tensor& q, const at::Tensor&,
                                                                        const at::Tensor&, bool, std::optional<double>,
                                                                        c10::string_view tensor_layout, bool) {
  return {at::empty_like(q, at::MemoryFormat::Contiguous), lse_like(q, parse_layout(tensor_layout))};
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_meta(const at::Tensor& x, const std::optional<at::Tensor>&,
                                                      double, c10::string_view tensor_layout,
                                                      int64_t tokens_per_scale) {
  check_tokens_per_scale(tokens_per_scale);
  const Layout layout = parse_layout(tensor_layout);
  const c10::SymInt b = x.sym_size(0), h = x.sym_size(head_axis(layout)), n = x.sym_size(seq_axis(layout));
  return {at::empty_symint({b, h, n, x.sym_size(3)}, x.options().dtype(at::kChar)),
          at::empty_symint({b, h, (n + tokens_per_scale - 1) / tokens_per_scale}, x.options().dtype(at::kFloat))};
}

at::Tensor key_center_meta(const at::Tensor& k, c10::string_view tensor_layout) {
  const Layout layout = parse_layout(tensor_layout);
  return at::empty_symint({k.sym_size(0), k.sym_size(head_axis(layout)), k.sym_size(3)}, k.options().dtype(at::kFloat));
}

TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {
  ops.def(
      "int8_attention_forward(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? sm_scale=None, "
      "str tensor_layout=\"HND\", bool smooth_k=True) -> Tensor");
  ops.def(
      "int8_attention_forward_with_lse(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? sm_scale=None, "
      "str tensor_layout=\"HND\", bool smooth_k=True) -> (Tensor, Tensor)");
  ops.def(
      "quantize_int8(Tensor x, Tensor? mean, float out_scale=1.0, str tensor_layout=\"HND\", int tokens_per_scale=1) "
      "-> (Tensor, Tensor)");
  ops.def("key_center(Tensor k, str tensor_layout=\"HND\") -> Tensor");
}

// CPU tensors reach the same functions so that their device check answers with a clear ValueError.
TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CUDA, ops) {
  ops.impl("int8_attention_forward", &int8_attention_forward);
  ops.impl("int8_attention_forward_with_lse", &int8_attention_forward_with_lse);
  ops.impl("quantize_int8", &quantize_int8);
  ops.impl("key_center", &key_center);
}

TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CPU, ops) {
  ops.impl("int8_attention_forward", &int8_attention_forward);
  ops.impl("int8_attention_forward_with_lse", &int8_attention_forward_with_lse);
  ops.impl("quantize_int8", &quantize_int8);
  ops.impl("key_center", &key_center);
}

TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, Meta, ops) {
  ops.impl("int8_attention_forward", &int8_attention_forward_meta);
  ops.impl("int8_attention_forward_with_lse", &int8_attention_forward_with_lse_meta);
  ops.impl("quantize_int8", &quantize_int8_meta);
  ops.impl("key_center", &key_center_meta);
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
