"""The public API: the attention op and the two pre-passes it is built from, checked and documented."""

from ._checks import check_attention_inputs, check_key_center_inputs, check_quantize_inputs
from ._ops import ops

__all__ = ["int8_attention_forward", "quantize_int8", "key_center"]


def _last_dim_contiguous(t):
    # The kernels read whole head_dim rows; any other stride pattern is addressed as is.
    return t if t.stride(-1) == 1 else t.contiguous()


def int8_attention_forward(q, k, v, is_causal=False, sm_scale=None, tensor_layout="HND", smooth_k=True,
                           return_lse=False):
    """Scaled-dot-product attention with INT8 Q.K^T, ``softmax(q k^T * sm_scale) v``.

    Args:
        q: ``[B, Hq, Nq, D]`` (``tensor_layout="HND"``) or ``[B, Nq, Hq, D]`` (``"NHD"``), CUDA,
            float16 or bfloat16, D in ``SUPPORTED_HEAD_DIMS``.
        k, v: ``[B, Hkv, Nkv, D]`` / ``[B, Nkv, Hkv, D]``, same dtype and device as q; ``Hq % Hkv == 0``
            (GQA/MQA: query head h uses k/v head ``h // (Hq // Hkv)``). Any Nq, Nkv >= 0.
        is_causal: bottom-right aligned causal mask (FlashAttention's convention): query i sees key j
            iff ``j <= i + Nkv - Nq``; equals SDPA's ``is_causal`` when Nq == Nkv. A query row that
            sees no key outputs 0 (and LSE -inf).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        tensor_layout: ``"HND"`` or ``"NHD"``; the output uses the same layout.
        smooth_k: subtract K's centre (a robust mean of a sample of its keys, ``reference.key_center``)
            before quantizing (softmax-invariant; keeps channel offsets shared by all keys from wasting the
            INT8 range). Leave it on unless measuring its effect.
        return_lse: also return the natural-log log-sum-exp of the scaled logits, fp32 ``[B, Hq, Nq]``.

    Returns:
        ``out`` (dtype of q, dense in q's layout), or ``(out, lse)`` if ``return_lse``.

    Any batch/head/sequence strides are read in place (e.g. slices of a fused QKV projection). A
    tensor whose last dimension is strided is first copied to a contiguous tensor (one extra read
    and write of it), as is a V whose rows are not 16-byte aligned. No autograd support.
    """
    check_attention_inputs(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    op = ops.int8_attention_forward_with_lse if return_lse else ops.int8_attention_forward
    return op(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k)


def quantize_int8(x, mean=None, out_scale=1.0, tensor_layout="HND", tokens_per_scale=1):
    """The kernels' symmetric INT8 quantizer (exposed for tests and inspection).

    ``x`` ``[B, H, N, D]`` (or ``[B, N, H, D]`` with ``tensor_layout="NHD"``) on CUDA, float16/bfloat16;
    ``mean`` optional fp32 ``[B, H, D]`` subtracted from every token first; ``tokens_per_scale``: 1 (one
    scale per token, as for Q) or ``KEY_TOKENS_PER_SCALE`` (one per block of keys, as for K). Returns
    ``(x_q, scale)``: int8 ``[B, H, N, D]`` (always HND) and fp32 ``[B, H, ceil(N / tokens_per_scale)]``
    with ``x - mean ~= x_q * scale[..., n // tokens_per_scale] / out_scale``. See
    `attention_int8.reference.quantize_int8`.
    """
    check_quantize_inputs(x, mean, tokens_per_scale)
    if mean is not None:
        mean = mean.contiguous()
    if x.dim() == 4:
        x = _last_dim_contiguous(x)
    return ops.quantize_int8(x, mean, float(out_scale), tensor_layout, tokens_per_scale)


def key_center(k, tensor_layout="HND"):
    """The centre the kernels subtract from K's keys before quantizing it (exposed for tests and inspection).

    ``k`` ``[B, H, N, D]`` (or ``[B, N, H, D]`` with ``tensor_layout="NHD"``) on CUDA, float16/bfloat16, N >= 1.
    Returns fp32 ``[B, H, D]``, bit-identical to `attention_int8.reference.key_center` on the HND view.
    """
    check_key_center_inputs(k)
    if k.dim() == 4:
        k = _last_dim_contiguous(k)
    return ops.key_center(k, tensor_layout)
