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
#include <string>
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

// The rows of q, k, v (or x) as the kernels address them: a dense [B, H, N, D] batch in either layout, or packed
// sequences [total, H, D] (ai8::PackedSequences), seen with batch stride 0 and N the longest sequence's.
struct Operand {
  at::Tensor tensor;
  Layout layout;  // dense only
  Shape shape;
  ai8::RowMajorView view;
  ai8::PackedSequences packed;  // cu_seqlens nullptr: dense
};

Operand dense_operand(const at::Tensor& t, Layout layout) {
  return {t, layout, shape_of(t, layout), view_of(t, layout), {}};
}

Operand packed_operand(const at::Tensor& t, const at::Tensor& cu_seqlens, int64_t max_seqlen) {
  return {t,
          Layout::kNHD,
          {cu_seqlens.size(0) - 1, t.size(1), max_seqlen, t.size(2)},
          {0, t.stride(1), t.stride(0)},
          {cu_seqlens.data_ptr<int>(), static_cast<int>(t.size(0))}};
}

bool is_packed(const Operand& x) { return x.packed.cu_seqlens != nullptr; }

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

std::string supported_head_dims() {
  std::string list;
  for (int d : ai8::kSupportedHeadDims) list += (list.empty() ? "" : ", ") + std::to_string(d);
  return list;
}

