"""The rules the kernels' inputs must follow, in one place.

`attention_input_error` and `device_error` return the exception a broken rule calls for (or None), so that the
Python API raises it and `layers` turns its message into the reason it falls back to SDPA. The C++ binding checks
the same rules again, as the last line of defence for callers of the raw op.
"""

import functools
import math
from numbers import Real

import torch

from .reference import KEY_TOKENS_PER_SCALE

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
HEAD_AXIS = {"HND": 1, "NHD": 2}  # the layouts, and where each keeps its heads
SEQUENCE_AXIS = {"HND": 2, "NHD": 1}
MIN_CAPABILITY = (8, 0)  # INT8 mma.sync


@functools.lru_cache(maxsize=None)
def _capability(device_index):
    # A device's capability never changes; querying it costs microseconds of every call's CPU time.
    return torch.cuda.get_device_capability(device_index)


def _tensor_error(name, t, what="a torch.Tensor"):
    if not isinstance(t, torch.Tensor):
        return TypeError(f"{name} must be {what}, got {type(t).__name__}")
    return None


def attention_input_error(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k, balance_channels=True,
                          smooth_q=True):
    """The first rule of the attention op that the arguments break, devices aside, as an exception; else None."""
    names = ("q", "k", "v")
    for name, t in zip(names, (q, k, v)):
        if error := _tensor_error(name, t):
            return error
    for name, flag in (("is_causal", is_causal), ("smooth_k", smooth_k), ("balance_channels", balance_channels),
                       ("smooth_q", smooth_q)):
        if not isinstance(flag, bool):
            return TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    for name, t in zip(names, (q, k, v)):
        if t.dim() != 4:
            return ValueError(f"{name} must be a 4-D tensor ([B, H, N, D] for HND, [B, N, H, D] for NHD), "
                              f"got {t.dim()} dims")
    if tensor_layout not in HEAD_AXIS:
        return ValueError(f'tensor_layout must be "HND" ([B, H, N, D]) or "NHD" ([B, N, H, D]), '
                          f"got {tensor_layout!r}")
    if not q.dtype == k.dtype == v.dtype:
        return TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.dtype not in DTYPES:
        return TypeError(f"q, k and v must be torch.float16 or torch.bfloat16, got {q.dtype}")

    if k.shape != v.shape:
        return ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        return ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    if k.shape[3] != q.shape[3]:
        return ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {q.shape[3]}")
    head_axis = HEAD_AXIS[tensor_layout]
    heads_q, heads_kv = q.shape[head_axis], k.shape[head_axis]
    if heads_q != 0 and (heads_kv == 0 or heads_q % heads_kv != 0):
        return ValueError(f"the number of q heads ({heads_q}) must be a multiple of the number of "
                          f"k/v heads ({heads_kv})")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        return ValueError(f"head_dim {q.shape[3]} is not supported; supported head dims are "
                          f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if sm_scale is not None:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, Real):
            return TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
        if not (math.isfinite(sm_scale) and sm_scale > 0):
            return ValueError(f"sm_scale must be a finite positive number, got {sm_scale}")
    return None


def device_error(tensors, names):
    """Why the tensors cannot run on the kernels (not one device, not CUDA, too old a GPU), or None."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        return ValueError(f"{', '.join(names)} must be on one device, got "
                          f"{', '.join(str(t.device) for t in tensors)}")
    if device.type == "meta":  # shape inference only (the op's Meta implementation)
        return None
    if device.type != "cuda":
        return ValueError(f"{', '.join(names)} are on {device}, but attention_int8 runs on CUDA tensors; on CPU, "
                          "attention_int8.reference.int8_attention_reference computes the same scheme in plain "
                          "PyTorch")
    capability = _capability(device.index)  # a tensor's CUDA device always has its index
    if capability < MIN_CAPABILITY:
        return ValueError(f"attention_int8 needs a GPU of compute capability "
                          f"{'.'.join(map(str, MIN_CAPABILITY))} or newer, but {device} is "
                          f"{'.'.join(map(str, capability))}")
    return None


def check_attention_inputs(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k, balance_channels=True,
                           smooth_q=True):
    """Raises the error of the first rule the attention op's arguments break."""
    error = attention_input_error(q, k, v, is_causal, sm_scale, tensor_layout, smooth_k, balance_channels,
                                  smooth_q) or \
        device_error((q, k, v), ("q", "k", "v"))
    if error:
        raise error


