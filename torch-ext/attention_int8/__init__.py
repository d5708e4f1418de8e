"""INT8-quantized scaled-dot-product attention for CUDA GPUs (compute capability 8.0+).

Q.K^T runs on INT8 tensor cores (Q with a scale per token, K smoothed by a centre shared by its keys and
with a scale per block of 64 keys), the softmax is
an online base-2 softmax in fp32, and P.V runs in fp16/bf16 with fp32 accumulation. The scheme is
documented, and implemented in plain PyTorch for CPUs, in `attention_int8.reference`; drop-in
integrations (SDPA-compatible function, kernels-hub layer, diffusers processor) live in
`attention_int8.layers`.
"""

import functools
import math
from numbers import Real

import torch

from . import layers, reference
from ._ops import ops

__all__ = ["SUPPORTED_HEAD_DIMS", "KEY_TOKENS_PER_SCALE", "int8_attention_forward", "quantize_int8", "key_center",
           "layers", "reference"]

SUPPORTED_HEAD_DIMS = (64, 96, 128)
KEY_TOKENS_PER_SCALE = reference.KEY_TOKENS_PER_SCALE  # K's scale granularity (Q's: one token)
_DTYPES = (torch.float16, torch.bfloat16)
_LAYOUTS = ("HND", "NHD")
_MIN_CAPABILITY = (8, 0)  # INT8 mma.sync


@functools.lru_cache(maxsize=None)
def _capability(device_index):
    # A device's capability never changes; querying it costs microseconds of every call's CPU time.
    return torch.cuda.get_device_capability(device_index)


def _check_device(tensors, names):
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"{', '.join(names)} must be on one device, got "
                         f"{', '.join(str(t.device) for t in tensors)}")
    if device.type == "meta":  # shape inference only (the op's Meta implementation)
        return
    if device.type != "cuda":
        raise ValueError(f"attention_int8 runs on CUDA tensors, got {device}; on CPU use "
                         "attention_int8.reference.int8_attention_reference (same scheme, plain PyTorch)")
    capability = _capability(device.index)  # a tensor's CUDA device always has its index
    if capability < _MIN_CAPABILITY:
        raise ValueError(f"attention_int8 needs a GPU of compute capability "
                         f"{'.'.join(map(str, _MIN_CAPABILITY))} or newer, but {device} is "
                         f"{'.'.join(map(str, capability))}")


def _last_dim_contiguous(t):
    # The kernels read whole head_dim rows; any other stride pattern is addressed as is.
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_inputs(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k):
    names = ("q", "k", "v")
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, flag in (("is_causal", is_causal), ("smooth_k", smooth_k)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    for name, t in zip(names, (q, k, v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor ([B, H, N, D] for HND, [B, N, H, D] for NHD), "
                             f"got {t.dim()} dims")
    if tensor_layout not in _LAYOUTS:
        raise ValueError(f'tensor_layout must be "HND" ([B, H, N, D]) or "NHD" ([B, N, H, D]), '
                         f"got {tensor_layout!r}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q, k and v must be torch.float16 or torch.bfloat16, got {q.dtype}")

    head_axis = 1 if tensor_layout == "HND" else 2
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {q.shape[3]}")
    heads_q, heads_kv = q.shape[head_axis], k.shape[head_axis]
    if heads_q != 0 and (heads_kv == 0 or heads_q % heads_kv != 0):
        raise ValueError(f"the number of q heads ({heads_q}) must be a multiple of the number of "
                         f"k/v heads ({heads_kv})")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {q.shape[3]} is not supported; supported head dims are "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if sm_scale is not None:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, Real):
            raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
        if not (math.isfinite(sm_scale) and sm_scale > 0):
            raise ValueError(f"sm_scale must be a finite positive number, got {sm_scale}")
    _check_device((q, k, v), names)


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
    _check_inputs(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k)
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
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if mean is not None:
        if not isinstance(mean, torch.Tensor):
            raise TypeError(f"mean must be a torch.Tensor or None, got {type(mean).__name__}")
        mean = mean.contiguous()
    if isinstance(tokens_per_scale, bool) or not isinstance(tokens_per_scale, int):
        raise TypeError(f"tokens_per_scale must be an int, got {type(tokens_per_scale).__name__}")
    if tokens_per_scale not in (1, KEY_TOKENS_PER_SCALE):
        raise ValueError(f"tokens_per_scale must be 1 or {KEY_TOKENS_PER_SCALE}, got {tokens_per_scale!r}")
    if x.dim() == 4:
        x = _last_dim_contiguous(x)
    return ops.quantize_int8(x, mean, float(out_scale), tensor_layout, tokens_per_scale)


def key_center(k, tensor_layout="HND"):
    """The centre the kernels subtract from K's keys before quantizing it (exposed for tests and inspection).

    ``k`` ``[B, H, N, D]`` (or ``[B, N, H, D]`` with ``tensor_layout="NHD"``) on CUDA, float16/bfloat16, N >= 1.
    Returns fp32 ``[B, H, D]``, bit-identical to `attention_int8.reference.key_center` on the HND view.
    """
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"k must be a torch.Tensor, got {type(k).__name__}")
    if k.dim() == 4:
        k = _last_dim_contiguous(k)
    return ops.key_center(k, tensor_layout)
