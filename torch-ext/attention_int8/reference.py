"""Pure-PyTorch reference of the attention_int8 scheme (the CPU path), and exact float64 attention.

The scheme, per (batch, head), with Q [Nq, D], K and V [Nkv, D]:

1. K smoothing (``smooth_k``): ``K' = K - c`` in fp32 with K's centre ``c = key_center(K)``: the mean of a
   sample of at most 128 keys without the sample's 1/32 farthest from its plain mean (attention sinks).
   Every logit of a query row moves by the same constant ``q . c``, so the softmax is unchanged, but channel
   offsets shared by all keys no longer eat the INT8 range. Any ``c`` would keep the softmax; the sample
   spares the kernels a pass over all of K (``KeyCenterParams`` in attention_int8.h).
2. Symmetric INT8 in fp32 with one scale per group of tokens: Q per token, K per block of
   ``KEY_TOKENS_PER_SCALE`` = 64 keys (keys ``64 b .. 64 b + 63``; the last block may be shorter).
   ``amax = max |x|`` over the group, ``x_q = round_half_even(x * (127 / amax))`` (the fp32 quotient
   first, then the product), clamped to [-127, 127]; ``scale = amax / 127 * out_scale``. A group with
   ``amax < 2^-64`` (bf16 only) uses ``x * 2^64`` and ``amax * 2^64`` in the quotient and the product
   (exact), since ``127 / amax`` overflows fp32 below ~3.7e-37. ``amax == 0``
   gives ``x_q = 0, scale = 0``; a group holding a non-finite value gets a NaN scale (its ``x_q`` is
   unspecified; here 0), so NaN reaches the output.
   Q uses ``out_scale = sm_scale * log2(e)``, K ``out_scale = 1``.
3. ``S2[i, j] = (q_q[i] . k_q[j]) * c[i, j // 64]`` with the logit scale ``c = q_scale[i] * k_scale[b]``
   truncated to 22 significant bits: exact integer dot products dequantized by one fp32
   multiply. S2 is the logit in base 2. (One scale per row and key block is what lets the kernels take
   a tile's max on the integers and exponentiate with one FMA; 22 bits make that FMA exact.)
4. Softmax in base 2: ``m = max_j S2``, ``P = 2^(S2 - m)``, ``l = sum_j P`` (fp32), then P rounded to the
   input dtype (fp16/bf16), ``O = (P V) / l`` accumulated in fp32 and cast to the input dtype.
5. ``LSE = (m + log2 l) * ln 2 + sm_scale * (q . c)`` (fp32): the log-sum-exp of the true scaled
   logits. Smoothing leaves the softmax unchanged but shifts its normalizer, so the shift is added back
   (only with ``smooth_k``).

Masking is bottom-right aligned: query i sees key j iff ``j <= i + Nkv - Nq``; a row that sees no key
outputs 0 with LSE -inf. GQA/MQA: query head h reads K/V head ``h // (Hq // Hkv)``.

The CUDA kernel runs step 4 as an online softmax over key tiles, so it rounds P at a running max and
rescales; this reference rounds P at the final row max. Everything else is the same arithmetic, so the
two agree to within the rounding of P and of the output (see tests/test_kernel_gpu.py).
"""

import math

import torch

__all__ = ["KEY_TOKENS_PER_SCALE", "CENTER_SAMPLE_KEYS", "center_sample", "key_center", "quantize_int8", "logit_scale",
           "int8_logits", "int8_attention_reference", "attention_float64"]

LOG2E = math.log2(math.e)
KEY_TOKENS_PER_SCALE = 64  # kKeyScaleTokens in attention_int8.h
CENTER_SAMPLE_KEYS = 128  # kCenterSampleKeys
CENTER_TRIM_DIVISOR = 32  # kCenterTrimDivisor

# Bound on the size of one [B, H, rows, Nkv] score block, so long sequences run in row chunks.
_MAX_SCORE_ELEMENTS = 1 << 25


def logit_scale(q_scale, k_scale):
    """``q_scale * k_scale`` in fp32, truncated to 22 significant bits, as the kernels compute it: their
    one-FMA dequantization is then exact. NaN stays NaN (whatever its payload bits), infinity stays infinity."""
    c = q_scale * k_scale
    return torch.where(c.isnan(), c, (c.view(torch.int32) & ~3).view(torch.float32))


