"""Pure-PyTorch reference of the attention_int8 scheme (the CPU path), and exact float64 attention.

The scheme, per (batch, head), with Q [Nq, D], K and V [Nkv, D]:

1. K smoothing (``smooth_k``): ``K' = K - c`` in fp32 with K's centre ``c = key_center(K)``: the mean of a
   sample of at most 128 keys without the sample's 1/32 farthest from its plain mean (attention sinks).
   Every logit of a query row moves by the same constant ``q . c``, so the softmax is unchanged, but channel
   offsets shared by all keys no longer eat the INT8 range. Any ``c`` would keep the softmax; the sample
   spares the kernels a pass over all of K (``KeyCenterParams`` in attention_int8.h).
2. Channel balancing (``balance_channels``, issue 46): channel c of Q is multiplied by ``s_c`` and of K' by
   ``1 / s_c`` (fp32), with ``s_c = balance_factors(Q - mu, K - c)`` from the channels' ranges about Q's and K's
   centres (``mu = key_center(Q)``, per query head) over sampled rows: ``sqrt(max|k_c| / max|q_c|)``, or 1 unless
   that is >= 2 or <= 1/2. ``q . k`` is unchanged up to fp32 rounding, and no outlier channel of K owns its INT8
   range; the ranges are about the centres because a Q offset shared by all rows (which smoothing would remove)
   says nothing about how finely a channel must be resolved.
3. Symmetric INT8 in fp32 with one scale per group of tokens: Q per token, K per block of
   ``KEY_TOKENS_PER_SCALE`` = 64 keys (keys ``64 b .. 64 b + 63``; the last block may be shorter).
   ``amax = max |x|`` over the group, ``x_q = round_half_even(x * (127 / amax))`` (the fp32 quotient
   first, then the product), clamped to [-127, 127]; ``scale = amax / 127 * out_scale``. A group with
   ``amax < 2^-64`` (bf16 only) uses ``x * 2^64`` and ``amax * 2^64`` in the quotient and the product
   (exact), since ``127 / amax`` overflows fp32 below ~3.7e-37. ``amax == 0``
   gives ``x_q = 0, scale = 0``; a group holding a non-finite value gets a NaN scale (its ``x_q`` is
   unspecified; here 0), so NaN reaches the output.
   Q uses ``out_scale = sm_scale * log2(e)``, K ``out_scale = 1``.
4. ``S2[i, j] = (q_q[i] . k_q[j]) * c[i, j // 64]`` with the logit scale ``c = q_scale[i] * k_scale[b]``
   truncated to 22 significant bits: exact integer dot products dequantized by one fp32
   multiply. S2 is the logit in base 2. (One scale per row and key block is what lets the kernels take
   a tile's max on the integers and exponentiate with one FMA; 22 bits make that FMA exact.)
5. Softmax in base 2: ``m = max_j S2``, ``P = 2^(S2 - m)``, ``l = sum_j P`` (fp32), then P rounded to the
   input dtype (fp16/bf16), ``O = (P V) / l`` accumulated in fp32 and cast to the input dtype.
6. ``LSE = (m + log2 l) * ln 2 + sm_scale * (q . c)`` (fp32): the log-sum-exp of the true scaled
   logits. Smoothing leaves the softmax unchanged but shifts its normalizer, so the shift is added back
   (only with ``smooth_k``).

Q smoothing (``smooth_q``, issue 46), in step 1: per query head whose centre ``mu = key_center(Q)`` (the same
sampled, trimmed mean as K's) is an offset worth removing, ``query_smoothing_heads``: ``max_d |mu_d|`` above
``QUERY_SHIFT_MIN_RATIO`` times Q's largest channel range about ``mu`` (over the sampled rows; none below
CENTER_SAMPLE_KEYS rows). Such a head quantizes ``Q' = Q - mu``, and every logit of its key j gains
``b_j = (mu . k'_j) * sm_scale * log2(e)`` (``key_bias``), in fp32 from the smoothed, unquantized K' the K quantizer
reads (before balancing). ``q . k' = (q - mu) . k' + mu . k'``, so the logits stay exact up to the quantization of
``Q - mu`` and of K'; a shared Q offset no longer eats Q's INT8 range. The bias enters step 4 as the addend of the
dequantizing FMA, ``S2 = fma(S, c, b_j)``. Other heads are left as they are: the bias costs the kernels time.

Option (off by default):

- ``pv_precision="int8"`` (issue 43), replacing step 5's fp16 P.V: V is quantized to INT8 with one scale per
  (64-key block, channel) (``quantize_v``; no centre is subtracted: it changed no measured class's error). Per
  query row and 64-key tile t, ``m_t = max`` of the tile's logits, ``P_u8 = round(255 * 2^(S2 - m_t))`` (u8, the
  tile's max maps to 255), and the tile contributes ``w_t * (P_u8 @ V_q) * v_scale[t]`` to O and
  ``w_t * rowsum(P_u8)`` to l, with ``w_t = 2^(m_t - m) / 255`` and ``m`` the row max; O = O / l, and
  ``LSE = (m + log2 l) * ln 2`` (+ step 6's shift). ``int8_pv_online`` is the same computation as the kernels
  run it.

Masking is bottom-right aligned: query i sees key j iff ``j <= i + Nkv - Nq``; a row that sees no key
outputs 0 with LSE -inf. GQA/MQA: query head h reads K/V head ``h // (Hq // Hkv)``.

The CUDA kernel runs step 5 as an online softmax over key tiles, so it rounds P at a running max and
rescales; this reference rounds P at the final row max. Everything else is the same arithmetic, so the
two agree to within the rounding of P and of the output (see tests/test_kernel_gpu.py).
"""