void check_sizes(const Shape& s, const char* name) {
  TORCH_CHECK_VALUE(ai8::head_dim_supported(static_cast<int>(s.head_dim)), name, " has head_dim ", s.head_dim,
                    "; supported head dims are ", supported_head_dims());
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
// stride (an expanded tensor; packed sequences have no batch stride to give it). Anything else is copied once
// into a dense tensor (documented cost).
Operand readable_in_place(const Operand& x, bool sm90) {
  const int64_t align = 16 / x.tensor.element_size();
  const ai8::RowMajorView& view = x.view;
  bool usable = reinterpret_cast<uintptr_t>(x.tensor.data_ptr()) % 16 == 0 && view.batch_stride % align == 0 &&
                view.head_stride % align == 0 && view.row_stride % align == 0;
  if (sm90) usable = usable && (is_packed(x) || view.batch_stride > 0) && view.head_stride > 0 && view.row_stride > 0;
  if (usable) return x;
  Operand copy = x;
  copy.tensor = at::empty_like(x.tensor, at::MemoryFormat::Contiguous).copy_(x.tensor);
  const at::Tensor& t = copy.tensor;
  copy.view = is_packed(x) ? ai8::RowMajorView{0, t.stride(1), t.stride(0)} : view_of(t, x.layout);
  return copy;
}

struct QuantizedRows {
  at::Tensor values;   // int8 [B, H, seqlen_pad, D] (sm90 layout: D -> sm90_row_bytes(D))
  at::Tensor scales;   // fp32 [B, H, ceil_div(seqlen_pad, tokens_per_scale)]
  at::Tensor row_dot;  // fp32 [B, H, seqlen_pad] (x . dot_vec), when a dot_vec was given
  at::Tensor key_bias, key_bias_max;  // K under Q smoothing: fp32 [B, Hq, seqlen_pad] and [B, Hq, seqlen_pad / 64]
};

// Q smoothing's per-head choice and shifts (KeyCenterParams), from K's centre pass.
struct QueryShift {
  at::Tensor shift;     // fp32 [B, Hq, D]
  at::Tensor smoothed;  // int32 [B, Hq]
};

// Quantizes x with one scale per tokens_per_scale tokens (1 or kKeyScaleTokens), rows padded to a
// multiple of row_multiple (per sequence, for packed sequences). K with a query_shift also gets Q smoothing's key
// biases (bias_scale = sm_scale * log2(e)).
QuantizedRows quantize(const Operand& x, const std::optional<at::Tensor>& mean, double out_scale,
                       int64_t tokens_per_scale, int64_t row_multiple, cudaStream_t stream,
                       const std::optional<at::Tensor>& dot_vec = {}, bool sm90_layout = false,
                       bool programmatic_launch = false, const std::optional<at::Tensor>& channel_scale = {},
                       const std::optional<QueryShift>& query_shift = {}, double bias_scale = 0.0) {
  const Shape& s = x.shape;
  const int64_t seqlen_pad = round_up(s.seqlen, row_multiple);
  const auto f32 = x.tensor.options().dtype(at::kFloat);
  const int64_t row_bytes = sm90_layout ? ai8::sm90_row_bytes(static_cast<int>(s.head_dim)) : s.head_dim;
  QuantizedRows out{at::empty({s.batch, s.heads, seqlen_pad, row_bytes}, x.tensor.options().dtype(at::kChar)),
                    at::empty({s.batch, s.heads, ai8::ceil_div(seqlen_pad, tokens_per_scale)}, f32),
                    dot_vec.has_value() ? at::empty({s.batch, s.heads, seqlen_pad}, f32) : at::Tensor(),
                    at::Tensor(), at::Tensor()};
  ai8::QuantizeParams params{};
  params.head_group = 1;
  for (const auto& vec : {dot_vec, channel_scale})  // both [B, Hkv, D]: heads per row of them
    if (vec.has_value()) params.head_group = static_cast<int>(s.heads / vec->size(1));
  if (dot_vec.has_value()) {
    params.dot_vec = dot_vec->data_ptr<float>();
    params.row_dot = out.row_dot.data_ptr<float>();
  }
  params.channel_scale = channel_scale.has_value() ? channel_scale->data_ptr<float>() : nullptr;
  if (query_shift.has_value()) {
    const int64_t heads_q = query_shift->smoothed.size(1);
    out.key_bias = at::empty({s.batch, heads_q, seqlen_pad}, f32);
    out.key_bias_max = at::empty({s.batch, heads_q, seqlen_pad / ai8::kKeyScaleTokens}, f32);
    params.query_shift = query_shift->shift.data_ptr<float>();
    params.query_smoothed = query_shift->smoothed.data_ptr<int>();
    params.key_bias = out.key_bias.data_ptr<float>();
    params.key_bias_max = out.key_bias_max.data_ptr<float>();
    params.query_group = static_cast<int>(heads_q / s.heads);
    params.bias_scale = static_cast<float>(bias_scale);
  }
  params.x = x.tensor.data_ptr();
  params.x_view = x.view;
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
  params.dtype = elem_type_of(x.tensor);
  params.sm90_layout = sm90_layout;
  params.programmatic_launch = programmatic_launch;
  params.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  check_cuda(ai8::launch_quantize(params, x.packed, stream), "launching quantize");
  return out;
}

// The centre pass over x (launch_key_center): the mean of a sample of its rows, outliers left out, [B, H, D] fp32;
// and for channel balancing, x's channel ranges about it (channel_range).
struct CenterPass {
  at::Tensor center, channel_range;
};

ai8::KeyCenterParams center_params(const Operand& x, const CenterPass& out) {
  const Shape& s = x.shape;
  ai8::KeyCenterParams params{};
  params.x = x.tensor.data_ptr();
  params.x_view = x.view;
  params.center = out.center.data_ptr<float>();
  params.channel_range = out.channel_range.defined() ? out.channel_range.data_ptr<float>() : nullptr;
  params.batch = static_cast<int>(s.batch);
  params.heads = static_cast<int>(s.heads);
  params.seqlen = static_cast<int>(s.seqlen);
  params.head_dim = static_cast<int>(s.head_dim);
  params.dtype = elem_type_of(x.tensor);
  return params;
}

CenterPass empty_center_pass(const Operand& x, bool with_range) {
  const Shape& s = x.shape;
  const auto f32 = x.tensor.options().dtype(at::kFloat);
  return {at::empty({s.batch, s.heads, s.head_dim}, f32),
          with_range ? at::empty({s.batch, s.heads, s.head_dim}, f32) : at::Tensor()};
}

at::Tensor compute_key_center(const Operand& x, cudaStream_t stream) {
  const CenterPass out = empty_center_pass(x, /*with_range=*/false);
  check_cuda(ai8::launch_key_center(center_params(x, out), x.packed, stream), "launching key_center");
  return out.center;
}

// What Q's centre pass gives the K side (KeyCenterParams): K's centre, channel balancing's factors s and 1 / s
// ([B, Hkv, D] fp32), and Q smoothing's choice and shifts; from one centre pass over Q and one over K, K's launched as
// the dependent of Q's on sm_90.
struct QueryFactors {
  at::Tensor k_center;
  std::optional<at::Tensor> balance, balance_inverse;
  std::optional<QueryShift> query_shift;
};

QueryFactors query_factors_of(const Operand& q, const Operand& k, bool balance, bool smooth_q, bool programmatic_launch,
                              cudaStream_t stream) {
  const CenterPass q_pass = empty_center_pass(q, /*with_range=*/true);
  const CenterPass k_pass = empty_center_pass(k, /*with_range=*/balance);
  check_cuda(ai8::launch_key_center(center_params(q, q_pass), q.packed, stream), "launching key_center on q");
  QueryFactors out{k_pass.center, {}, {}, {}};
  ai8::KeyCenterParams params = center_params(k, k_pass);
  params.query_range = q_pass.channel_range.data_ptr<float>();
  params.query_group = static_cast<int>(q.shape.heads / k.shape.heads);
  if (balance) {
    out.balance = at::empty_like(k_pass.center);
    out.balance_inverse = at::empty_like(k_pass.center);
    params.balance = out.balance->data_ptr<float>();
    params.balance_inverse = out.balance_inverse->data_ptr<float>();
  }
  if (smooth_q) {
    out.query_shift = QueryShift{at::empty_like(q_pass.center),
                                 at::empty({q.shape.batch, q.shape.heads}, q_pass.center.options().dtype(at::kInt))};
    params.query_center = q_pass.center.data_ptr<float>();
    params.query_shift = out.query_shift->shift.data_ptr<float>();
    params.query_smoothed = out.query_shift->smoothed.data_ptr<int>();
  }
  params.programmatic_launch = programmatic_launch;
  check_cuda(ai8::launch_key_center(params, k.packed, stream), "launching key_center on k");
  return out;
}

// The checks shared by the dense and the packed op: dtypes, devices, head counts and dims, the scale. Returns the
// softmax scale.
double check_attention_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Shape& sq,
                                const Shape& sk, std::optional<double> sm_scale) {
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "q, k and v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), " and ",
                   v.scalar_type());
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), "q, k and v must be on one device, got ",
                    q.device(), ", ", k.device(), " and ", v.device());
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(sk.head_dim == sq.head_dim, "k has head_dim ", sk.head_dim, " but q has head_dim ", sq.head_dim);
  TORCH_CHECK_VALUE(sq.heads == 0 || (sk.heads > 0 && sq.heads % sk.heads == 0),
                    "the number of q heads (", sq.heads, ") must be a multiple of the number of k/v heads (", sk.heads,
                    ")");
  check_sizes(sq, "q");
  check_sizes(sk, "k");
  const double scale = sm_scale.has_value() ? *sm_scale : 1.0 / std::sqrt(static_cast<double>(sq.head_dim));
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0.0, "sm_scale must be a finite positive number, got ", scale);
  return scale;
}

