"""Drop-in integrations of the INT8 attention kernel.

* `int8_scaled_dot_product_attention`: `torch.nn.functional.scaled_dot_product_attention`'s signature and
  semantics; runs the kernel when it can and falls back to SDPA (with a one-time warning per reason) otherwise.
* `Int8Attention`: the same as a stateless kernels-hub layer, for `kernels.kernelize`.
* `Int8AttnProcessor`: a diffusers attention processor (self/cross attention, FLUX joint attention, q/k norms,
  rotary embeddings) that keeps the projections in `[B, N, H, D]` so the kernel reads them without copies.
"""

import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._api import _varlen, int8_attention_forward
from ._checks import HEAD_AXIS, SEQUENCE_AXIS, attention_input_error, device_error
from .reference import int8_attention_reference

__all__ = ["Int8Attention", "Int8AttnProcessor", "int8_scaled_dot_product_attention", "register_diffusers_backend",
           "sageattn", "transformers_attention"]

_warned_reasons: set = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        warnings.warn(
            f"attention_int8: {reason}; using torch.nn.functional.scaled_dot_product_attention instead",
            stacklevel=4,
        )


def _fallback_reason(q, k, v, dropout_p, is_causal, scale, enable_gqa, layout, bottom_right) -> Optional[str]:
    """Why the kernel cannot compute this unmasked call exactly as asked (device aside), or None."""
    if dropout_p > 0.0:
        return "dropout_p > 0 is not supported"
    if error := attention_input_error(q, k, v, is_causal, scale, layout, smooth_k=True):
        return str(error)
    h, n = HEAD_AXIS[layout], SEQUENCE_AXIS[layout]
    if q.shape[h] != k.shape[h] and not enable_gqa:
        return "query and key/value head counts differ (GQA needs enable_gqa=True)"
    if is_causal and q.shape[n] != k.shape[n] and not bottom_right:
        # SDPA aligns the causal mask top-left, the kernel bottom-right: they agree only for Nq == Nkv.
        return "is_causal with Nq != Nkv (SDPA's mask is top-left aligned)"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "inputs require grad (the kernel is forward-only)"
    return None


def _key_padding(attn_mask, q, k, layout, is_causal):
    """``(keep, None)``: attn_mask as a bool ``[B, Nkv]`` mask of the keys each batch row keeps, if it is one (the same
    for every head and query: boolean, or additive with only 0 and -inf); else ``(None, why not)``."""
    if is_causal:
        return None, "attn_mask together with is_causal"  # SDPA raises on it: the fallback reports SDPA's error
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() > 4:
        return None, "attn_mask is not a tensor of at most 4 dims"
    h, n = HEAD_AXIS[layout], SEQUENCE_AXIS[layout]
    full = (q.shape[0], q.shape[h], q.shape[n], k.shape[n])
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if any(m not in (1, f) for m, f in zip(mask.shape, full)) or mask.device != q.device:
        return None, "attn_mask does not broadcast to [B, H, Nq, Nkv] on the inputs' device"
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point() and bool(((mask == 0) | (mask == -math.inf)).all()):
        keep = mask == 0
    else:
        return None, "attn_mask other than a key-padding mask (boolean, or additive 0 / -inf) is not supported"
    if (keep.shape[1] != 1 or keep.shape[2] != 1) and not bool((keep == keep[:, :1, :1]).all()):
        return None, "attn_mask that differs between heads or queries (not a key-padding mask) is not supported"
    keep = keep[:, 0, 0].expand(full[0], full[3])
    if not bool(keep.any(dim=-1).all()):
        return None, "attn_mask that masks every key of a batch row (SDPA outputs NaN there)"
    return keep, None


def _equal_right_padding(keep_k):
    """The kept length when every batch row keeps the same prefix of keys (keep_k bool [B, Nkv] on the host),
    else None."""
    length = int(keep_k[0].sum())
    return length if bool(keep_k[:, :length].all()) and bool((keep_k.sum(dim=-1) == length).all()) else None