import math

import torch

__all__ = ["KEY_TOKENS_PER_SCALE", "CENTER_SAMPLE_KEYS", "PV_PRECISIONS", "P_U8_MAX", "BALANCE_MIN_FACTOR",
           "QUERY_SHIFT_MIN_RATIO", "center_sample", "key_center", "quantize_int8", "logit_scale", "balance_factors",
           "query_smoothing_heads", "key_bias", "int8_logits",
           "quantize_v", "int8_pv", "int8_pv_online", "int8_attention_reference", "attention_float64"]

LOG2E = math.log2(math.e)
KEY_TOKENS_PER_SCALE = 64  # kKeyScaleTokens in attention_int8.h
CENTER_SAMPLE_KEYS = 128  # kCenterSampleKeys
CENTER_TRIM_DIVISOR = 32  # kCenterTrimDivisor
PV_PRECISIONS = ("fp16", "int8")
P_U8_MAX = 255  # the INT8 P.V stores P in (0, 1] as round(255 P): unsigned, the tile's max at 255
BALANCE_MIN_FACTOR = 2.0  # kBalanceMinFactor in attention_int8.h: a channel is left alone unless its ranges differ 4x
QUERY_SHIFT_MIN_RATIO = 0.25  # kQueryShiftMinRatio: Q smoothing where max |mu| exceeds this times Q's largest range

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


def balance_factors(q, k):
    """Channel balancing factors ``s``, fp32 [B, Hkv, D], for q [B, Hq, Nq, D] and k [B, Hkv, Nkv, D] (fp32, each less
    its centre; Nq, Nkv > 0): per K/V head and channel, ``sqrt(max|k_c| / max|q_c|)`` with the maxima over the
    rows center_sample picks (of every query head the K/V head serves). Q's channel times s and K's times 1 / s
    keep q . k (up to fp32 rounding) and give both quantizers the channel range ``sqrt(max|q_c| max|k_c|)``.
    s is 1 where either maximum is 0 or not finite, and where it would lie within BALANCE_MIN_FACTOR of 1:
    reweighting channels that are already balanced, by sampling noise alone, costs accuracy (docs/DESIGN.md,
    rationale). For the same reason s is all 1 when Q or K has fewer rows than a full sample (CENTER_SAMPLE_KEYS):
    the max of a few rows is far below that of 128."""
    if min(q.shape[-2], k.shape[-2]) < CENTER_SAMPLE_KEYS:  # too few rows to tell an outlier channel from noise
        return torch.ones(k.shape[:2] + k.shape[-1:], dtype=torch.float32, device=k.device)
    q_max = q[..., center_sample(q.shape[-2], q.device), :].abs().amax(dim=-2)
    q_max = q_max.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1])).amax(dim=2)
    k_max = k[..., center_sample(k.shape[-2], k.device), :].abs().amax(dim=-2)
    s = torch.sqrt(k_max / q_max)
    skewed = torch.isfinite(s) & (s > 0) & ((s >= BALANCE_MIN_FACTOR) | (s <= 1 / BALANCE_MIN_FACTOR))
    return torch.where(skewed, s, torch.ones_like(s))