// O (and the LSE) of q, k, v into out (through out_view) and lse: the pre-passes and the attention kernel. The
// operands are checked, and out holds at least one element.
void run_attention(const Operand& q, const Operand& k, const Operand& v, const at::Tensor& out,
                   const ai8::RowMajorView& out_view, const at::Tensor& lse, bool is_causal, double scale,
                   bool smooth_k, bool balance_channels, bool smooth_q, Capability cc) {
  const bool with_lse = lse.defined();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ai8::AttentionKernel kernel = attention_kernel_for(cc);
  const bool sm90 = kernel == ai8::AttentionKernel::kSm90;
  const int kv_splits = forced_kv_splits();  // checked on every GPU, though only the sm90 kernel splits
  // Copies (if any) first: on Hopper the kernels after K's centre start under their predecessor's tail
  // (programmatic dependent launch), and the attention kernel reads Q and V before it waits for K.
  const Operand v_rows = readable_in_place(v, sm90);
  const Operand q_rows = sm90 ? readable_in_place(q, sm90) : q;
  // K smoothing: one centre is shared by every key, so subtracting it shifts each logit row by a
  // constant (softmax-invariant) while taking the channel offsets out of the INT8 range. The pre-pass of channel
  // balancing and Q smoothing computes that centre too.
  std::optional<at::Tensor> k_center, q_balance, k_balance;
  std::optional<QueryShift> query_shift;
  if ((balance_channels || smooth_q) && q.shape.seqlen > 0 && k.shape.seqlen > 0) {
    QueryFactors factors = query_factors_of(q, k, balance_channels, smooth_q, /*programmatic_launch=*/sm90, stream);
    if (smooth_k) k_center = factors.k_center;
    q_balance = factors.balance;
    k_balance = factors.balance_inverse;
    query_shift = factors.query_shift;
  } else if (smooth_k && k.shape.seqlen > 0) {
    k_center = compute_key_center(k, stream);
  }
  // sm_scale and log2(e) ride on the Q scales: the kernel's dequantized S is the base-2 logit.
  // K smoothing moves logit row i by q_i . k_center: softmax ignores that, the LSE must add it back (each
  // kernel's epilogue does, from the inputs AttentionParams names).
  const bool lse_shift = with_lse && k_center.has_value();
  const double q_out_scale = scale * kLog2e;
  const QuantizedRows k_q =
      quantize(k, k_center, 1.0, ai8::kKeyScaleTokens, ai8::kKeyPad, stream, std::nullopt, /*sm90_layout=*/sm90,
               /*programmatic_launch=*/sm90 && (k_center || k_balance || query_shift), k_balance, query_shift,
               q_out_scale);

  ai8::AttentionParams params{};
  QuantizedRows q_q;
  if (sm90) {  // the kernel quantizes its Q tiles itself
    params.q_input = q_rows.tensor.data_ptr();
    params.q_view = q_rows.view;
    params.q_out_scale = static_cast<float>(q_out_scale);
    params.k_center = lse_shift ? k_center->data_ptr<float>() : nullptr;
    params.q_balance = q_balance.has_value() ? q_balance->data_ptr<float>() : nullptr;
  } else {  // Q's shift is the quantizer's mean
    q_q = quantize(q, query_shift.has_value() ? std::optional<at::Tensor>(query_shift->shift) : std::nullopt,
                   q_out_scale, 1, ai8::kQueryPad, stream, lse_shift ? k_center : std::nullopt,
                   /*sm90_layout=*/false, /*programmatic_launch=*/false, q_balance);
    params.q = q_q.values.data_ptr<int8_t>();
    params.q_scale = q_q.scales.data_ptr<float>();
    params.q_center_dot = lse_shift ? q_q.row_dot.data_ptr<float>() : nullptr;
    params.seqlen_q_pad = static_cast<int>(q_q.values.size(2));
  }
  if (query_shift.has_value()) {  // the portable kernel reads the flags and biases, the sm90 kernel all four
    params.query_smoothed = query_shift->smoothed.data_ptr<int>();
    params.query_shift = query_shift->shift.data_ptr<float>();
    params.key_bias = k_q.key_bias.data_ptr<float>();
    params.key_bias_max = k_q.key_bias_max.data_ptr<float>();
  }
  params.sm_scale = static_cast<float>(scale);
  params.k = k_q.values.data_ptr<int8_t>();
  params.k_scale = k_q.scales.data_ptr<float>();
  params.v = v_rows.tensor.data_ptr();
  params.v_view = v_rows.view;
  params.o = out.data_ptr();
  params.o_view = out_view;
  params.lse = with_lse ? lse.data_ptr<float>() : nullptr;
  params.batch = static_cast<int>(q.shape.batch);
  params.heads_q = static_cast<int>(q.shape.heads);
  params.heads_kv = static_cast<int>(k.shape.heads);
  params.seqlen_q = static_cast<int>(q.shape.seqlen);
  params.seqlen_kv = static_cast<int>(k.shape.seqlen);
  params.seqlen_kv_pad = static_cast<int>(k_q.values.size(2));
  params.head_dim = static_cast<int>(q.shape.head_dim);
  params.packed_q = q.packed;
  params.packed_kv = v.packed;
  params.causal = is_causal;
  params.kernel = kernel;
  // The K quantizer ran just before (its launch is skipped only without keys).
  params.programmatic_launch = sm90 && k.shape.seqlen > 0;
  params.dtype = elem_type_of(q.tensor);
  at::Tensor o_partial, row_stats;
  if (sm90) {
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
    params.schedule = ai8::tile_schedule_sm90(params, props->multiProcessorCount, props->l2CacheSize, kv_splits);
    if (params.schedule.split_tiles > 0) {
      const auto f32 = q.tensor.options().dtype(at::kFloat);
      o_partial = at::empty({params.schedule.partial_rows(), q.shape.head_dim}, f32);
      static_assert(sizeof(ai8::SplitRowStats) == 3 * sizeof(float), "SplitRowStats is three fp32");
      row_stats = at::empty({params.schedule.partial_rows(), 3}, f32);
      params.o_partial = o_partial.data_ptr<float>();
      params.row_stats = reinterpret_cast<ai8::SplitRowStats*>(row_stats.data_ptr<float>());
    }
  }
  check_cuda(ai8::launch_attention_forward(params, stream), "launching attention_forward");
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool is_causal, std::optional<double> sm_scale,
                                                     c10::string_view tensor_layout, bool smooth_k,
                                                     bool balance_channels, bool smooth_q, bool with_lse) {
  check_input(q, "q");
  check_input(k, "k");
  check_input(v, "v");
  const Layout layout = parse_layout(tensor_layout);
  const Shape sq = shape_of(q, layout), sk = shape_of(k, layout);
  const double scale = check_attention_operands(q, k, v, sq, sk, sm_scale);
  TORCH_CHECK_VALUE(sk.batch == sq.batch, "k has batch ", sk.batch, " but q has batch ", sq.batch);
  const Capability cc = checked_capability(q);

  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor lse = with_lse ? at::empty({sq.batch, sq.heads, sq.seqlen}, q.options().dtype(at::kFloat)) : at::Tensor();
  if (out.numel() == 0) return {out, lse};
  run_attention(dense_operand(q, layout), dense_operand(k, layout), dense_operand(v, layout), out,
                view_of(out, layout), lse, is_causal, scale, smooth_k, balance_channels, smooth_q, cc);
  return {out, lse};
}