def _padded_as_varlen(q, k, v, keep_q, keep_k, layout, is_causal, scale, smooth_k, on_cpu):
    """Attention of each batch row over the keys keep_k keeps, for the queries keep_q keeps (all if None; the
    others output 0), as one packed varlen call: causal alignment counts kept tokens only, as in FlashAttention's
    unpadded path. keep_q and keep_k are bool [B, N] on the host."""
    q, k, v = (t.transpose(1, 2) if layout == "HND" else t for t in (q, k, v))  # [B, N, H, D] views
    batch, seqlen_q, heads_q, head_dim = q.shape
    if keep_q is None:
        keep_q = torch.ones(batch, seqlen_q, dtype=torch.bool)

    def kept_rows(keep):  # the kept tokens' rows in [B * N], and each batch row's offset among them
        offsets = torch.zeros(batch + 1, dtype=torch.int32)
        offsets[1:] = keep.sum(dim=-1).cumsum(0)
        return keep.flatten().nonzero().squeeze(1).to(q.device), offsets.to(q.device)

    (rows_q, cu_q), (rows_k, cu_k) = kept_rows(keep_q), kept_rows(keep_k)
    q_packed, k_packed, v_packed = (t.reshape(-1, *t.shape[2:]).index_select(0, rows)
                                    for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k)))
    out_packed = _varlen(q_packed, k_packed, v_packed, cu_q, cu_k, int(keep_q.sum(dim=-1).max()),
                         int(keep_k.sum(dim=-1).max()), is_causal, scale, False, on_cpu, smooth_k)
    out = q.new_zeros(batch * seqlen_q, heads_q, head_dim).index_copy_(0, rows_q, out_packed)
    out = out.view(batch, seqlen_q, heads_q, head_dim)
    return out.transpose(1, 2).contiguous() if layout == "HND" else out


def _bottom_right_mask(nq, nkv, device):
    """The kernel's causal mask as SDPA's boolean attn_mask [Nq, Nkv]: query i sees key j iff j <= i + Nkv - Nq."""
    return torch.ones(nq, nkv, dtype=torch.bool, device=device).tril(nkv - nq)


def _kept_token_mask(keep_q, keep_k, is_causal):
    """SDPA's boolean attn_mask [B, 1, Nq, Nkv] for attention among kept tokens only: query i sees key j iff both are
    kept and, under is_causal, j's rank among the kept keys is at most i's among the kept queries plus the
    difference of their counts (bottom-right alignment over kept tokens, as in `_padded_as_varlen`)."""
    visible = keep_q[:, :, None] & keep_k[:, None, :]
    if is_causal:  # ranks from the end: 0 for the last kept token
        rank_q = keep_q.cumsum(-1) - keep_q.sum(-1, keepdim=True)
        rank_k = keep_k.cumsum(-1) - keep_k.sum(-1, keepdim=True)
        visible &= rank_k[:, None, :] <= rank_q[:, :, None]
    return visible[:, None]