def query_smoothing_heads(q, q_center):
    """Which query heads Q smoothing takes, bool [B, Hq], for q [B, Hq, Nq, D] and its centre (key_center) [B, Hq, D]:
    ``max_d |mu_d| > QUERY_SHIFT_MIN_RATIO * max_d range_d`` with Q's channel ranges about the centre over the rows
    center_sample picks, as the kernels decide (``query_smoothing_pays``). None with fewer than CENTER_SAMPLE_KEYS
    rows (the kernels have no ranges there), and none where a value is NaN."""
    if q.shape[-2] < CENTER_SAMPLE_KEYS:
        return torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
    sample = q[..., center_sample(q.shape[-2], q.device), :].float()
    spread = (sample - q_center.unsqueeze(-2)).abs().amax(dim=-2).amax(dim=-1)
    offset = q_center.abs().amax(dim=-1)
    return (spread > 0) & (offset > QUERY_SHIFT_MIN_RATIO * spread)


def key_bias(q_shift, k, sm_scale):
    """Q smoothing's exact per-key bias in base-2 logit units, fp32 [B, Hq, Nkv]: ``(mu . k_j) * sm_scale * log2 e``
    for the heads' shifts ``mu`` [B, Hq, D] and the smoothed K, fp32 [B, Hq, Nkv, D] (K/V heads repeated to the query
    heads), before balancing and rounding."""
    return (k @ q_shift.unsqueeze(-1)).squeeze(-1) * (sm_scale * LOG2E)


def _centered(x, center):
    return x.float() if center is None else x.float() - center.float().unsqueeze(-2)


def _quantized_operands(q, k, group, sm_scale, smooth_k, smooth_q, balance_channels):
    """Steps 1 to 3, with Q smoothing, on HND q, k: ``(q_q, q_scale, k_q, k_scale, k_center, bias)`` with K's values
    (as fp32) and scales (one per key) repeated to the query heads, and Q smoothing's key bias (None without
    smooth_q)."""
    seqlen_q, seqlen_kv = q.shape[2], k.shape[2]
    balance = balance_channels and seqlen_q > 0 and seqlen_kv > 0
    smooth_q = smooth_q and seqlen_q > 0 and seqlen_kv > 0
    k_center = key_center(k) if (smooth_k or balance) and seqlen_kv > 0 else None
    q_center = key_center(q) if smooth_q or balance else None
    s = balance_factors(_centered(q, q_center), _centered(k, k_center)) if balance else None
    # Unchosen heads get a shift and biases of zeros, which change no bit of their logits (and no branch depends on
    # the data, which torch.compile could not trace).
    q_shift = torch.where(query_smoothing_heads(q, q_center).unsqueeze(-1), q_center, 0.0) if smooth_q else None
    q, k = _centered(q, q_shift), _centered(k, k_center if smooth_k else None)
    bias = None if q_shift is None else key_bias(q_shift, _repeat_heads(k, group), sm_scale)
    k_center = k_center if smooth_k else None
    if s is not None:
        q, k = q * _repeat_heads(s, group).unsqueeze(-2), k * s.reciprocal().unsqueeze(-2)
    q_q, q_scale = quantize_int8(q, out_scale=sm_scale * LOG2E)
    k_q, k_scale = quantize_int8(k, tokens_per_scale=KEY_TOKENS_PER_SCALE)
    k_scale = k_scale.repeat_interleave(KEY_TOKENS_PER_SCALE, dim=-1)[..., :seqlen_kv]  # per key
    return q_q, q_scale, _repeat_heads(k_q, group).float(), _repeat_heads(k_scale, group), k_center, bias


def _logits(q_q, q_scale, k_q, k_scale, bias=None):
    """Step 4: the base-2 logits of the rows of q_q against every key, and their scales c.

    |q_q . k_q| <= 128 * 127^2 < 2^24 and all operands are small integers, so an fp32 matmul of them is
    exact in any summation order (TF32 too: 8-bit integers fit its mantissa). With a key bias [..., Nkv] the
    dequantization is the kernels' FMA, rounded once: the product of a 24-bit integer and 22-bit c is exact in
    float64."""
    c = logit_scale(q_scale[..., None], k_scale[..., None, :])
    dots = q_q.float() @ k_q.transpose(-1, -2)
    if bias is None:
        return dots * c, c
    return torch.addcmul(bias.double().unsqueeze(-2), dots.double(), c.double()).float(), c