void check_packed_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 3, name, " must be a 3-D packed tensor [total_tokens, H, D], got ", t.dim(), " dims");
  check_input(t.unsqueeze(0), name);
}

void check_cu_seqlens(const at::Tensor& cu, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt, name, " must be a torch.int32 tensor, got ", cu.scalar_type());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 1, name, " must be a 1-D tensor of B + 1 offsets, got shape ",
                    cu.sizes());
  TORCH_CHECK_VALUE(cu.device() == q.device(), name, " must be on the device of q (", q.device(), "), got ",
                    cu.device());
  TORCH_CHECK_VALUE(cu.is_contiguous(), name, " must be contiguous");
}

// Packed sequences (FlashAttention's varlen form). cu_seqlens' values are not read on the host (that would
// synchronize with the GPU): the kernels clamp each sequence to the packed tensor and to its max_seqlen, so that
// offsets breaking the varlen rules give wrong rows but never an access outside the tensors (the Python API
// checks the rules).
std::tuple<at::Tensor, at::Tensor> attention_varlen_forward(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                                            const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                            int64_t max_seqlen_k, bool is_causal,
                                                            std::optional<double> sm_scale, bool smooth_k,
                                                            bool balance_channels, bool smooth_q, bool with_lse) {
  check_packed_input(q, "q");
  check_packed_input(k, "k");
  check_packed_input(v, "v");
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q);
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0),
                    "cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, got ",
                    cu_seqlens_q.size(0) - 1, " and ", cu_seqlens_k.size(0) - 1);
  for (const auto& [name, bound] : {std::pair{"max_seqlen_q", max_seqlen_q}, std::pair{"max_seqlen_k", max_seqlen_k}})
    TORCH_CHECK_VALUE(bound >= 0, name, " must be at least 0, got ", bound);
  TORCH_CHECK_VALUE(q.size(0) <= INT32_MAX && k.size(0) <= INT32_MAX, "packed tensors must hold fewer than 2^31 rows");
  const Operand q_op = packed_operand(q, cu_seqlens_q, max_seqlen_q);
  const Operand k_op = packed_operand(k, cu_seqlens_k, max_seqlen_k);
  const Operand v_op = packed_operand(v, cu_seqlens_k, max_seqlen_k);
  const double scale = check_attention_operands(q, k, v, q_op.shape, k_op.shape, sm_scale);
  const Capability cc = checked_capability(q);

  const c10::cuda::CUDAGuard device_guard(q.device());
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor lse = with_lse ? at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat)) : at::Tensor();
  if (out.numel() == 0) return {out, lse};
  // No sequence holds a query row, though q has rows (offsets the Python API refuses): no kernel grid to launch.
  if (q_op.shape.batch == 0 || max_seqlen_q == 0) {
    out.zero_();
    if (with_lse) lse.fill_(-INFINITY);
    return {out, lse};
  }
  run_attention(q_op, k_op, v_op, out, {0, out.stride(1), out.stride(0)}, lse, is_causal, scale, smooth_k,
                balance_channels, smooth_q, cc);
  return {out, lse};
}

