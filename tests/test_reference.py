"""The quantization scheme itself, through the pure-PyTorch reference, on CPU (runs in CI).

The GPU tests hold the kernel to this reference; these hold the reference (the scheme) to exact float64
attention, and check the quantizer's properties one by one.
"""

import functools
import itertools
import math

import pytest
import torch

from _helpers import (HEAD_DIMS, LSE_ATOL, REL_L1_MAX, Case, accuracy_failures, activation_inputs, assert_accurate,
                      center_inputs, lse_failures, make_qkv, metrics)

# (Nq, Nkv, causal): single rows, tails of the kernel's 128-row / 64-key tiles, Nq > Nkv under the causal
# mask (leading rows see no key), Nq < Nkv, and a long square case.
SHAPES = [(1, 1, False), (1, 1, True), (3, 200, False), (65, 65, True), (129, 200, False), (200, 129, True),
          (129, 1024, True), (1000, 1000, False), (1024, 1024, True)]
HEADS = [(2, 2), (4, 1), (6, 2)]
LAYOUTS = ["HND", "NHD"]
DTYPES = [torch.float16, torch.bfloat16]

# The options of issues 43 (INT8 P.V) and 46 (Q smoothing, channel balancing).
OPTIONS = {"int8": dict(pv_precision="int8"), "fp16-remedies": dict(smooth_q=True, balance_channels=True),
           "int8-remedies": dict(pv_precision="int8", smooth_q=True, balance_channels=True)}