def int8_logits(q, k, sm_scale=None, tensor_layout="HND", smooth_k=True, smooth_q=True, balance_channels=True):
    """Steps 1 to 3 of the scheme (for tests and inspection): ``(logits, c)``, both fp32 [B, Hq, Nq, Nkv] (HND):
    the base-2 logits before any mask, and the scale ``c = logit_scale(q_scale[i], k_scale[j // 64])`` each
    was dequantized with, one integer step of its INT8 dot product."""
    q, k, _, group, sm_scale = _prepare(q, k, k, sm_scale, tensor_layout)  # no V: K stands in
    q_q, q_scale, k_q, k_scale, _, bias = _quantized_operands(q, k, group, sm_scale, smooth_k, smooth_q,
                                                              balance_channels)
    return _logits(q_q, q_scale, k_q, k_scale, bias)


def quantize_v(v):
    """V for the INT8 P.V: ``(v_q, v_scale)``, int8 [..., N, D] and fp32 [..., ceil(N / 64), D]: v quantized by
    quantize_int8's rule with one scale per (64-key block, channel):
    ``v ~= v_q[..., n, d] * v_scale[..., n // 64, d]``."""
    x = v.float()
    seqlen = x.shape[-2]
    blocks = -(-seqlen // KEY_TOKENS_PER_SCALE)
    x = torch.nn.functional.pad(x, (0, 0, 0, blocks * KEY_TOKENS_PER_SCALE - seqlen))  # zero keys: no effect on amax
    # Transposed to [..., blocks, D, 64] (K-major, as the kernels store V), each (block, channel) is one group.
    v_q, v_scale = quantize_int8(x.unflatten(-2, (blocks, KEY_TOKENS_PER_SCALE)).transpose(-1, -2))
    return v_q.transpose(-1, -2).flatten(-3, -2)[..., :seqlen, :], v_scale


def _p_u8(s2, m_tile):
    """``round(255 * 2^(s2 - m_tile))`` (as fp32 integers 0..255): P of a tile at the tile's max; 0 where masked."""
    m_tile = torch.where(m_tile == -math.inf, torch.zeros_like(m_tile), m_tile)
    return torch.round(P_U8_MAX * torch.exp2(s2 - m_tile))


def int8_pv(s2, v_q, v_scale):
    """The INT8 P.V in closed form for base-2 logits s2 [..., rows, Nkv] (-inf where masked), v_q [..., Nkv, D]
    and v_scale [..., T, D] (quantize_v): ``(o, m, l)`` with the row max m [..., rows, 1] and
    ``o = sum_t w_t (P_u8 @ V_q)_t v_scale[t]``, ``l = sum_t w_t rowsum(P_u8)_t``, ``w_t = 2^(m_t - m) / 255``:
    what int8_pv_online computes tile by tile."""
    seqlen, blocks = s2.shape[-1], v_scale.shape[-2]
    pad = blocks * KEY_TOKENS_PER_SCALE - seqlen
    tiles = torch.nn.functional.pad(s2, (0, pad), value=-math.inf).unflatten(-1, (blocks, KEY_TOKENS_PER_SCALE))
    m_tile = tiles.amax(dim=-1, keepdim=True)  # [..., rows, T, 1]
    p_u8 = _p_u8(tiles, m_tile)
    v_tiles = torch.nn.functional.pad(v_q.float(), (0, 0, 0, pad)).unflatten(-2, (blocks, KEY_TOKENS_PER_SCALE))
    acc = (p_u8.transpose(-2, -3) @ v_tiles).transpose(-2, -3)  # [..., rows, T, D]: integers < 2^24, exact
    m = m_tile.amax(dim=-2) if blocks > 0 else s2.new_full(s2.shape[:-1] + (1,), -math.inf)  # [..., rows, 1]
    w = torch.exp2(m_tile - torch.where(m == -math.inf, torch.zeros_like(m), m).unsqueeze(-1)) / P_U8_MAX
    o = (acc * (w * v_scale.unsqueeze(-3))).sum(dim=-2)
    l = (w * p_u8.sum(dim=-1, keepdim=True)).sum(dim=-2)
    return o, m, l


def int8_pv_online(s2, v_q, v_scale):
    """The INT8 P.V of ``int8_pv`` as the kernels run it: key tiles in order, a running row max ``m``, and O and l
    rescaled by ``2^(m_old - m)`` when a tile raises m (a factor 1 otherwise: the kernels skip it). Same arguments
    and results ``(o, m, l)``; equal to the closed form up to fp32 rounding."""
    rows = s2.shape[:-1]
    m = s2.new_full(rows + (1,), -math.inf)
    o = s2.new_zeros(rows + (v_q.shape[-1],))
    l = s2.new_zeros(rows + (1,))
    for t in range(v_scale.shape[-2]):
        keys = slice(t * KEY_TOKENS_PER_SCALE, (t + 1) * KEY_TOKENS_PER_SCALE)
        s = s2[..., keys]
        m_tile = s.amax(dim=-1, keepdim=True)
        m_new = torch.maximum(m, m_tile)
        base = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        rescale = torch.exp2(m - base)
        w = torch.exp2(m_tile - base) / P_U8_MAX
        p_u8 = _p_u8(s, m_tile)  # u8 operand of the u8.s8 product
        acc = p_u8 @ v_q[..., keys, :].float()  # int32 accumulators on the tensor cores
        o = o * rescale + acc * (w * v_scale[..., t : t + 1, :])
        l = l * rescale + w * p_u8.sum(dim=-1, keepdim=True)
        m = m_new
    return o, m, l


def _pv_fp16(s2, v, dtype):
    """Step 5's fp16/bf16 P.V at the final row max: ``(o, m, l)`` as int8_pv returns them (but m = 0, not -inf, in
    rows without a key)."""
    m = s2.amax(dim=-1, keepdim=True) if s2.shape[-1] > 0 else s2.new_full(s2.shape[:-1] + (1,), -math.inf)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)  # rows without a key: 2^(-inf - 0) = 0
    p = torch.exp2(s2 - m)
    return p.to(dtype).float() @ v, m, p.sum(dim=-1, keepdim=True)


