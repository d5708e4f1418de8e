// Host-side interface of the CUDA kernels. This header is the one source of truth for the launchers'
// signatures: both the .cu files that define them and the torch binding include it, so a mismatch
// between declaration and definition is a compile error, not a link-time surprise.
//
// It is deliberately free of torch types: the .cu files compile with nvcc alone (fast, and the same
// under kernel-builder and the local build).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace attention_int8 {

enum class ElemType { kFloat16, kBFloat16 };

// Row padding of the quantized workspaces, which the binding allocates. Every kernel's query tile
// equals kQueryPad and every key tile divides kKeyPad (kernel_traits.cuh static_asserts both), so
// the kernels read whole tiles of Q and K without bounds checks.
constexpr int kQueryPad = 384;  // the sm90 kernel's 192-row and the portable kernel's 128-row query tiles
constexpr int kKeyPad = 128;

constexpr bool head_dim_supported(int d) { return d == 64 || d == 96 || d == 128; }

// The Hopper kernel (wgmma, built for sm_90a) serves head_dim 128 on compute capability 9.0; it
// reads V pre-transposed (launch_transpose_v). Everything else takes the portable mma.sync kernel.
constexpr bool sm90_kernel_supported(int cc_major, int cc_minor, int head_dim) {
  return cc_major == 9 && cc_minor == 0 && head_dim == 128;
}

// Rows of an [B, H, N, D] tensor addressed by strides (in elements; the D stride must be 1).
struct RowMajorView {
  int64_t batch_stride;
  int64_t head_stride;
  int64_t row_stride;
};

// Per-token symmetric INT8 quantization of Q (or K) read from the user's layout:
//   x_q[b,h,n,:] = round(x[b,h,n,:] * 127 / amax),   scale[b,h,n] = amax / 127 * out_scale,
// where amax = max_d |x[b,h,n,d] - mean[b,h,d]| (mean optional, the K smoothing).
// Output is dense [B, H, n_pad, D] int8 and [B, H, n_pad] fp32; rows in [n, n_pad) are zero.
// A row holding a non-finite value gets a NaN scale, so NaN propagates to the attention output.
struct QuantizeParams {
  const void* x;
  RowMajorView x_view;
  const float* mean;  // [B, H, D] fp32 contiguous, or nullptr
  int8_t* x_q;
  float* scale;
  // Optional, from the unquantized row: row_dot[b, h, n] = x[b, h, n, :] . dot_vec[b, h / dot_head_group, :].
  // Q rows dotted with K's token mean give the logit shift that K smoothing removed, which the LSE needs.
  const float* dot_vec;  // [B, H / dot_head_group, D] fp32 contiguous, or nullptr
  int dot_head_group;
  float* row_dot;        // [B, H, seqlen_pad]
  int batch, heads, seqlen, seqlen_pad, head_dim;
  float out_scale;
  ElemType dtype;
  // head_dim 128 only: store each row's eight 16-byte chunks in the order of the K-major 128-byte
  // swizzle (chunk c of row n at position c ^ (n % 8)), the shared-memory image the sm90 kernel's
  // wgmma reads, so it can load tiles with plain contiguous copies.
  bool swizzle_128b;
};

// O = softmax(dequant(Q_q K_q^T)) V with an online base-2 softmax. Q/K come from the quantizer
// above (dense, padded); V and O are read/written through strides. Causal masking is bottom-right
// aligned: query i sees key j iff j <= i + (seqlen_kv - seqlen_q).
struct AttentionParams {
  const int8_t* q;      // [B, Hq,  seqlen_q_pad,  D]
  const int8_t* k;      // [B, Hkv, seqlen_kv_pad, D]
  const float* q_scale; // [B, Hq,  seqlen_q_pad], includes sm_scale * log2(e)
  const float* k_scale; // [B, Hkv, seqlen_kv_pad]
  const void* v;
  RowMajorView v_view;
  const void* v_t;      // V^T tiles from launch_transpose_v: the sm90 kernel's V; else nullptr
  void* o;
  RowMajorView o_view;
  float* lse;           // [B, Hq, seqlen_q] natural-log log-sum-exp, or nullptr
  int batch, heads_q, heads_kv, seqlen_q, seqlen_kv, seqlen_q_pad, seqlen_kv_pad, head_dim;
  bool causal;
  ElemType dtype;
};

// V [B, H, N, D] (strided, 16-bit elements) -> V^T in tiles of 64 keys, [B, H, n_pad / 64, D, 64],
// zeros in keys [N, n_pad): the K-major operand of the sm90 kernel's P.V wgmma, each 128-byte row
// (64 keys of one channel d) with its 16-byte chunks in 128-byte-swizzle order (chunk c at c ^ (d % 8)),
// so the keys n0 .. n0 + 127 of a head are one contiguous 32 KiB shared-memory image at offset n0 * D.
struct TransposeParams {
  const void* v;
  RowMajorView v_view;
  void* v_t;
  int batch, heads, seqlen, seqlen_pad, head_dim;
};

cudaError_t launch_quantize_per_token(const QuantizeParams& params, cudaStream_t stream);
cudaError_t launch_transpose_v(const TransposeParams& params, cudaStream_t stream);
// Runs the sm90 kernel when params.v_t is set (see sm90_kernel_supported), else the portable one.
// The sm90 kernel needs Q and K quantized with swizzle_128b.
cudaError_t launch_attention_forward(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_forward_sm90(const AttentionParams& params, cudaStream_t stream);

}  // namespace attention_int8