def check_quantize_inputs(x, mean, tokens_per_scale):
    """Raises on the quantizer's arguments that only Python can check (the op checks shapes and devices)."""
    if error := _tensor_error("x", x):
        raise error
    if mean is not None and (error := _tensor_error("mean", mean, "a torch.Tensor or None")):
        raise error
    if isinstance(tokens_per_scale, bool) or not isinstance(tokens_per_scale, int):
        raise TypeError(f"tokens_per_scale must be an int, got {type(tokens_per_scale).__name__}")
    if tokens_per_scale not in (1, KEY_TOKENS_PER_SCALE):
        raise ValueError(f"tokens_per_scale must be 1 or {KEY_TOKENS_PER_SCALE}, got {tokens_per_scale!r}")


def check_key_center_inputs(k):
    """Raises unless k is a tensor (the op checks the rest)."""
    if error := _tensor_error("k", k):
        raise error


def _cu_seqlens_error(name, cu, total, device):
    """Why `cu` is not a valid cumulative-length tensor over `total` tokens (None if it is), and its values."""
    if error := _tensor_error(name, cu):
        return error, None
    if cu.dtype != torch.int32:
        return TypeError(f"{name} must be a torch.int32 tensor, got {cu.dtype}"), None
    if cu.dim() != 1 or cu.numel() < 1:
        return ValueError(f"{name} must be a 1-D tensor of B + 1 offsets, got shape {tuple(cu.shape)}"), None
    if cu.device != device:
        return ValueError(f"{name} must be on the device of q ({device}), got {cu.device}"), None
    if device.type == "meta":  # shape inference has no values to check
        return None, None
    offsets = cu.tolist()
    if offsets[0] != 0:
        return ValueError(f"{name} must start at 0, got {offsets[0]}"), None
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        return ValueError(f"{name} must be non-decreasing, got {offsets}"), None
    if offsets[-1] != total:
        return ValueError(f"{name} must end at the number of packed tokens ({total}), got {offsets[-1]}"), None
    return None, offsets


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, sm_scale,
                        kernel_device=True):
    """Raises the error of the first rule the varlen op's arguments break; else returns the host copies of
    cu_seqlens_q and cu_seqlens_k (lists of B + 1 offsets; None for meta tensors). ``kernel_device=False`` leaves
    out the device rule, for the CPU reference."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if error := _tensor_error(name, t):
            raise error
        if t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D packed tensor [total_tokens, H, D], got {t.dim()} dims")
    # The per-sequence rules are the dense op's on a batch of one packed sequence ([1, total, H, D], NHD).
    if error := attention_input_error(q[None], k[None], v[None], is_causal, sm_scale, "NHD", True):
        raise error
    offsets = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        error, values = _cu_seqlens_error(name, cu, total, q.device)
        if error:
            raise error
        offsets.append(values)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, got "
                         f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    for name, bound, values in (("max_seqlen_q", max_seqlen_q, offsets[0]), ("max_seqlen_k", max_seqlen_k, offsets[1])):
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise TypeError(f"{name} must be an int, got {type(bound).__name__}")
        longest = max((b - a for a, b in zip(values, values[1:])), default=0) if values is not None else 0
        if bound < longest:
            raise ValueError(f"{name} ({bound}) is less than the longest sequence ({longest})")
    if kernel_device and (error := device_error((q, k, v), ("q", "k", "v"))):
        raise error
    return offsets