def int8_attention_reference(q, k, v, is_causal=False, sm_scale=None, tensor_layout="HND", smooth_k=True,
                             return_lse=False, pv_precision="fp16", smooth_q=True, balance_channels=True):
    """The INT8 scheme of the module docstring, in PyTorch (any device). Same signature and outputs as
    ``attention_int8.int8_attention_forward``: ``out`` (dtype and layout of q) or ``(out, lse)``. ``pv_precision``:
    "fp16" (P.V in the input dtype, step 5) or "int8"; ``smooth_q``: Q smoothing (step 1); ``balance_channels``:
    step 2."""
    if pv_precision not in PV_PRECISIONS:
        raise ValueError(f'pv_precision must be "fp16" or "int8", got {pv_precision!r}')
    q, k, v, group, sm_scale = _prepare(q, k, v, sm_scale, tensor_layout)
    batch, heads_q, seqlen_q, _ = q.shape
    seqlen_kv = k.shape[2]
    q_q, q_scale, k_q, k_scale, k_center, bias = _quantized_operands(q, k, group, sm_scale, smooth_k, smooth_q,
                                                                     balance_channels)
    if pv_precision == "int8":
        v_q, v_scale = (_repeat_heads(t, group) for t in quantize_v(v))
    else:
        # P and V are fp16/bf16 values, exact in fp32/TF32: only the accumulation of P V rounds.
        v = _repeat_heads(v, group).float()

    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    for start, stop in _row_chunks(batch, heads_q, seqlen_q, seqlen_kv):
        s2, _ = _logits(q_q[:, :, start:stop], q_scale[:, :, start:stop], k_q, k_scale, bias)
        visible = _visible(start, stop, seqlen_q, seqlen_kv, is_causal, q.device)
        if visible is not None:
            s2 = s2.masked_fill(~visible, -math.inf)
        has_key = _row_has_key(start, stop, seqlen_q, seqlen_kv, is_causal, q.device)
        if pv_precision == "int8":
            o, m, row_sum = int8_pv(s2, v_q, v_scale)
        else:
            o, m, row_sum = _pv_fp16(s2, v, q.dtype)
        o = o / row_sum
        out[:, :, start:stop] = torch.where(has_key[:, None], o, torch.zeros_like(o))
        row_lse = (m + torch.log2(row_sum)).squeeze(-1) * math.log(2.0)
        lse[:, :, start:stop] = torch.where(has_key, row_lse, lse[:, :, start:stop])
    if k_center is not None:  # step 6: add back the shift q . c that smoothing took out of the logits
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