at::Tensor lse_like(const at::Tensor& q, Layout layout) {
  return at::empty_symint({q.sym_size(0), q.sym_size(head_axis(layout)), q.sym_size(seq_axis(layout))},
                          q.options().dtype(at::kFloat));
}

}  // namespace

at::Tensor int8_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                                  std::optional<double> sm_scale, c10::string_view tensor_layout, bool smooth_k,
                                  bool balance_channels, bool smooth_q) {
  return std::get<0>(
      attention_forward(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k, balance_channels, smooth_q,
                        /*with_lse=*/false));
}

std::tuple<at::Tensor, at::Tensor> int8_attention_forward_with_lse(const at::Tensor& q, const at::Tensor& k,
                                                                   const at::Tensor& v, bool is_causal,
                                                                   std::optional<double> sm_scale,
                                                                   c10::string_view tensor_layout, bool smooth_k,
                                                                   bool balance_channels, bool smooth_q) {
  return attention_forward(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k, balance_channels, smooth_q,
                           /*with_lse=*/true);
}

at::Tensor int8_attention_varlen_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                         int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
                                         std::optional<double> sm_scale, bool smooth_k, bool balance_channels, bool smooth_q) {
  return std::get<0>(attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              is_causal, sm_scale, smooth_k, balance_channels, smooth_q,
                                              /*with_lse=*/false));
}

