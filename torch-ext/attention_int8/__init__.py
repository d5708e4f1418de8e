"""INT8-quantized scaled-dot-product attention for CUDA GPUs (compute capability 8.0+).

Q.K^T runs on INT8 tensor cores (Q with a scale per token, K smoothed by a centre shared by its keys and
with a scale per block of 64 keys), the softmax is an online base-2 softmax in fp32, and P.V runs in
fp16/bf16 with fp32 accumulation.

* `int8_attention_forward`, `quantize_int8`, `key_center`: the ops (CUDA), with their argument checks;
* `int8_attention_varlen`: the op on packed sequences of different lengths (FlashAttention's varlen form);
* `flash_attn_func`, `flash_attn_varlen_func`: FlashAttention 2's interface on the op, which transformers calls for
  ``attn_implementation="<org>/attention-int8"``;
* `sageattn`, `transformers_attention`: SageAttention's entry point (diffusers' `sage_hub`, ComfyUI) and a
  transformers attention function (for `AttentionInterface.register`), from `layers`;
* `attention_int8.layers`: drop-in integrations (an SDPA-compatible function, a kernels-hub layer, a
  diffusers processor and backend);
* `attention_int8.reference`: the same scheme in plain PyTorch (CPU or GPU), and exact float64 attention.

The source tree without a build (no generated `_ops.py`) offers `reference` only.
"""

import importlib.util

from . import reference
from ._checks import SUPPORTED_HEAD_DIMS
from .reference import KEY_TOKENS_PER_SCALE  # K's scale granularity (Q's: one token)

__all__ = ["SUPPORTED_HEAD_DIMS", "KEY_TOKENS_PER_SCALE", "int8_attention_forward", "int8_attention_varlen",
           "quantize_int8", "key_center", "flash_attn_func", "flash_attn_varlen_func", "sageattn",
           "transformers_attention", "layers", "reference"]

_NEED_BUILD = ("int8_attention_forward", "int8_attention_varlen", "quantize_int8", "key_center", "flash_attn_func",
               "flash_attn_varlen_func", "sageattn", "transformers_attention", "layers", "ops")

if importlib.util.find_spec(f"{__name__}._ops") is not None:
    from . import layers
    from ._api import (flash_attn_func, flash_attn_varlen_func, int8_attention_forward, int8_attention_varlen,
                       key_center, quantize_int8)
    from .layers import sageattn, transformers_attention
    from ._ops import ops


def __getattr__(name):
    hint = "; it needs the built kernel (`make build`, then load build/ or the hub kernel)" \
        if name in _NEED_BUILD else ""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}{hint}")