def _grid():
    """Every shape x head dim x dtype; heads, layout and input kind rotate so each value meets many others."""
    for i, ((nq, nkv, causal), d, dtype) in enumerate(itertools.product(SHAPES, HEAD_DIMS, DTYPES)):
        hq, hkv = HEADS[i % len(HEADS)]
        # The bars are for whole outputs, and a few rows are too noisy a sample (_helpers.py): at least 32 query rows
        # (cheap here). With 6 rows the q_shift case at N = 3 failed 2 of 200 draws, one with 12 rows failed on the
        # device (2026-12-06), and 18 rows reached rel L1 0.0188 in 300 draws.
        batch = math.ceil(32 / (hq * nq))
        yield Case(batch=batch, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_kv=nkv, head_dim=d, is_causal=causal,
                   dtype=dtype, layout=LAYOUTS[(i // 2) % 2], kind=("normal", "k_offset", "q_shift")[(i // 3) % 3])


@pytest.mark.parametrize("case", list(_grid()), ids=str)
def test_scheme_accuracy(ai8, case):
    q, k, v = make_qkv(case)
    kwargs = dict(is_causal=case.is_causal, tensor_layout=case.layout, return_lse=True)
    out, lse = ai8.reference.int8_attention_reference(q, k, v, **kwargs)
    exact, exact_lse = ai8.reference.attention_float64(q, k, v, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (case.batch, case.heads_q, case.seqlen_q) and lse.dtype == torch.float32
    failures = accuracy_failures(out, exact, str(case)) + lse_failures(lse, exact_lse, LSE_ATOL, str(case))
    assert not failures, failures


def test_smoothing_is_softmax_invariant(ai8):
    """Subtracting K's centre leaves float64 attention unchanged and shifts the LSE by q . c."""
    q, k, v = (t.double() for t in make_qkv(Case(seqlen_q=100, seqlen_kv=300, kind="k_offset")))
    mean = ai8.reference.key_center(k).double().unsqueeze(-2)
    out, lse = ai8.reference.attention_float64(q, k, v, return_lse=True)
    out_smooth, lse_smooth = ai8.reference.attention_float64(q, k - mean, v, return_lse=True)
    shift = (q @ mean.transpose(-1, -2)).squeeze(-1) * q.shape[-1] ** -0.5
    assert (out - out_smooth).abs().max() <= 1e-12
    assert (lse - (lse_smooth + shift)).abs().max() <= 1e-10
    assert shift.abs().max() > 1  # the channel offset makes the LSE shift large


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_smoothing_matters(ai8, dtype):
    """On keys with a shared channel offset, quantizing without smoothing spends the INT8 range on the offset."""
    q, k, v = make_qkv(Case(seqlen_q=256, seqlen_kv=512, head_dim=128, dtype=dtype, kind="k_offset"))
    exact = ai8.reference.attention_float64(q, k, v)
    err = {smooth: metrics(ai8.reference.int8_attention_reference(q, k, v, smooth_k=smooth), exact)["rel_l1"]
           for smooth in (True, False)}
    # Measured: ~0.009 with smoothing, ~0.055 without.
    assert err[True] <= 0.02 and err[False] >= 3 * err[True], err


@pytest.mark.parametrize("seqlen", [1, 127, 128, 129, 1000, 4096, 4608, 2**31 - 1])
def test_center_sample_strata(ai8, seqlen):
    """K's centre samples every key up to CENTER_SAMPLE_KEYS, else one key in each of that many equal strata, at
    offsets that vary: a 64 x 64 image's tokens (N = 4096, strata of 32 keys) are sampled from every column."""
    sample = ai8.reference.center_sample(seqlen)
    count = ai8.reference.CENTER_SAMPLE_KEYS
    if seqlen <= count:
        assert torch.equal(sample, torch.arange(seqlen))
        return
    i = torch.arange(count)
    assert sample.shape == (count,) and (sample[1:] > sample[:-1]).all()
    assert (sample >= i * seqlen // count).all() and (sample < (i + 1) * seqlen // count).all()
    stratum = seqlen / count
    assert len(set((sample - i * seqlen // count).tolist())) > min(stratum, count) / 4
    if seqlen == 4096:
        assert len(set((sample % 64).tolist())) == 64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_key_center_leaves_out_sinks(ai8, dtype):
    """Keys 20x the others' size among the sampled ones (attention sinks) are what the centre leaves out: it is
    then exactly the mean of the other sampled keys, while the plain sample mean moves far off the offset."""
    k = center_inputs(ai8, "sinks", dtype=dtype)
    x = k[:, :, ai8.reference.center_sample(k.shape[2])].double()
    norms = x.abs().amax(dim=-1)
    sinks = norms >= 10 * norms.median(dim=-1, keepdim=True).values  # [B, H, n]
    assert (sinks.sum(dim=-1) == x.shape[2] // ai8.reference.CENTER_TRIM_DIVISOR).all()
    others = torch.where(sinks.unsqueeze(-1), 0.0, x).sum(dim=-2) / (~sinks).sum(dim=-1, keepdim=True)
    center = ai8.reference.key_center(k)
    assert torch.equal(center, others.float())
    all_norms = k.double().abs().amax(dim=-1, keepdim=True)
    normal = all_norms < 10 * all_norms.median(dim=-2, keepdim=True).values
    offset = torch.where(normal, k.double(), 0.0).sum(dim=-2) / normal.sum(dim=-2)  # up to noise / sqrt(N)
    assert (center - offset).abs().max() < 1.0 < (x.mean(dim=-2) - offset).abs().max()


def test_key_center_ties_and_non_finite(ai8):
    """Ties at the trimming threshold keep every tied key; one infinity in a sampled key leaves that key out (its
    distance is NaN) and the centre finite; one NaN makes every distance NaN, so no key is kept: centre NaN."""
    k = center_inputs(ai8, "ties", seqlen=100)
    assert torch.equal(ai8.reference.key_center(k), (k.double().sum(dim=-2) / 100).float())
    k = center_inputs(ai8, "inf", seqlen=100)
    bad = torch.isinf(k).any(dim=-1, keepdim=True)
    kept_mean = torch.where(bad, 0.0, k.double()).sum(dim=-2) / 99
    assert torch.equal(ai8.reference.key_center(k), kept_mean.float())
    assert ai8.reference.key_center(center_inputs(ai8, "nan", seqlen=100)).isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 65504.0])
@pytest.mark.parametrize("tokens_per_scale", [1, 64])
def test_quantize_properties(ai8, dtype, magnitude, tokens_per_scale):
    # Up to fp16's largest finite value; tokens of magnitudes 0.1x-1x (not near 0: at 1e-3 such a token would
    # flush to fp16 zeros, whose scale is 0); 200 tokens = 3 blocks + 8.
    x = ((torch.rand(2, 3, 200, 128) * 2 - 1) * (0.1 + 0.9 * torch.rand(2, 3, 200, 1)) * magnitude).to(dtype)
    x_q, scale = ai8.reference.quantize_int8(x, tokens_per_scale=tokens_per_scale)
    groups = -(-200 // tokens_per_scale)
    assert x_q.dtype == torch.int8 and x_q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, groups)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    def per_token(group_values):  # [..., groups] -> [..., 200, 1]
        return group_values.repeat_interleave(tokens_per_scale, dim=-1)[..., :200, None]

    def group_amax(t):  # [..., 200, D] -> [..., groups]
        padded = torch.nn.functional.pad(t.abs().amax(dim=-1), (0, groups * tokens_per_scale - 200))
        return padded.unflatten(-1, (groups, tokens_per_scale)).amax(dim=-1)

    # Symmetric range: the group's largest |x| maps to exactly 127, and -x quantizes to -x_q.
    assert torch.equal(group_amax(x_q), torch.full_like(scale, 127, dtype=torch.int8))
    neg_q, neg_scale = ai8.reference.quantize_int8(-x, tokens_per_scale=tokens_per_scale)
    assert torch.equal(neg_q, -x_q) and torch.equal(neg_scale, scale)
    # Round to nearest: |x_q * scale - x| <= scale / 2, up to the fp32 rounding of 127 / amax and x * inv.
    token_scale = per_token(scale.double())
    err = (x_q.double() * token_scale - x.double()).abs()
    assert (err <= token_scale * (0.5 + 1e-4)).all()
    # Same integers as the exact float64 quantization with the group's amax, except where fp32 rounding
    # lands across a tie.
    x64 = x.double()
    ideal = torch.round(x64 * 127 / per_token(group_amax(x64)))
    diff = (x_q.double() - ideal).abs()
    assert diff.max() <= 1 and (diff > 0).double().mean() <= 1e-3


def test_key_blocks_are_independent(ai8):
    """Per block of 64 keys: each block (the last one shorter) quantizes exactly as one token of all its values."""
    x = torch.randn(1, 2, 150, 64) * torch.rand(1, 2, 150, 1) * 10
    x_q, scale = ai8.reference.quantize_int8(x, tokens_per_scale=64)
    for b, rows in enumerate((slice(0, 64), slice(64, 128), slice(128, 150))):
        alone_q, alone_scale = ai8.reference.quantize_int8(x[:, :, rows].reshape(1, 2, 1, -1))
        assert torch.equal(x_q[:, :, rows].reshape(1, 2, 1, -1), alone_q) and torch.equal(scale[..., b:b + 1],
                                                                                           alone_scale)


def test_quantize_rounds_half_to_even(ai8):
    # amax = 127 makes 127 / amax exactly 1, so x * inv lands exactly on the halves.
    x = torch.zeros(1, 1, 1, 64, dtype=torch.float16)
    x[..., :7] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, 1.5, -1.5])
    x_q, scale = ai8.reference.quantize_int8(x)
    assert x_q[..., :7].flatten().tolist() == [127, 2, 4, -2, 0, 2, -2]
    assert scale.item() == 1.0


def test_quantize_mean_and_out_scale(ai8):
    x = torch.randn(2, 2, 50, 64).half()
    mean = torch.randn(2, 2, 64)
    x_q, scale = ai8.reference.quantize_int8(x, mean, out_scale=0.3)
    x_q_ref, _ = ai8.reference.quantize_int8(x.float() - mean[:, :, None])
    assert torch.equal(x_q, x_q_ref)
    # out_scale multiplies the fp32 amax / 127.
    amax = (x.float() - mean[:, :, None]).abs().amax(dim=-1)
    assert torch.equal(scale, amax / torch.tensor(127.0) * torch.tensor(0.3, dtype=torch.float32))


def test_logit_scale_keeps_22_bits(ai8):
    """q_scale * k_scale truncated to 22 significant bits (the kernels' exact one-FMA dequantization relies on
    it): the low 2 mantissa bits are clear, and the result is the fp32 product rounded toward zero."""
    q_scale = torch.rand(4, 3, 300, 1) * 10
    k_scale = torch.rand(4, 3, 1, 5) * 10
    c = ai8.reference.logit_scale(q_scale, k_scale)
    assert ((c.view(torch.int32) & 3) == 0).all()
    raw = q_scale * k_scale
    assert (c <= raw).all() and ((raw.double() - c.double()) < raw.double() * 2.0 ** -21).all()
    assert (c != raw).any()  # the truncation did something on these random scales
    inf = torch.tensor([math.inf, -math.inf])
    assert torch.equal(ai8.reference.logit_scale(inf, torch.ones(2)), inf)
    # NaN stays NaN whatever its bits.
    nan = torch.tensor([0x7FFFFFFF, 0x7FC00000, -1], dtype=torch.int32).view(torch.float32)
    assert ai8.reference.logit_scale(nan, torch.ones(3)).isnan().all()


def test_quantize_zero_and_non_finite_rows(ai8):
    x = torch.randn(1, 2, 6, 96).half()
    x[0, 0, 1] = 0
    x[0, 1, 2, 5] = math.nan
    x[0, 1, 4, 0] = math.inf
    x_q, scale = ai8.reference.quantize_int8(x)
    assert scale[0, 0, 1] == 0 and (x_q[0, 0, 1] == 0).all()
    assert scale[0, 1, 2].isnan() and scale[0, 1, 4].isnan()
    bad = torch.zeros_like(scale, dtype=torch.bool)
    bad[0, 1, 2] = bad[0, 1, 4] = True
    assert torch.isfinite(scale[~bad]).all()
    # Rows are independent: the finite rows quantize as they would on their own.
    alone_q, alone_scale = ai8.reference.quantize_int8(x[~bad][None])
    assert torch.equal(alone_q[0], x_q[~bad]) and torch.equal(alone_scale[0], scale[~bad])
    # Per key block, the block holding a non-finite value gets the NaN scale.
    _, block_scale = ai8.reference.quantize_int8(x, tokens_per_scale=64)
    assert torch.equal(block_scale.isnan().flatten(), torch.tensor([False, True]))


@pytest.mark.parametrize("option", ["fp16", *OPTIONS])
def test_rows_without_keys(ai8, option):
    """Nq > Nkv under the bottom-right causal mask: the first Nq - Nkv rows see no key -> 0 and LSE -inf."""
    q, k, v = make_qkv(Case(seqlen_q=300, seqlen_kv=100, is_causal=True))
    options = OPTIONS.get(option, {})
    for fn in (functools.partial(ai8.reference.int8_attention_reference, **options), ai8.reference.attention_float64):
        out, lse = fn(q, k, v, is_causal=True, return_lse=True)
        assert (out[:, :, :200] == 0).all() and torch.isneginf(lse[:, :, :200]).all()
        assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 200:]).all()
        assert (out[:, :, 200:].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("option", ["fp16", *OPTIONS])
@pytest.mark.parametrize("seqlen_q, seqlen_kv", [(0, 0), (0, 64), (64, 0)])
def test_empty_sequences(ai8, seqlen_q, seqlen_kv, option):
    q, k, v = make_qkv(Case(seqlen_q=seqlen_q, seqlen_kv=seqlen_kv))
    out, lse = ai8.reference.int8_attention_reference(q, k, v, return_lse=True, **OPTIONS.get(option, {}))
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_bottom_right_causal_matches_sdpa_for_square(ai8):
    """For Nq == Nkv the convention equals SDPA's is_causal; the float64 reference must agree with it."""
    q, k, v = (t.double() for t in make_qkv(Case(seqlen_q=77, seqlen_kv=77)))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (ai8.reference.attention_float64(q, k, v, is_causal=True) - sdpa).abs().max() <= 1e-12


@pytest.mark.parametrize("option", ["fp16", "int8"])
def test_nan_propagates(ai8, option):
    q, k, v = make_qkv(Case(heads_q=4, heads_kv=2, seqlen_q=64, seqlen_kv=64))
    q[0, 1, 5, 3] = math.nan
    out = ai8.reference.int8_attention_reference(q, k, v, **OPTIONS.get(option, {}))
    bad = torch.zeros(out.shape[:-1], dtype=torch.bool)
    bad[0, 1, 5] = True
    assert out[bad].isnan().all() and torch.isfinite(out[~bad]).all()


def test_timestep_argument_is_gone(ai8):
    """The original kernel's `timestep` scaled Q's quantization inconsistently; the API no longer takes it."""
    q, k, v = make_qkv(Case(seqlen_q=8, seqlen_kv=8))
    with pytest.raises(TypeError, match="timestep"):
        ai8.int8_attention_forward(q, k, v, timestep=1)
    for name in ("int8_attention_forward", "int8_attention_forward_with_lse", "quantize_int8"):
        assert "timestep" not in str(getattr(ai8.ops, name).default._schema)


def _option_grid():
    """The grid of test_scheme_accuracy: INT8 P.V on every case, the remedies on every third (each with every kind)."""
    for i, case in enumerate(_grid()):
        yield pytest.param(case, "int8", id=f"{case}-int8")
        if i % 3:
            name = ("fp16-remedies", "int8-remedies")[i % 3 - 1]
            yield pytest.param(case, name, id=f"{case}-{name}")


@pytest.mark.parametrize("case, option", list(_option_grid()))
def test_option_accuracy(ai8, case, option):
    """INT8 P.V and the remedies hold the bars on the grid. Measured over 5 draws of the whole grid: INT8 P.V rel
    L1 <= 0.0146 on normal and k_offset inputs but 0.0187 on q_shift (fp16 P.V: 0.0164), cos >= 0.99981; with
    both remedies (2 draws) <= 0.0143 on every kind (fp16 P.V 0.0116), cos >= 0.99989."""
    q, k, v = make_qkv(case)
    kwargs = dict(is_causal=case.is_causal, tensor_layout=case.layout, return_lse=True)
    out, lse = ai8.reference.int8_attention_reference(q, k, v, **kwargs, **OPTIONS[option])
    exact, exact_lse = ai8.reference.attention_float64(q, k, v, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous() and lse.dtype == torch.float32
    failures = accuracy_failures(out, exact, str(case)) + lse_failures(lse, exact_lse, LSE_ATOL, str(case))
    assert not failures, failures


# Issue 46's classes with both remedies, N = 1024, 256 rows: the residual (rel L1, cos) each is held to where the
# bars (None) cannot hold. Measured, 25 fresh draws each (after, with fp16 / int8 P.V): Q + 5 randn(D) rel L1
# <= 0.0077 / 0.0110 (before: 0.010-0.043); K channels 30x plus that offset <= 0.0142 / 0.0222 (before: up to
# 0.28 / 0.43; in 100 more draws int8 reached 0.0158, so about 1 in 100 exceeds 0.02); K channels 30x alone
# 0.021-0.031 for both (before 0.078-0.110, cos >= 0.99940 after): balancing cuts it 3x at least, but no remedy
# here reaches the bars. Over 300 more draws of each (CPU, 2026-12-08) the cut was at least 2.9x (K outliers
# alone), 1.4x (both classes, int8 P.V: from a `before` near the bar) and 1.5x (the Q offset alone).
HARD_RESIDUALS = {("q_offset", "fp16"): None, ("q_offset", "int8"): None,
                  ("k_outliers+q_offset", "fp16"): None, ("k_outliers+q_offset", "int8"): (0.035, 0.999),
                  ("k_outliers", "fp16"): (0.045, 0.998), ("k_outliers", "int8"): (0.045, 0.998)}


@pytest.mark.parametrize("kind, pv_precision", list(HARD_RESIDUALS), ids="-".join)
def test_remedies_on_hard_inputs(ai8, kind, pv_precision):
    q, k, v = activation_inputs(k_outliers=30 if "k_outliers" in kind else 0, q_offset=5 if "q_offset" in kind else 0)
    exact = ai8.reference.attention_float64(q, k, v)
    run = ai8.reference.int8_attention_reference
    before = metrics(run(q, k, v, pv_precision=pv_precision, smooth_q=False, balance_channels=False), exact)
    out = run(q, k, v, pv_precision=pv_precision, smooth_q=True, balance_channels=True)
    after = metrics(out, exact)
    if before["rel_l1"] > REL_L1_MAX / 2:  # the remedies must cut a hard draw's error, or bring it below half the bar
        cut = 1.25 if kind == "q_offset" else 2.0
        assert after["rel_l1"] < max(before["rel_l1"] / cut, REL_L1_MAX / 2), (before, after)
    else:  # an easy draw (the offset can peak attention): the remedies must keep its error
        assert after["rel_l1"] <= 1.05 * before["rel_l1"], (before, after)
    residual = HARD_RESIDUALS[kind, pv_precision]
    if residual is None:
        assert_accurate(out, exact, f"{kind} {pv_precision}")
    else:
        assert after["rel_l1"] <= residual[0] and after["cos"] >= residual[1], after


def test_q_smoothing_logits_are_exact(ai8):
    """With smooth_q (and balance_channels), the logits are q . k' (K' the smoothed K) up to the quantization of
    the two operands the INT8 product sees, bounded from their own scales: a shared Q offset 20x the rows' scale
    adds nothing. Without smooth_q the same bound fails: Q's range is spent on the offset."""
    reference = ai8.reference
    q, k, _ = make_qkv(Case(heads_q=4, heads_kv=2, seqlen_q=200, seqlen_kv=300, head_dim=128, kind="k_offset"))
    q = (q.float() + 20 * torch.randn(1, 4, 1, 128)).half()
    k[..., :3] *= 8
    sm_scale = 128 ** -0.5
    out_scale = torch.tensor(sm_scale * math.log2(math.e), dtype=torch.float32)
    k_smooth = k.float() - reference.key_center(k).unsqueeze(-2)
    q_smooth = q.float() - reference.key_center(q).unsqueeze(-2)
    k_rep = k_smooth.double().repeat_interleave(2, dim=1)
    exact = (q.double() @ k_rep.transpose(-1, -2)) * sm_scale * math.log2(math.e)
    for balance in (False, True):
        scale = reference.balance_factors(q_smooth, k_smooth) if balance else torch.ones(1, 2, 128)
        q_op = (q_smooth * scale.repeat_interleave(2, dim=1).unsqueeze(-2) * out_scale).double()
        k_op = (k_smooth * scale.reciprocal().unsqueeze(-2)).double().repeat_interleave(2, dim=1)
        q_step = q_op.abs().amax(dim=-1, keepdim=True) / 127  # [..., Nq, 1]
        k_step = torch.nn.functional.pad(k_op, (0, 0, 0, 20)).unflatten(-2, (5, 64)).abs().amax(dim=(-1, -2)) / 127
        k_step = k_step.repeat_interleave(64, dim=-1)[..., None, :300]  # [..., 1, Nkv], one per 64-key block
        # |x - x_q step| <= step / 2 for each operand, so |q.k - q_q.k_q| <= the sum of the two cross terms and
        # their product, plus fp32 rounding of the bias and of the scaled operands.
        bound = (q_step / 2 * k_op.abs().sum(dim=-1).unsqueeze(-2) + k_step / 2 * q_op.abs().sum(dim=-1, keepdim=True)
                 + 128 * q_step * k_step / 4) + 1e-5 * (1 + exact.abs())
        logits, _ = reference.int8_logits(q, k, smooth_q=True, balance_channels=balance)
        err = (logits.double() - exact).abs()
        assert (err <= bound).all(), (err / bound).max()
        assert (err / bound).mean() < 0.2  # the bound is a worst case; typical errors are random-walk sized
    unsmoothed, _ = reference.int8_logits(q, k, smooth_q=False, balance_channels=False)
    assert ((unsmoothed.double() - exact).abs() > bound).float().mean() > 0.5


def test_query_smoothing_heads(ai8):
    """Q smoothing's per-head choice: a head whose centre's largest channel exceeds a quarter of Q's largest channel
    range about it is smoothed, one below that is not, and none is with fewer than 128 rows or a NaN in its sample."""
    reference = ai8.reference
    q = torch.rand(2, 4, 300, 64) * 2 - 1  # ranges about the centre close to 1
    q[:, 0, :, 3] += 0.5
    q[:, 1, :, 3] += 0.1
    q[:, 2] += 0.6
    q[1, 2, reference.center_sample(300)[7], 5] = math.nan
    chosen = reference.query_smoothing_heads(q, reference.key_center(q))
    assert chosen.dtype == torch.bool and chosen.shape == (2, 4)
    assert chosen.tolist() == [[True, False, True, False], [True, False, False, False]]
    assert not reference.query_smoothing_heads(q[:, :, :127], reference.key_center(q[:, :, :127])).any()
    # Unchosen heads quantize and attend exactly as without Q smoothing.
    k, v = torch.randn(2, 2, 200, 64).half(), torch.randn(2, 2, 200, 64).half()
    on, off = (reference.int8_attention_reference(q.half(), k, v, smooth_q=flag) for flag in (True, False))
    assert torch.equal(on[:, 1], off[:, 1]) and torch.equal(on[:, 3], off[:, 3]) and not torch.equal(on[:, 0], off[:, 0])


def test_channel_balancing(ai8):
    """balance_factors: q . k is unchanged (float64); where a channel's sampled Q and K ranges differ 4x or more
    they become equal, sqrt(max|q_c| max|k_c|), else it keeps factor 1; GQA takes Q's range over the query heads
    of a K/V head; a dead or non-finite channel keeps factor 1."""
    q = torch.randn(2, 6, 300, 64) * torch.tensor([1 / 16] * 16 + [1.0] * 32 + [16.0] * 16)  # ranges vs K's
    k = torch.randn(2, 2, 500, 64)
    k[..., 5] *= 40
    q[..., 7] = 0
    k[1, 1, ai8.reference.center_sample(500)[3], 9] = math.nan
    s = ai8.reference.balance_factors(q, k)
    assert s.shape == (2, 2, 64) and s.dtype == torch.float32
    assert (s[..., 7] == 1).all() and s[1, 1, 9] == 1 and (s[..., 5] > 2).all()
    moved = s != 1
    moved[..., 7] = True
    moved[1, 1, 9] = True
    assert moved[..., :16].all() and not moved[..., 16:48].any() and moved[..., 48:].all()
    q_b, k_b = q.double() * s.repeat_interleave(3, dim=1).double().unsqueeze(-2), k.double() / s.double().unsqueeze(-2)
    assert torch.allclose(q_b @ k_b.repeat_interleave(3, dim=1).transpose(-1, -2),
                          q.double() @ k.double().repeat_interleave(3, dim=1).transpose(-1, -2), rtol=1e-12, atol=1e-10,
                          equal_nan=True)
    sample = lambda t: t[..., ai8.reference.center_sample(t.shape[-2]), :]
    q_range = sample(q_b).abs().amax(dim=-2).unflatten(1, (2, 3)).amax(dim=2)
    k_range = sample(k_b).abs().amax(dim=-2)
    ok = s != 1
    assert torch.allclose(q_range[ok], k_range[ok], rtol=1e-6)


def test_quantize_v_per_block_channel(ai8):
    """One scale per (64-key block, channel): each is quantize_int8 of that block's column alone."""
    v = torch.randn(2, 3, 150, 96) * torch.rand(1, 1, 1, 96) * 10
    v_q, v_scale = ai8.reference.quantize_v(v.half())
    assert v_q.shape == v.shape and v_q.dtype == torch.int8 and v_scale.shape == (2, 3, 3, 96)
    for b, rows in enumerate((slice(0, 64), slice(64, 128), slice(128, 150))):
        column_q, column_scale = ai8.reference.quantize_int8(v.half()[:, :, rows].transpose(-1, -2))
        assert torch.equal(v_q[:, :, rows], column_q.transpose(-1, -2)) and torch.equal(v_scale[:, :, b], column_scale)


@pytest.mark.parametrize("seqlen_kv, is_causal", [(1000, True), (130, False), (64, True)])
def test_int8_pv_online_equals_closed_form(ai8, seqlen_kv, is_causal):
    """The kernels' tile-by-tile form (running max, rescaled O and l) is the closed form up to fp32 rounding:
    tails of the last 64-key tile, fully masked tiles and rows that see no key (causal Nq > Nkv) included."""
    reference = ai8.reference
    q, k, v = make_qkv(Case(heads_q=4, heads_kv=2, seqlen_q=300, seqlen_kv=seqlen_kv, head_dim=64, kind="q_shift"))
    logits, _ = reference.int8_logits(q, k)
    logits = logits * 3  # sharper rows: the running max moves between tiles by more than a few units
    if is_causal:
        rows, cols = torch.arange(300)[:, None], torch.arange(seqlen_kv)[None, :]
        logits = logits.masked_fill(cols > rows + seqlen_kv - 300, -math.inf)
    v_q, v_scale = (t.repeat_interleave(2, dim=1) for t in reference.quantize_v(v))
    o, m, l = reference.int8_pv(logits, v_q, v_scale)
    o_online, m_online, l_online = reference.int8_pv_online(logits, v_q, v_scale)
    assert torch.equal(m, m_online)
    seen = torch.isfinite(m).squeeze(-1)
    assert (l[~seen] == 0).all() and (o[~seen] == 0).all() and (l_online[~seen] == 0).all()
    assert (l[seen] >= 1 - 1e-6).all()  # the row's max tile alone adds 255 / 255
    torch.testing.assert_close(l_online, l, rtol=1e-5, atol=0)
    v_max = (v_q.float() * v_scale.repeat_interleave(64, dim=-2)[..., :seqlen_kv, :]).abs().max()
    err = ((o_online - o)[seen] / l[seen]).abs().max() / v_max  # normalized outputs, relative to max |V|
    assert err <= 1e-5, err  # fp32 reassociation only


@pytest.mark.parametrize("value", ["fp8", "int4", None, "FP16"])
def test_bad_pv_precision(ai8, value):
    q, k, v = make_qkv(Case(seqlen_q=8, seqlen_kv=8))
    with pytest.raises(ValueError, match="pv_precision"):
        ai8.reference.int8_attention_reference(q, k, v, pv_precision=value)
