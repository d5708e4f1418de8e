// Packed sequences (PackedSequences in attention_int8.h): a kernel instantiated for them narrows its params to
// the sequence of its batch index at the top, and the code after that is the dense code, unchanged.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention_int8.h"

namespace attention_int8 {

struct SequenceSpan {
  int start;   // the sequence's first row in the packed tensor
  int length;
};

// Sequence b's rows, clamped to the tensor and to max_length: offsets that break the varlen rules (the Python API
// checks them; the op does not read them on the host) cannot make a kernel address rows outside the tensor.
__device__ __forceinline__ SequenceSpan sequence_span(const PackedSequences& s, int b, int max_length) {
  const int start = min(max(__ldg(s.cu_seqlens + b), 0), s.total_rows);
  const int end = min(max(__ldg(s.cu_seqlens + b + 1), start), s.total_rows);
  return {start, min(end - start, max_length)};
}

// Row `row` of a tensor of Elem seen through `view` (its batch and head offsets still to add); an absent tensor
// (nullptr) stays absent.
template <typename Elem, typename Ptr>
__device__ __forceinline__ Ptr offset_rows(Ptr base, const RowMajorView& view, int row) {
  using Typed = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const Elem, Elem>;
  return base == nullptr ? base : static_cast<Ptr>(static_cast<Typed*>(base) + int64_t(row) * view.row_stride);
}

// The quantizer's and the centre's params (x, x_view, seqlen) narrowed to sequence b of `packed`.
template <typename Elem, typename Params>
__device__ __forceinline__ Params narrow_rows_to_sequence(const Params& p, const PackedSequences& packed, int b) {
  Params s = p;
  const SequenceSpan span = sequence_span(packed, b, p.seqlen);
  s.x = offset_rows<Elem>(p.x, p.x_view, span.start);
  s.seqlen = span.length;
  return s;
}

// The attention params narrowed to sequence b: its lengths, and its first rows of Q, V, O and the LSE (whose row
// stride is 1: lse_slot).
template <typename Elem>
__device__ __forceinline__ AttentionParams narrow_to_sequence(const AttentionParams& p, int b) {
  AttentionParams s = p;
  const SequenceSpan q = sequence_span(p.packed_q, b, p.seqlen_q), kv = sequence_span(p.packed_kv, b, p.seqlen_kv);
  s.seqlen_q = q.length;
  s.seqlen_kv = kv.length;
  s.q_input = offset_rows<Elem>(p.q_input, p.q_view, q.start);
  s.o = offset_rows<Elem>(p.o, p.o_view, q.start);
  s.v = offset_rows<Elem>(p.v, p.v_view, kv.start);
  s.lse = p.lse == nullptr ? nullptr : p.lse + q.start;
  return s;
}

}  // namespace attention_int8
