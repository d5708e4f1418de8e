"""The public API: the attention op and the two pre-passes it is built from, checked and documented."""

import torch

from ._checks import (attention_input_error, check_attention_inputs, check_key_center_inputs, check_quantize_inputs,
                      check_varlen_inputs)
from ._ops import ops
from .reference import int8_attention_reference

__all__ = ["int8_attention_forward", "int8_attention_varlen", "quantize_int8", "key_center", "flash_attn_func",
           "flash_attn_varlen_func"]


def _last_dim_contiguous(t):
    # The kernels read whole head_dim rows; any other stride pattern is addressed as is.
    return t if t.stride(-1) == 1 else t.contiguous()


def int8_attention_forward(q, k, v, is_causal=False, sm_scale=None, tensor_layout="HND", smooth_k=True,
                           return_lse=False, balance_channels=True, smooth_q=True):
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
        balance_channels: channel balancing (``reference.balance_factors``): where a channel's range in K and in
            Q (each about its sampled centre) differ 4x or more, scale it by ``s`` in Q and ``1 / s`` in K, so that
            an outlier channel of K no longer owns K's INT8 range; ``q . k`` is unchanged. Channels within that
            factor are left alone, so ordinary inputs quantize as without it.
        smooth_q: Q smoothing (``reference.query_smoothing_heads``): in each query head whose Q has an offset shared
            by its rows (its centre's largest channel above a quarter of Q's largest channel range about it), quantize
            ``q - mu`` and add back the exact fp32 bias ``mu . k_j`` to every logit of key j, so that the offset no
            longer owns Q's INT8 range; ``q . k`` is unchanged. Other heads run as without it, at no cost in the key
            loop. Needs at least 128 query rows.

    Returns:
        ``out`` (dtype of q, dense in q's layout), or ``(out, lse)`` if ``return_lse``.

    Any batch/head/sequence strides are read in place (e.g. slices of a fused QKV projection). A
    tensor whose last dimension is strided is first copied to a contiguous tensor (one extra read
    and write of it), as is a V whose rows are not 16-byte aligned. No autograd support.
    """
    check_attention_inputs(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k, balance_channels, smooth_q)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    op = ops.int8_attention_forward_with_lse if return_lse else ops.int8_attention_forward
    return op(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k, balance_channels, smooth_q)


def int8_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False,
                          sm_scale=None, return_lse=False):
    """`int8_attention_forward` on a batch of sequences of different lengths, packed as in FlashAttention's
    ``flash_attn_varlen_func``.

    Args:
        q: ``[total_q, Hq, D]``, the queries of all sequences one after the other (CUDA, float16 or bfloat16).
        k, v: ``[total_k, Hkv, D]``, likewise; ``Hq % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` on q's device, the offsets of the sequences in q and in
            k/v: sequence b is ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``. They start at 0, never decrease and
            end at ``total_q`` / ``total_k``; a sequence may be empty.
        max_seqlen_q, max_seqlen_k: ints at least the longest query / key sequence.
        is_causal: bottom-right aligned within each sequence: its query i sees its key j iff
            ``j <= i + N_k - N_q``; a query row that sees no key outputs 0 (LSE -inf).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        return_lse: also return the natural-log LSE, fp32 ``[Hq, total_q]`` (FlashAttention 2's varlen layout).

    Returns:
        ``out`` ``[total_q, Hq, D]`` in q's dtype, or ``(out, lse)``.

    No token attends across sequences, and K's smoothing centre and scales are each sequence's own. One launch of
    each kernel covers the whole batch, reading the packed tensors in place; checking cu_seqlens' values (before any
    GPU work) synchronizes with the GPU.
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, sm_scale, return_lse,
                   on_cpu=False)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, sm_scale, return_lse, on_cpu,
            smooth_k=True):
    """`int8_attention_varlen`, on the kernel or (`on_cpu`) on the CPU reference."""
    offsets_q, offsets_k = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               is_causal, sm_scale, kernel_device=not on_cpu)
    if on_cpu:
        out, lse = per_sequence_attention(int8_attention_reference, q, k, v, offsets_q, offsets_k, is_causal, sm_scale,
                                          smooth_k)
        return (out, lse) if return_lse else out
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    op = ops.int8_attention_varlen_forward_with_lse if return_lse else ops.int8_attention_varlen_forward
    return op(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k, is_causal,
              sm_scale, smooth_k)


def per_sequence_attention(dense, q, k, v, offsets_q, offsets_k, is_causal, sm_scale, smooth_k=True):
    """``(out [total_q, Hq, D], lse [Hq, total_q])`` of packed q, k, v with one call of `dense` (the signature of
    `int8_attention_forward`; the CPU reference) per sequence, on ``[1, N, H, D]`` views."""
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(offsets_q, offsets_q[1:]), zip(offsets_k, offsets_k[1:])):
        out, lse = dense(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], is_causal=is_causal, sm_scale=sm_scale,
                         tensor_layout="NHD", smooth_k=smooth_k, return_lse=True)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:  # no sequence at all
        return q.new_empty(q.shape), q.new_empty((q.shape[1], 0), dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses, dim=-1)


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


# ---------------------------------------------------------------------------------------------------------------
# FlashAttention 2's interface: what transformers calls on a hub kernel (attn_implementation="<org>/attention-int8")
# ---------------------------------------------------------------------------------------------------------------

def _on_cpu(*tensors):
    return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)


def _check_flash_options(dropout_p, window_size, softcap, alibi_slopes, s_aux, block_table=None):
    """Raises ValueError on the first FlashAttention option whose value the INT8 op cannot honour."""
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 (the INT8 kernel has no dropout), got {dropout_p}")
    if not isinstance(window_size, (tuple, list)) or tuple(window_size) != (-1, -1):
        raise ValueError(f"window_size must be (-1, -1) (sliding windows are not supported), got {window_size!r}")
    if softcap is not None and softcap != 0.0:
        raise ValueError(f"softcap must be 0.0 (logit soft-capping is not supported), got {softcap}")
    for name, value in (("alibi_slopes", alibi_slopes), ("s_aux", s_aux), ("block_table", block_table)):
        if value is not None:
            raise ValueError(f"{name} must be None (it is not supported), got a {type(value).__name__}")


def _seqlen_int(bound):
    """A maximum sequence length as an int: transformers passes a one-element integer tensor for packed sequences."""
    if isinstance(bound, torch.Tensor) and bound.numel() == 1 and not bound.is_floating_point() \
            and bound.dtype != torch.bool:
        return int(bound)
    return bound


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, s_aux=None):
    """FlashAttention 2's ``flash_attn_func`` on `int8_attention_forward` (layout NHD).

    transformers calls it through its FlashAttention wrapper for a hub kernel loaded with
    ``attn_implementation="<org>/attention-int8"``, on batches without padding.

    Args:
        q: ``[B, Nq, Hq, D]``; k, v: ``[B, Nkv, Hkv, D]`` with ``Hq % Hkv == 0``; float16 or bfloat16, D in
            ``SUPPORTED_HEAD_DIMS``. CUDA tensors run the kernel; CPU tensors run
            `attention_int8.reference.int8_attention_reference`, the same scheme in PyTorch (slow; for tests and
            machines without a GPU).
        softmax_scale: default ``1 / sqrt(D)``.
        causal: bottom-right aligned, as in FlashAttention >= 2.1 (query i sees key j iff ``j <= i + Nkv - Nq``).
        deterministic: accepted and without effect (FlashAttention uses it in its backward pass only).
        return_attn_probs: also return the LSE, as FlashAttention does.
        dropout_p, window_size, softcap, alibi_slopes, s_aux (attention sinks): only their defaults (0.0,
            (-1, -1), 0.0, None, None) are supported; other values raise ValueError.

    Returns:
        ``out`` ``[B, Nq, Hq, D]``, or with `return_attn_probs` ``(out, lse, None)``: the natural-log LSE, fp32
        ``[B, Hq, Nq]``, and None where FlashAttention returns its dropout pattern. No autograd.
    """
    _check_flash_options(dropout_p, window_size, softcap, alibi_slopes, s_aux)
    if _on_cpu(q, k, v):
        if error := attention_input_error(q, k, v, causal, softmax_scale, "NHD", True):
            raise error
        dense = int8_attention_reference
    else:
        dense = int8_attention_forward
    result = dense(q, k, v, is_causal=causal, sm_scale=softmax_scale, tensor_layout="NHD",
                   return_lse=return_attn_probs)
    return (*result, None) if return_attn_probs else result


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, s_aux=None):
    """FlashAttention 2's ``flash_attn_varlen_func`` on `int8_attention_varlen`.

    transformers calls it through its FlashAttention wrapper for a hub kernel loaded with
    ``attn_implementation="<org>/attention-int8"``, on padded batches (unpadded into packed sequences) and packed
    ones (``position_ids`` restarting per sequence); its signature tells transformers which keywords to pass.

    Args:
        q: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]``; cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k:
            as in `int8_attention_varlen` (the maximum lengths may also be one-element integer tensors). CUDA
            tensors run the kernel; CPU tensors run the PyTorch reference per sequence (slow; for tests).
        softmax_scale, causal, deterministic, return_attn_probs: as in `flash_attn_func` (causal is bottom-right
            aligned within each sequence).
        dropout_p, window_size, softcap, alibi_slopes, s_aux, block_table (a paged KV cache): only their defaults
            are supported; other values raise ValueError.

    Returns:
        ``out`` ``[total_q, Hq, D]``, or with `return_attn_probs` ``(out, lse, None)``, lse fp32 ``[Hq, total_q]``.
    """
    _check_flash_options(dropout_p, window_size, softcap, alibi_slopes, s_aux, block_table)
    result = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, _seqlen_int(max_seqlen_q), _seqlen_int(max_seqlen_k),
                     causal, softmax_scale, return_attn_probs, on_cpu=_on_cpu(q, k, v))
    return (*result, None) if return_attn_probs else result
