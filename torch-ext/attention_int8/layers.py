"""Drop-in integrations of the INT8 attention kernel.

* `int8_scaled_dot_product_attention`: `torch.nn.functional.scaled_dot_product_attention`'s signature and
  semantics; runs the kernel when it can and falls back to SDPA (with a one-time warning per reason) otherwise.
* `Int8Attention`: the same as a stateless kernels-hub layer, for `kernels.kernelize`.
* `Int8AttnProcessor`: a diffusers attention processor (self/cross attention, FLUX joint attention, q/k norms,
  rotary embeddings) that keeps the projections in `[B, N, H, D]` so the kernel reads them without copies.
"""

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._api import int8_attention_forward
from ._checks import HEAD_AXIS, SEQUENCE_AXIS, attention_input_error, device_error
from .reference import int8_attention_reference

__all__ = ["Int8Attention", "Int8AttnProcessor", "int8_scaled_dot_product_attention"]

_warned_reasons: set = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        warnings.warn(
            f"attention_int8: {reason}; using torch.nn.functional.scaled_dot_product_attention instead",
            stacklevel=4,
        )


def _fallback_reason(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout) -> Optional[str]:
    """Why the kernel cannot compute this call exactly as SDPA would (device aside), or None."""
    if attn_mask is not None:
        return "attn_mask is not supported"
    if dropout_p > 0.0:
        return "dropout_p > 0 is not supported"
    if error := attention_input_error(q, k, v, is_causal, scale, layout, smooth_k=True):
        return str(error)
    h, n = HEAD_AXIS[layout], SEQUENCE_AXIS[layout]
    if q.shape[h] != k.shape[h] and not enable_gqa:
        return "query and key/value head counts differ (GQA needs enable_gqa=True)"
    if is_causal and q.shape[n] != k.shape[n]:
        # SDPA aligns the causal mask top-left, the kernel bottom-right: they agree only for Nq == Nkv.
        return "is_causal with Nq != Nkv (SDPA's mask is top-left aligned)"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "inputs require grad (the kernel is forward-only)"
    return None


def _attention(q, k, v, *, layout, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
               use_reference_on_cpu=False):
    """Attention in `layout` ("HND" or "NHD") on the kernel, the CPU reference, or SDPA, whichever applies."""
    reason = _fallback_reason(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout)
    if reason is None and use_reference_on_cpu and q.device.type == k.device.type == v.device.type == "cpu":
        return int8_attention_reference(q, k, v, is_causal=is_causal, sm_scale=scale, tensor_layout=layout)
    if reason is None and (error := device_error((q, k, v), ("q", "k", "v"))):
        reason = str(error)
    if reason is not None:
        _warn_once(reason)
        if layout == "NHD":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2) if layout == "NHD" else out

    return int8_attention_forward(q, k, v, is_causal=is_causal, sm_scale=scale, tensor_layout=layout)


def int8_scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                      scale=None, enable_gqa=False, *, use_reference_on_cpu=False):
    """`torch.nn.functional.scaled_dot_product_attention` on the INT8 kernel.

    Inputs are `[B, H, N, D]` (SDPA's layout). The kernel runs for CUDA float16/bfloat16 q, k, v with a head dim in
    `SUPPORTED_HEAD_DIMS`, no mask, no dropout, no autograd, and (for `is_causal`) Nq == Nkv, where the kernel's
    bottom-right causal mask equals SDPA's top-left one. Anything else runs SDPA itself, after a one-time warning
    per reason, so the result is always SDPA's semantics (the kernel's within INT8 quantization error).

    `use_reference_on_cpu=True` runs CPU inputs through the pure-PyTorch reference of the quantization scheme
    instead of SDPA (slow; for testing models on machines without a GPU).
    """
    return _attention(query, key, value, layout="HND", attn_mask=attn_mask, dropout_p=dropout_p,
                      is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                      use_reference_on_cpu=use_reference_on_cpu)


class Int8Attention(nn.Module):
    """kernels-hub layer replacing an SDPA-style attention core module.

    The module it replaces is `torch.nn.functional.scaled_dot_product_attention` as a module, e.g.::

        @use_kernel_forward_from_hub("ScaledDotProductAttention")
        class ScaledDotProductAttention(nn.Module):
            def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False):
                return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                      scale=scale, enable_gqa=enable_gqa)

    mapped with `{"ScaledDotProductAttention": {"cuda": LayerRepository(..., layer_name="Int8Attention")}}`.
    kernelize swaps in `forward` only, so the layer keeps no state; calls it cannot serve fall back to SDPA.
    """

    can_torch_compile = True
    has_backward = False

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        return int8_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                 enable_gqa)