def center_sample(seqlen, device=None):
    """Indices of the keys K's centre is taken from (``center_sample_key`` in attention_int8.h): all of them up to
    CENTER_SAMPLE_KEYS, else one in each of CENTER_SAMPLE_KEYS strata of ``N / CENTER_SAMPLE_KEYS`` keys, at a
    fraction of the stratum given by a multiplicative hash of its index (a fixed stride could alias with
    periodic structure, e.g. the rows of an image's tokens)."""
    if seqlen <= CENTER_SAMPLE_KEYS:
        return torch.arange(seqlen, device=device)
    i = torch.arange(CENTER_SAMPLE_KEYS, dtype=torch.int64, device=device)
    first, end = i * seqlen // CENTER_SAMPLE_KEYS, (i + 1) * seqlen // CENTER_SAMPLE_KEYS
    fraction = ((i * 2654435761) & 0xFFFFFFFF) >> 16
    return first + ((fraction * (end - first)) >> 16)


def key_center(k):
    """K's centre for smoothing, fp32 ``[..., D]`` from ``k`` ``[..., N, D]`` (N > 0), as the kernels compute it.

    Of the sampled keys (center_sample), the n // 32 farthest from their plain mean, by ``max_d |k_d - m0_d|``
    in fp32, are left out (more where distances tie), and the rest averaged. One attention-sink key many
    times the others' size would otherwise move a sample's mean by 1/n of itself. Sums in fp64, exact for fp16
    values. A distance is NaN if any of its terms is; more NaN distances than n // 32 leave no key, and a
    NaN centre."""
    x = k[..., center_sample(k.shape[-2], k.device), :].double()
    n = x.shape[-2]
    plain = (x.sum(dim=-2, keepdim=True) / n).float()
    distance = (x.float() - plain).abs().amax(dim=-1)
    rank = n - n // CENTER_TRIM_DIVISOR - 1
    threshold = distance.sort(dim=-1).values[..., rank : rank + 1]  # NaN sorts last
    kept = (distance <= threshold).unsqueeze(-1)
    return (torch.where(kept, x, 0.0).sum(dim=-2) / kept.sum(dim=-2)).float()