def _attention(q, k, v, *, layout, attn_mask=None, kept_tokens=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False, use_reference_on_cpu=False, bottom_right=False, smooth_k=True):
    """Attention in `layout` ("HND" or "NHD") on the kernel, the CPU reference, or SDPA, whichever applies.

    A key-padding attn_mask, or `kept_tokens` (bool ``[B, Nq]`` and ``[B, Nkv]``: attention among the kept tokens
    of each batch row, padded queries output 0), runs one varlen call on the kept tokens. `bottom_right`:
    is_causal means the kernel's bottom-right aligned mask (FlashAttention's) also for Nq != Nkv, as SDPA
    fallbacks then compute too.
    """
    reason = _fallback_reason(q, k, v, dropout_p, is_causal, scale, enable_gqa, layout, bottom_right)
    keep_q, keep_k = (None, None) if kept_tokens is None else kept_tokens
    if reason is None and attn_mask is not None:
        keep_k, reason = _key_padding(attn_mask, q, k, layout, is_causal)
    on_cpu = use_reference_on_cpu and q.device.type == k.device.type == v.device.type == "cpu"
    if reason is None and not on_cpu and (error := device_error((q, k, v), ("q", "k", "v"))):
        reason = str(error)
    if reason is not None:
        _warn_once(reason)
        n = SEQUENCE_AXIS[layout]
        if kept_tokens is not None:
            attn_mask, is_causal = _kept_token_mask(keep_q, keep_k, is_causal), False
        elif is_causal and bottom_right and q.shape[n] != k.shape[n] and attn_mask is None:
            attn_mask, is_causal = _bottom_right_mask(q.shape[n], k.shape[n], q.device), False
        if layout == "NHD":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if kept_tokens is not None:  # rows that see no kept key: 0, as the kernel gives, not SDPA's NaN
            out = out.masked_fill(~attn_mask.any(dim=-1, keepdim=True), 0)
        return out.transpose(1, 2) if layout == "NHD" else out

    if keep_k is not None:
        keep_k = keep_k.cpu()  # one synchronization: the kept tokens decide the shapes
        length = _equal_right_padding(keep_k) if kept_tokens is None else None
        if length is None:
            keep_q = None if keep_q is None else keep_q.cpu()
            return _padded_as_varlen(q, k, v, keep_q, keep_k, layout, is_causal, scale, smooth_k, on_cpu)
        n = SEQUENCE_AXIS[layout]  # equal right padding: one dense call on the common prefix, no packing
        k, v = k.narrow(n, 0, length), v.narrow(n, 0, length)
    op = int8_attention_reference if on_cpu else int8_attention_forward
    return op(q, k, v, is_causal=is_causal, sm_scale=scale, tensor_layout=layout, smooth_k=smooth_k)