std::tuple<at::Tensor, at::Tensor> int8_attention_varlen_forward_with_lse(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
    std::optional<double> sm_scale, bool smooth_k, bool balance_channels, bool smooth_q) {
  return attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, sm_scale,
                                  smooth_k, balance_channels, smooth_q, /*with_lse=*/true);
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
  const QuantizedRows rows = quantize(dense_operand(x, layout), mean, out_scale, tokens_per_scale, /*row_multiple=*/1,
                                      c10::cuda::getCurrentCUDAStream());
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
  return compute_key_center(dense_operand(k, layout), c10::cuda::getCurrentCUDAStream());
}

at::Tensor int8_attention_forward_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, bool,
                                       std::optional<double>, c10::string_view, bool, bool, bool) {
  return at::empty_like(q, at::MemoryFormat::Contiguous);
}

std::tuple<at::Tensor, at::Tensor> int8_attention_forward_with_lse_meta(const at::Tensor& q, const at::Tensor&,
                                                                        const at::Tensor&, bool, std::optional<double>,
                                                                        c10::string_view tensor_layout, bool, bool,
                                                                        bool) {
  return {at::empty_like(q, at::MemoryFormat::Contiguous), lse_like(q, parse_layout(tensor_layout))};
}

at::Tensor int8_attention_varlen_forward_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool,
                                              std::optional<double>, bool, bool, bool) {
  return at::empty_like(q, at::MemoryFormat::Contiguous);
}