def quantize_int8(x, mean=None, out_scale=1.0, tokens_per_scale=1):
    """Symmetric INT8 quantization of ``x`` [..., N, D] with one scale per ``tokens_per_scale`` tokens.

    ``mean`` [..., D] (fp32, optional) is subtracted first (K smoothing). Returns ``(x_q, scale)``: int8
    [..., N, D] and fp32 [..., ceil(N / tokens_per_scale)] with
    ``x - mean ~= x_q * scale[..., n // tokens_per_scale] / out_scale``.
    """
    x = x.float()
    if mean is not None:
        x = x - mean.float().unsqueeze(-2)
    n = x.shape[-2]
    groups = -(-n // tokens_per_scale)
    padded = torch.nn.functional.pad(x, (0, 0, 0, groups * tokens_per_scale - n))  # zero rows: no effect on amax
    grouped = padded.flatten(-2).unflatten(-1, (groups, tokens_per_scale * x.shape[-1]))  # [..., groups, T * D]
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(grouped).all(dim=-1, keepdim=True)
    # Tensor-by-tensor fp32 division on purpose: `127.0 / t` is computed by PyTorch as reciprocal(t) * 127
    # and `t / 127` on CUDA as t * (1 / 127), each one rounding more than the kernel's IEEE division.
    prescale = torch.where(amax < 2.0**-64, 2.0**64, 1.0).to(amax.dtype)
    inv = torch.full_like(amax, 127.0) / (amax * prescale)
    x_q = torch.round(grouped * prescale * inv).clamp_(-127, 127)
    scale = amax / torch.full_like(amax, 127.0) * torch.full_like(amax, out_scale)
    x_q = torch.where(finite & (amax > 0), x_q, torch.zeros_like(x_q)).to(torch.int8)
    scale = torch.where(finite, scale, torch.full_like(scale, math.nan))
    x_q = x_q.flatten(-2, -1).unflatten(-1, (-1, x.shape[-1]))[..., :n, :]
    return x_q, scale.squeeze(-1)


def _to_hnd(t, tensor_layout):
    if tensor_layout not in ("HND", "NHD"):
        raise ValueError(f'tensor_layout must be "HND" or "NHD", got {tensor_layout!r}')
    return t if tensor_layout == "HND" else t.transpose(1, 2)


def _from_hnd(t, tensor_layout):
    return (t if tensor_layout == "HND" else t.transpose(1, 2)).contiguous()


def _row_chunks(batch, heads, seqlen_q, seqlen_kv):
    rows = max(1, _MAX_SCORE_ELEMENTS // max(1, batch * heads * seqlen_kv))
    for start in range(0, seqlen_q, rows):
        yield start, min(seqlen_q, start + rows)


def _visible(start, stop, seqlen_q, seqlen_kv, is_causal, device):
    """[rows, Nkv] mask of the keys each query row in [start, stop) sees (None: all keys)."""
    if not is_causal:
        return None
    rows = torch.arange(start, stop, device=device)[:, None]
    cols = torch.arange(seqlen_kv, device=device)[None, :]
    return cols <= rows + (seqlen_kv - seqlen_q)


def _row_has_key(start, stop, seqlen_q, seqlen_kv, is_causal, device):
    rows = torch.arange(start, stop, device=device)
    last_key = rows + (seqlen_kv - seqlen_q) if is_causal else torch.full_like(rows, seqlen_kv - 1)
    return last_key >= 0


def _repeat_heads(t, group):
    """K/V heads repeated for GQA: query head h reads K/V head h // group (no copy when group == 1)."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _prepare(q, k, v, sm_scale, tensor_layout):
    q, k, v = (_to_hnd(t, tensor_layout) for t in (q, k, v))
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q % heads_kv != 0:
        raise ValueError(f"q heads ({heads_q}) must be a multiple of k/v heads ({heads_kv})")
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return q, k, v, heads_q // heads_kv, sm_scale


def _quantized_operands(q, k, group, sm_scale, smooth_k):
    """Steps 1 and 2 on HND q, k: ``(q_q, q_scale, k_q, k_scale, k_center)`` with K's values (as fp32) and
    scales (one per key) repeated to the query heads."""
    seqlen_kv = k.shape[2]
    k_center = key_center(k) if smooth_k and seqlen_kv > 0 else None
    q_q, q_scale = quantize_int8(q, out_scale=sm_scale * LOG2E)
    k_q, k_scale = quantize_int8(k, k_center, tokens_per_scale=KEY_TOKENS_PER_SCALE)
    k_scale = k_scale.repeat_interleave(KEY_TOKENS_PER_SCALE, dim=-1)[..., :seqlen_kv]  # per key
    return q_q, q_scale, _repeat_heads(k_q, group).float(), _repeat_heads(k_scale, group), k_center


def _logits(q_q, q_scale, k_q, k_scale):
    """Step 3: the base-2 logits of the rows of q_q against every key, and their scales c.

    |q_q . k_q| <= 128 * 127^2 < 2^24 and all operands are small integers, so an fp32 matmul of them is
    exact in any summation order (TF32 too: 8-bit integers fit its mantissa)."""
    c = logit_scale(q_scale[..., None], k_scale[..., None, :])
    return (q_q.float() @ k_q.transpose(-1, -2)) * c, c


def int8_logits(q, k, sm_scale=None, tensor_layout="HND", smooth_k=True):
    """Steps 1 to 3 of the scheme (for tests and inspection): ``(logits, c)``, both fp32 [B, Hq, Nq, Nkv] (HND):
    the base-2 logits before any mask, and the scale ``c = logit_scale(q_scale[i], k_scale[j // 64])`` each
    was dequantized with, one integer step of its INT8 dot product."""
    q, k, _, group, sm_scale = _prepare(q, k, k, sm_scale, tensor_layout)  # no V: K stands in
    q_q, q_scale, k_q, k_scale, _ = _quantized_operands(q, k, group, sm_scale, smooth_k)
    return _logits(q_q, q_scale, k_q, k_scale)


def int8_attention_reference(q, k, v, is_causal=False, sm_scale=None, tensor_layout="HND", smooth_k=True,
                             return_lse=False):
    """The INT8 scheme of the module docstring, in PyTorch (any device). Same signature and outputs as
    ``attention_int8.int8_attention_forward``: ``out`` (dtype and layout of q) or ``(out, lse)``."""
    q, k, v, group, sm_scale = _prepare(q, k, v, sm_scale, tensor_layout)
    batch, heads_q, seqlen_q, _ = q.shape
    seqlen_kv = k.shape[2]
    q_q, q_scale, k_q, k_scale, k_center = _quantized_operands(q, k, group, sm_scale, smooth_k)
    # P and V are fp16/bf16 values, exact in fp32/TF32: only the accumulation of P V rounds.
    v = _repeat_heads(v, group).float()

    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    for start, stop in _row_chunks(batch, heads_q, seqlen_q, seqlen_kv):
        s2, _ = _logits(q_q[:, :, start:stop], q_scale[:, :, start:stop], k_q, k_scale)
        visible = _visible(start, stop, seqlen_q, seqlen_kv, is_causal, q.device)
        if visible is not None:
            s2 = s2.masked_fill(~visible, -math.inf)
        has_key = _row_has_key(start, stop, seqlen_q, seqlen_kv, is_causal, q.device)
        m = s2.amax(dim=-1, keepdim=True) if seqlen_kv > 0 else s2.new_full(s2.shape[:-1] + (1,), -math.inf)
        m = torch.where(m == -math.inf, torch.zeros_like(m), m)  # rows without a key: 2^(-inf - 0) = 0
        p = torch.exp2(s2 - m)
        row_sum = p.sum(dim=-1, keepdim=True)
        o = (p.to(q.dtype).float() @ v) / row_sum
        out[:, :, start:stop] = torch.where(has_key[:, None], o, torch.zeros_like(o))
        row_lse = (m + torch.log2(row_sum)).squeeze(-1) * math.log(2.0)
        lse[:, :, start:stop] = torch.where(has_key, row_lse, lse[:, :, start:stop])
    if k_center is not None:  # step 5: add back the shift q . c that smoothing took out of the logits
        lse += (q.float() @ _repeat_heads(k_center, group).unsqueeze(-1)).squeeze(-1) * sm_scale
    out = _from_hnd(out.to(q.dtype), tensor_layout)
    return (out, lse) if return_lse else out


def attention_float64(q, k, v, is_causal=False, sm_scale=None, tensor_layout="HND", return_lse=False):
    """Exact softmax attention in float64 with the same masking, GQA and layout conventions.

    Returns float64 ``out`` in the layout of q, or ``(out, lse)`` with the natural-log LSE [B, Hq, Nq]."""
    q, k, v, group, sm_scale = _prepare(q, k, v, sm_scale, tensor_layout)
    batch, heads_q, seqlen_q, _ = q.shape
    seqlen_kv = k.shape[2]
    k = _repeat_heads(k, group).double()
    v = _repeat_heads(v, group).double()

    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=torch.float64, device=q.device)
    for start, stop in _row_chunks(batch, heads_q, seqlen_q, seqlen_kv):
        s = (q[:, :, start:stop].double() @ k.transpose(-1, -2)) * sm_scale
        visible = _visible(start, stop, seqlen_q, seqlen_kv, is_causal, q.device)
        if visible is not None:
            s = s.masked_fill(~visible, -math.inf)
        has_key = _row_has_key(start, stop, seqlen_q, seqlen_kv, is_causal, q.device)
        row_lse = torch.logsumexp(s, dim=-1)
        safe_lse = torch.where(has_key, row_lse, torch.zeros_like(row_lse))
        o = torch.exp(s - safe_lse[..., None]) @ v
        out[:, :, start:stop] = torch.where(has_key[:, None], o, torch.zeros_like(o))
        lse[:, :, start:stop] = torch.where(has_key, row_lse, lse[:, :, start:stop])
    out = _from_hnd(out, tensor_layout)
    return (out, lse) if return_lse else out