def int8_scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                      scale=None, enable_gqa=False, *, use_reference_on_cpu=False):
    """`torch.nn.functional.scaled_dot_product_attention` on the INT8 kernel.

    Inputs are `[B, H, N, D]` (SDPA's layout). The kernel runs for CUDA float16/bfloat16 q, k, v with a head dim in
    `SUPPORTED_HEAD_DIMS`, no dropout, no autograd, and (for `is_causal`) Nq == Nkv, where the kernel's bottom-right
    causal mask equals SDPA's top-left one. A key-padding `attn_mask` (the same for every head and query, e.g.
    `[B, 1, 1, Nkv]` or `[Nkv]`: boolean with True = attend, or additive with only 0 and -inf) runs the kernel once
    per batch row on the keys it keeps (a view when they are a prefix of the row, else a gathered copy; a row of
    equal right padding for all runs one call); reading the mask synchronizes with the GPU. Anything else, other
    masks included, runs SDPA itself, after a one-time warning per reason, so the result is always SDPA's
    semantics (the kernel's within INT8 quantization error).

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


# SageAttention's tuning keywords and the values it accepts: they choose among its kernels, which this package has no
# counterpart of, so they are checked and otherwise ignored.
_SAGE_OPTIONS = {
    "qk_quant_gran": ("per_warp", "per_thread"),
    "pv_accum_dtype": ("fp16", "fp32", "fp16+fp32", "fp32+fp16", "fp32+fp32"),
    "quantization_backend": ("triton", "cuda"),
}


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kwargs):
    """SageAttention's `sageattn` on this kernel: what diffusers' `sage_hub` backend and ComfyUI call.

    `q`, `k`, `v`, `tensor_layout`, `is_causal` (bottom-right aligned), `sm_scale` and `return_lse` are
    `int8_attention_forward`'s, with its input rules (errors raise; nothing falls back); the LSE is fp32
    ``[B, Hq, Nq]`` in either layout, as SageAttention returns it. Keywords SageAttention accepts:

    * `smooth_k` (default True): K smoothing, as in `int8_attention_forward`;
    * `attn_mask` (ComfyUI passes one; SageAttention ignores it): SDPA's mask semantics, in `tensor_layout`, through
      `int8_scaled_dot_product_attention`'s rules (a key-padding mask runs the kernel, any other mask SDPA after a
      one-time warning); not with `return_lse`;
    * `qk_quant_gran`, `pv_accum_dtype`, `quantization_backend`, `smooth_v`: SageAttention's kernel choices, checked
      against the values it accepts and otherwise without effect (this kernel quantizes Q per token and K per 64
      keys, and runs P.V in 16 bits with fp32 accumulation, where SageAttention ignores `smooth_v` too).

    Any other keyword raises TypeError.
    """
    attn_mask = kwargs.pop("attn_mask", None)
    smooth_k = kwargs.pop("smooth_k", True)
    smooth_v = kwargs.pop("smooth_v", False)
    for name, value in kwargs.items():
        if name not in _SAGE_OPTIONS:
            raise TypeError(f"sageattn() got an unexpected keyword argument {name!r}")
        if value not in _SAGE_OPTIONS[name]:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, _SAGE_OPTIONS[name]))}, got {value!r}")
    if not isinstance(smooth_v, bool):
        raise TypeError(f"smooth_v must be a bool, got {type(smooth_v).__name__}")
    if attn_mask is None:
        return int8_attention_forward(q, k, v, is_causal=is_causal, sm_scale=sm_scale, tensor_layout=tensor_layout,
                                      smooth_k=smooth_k, return_lse=return_lse)
    if return_lse:
        raise ValueError("sageattn: return_lse is not supported together with attn_mask")
    if tensor_layout not in HEAD_AXIS:
        raise ValueError(f'tensor_layout must be "HND" or "NHD", got {tensor_layout!r}')
    return _attention(q, k, v, layout=tensor_layout, attn_mask=attn_mask, is_causal=is_causal, scale=sm_scale,
                      enable_gqa=True, bottom_right=True, smooth_k=smooth_k)


def transformers_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention function in transformers' `AttentionInterface` form, on the INT8 kernel.

    `query` ``[B, Hq, Nq, D]``, `key`/`value` ``[B, Hkv, Nkv, D]`` (Hkv may divide Hq); returns
    ``(out [B, Nq, Hq, D], None)``. Causal (``kwargs["is_causal"]``, else ``module.is_causal``, else True)
    is bottom-right aligned, as in FlashAttention: with a KV cache the Nq new queries are the last Nq positions.

    `attention_mask`:

    * None: no padding;
    * ``[B, Nkv]`` (bool or 0/1; what transformers builds for FlashAttention): the keys each row keeps (left or
      right padding); the query at key position ``Nkv - Nq + i`` is kept with its key. The rows' kept tokens run as
      one packed varlen call (causal counts kept tokens only) and padded query rows output 0, as FlashAttention's
      varlen path;
    * 4-D (an SDPA mask): `int8_scaled_dot_product_attention`'s rules (key-padding masks run the kernel).

    Hub strings (``attn_implementation="<org>/attention-int8"``, with or without ``:<function>``) do not reach this
    function: for them transformers runs its FlashAttention wrapper over `flash_attn_func` / `flash_attn_varlen_func`.
    Registered under a name of one's own this function needs a mask function too, and FlashAttention's builds the
    2-D mask::

        AttentionInterface.register("int8", transformers_attention)
        AttentionMaskInterface.register("int8", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])

    CPU tensors run the pure-PyTorch reference of the scheme (slow; for tests); what the kernel cannot run (dropout,
    float32, other head dims, ...) runs SDPA after a one-time warning. `softcap`, `sliding_window` and `s_aux`
    (attention sinks) are not supported and raise ValueError.
    """
    for name in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"transformers_attention: {name} is not supported")
    is_causal = kwargs.get("is_causal")
    is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # NHD views: the output is then dense [B, N, H, D]
    options = dict(layout="NHD", dropout_p=dropout, scale=scaling, enable_gqa=True, use_reference_on_cpu=True,
                   bottom_right=True)
    if attention_mask is None or attention_mask.dim() != 2:
        return _attention(q, k, v, attn_mask=attention_mask, is_causal=is_causal and attention_mask is None,
                          **options), None
    if tuple(attention_mask.shape) != (k.shape[0], k.shape[1]):
        raise ValueError(f"a 2-D attention_mask must be [B, Nkv] = {[k.shape[0], k.shape[1]]}, "
                         f"got {list(attention_mask.shape)}")
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"more queries ({q.shape[1]}) than keys ({k.shape[1]}) with a [B, Nkv] attention_mask")
    keep_k = attention_mask.bool()
    keep_q = keep_k[:, k.shape[1] - q.shape[1]:]
    return _attention(q, k, v, kept_tokens=(keep_q, keep_k), is_causal=is_causal, **options), None