def _split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, N, H*D] -> [B, N, H, D] as a view: the kernel's NHD layout, no transpose or copy."""
    return x.unflatten(-1, (-1, head_dim))


def _maybe_norm(attn, name: str, x: torch.Tensor) -> torch.Tensor:
    norm = getattr(attn, name, None)
    return x if norm is None else norm(x)


def _apply_rotary(x: torch.Tensor, rotary_emb) -> torch.Tensor:
    """FLUX's rotary embedding on x [B, N, H, D]: cos, sin [N, D], rotating interleaved (even, odd) pairs."""
    cos, sin = (t[None, :, None, :] for t in rotary_emb)
    x_even, x_odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    x_rotated = torch.stack((-x_odd, x_even), dim=-1).flatten(-2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


class Int8AttnProcessor:
    """diffusers attention processor whose attention core is the INT8 kernel (diffusers is duck-typed, not imported).

    Set with `model.set_attn_processor(Int8AttnProcessor())`. Covers transformer attention modules:

    * self- and cross-attention: `to_q`, `to_k`, `to_v`, `heads`, optional `to_out` (`[Linear, Dropout]`),
      `residual_connection`, `rescale_output_factor`; GQA when `to_k` has fewer heads than `to_q`;
    * per-head q/k normalization `norm_q` / `norm_k` (FLUX, SD3, ...);
    * joint attention (FLUX double-stream, SD3): if the module has `add_q_proj` and `encoder_hidden_states` is
      given, the context is projected with `add_{q,k,v}_proj` (+ `norm_added_q/k`), concatenated before the
      image tokens (FLUX's order; without a mask or rotary embedding the order does not change the result),
      attended jointly and split back (`to_add_out` on the context if present); returns `(hidden, context)`;
    * `image_rotary_emb = (cos, sin)`, each `[N_total, D]`, FLUX's interleaved-pair convention;
    * `attention_mask` (already broadcastable to `[B, H, Nq, Nkv]`) is passed to SDPA: masked calls fall back.

    UNet-style modules (`group_norm`, `spatial_norm`, `norm_cross`, 4-D feature maps) are not covered.
    Subclasses may override `attention` (e.g. with SDPA, for an A/B comparison with identical projections).
    """

    def __init__(self, use_reference_on_cpu: bool = False):
        self.use_reference_on_cpu = use_reference_on_cpu

    def attention(self, q, k, v, attention_mask):
        """The attention core on [B, N, H, D] tensors (Hkv may divide Hq); a subclass may swap it out."""
        return _attention(q, k, v, layout="NHD", attn_mask=attention_mask, enable_gqa=True,
                          use_reference_on_cpu=self.use_reference_on_cpu)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if hidden_states.dim() != 3 or any(
                getattr(attn, name, None) is not None for name in ("group_norm", "spatial_norm", "norm_cross")):
            raise NotImplementedError("Int8AttnProcessor covers transformer attention on [B, N, C] hidden states")
        joint = encoder_hidden_states is not None and getattr(attn, "add_q_proj", None) is not None
        kv_states = encoder_hidden_states if encoder_hidden_states is not None and not joint else hidden_states

        q = attn.to_q(hidden_states)
        head_dim = q.shape[-1] // attn.heads
        q = _maybe_norm(attn, "norm_q", _split_heads(q, head_dim))
        k = _maybe_norm(attn, "norm_k", _split_heads(attn.to_k(kv_states), head_dim))
        v = _split_heads(attn.to_v(kv_states), head_dim)
        if joint:
            n_context = encoder_hidden_states.shape[1]
            cq = _maybe_norm(attn, "norm_added_q", _split_heads(attn.add_q_proj(encoder_hidden_states), head_dim))
            ck = _maybe_norm(attn, "norm_added_k", _split_heads(attn.add_k_proj(encoder_hidden_states), head_dim))
            cv = _split_heads(attn.add_v_proj(encoder_hidden_states), head_dim)
            q, k, v = torch.cat((cq, q), dim=1), torch.cat((ck, k), dim=1), torch.cat((cv, v), dim=1)
        if image_rotary_emb is not None:
            q, k = _apply_rotary(q, image_rotary_emb), _apply_rotary(k, image_rotary_emb)

        out = self.attention(q, k, v, attention_mask).flatten(2)

        if joint:
            context, out = out.split((n_context, out.shape[1] - n_context), dim=1)
            if getattr(attn, "to_add_out", None) is not None:
                context = attn.to_add_out(context)
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "residual_connection", False):
            out = out + hidden_states
        rescale = getattr(attn, "rescale_output_factor", 1.0)
        if rescale != 1.0:
            out = out / rescale
        return (out, context) if joint else out