std::tuple<at::Tensor, at::Tensor> int8_attention_varlen_forward_with_lse_meta(const at::Tensor& q, const at::Tensor&,
                                                                               const at::Tensor&, const at::Tensor&,
                                                                               const at::Tensor&, int64_t, int64_t,
                                                                               bool, std::optional<double>, bool,
                                                                               bool, bool) {
  return {at::empty_like(q, at::MemoryFormat::Contiguous),
          at::empty_symint({q.sym_size(1), q.sym_size(0)}, q.options().dtype(at::kFloat))};
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
      "str tensor_layout=\"HND\", bool smooth_k=True, bool balance_channels=True, bool smooth_q=True) -> Tensor");
  ops.def(
      "int8_attention_forward_with_lse(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? sm_scale=None, "
      "str tensor_layout=\"HND\", bool smooth_k=True, bool balance_channels=True, bool smooth_q=True) -> (Tensor, Tensor)");
  ops.def(
      "int8_attention_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, bool is_causal=False, float? sm_scale=None, bool smooth_k=True, "
      "bool balance_channels=True, bool smooth_q=True) -> Tensor");
  ops.def(
      "int8_attention_varlen_forward_with_lse(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, bool is_causal=False, float? sm_scale=None, bool smooth_k=True, "
      "bool balance_channels=True, bool smooth_q=True) "
      "-> (Tensor, Tensor)");
  ops.def(
      "quantize_int8(Tensor x, Tensor? mean, float out_scale=1.0, str tensor_layout=\"HND\", int tokens_per_scale=1) "
      "-> (Tensor, Tensor)");
  ops.def("key_center(Tensor k, str tensor_layout=\"HND\") -> Tensor");
}

// CPU tensors reach the same functions so that their device check answers with a clear ValueError.
TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CUDA, ops) {
  ops.impl("int8_attention_forward", &int8_attention_forward);
  ops.impl("int8_attention_forward_with_lse", &int8_attention_forward_with_lse);
  ops.impl("int8_attention_varlen_forward", &int8_attention_varlen_forward);
  ops.impl("int8_attention_varlen_forward_with_lse", &int8_attention_varlen_forward_with_lse);
  ops.impl("quantize_int8", &quantize_int8);
  ops.impl("key_center", &key_center);
}

TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, CPU, ops) {
  ops.impl("int8_attention_forward", &int8_attention_forward);
  ops.impl("int8_attention_forward_with_lse", &int8_attention_forward_with_lse);
  ops.impl("int8_attention_varlen_forward", &int8_attention_varlen_forward);
  ops.impl("int8_attention_varlen_forward_with_lse", &int8_attention_varlen_forward_with_lse);
  ops.impl("quantize_int8", &quantize_int8);
  ops.impl("key_center", &key_center);
}

TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, Meta, ops) {
  ops.impl("int8_attention_forward", &int8_attention_forward_meta);
  ops.impl("int8_attention_forward_with_lse", &int8_attention_forward_with_lse_meta);
  ops.impl("int8_attention_varlen_forward", &int8_attention_varlen_forward_meta);
  ops.impl("int8_attention_varlen_forward_with_lse", &int8_attention_varlen_forward_with_lse_meta);
  ops.impl("quantize_int8", &quantize_int8_meta);
  ops.impl("key_center", &key_center_meta);
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