def register_diffusers_backend():
    """Make diffusers' `sage_hub` attention backend run this package's `sageattn`; returns its name, "sage_hub".

    diffusers' backends are a closed enum (`AttentionBackendName`), so a third-party kernel cannot add its own;
    this fills the slot of the hub kernel `sage_hub` would download, after which
    ``transformer.set_attention_backend("sage_hub")`` selects this kernel, with no download, for every model whose
    processors call diffusers' `dispatch_attention_fn` (FLUX, Wan, HunyuanVideo, ...). That backend rejects
    attention masks itself.
    """
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    _HUB_KERNELS_REGISTRY[AttentionBackendName.SAGE_HUB].kernel_fn = sageattn
    return AttentionBackendName.SAGE_HUB.value


def _split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, N, H*D] -> [B, N, H, D] as a view: the kernel's NHD layout, no transpose or copy."""
    return x.unflatten(-1, (-1, head_dim))


def _norm_width(norm) -> Optional[int]:
    """The number of channels a norm module normalizes over (None if it does not say)."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.shape[-1]
    shape = getattr(norm, "normalized_shape", None) or getattr(norm, "dim", None)
    return shape[-1] if shape else None


def _heads(attn, name: str, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A projection [B, N, H*D] as [B, N, H, D], with the norm `attn.<name>` applied where it belongs: over the
    whole projection (Wan) or per head (FLUX, SD3, HunyuanVideo)."""
    norm = getattr(attn, name, None)
    if norm is not None and _norm_width(norm) == x.shape[-1] != head_dim:
        return _split_heads(norm(x), head_dim)
    x = _split_heads(x, head_dim)
    return x if norm is None else norm(x)


def _apply_rotary(x: torch.Tensor, rotary_emb) -> torch.Tensor:
    """Rotary embedding on x [B, N, H, D], rotating interleaved (even, odd) pairs: (cos, sin) each [N, D] (FLUX) or
    broadcastable [1, N, 1, D] (Wan), every angle repeated for its pair."""
    cos, sin = (t[None, :, None, :] if t.dim() == 2 else t for t in rotary_emb)
    if cos.dim() != 4 or cos.shape[1] != x.shape[1]:
        raise ValueError(f"Int8AttnProcessor: the rotary embedding has shape {tuple(rotary_emb[0].shape)}, but "
                         f"attention runs over {x.shape[1]} tokens; an embedding of only some of the tokens "
                         "(HunyuanVideo's form) is not supported: use register_diffusers_backend()")
    x_even, x_odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    x_rotated = torch.stack((-x_odd, x_even), dim=-1).flatten(-2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


# Wan's image-to-video cross-attention: the text encoder's fixed context length, after the image tokens.
WAN_TEXT_TOKENS = 512


class Int8AttnProcessor:
    """diffusers attention processor whose attention core is the INT8 kernel (diffusers is duck-typed, not imported).

    Set with `model.set_attn_processor(Int8AttnProcessor())`. Covers transformer attention modules:

    * self- and cross-attention: `to_q`, `to_k`, `to_v`, `heads`, optional `to_out` (`[Linear, Dropout]`),
      `residual_connection`, `rescale_output_factor`; GQA when `to_k` has fewer heads than `to_q`;
    * q/k normalization `norm_q` / `norm_k`, per head (FLUX, SD3, ...) or over the whole projection (Wan);
    * joint attention (FLUX double-stream, SD3): if the module has `add_q_proj` and `encoder_hidden_states` is
      given, the context is projected with `add_{q,k,v}_proj` (+ `norm_added_q/k`), concatenated before the
      image tokens (FLUX's order; without a mask or rotary embedding the order does not change the result),
      attended jointly and split back (`to_add_out` on the context if present); returns `(hidden, context)`;
    * Wan's image-to-video cross-attention: with `add_k_proj` but no `add_q_proj`, the context's first
      ``N - 512`` tokens are image tokens, attended separately through `add_{k,v}_proj` (+ `norm_added_k`) and added;
    * `image_rotary_emb = (cos, sin)` of all attended tokens, each `[N, D]` (FLUX) or `[1, N, 1, D]` (Wan; the
      processor's fifth argument, Wan's `rotary_emb`), interleaved pairs;
    * `attention_mask` (broadcastable to `[B, H, Nq, Nkv]`): `int8_scaled_dot_product_attention`'s rules (a
      key-padding mask runs the kernel, other masks fall back to SDPA).

    HunyuanVideo's forms (a rotary embedding of the image tokens only; the context concatenated after them, or
    passed with a rotary embedding to a module without `add_q_proj`) raise ValueError: for HunyuanVideo use
    diffusers' own processors through `register_diffusers_backend`.
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
        cross = encoder_hidden_states is not None and not joint
        if cross and image_rotary_emb is not None:
            raise ValueError("Int8AttnProcessor: a rotary embedding with a cross-attention context (HunyuanVideo's "
                             "single-stream form, which concatenates the context) is not supported: use "
                             "register_diffusers_backend()")
        image_context = None
        if cross and getattr(attn, "add_k_proj", None) is not None:  # Wan image-to-video: image tokens, then text
            n_image = encoder_hidden_states.shape[1] - WAN_TEXT_TOKENS
            image_context, encoder_hidden_states = encoder_hidden_states.split(
                (n_image, WAN_TEXT_TOKENS), dim=1)
        kv_states = encoder_hidden_states if cross else hidden_states

        q = attn.to_q(hidden_states)
        head_dim = q.shape[-1] // attn.heads
        q = _heads(attn, "norm_q", q, head_dim)
        k = _heads(attn, "norm_k", attn.to_k(kv_states), head_dim)
        v = _split_heads(attn.to_v(kv_states), head_dim)
        if joint:
            n_context = encoder_hidden_states.shape[1]
            cq = _heads(attn, "norm_added_q", attn.add_q_proj(encoder_hidden_states), head_dim)
            ck = _heads(attn, "norm_added_k", attn.add_k_proj(encoder_hidden_states), head_dim)
            cv = _split_heads(attn.add_v_proj(encoder_hidden_states), head_dim)
            q, k, v = torch.cat((cq, q), dim=1), torch.cat((ck, k), dim=1), torch.cat((cv, v), dim=1)
        if image_rotary_emb is not None:
            q, k = _apply_rotary(q, image_rotary_emb), _apply_rotary(k, image_rotary_emb)

        out = self.attention(q, k, v, attention_mask).flatten(2)
        if image_context is not None:  # Wan adds the attention over the image tokens, unmasked, to the text's
            image_k = _heads(attn, "norm_added_k", attn.add_k_proj(image_context), head_dim)
            image_v = _split_heads(attn.add_v_proj(image_context), head_dim)
            out = out + self.attention(q, image_k, image_v, None).flatten(2)

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
