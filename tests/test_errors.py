"""Bad input gets a clear error; edge-case input gets a defined result.

Argument checks run twice: in the Python API (on CPU tensors, so CI covers them: the Python checks come
before the device check) and in the C++ binding through the raw op (on the GPU). Each case must fail with
the right exception type and a message naming the argument and what was expected.
"""

import concurrent.futures
import math
import re

import pytest
import torch

from _helpers import HEAD_DIMS, KERNELS, Case, assert_accurate, make_qkv, reference_failures, select_kernel
from conftest import requires_cuda


def _inputs(device):
    """q [2, 4, 16, 128], k and v [2, 2, 16, 128], fp16, HND: valid, so each case breaks one thing."""
    q = torch.randn(2, 4, 16, 128, dtype=torch.float16, device=device)
    k, v = (torch.randn(2, 2, 16, 128, dtype=torch.float16, device=device) for _ in range(2))
    return q, k, v


def _wide(t):
    return torch.cat((t, t), dim=-1)


# id -> (make the bad call's arguments from valid (q, k, v), exception, patterns the message must contain)
ARGUMENT_CASES = {
    "q_3d": (lambda q, k, v: ((q[0], k, v), {}), ValueError, [r"\bq\b", r"4-D"]),
    "k_5d": (lambda q, k, v: ((q, k[None], v), {}), ValueError, [r"\bk\b", r"4-D"]),
    "v_3d": (lambda q, k, v: ((q, k, v[0]), {}), ValueError, [r"\bv\b", r"4-D"]),
    "batch_mismatch": (lambda q, k, v: ((q, k[:1], v[:1]), {}), ValueError, [r"batch"]),
    "head_dim_mismatch": (lambda q, k, v: ((q, k[..., :64], v[..., :64]), {}), ValueError, [r"head_dim"]),
    "kv_shape_mismatch": (lambda q, k, v: ((q, k, v[:, :, :8]), {}), ValueError, [r"\bk\b", r"\bv\b", r"shape"]),
    "heads_not_multiple": (lambda q, k, v: ((q[:, :3], k, v), {}), ValueError, [r"heads", r"multiple"]),
    "head_dim_72": (lambda q, k, v: ((q[..., :72], k[..., :72], v[..., :72]), {}), ValueError,
                    [r"\b72\b", r"\b64\b", r"\b80\b", r"\b96\b", r"\b128\b", r"\b256\b"]),
    "head_dim_512": (lambda q, k, v: ((_wide(_wide(q)), _wide(_wide(k)), _wide(_wide(v))), {}), ValueError,
                     [r"\b512\b", r"\b64\b", r"\b80\b", r"\b96\b", r"\b128\b", r"\b256\b"]),
    "float32": (lambda q, k, v: ((q.float(), k.float(), v.float()), {}), TypeError, [r"float16", r"bfloat16"]),
    "mixed_dtypes": (lambda q, k, v: ((q, k.bfloat16(), v), {}), TypeError, [r"dtype"]),
    "layout": (lambda q, k, v: ((q, k, v), {"tensor_layout": "BHND"}), ValueError,
               [r"tensor_layout", r"\bHND\b", r"\bNHD\b"]),
    **{f"sm_scale_{value}": (lambda q, k, v, value=value: ((q, k, v), {"sm_scale": value}), ValueError, [r"sm_scale"])
       for value in (0.0, -0.125, math.inf, math.nan)},
}

# Checks only Python can make: the raw op's schema rejects these before any C++ code runs.
PYTHON_ONLY_CASES = {
    "q_not_tensor": (lambda q, k, v: ((q.tolist(), k, v), {}), TypeError, [r"\bq\b", r"Tensor"]),
    "is_causal_not_bool": (lambda q, k, v: ((q, k, v), {"is_causal": 1}), TypeError, [r"is_causal", r"bool"]),
    "balance_not_bool": (lambda q, k, v: ((q, k, v), {"balance_channels": "yes"}), TypeError,
                         [r"balance_channels", r"bool"]),
    "smooth_q_not_bool": (lambda q, k, v: ((q, k, v), {"smooth_q": 1.0}), TypeError, [r"smooth_q", r"bool"]),
    "sm_scale_tensor": (lambda q, k, v: ((q, k, v), {"sm_scale": torch.tensor(0.1)}), TypeError, [r"sm_scale"]),
}


def _assert_raises(exc, patterns, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message, re.IGNORECASE), f"{pattern!r} not in {message!r}"


def test_tests_cover_every_supported_head_dim(ai8):
    assert HEAD_DIMS == ai8.SUPPORTED_HEAD_DIMS


@pytest.mark.parametrize("case", list(ARGUMENT_CASES) + list(PYTHON_ONLY_CASES))
def test_python_argument_checks(ai8, case):
    make_args, exc, patterns = {**ARGUMENT_CASES, **PYTHON_ONLY_CASES}[case]
    args, kwargs = make_args(*_inputs("cpu"))
    _assert_raises(exc, patterns, ai8.int8_attention_forward, *args, **kwargs)


@requires_cuda
@pytest.mark.parametrize("case", list(ARGUMENT_CASES))
def test_op_argument_checks(ai8, case):
    make_args, exc, patterns = ARGUMENT_CASES[case]
    args, kwargs = make_args(*_inputs("cuda"))
    _assert_raises(exc, patterns, ai8.ops.int8_attention_forward, *args, **kwargs)
    _assert_raises(exc, patterns, ai8.ops.int8_attention_forward_with_lse, *args, **kwargs)


@pytest.mark.parametrize("value, exc", [(2, ValueError), (128, ValueError), (0, ValueError), (64.0, TypeError),
                                        (True, TypeError)])
def test_quantize_tokens_per_scale_checked(ai8, value, exc):
    x = torch.randn(1, 2, 70, 64, dtype=torch.float16, device="cuda" if torch.cuda.is_available() else "cpu")
    _assert_raises(exc, [r"tokens_per_scale"], ai8.quantize_int8, x, tokens_per_scale=value)
    if x.is_cuda and exc is ValueError:  # the raw op's own check (its schema already refuses non-ints)
        _assert_raises(exc, [r"tokens_per_scale", r"\b1\b", r"\b64\b"], ai8.ops.quantize_int8, x, None, 1.0, "HND",
                       value)


@requires_cuda
def test_key_center_argument_checks(ai8):
    """K's centre needs at least one key, a floating K of 16 bits and a known layout, and says which is wrong."""
    k = torch.randn(1, 2, 70, 64, dtype=torch.float16, device="cuda")
    _assert_raises(ValueError, [r"\bk\b", r"at least one key"], ai8.key_center, k[:, :, :0])
    _assert_raises(TypeError, [r"\bk\b", r"float16 or bfloat16"], ai8.key_center, k.float())
    _assert_raises(ValueError, [r"tensor_layout"], ai8.key_center, k, tensor_layout="BHND")
    _assert_raises(ValueError, [r"\bk\b", r"head_dim"], ai8.key_center, _wide(_wide(_wide(k))))
    _assert_raises(TypeError, [r"\bk\b", r"torch.Tensor"], ai8.key_center, k.tolist())
    _assert_raises(ValueError, [r"\bk\b", r"CUDA"], ai8.key_center, k.cpu())


def test_cpu_tensors_point_to_the_reference(ai8):
    q, k, v = _inputs("cpu")
    for fn in (ai8.int8_attention_forward, ai8.ops.int8_attention_forward):
        _assert_raises(ValueError, [r"CUDA", r"reference\.int8_attention_reference"], fn, q, k, v)


def test_meta_tensors_give_shapes(ai8):
    """Shape inference (FakeTensor / torch.compile) through the Python API and the op's Meta implementation."""
    q = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16, device="meta")
    k = v = torch.empty(2, 300, 2, 64, dtype=torch.bfloat16, device="meta")
    out, lse = ai8.int8_attention_forward(q, k, v, tensor_layout="NHD", return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
    x_q, scale = ai8.quantize_int8(q, tensor_layout="NHD")
    assert x_q.shape == (2, 8, 100, 64) and x_q.dtype == torch.int8 and scale.shape == (2, 8, 100)
    x_q, scale = ai8.quantize_int8(q, tensor_layout="NHD", tokens_per_scale=ai8.KEY_TOKENS_PER_SCALE)
    assert x_q.shape == (2, 8, 100, 64) and scale.shape == (2, 8, 2)
    center = ai8.key_center(k, tensor_layout="NHD")
    assert center.shape == (2, 2, 64) and center.dtype == torch.float32


@requires_cuda
def test_mixed_devices(ai8):
    q, k, v = _inputs("cuda")
    for fn in (ai8.int8_attention_forward, ai8.ops.int8_attention_forward):
        _assert_raises(ValueError, [r"device|CUDA"], fn, q, k.cpu(), v)


@requires_cuda
def test_compute_capability_checked(ai8, monkeypatch):
    monkeypatch.setattr(ai8._checks, "_capability", lambda device_index: (7, 5))  # the API's cached query
    _assert_raises(ValueError, [r"compute capability", r"8\.0", r"7\.5"], ai8.int8_attention_forward,
                   *_inputs("cuda"))


@requires_cuda
def test_strided_last_dim(ai8):
    """The Python API copies a tensor with a strided head_dim (documented cost); the raw op refuses it."""
    q, k, v = make_qkv(Case(seqlen_q=100, seqlen_kv=100), "cuda")
    q_strided = torch.stack((q, q), dim=-1)[..., 0]
    assert q_strided.stride(-1) == 2
    _assert_raises(ValueError, [r"\bq\b", r"contiguous|stride"], ai8.ops.int8_attention_forward, q_strided, k, v)
    assert torch.equal(ai8.int8_attention_forward(q_strided, k, v), ai8.int8_attention_forward(q, k, v))


@requires_cuda
@pytest.mark.parametrize("batch, seqlen_q, seqlen_kv", [(2, 0, 64), (2, 0, 0), (0, 16, 16), (2, 64, 0)])
@pytest.mark.parametrize("path", ["python", "op"])
def test_empty_sequences(ai8, batch, seqlen_q, seqlen_kv, path):
    """N = 0: an empty output (no launch); Nkv = 0: every query row sees no key -> 0 and LSE -inf."""
    q, k, v = make_qkv(Case(batch=batch, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv), "cuda")
    if path == "python":
        out, lse = ai8.int8_attention_forward(q, k, v, return_lse=True)
    else:
        out, lse = ai8.ops.int8_attention_forward_with_lse(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    assert (out == 0).all() and torch.isneginf(lse).all()


@requires_cuda
@pytest.mark.parametrize("q_shape, kv_shape, patterns", [
    ((1, 65536, 1, 64), (1, 1, 1, 64), [r"heads", r"65535"]),
    ((65536, 1, 1, 64), (65536, 1, 1, 64), [r"batch", r"65535"]),
    ((1, 1, (1 << 30) + 1, 64), (1, 1, 1, 64), [r"sequence length", str(1 << 30)]),
])
def test_launch_limits_refused(ai8, q_shape, kv_shape, patterns):
    """Sizes past the kernel's grid or 32-bit row-index limits are refused before any allocation (the
    tensors here are broadcast views of one row, so the test costs no memory)."""
    row = torch.zeros(1, 1, 1, 64, dtype=torch.float16, device="cuda")
    q, k = row.expand(q_shape), row.expand(kv_shape)
    for fn in (ai8.int8_attention_forward, ai8.ops.int8_attention_forward):
        _assert_raises(ValueError, patterns, fn, q, k, k)


_BIG_MEMORY = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < (80 << 30),
    reason="needs a CUDA GPU with >= 80 GiB (4 GiB tensors and their float64 references)")


@_BIG_MEMORY
def test_offsets_beyond_int32_heads(ai8, monkeypatch):
    """q, k, v and out of 2 * 32768 * 257 * 128 > 2^31 elements: batch/head/row offsets need 64 bits."""
    q, k, v = (torch.randn(2, 32768, 257, 128, dtype=torch.float16, device="cuda") for _ in range(3))
    heads = [(0, 0), (1, 16383), (1, 32767)]  # the last head's rows start past 2^31 elements
    sel = [(slice(b, b + 1), slice(h, h + 1)) for b, h in heads]
    refs = [ai8.reference.int8_attention_reference(q[s], k[s], v[s]) for s in sel]
    exacts = [ai8.reference.attention_float64(q[s], k[s], v[s]) for s in sel]
    for kernel in KERNELS:
        select_kernel(monkeypatch, kernel)
        out = ai8.int8_attention_forward(q, k, v)
        for (b, h), s, ref, exact in zip(heads, sel, refs, exacts):
            assert_accurate(out[s], exact, f"{kernel} b={b} h={h}")
            failures = reference_failures(out[s], ref, v[s], f"{kernel} b={b} h={h}")
            assert not failures, failures


@_BIG_MEMORY
def test_offsets_beyond_int32_keys(ai8, monkeypatch):
    """2^24 + 100 keys of D = 128: the last keys start past 2^31 elements. Each query is a scaled copy of
    one key, so its output is (nearly) that key's V row: reading the wrong rows cannot pass."""
    seqlen_kv = (1 << 24) + 100
    k, v = (torch.randn(1, 1, seqlen_kv, 128, dtype=torch.float16, device="cuda") for _ in range(2))
    # Integer steps: a float32 linspace rounds 2^24 + 99 up, past the last key.
    targets = torch.cat((torch.arange(32, device="cuda") * ((seqlen_kv - 1) // 31),
                         torch.arange(seqlen_kv - 32, seqlen_kv, device="cuda")))
    q = k[:, :, targets] * 4
    exact = ai8.reference.attention_float64(q, k, v)
    assert (exact - v[:, :, targets].double()).abs().max() < 0.1  # the premise: attention ~ one-hot
    for kernel in KERNELS:
        select_kernel(monkeypatch, kernel)
        assert_accurate(ai8.int8_attention_forward(q, k, v), exact, f"{kernel}, 2^24 + 100 keys")


@requires_cuda
@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_without_keys(ai8, monkeypatch, kernel):
    """Nq > Nkv under the bottom-right causal mask: the first Nq - Nkv rows see no key."""
    select_kernel(monkeypatch, kernel)
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_kv=100, head_dim=128, is_causal=True,
                dtype=torch.bfloat16)
    q, k, v = make_qkv(case, "cuda")
    out, lse = ai8.int8_attention_forward(q, k, v, is_causal=True, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, :, :200] == 0).all() and torch.isneginf(lse[:, :, :200]).all()
    assert_accurate(out, ai8.reference.attention_float64(q, k, v, is_causal=True))


@requires_cuda
@pytest.mark.parametrize("kernel", KERNELS)
def test_fp16_extremes(ai8, monkeypatch, kernel):
    """Inputs up to 65504 (fp16's largest): scales and means computed in fp32, nothing overflows."""
    select_kernel(monkeypatch, kernel)
    q, k, v = make_qkv(Case(heads_q=4, heads_kv=2, seqlen_q=256, seqlen_kv=256, head_dim=128, kind="k_offset"),
                       "cuda")
    factors = [65504 / t.float().abs().max().item() for t in (q, k, v)]
    q, k, v = ((t.float() * f).half() for t, f in zip((q, k, v), factors))
    assert all(t.abs().max().item() == 65504 for t in (q, k, v))
    # Logits of order 1 (sm_scale undoes the magnitude): accurate as for ordinary inputs.
    sm_scale = 128 ** -0.5 / (factors[0] * factors[1])
    out = ai8.int8_attention_forward(q, k, v, sm_scale=sm_scale)
    assert_accurate(out, ai8.reference.attention_float64(q, k, v, sm_scale=sm_scale), "logits ~ 1")
    failures = reference_failures(out, ai8.reference.int8_attention_reference(q, k, v, sm_scale=sm_scale), v)
    # The default sm_scale: logits ~ 1e9 in fp32 and a one-hot softmax, still finite.
    assert torch.isfinite(ai8.int8_attention_forward(q, k, v)).all()
    # Without smoothing, kernel and reference quantize identical rows, so they pick the same row of v, except
    # in rows with a runner-up key less than one step of S below the max (rare: see _near_tie_rows).
    plain = ai8.int8_attention_forward(q, k, v, smooth_k=False)
    plain_ref = ai8.reference.int8_attention_reference(q, k, v, smooth_k=False)
    near_tie = _near_tie_rows(ai8, q, k)
    assert near_tie.float().mean().item() < 0.01, near_tie.sum().item()
    failures += reference_failures(plain[~near_tie], plain_ref[~near_tie], v, "one-hot rows")
    assert not failures, failures


def _near_tie_rows(ai8, q, k):
    """[B, Hq, Nq] rows (HND, default sm_scale, no smoothing) whose two largest fp32 logits of the scheme differ
    by less than two steps of S, 2 * c with c the row's largest logit scale. The Hopper kernel resolves the
    exponents of a tile that does not hold the row's max only to within 0.75 c (attention_fwd_sm90.cu), so at
    one-hot logits (c ~ 1e4 here) it may weigh such a runner-up 1 where the reference gives 2^-gap = 0."""
    logits, c = ai8.reference.int8_logits(q, k, smooth_k=False)
    top = logits.topk(2, dim=-1).values
    gap = top[..., 0] - top[..., 1]
    return (gap > 0) & (gap < 2 * c.amax(dim=-1))


@requires_cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tiny", ["q", "k"])
def test_bf16_tiny_groups(ai8, monkeypatch, kernel, tiny):
    """bf16 Q rows (or K) of magnitude ~1e-37, below 127 / FLT_MAX: 127 / amax overflows fp32, so these
    groups are quantized at a 2^64 prescale (quant_math.cuh). The other operand at ~1e29 and sm_scale 1e7
    give logits of order 1, where a row quantized by sign alone (an infinite inverse scale) or to zeros
    misses the float64 output by far."""
    select_kernel(monkeypatch, kernel)
    q, k, v = make_qkv(Case(heads_q=4, heads_kv=2, seqlen_q=200, seqlen_kv=300, head_dim=128, dtype=torch.bfloat16),
                       "cuda")
    small, large = (q, k) if tiny == "q" else (k, q)
    small = (small.float() / small.float().abs().amax(dim=-1, keepdim=True) * 2e-37).bfloat16()
    large = (large.float() * 1e29).bfloat16()
    q, k = (small, large) if tiny == "q" else (large, small)
    assert small.float().abs().max().item() < 127 / torch.finfo(torch.float32).max
    exact = ai8.reference.attention_float64(q, k, v, sm_scale=1e7)
    uniform = ai8.reference.attention_float64(q, torch.zeros_like(k), v, sm_scale=1e7)
    assert (exact - uniform).abs().max().item() > 0.1  # the premise: logits that matter
    out = ai8.int8_attention_forward(q, k, v, sm_scale=1e7)
    assert_accurate(out, exact, f"tiny {tiny}")
    failures = reference_failures(out, ai8.reference.int8_attention_reference(q, k, v, sm_scale=1e7), v)
    assert not failures, failures


@requires_cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("zeros", ["q", "k", "some_q_rows"])
def test_zero_inputs(ai8, monkeypatch, kernel, zeros):
    """amax = 0 gives scale 0: an all-zero Q row or K attends uniformly, like float64 attention."""
    select_kernel(monkeypatch, kernel)
    q, k, v = make_qkv(Case(heads_q=4, heads_kv=2, seqlen_q=200, seqlen_kv=300, head_dim=128, is_causal=True),
                       "cuda")
    if zeros == "q":
        q.zero_()
    elif zeros == "k":
        k.zero_()
    else:
        q[:, :, ::3] = 0
    out = ai8.int8_attention_forward(q, k, v, is_causal=True)
    assert_accurate(out, ai8.reference.attention_float64(q, k, v, is_causal=True), zeros)
    failures = reference_failures(out, ai8.reference.int8_attention_reference(q, k, v, is_causal=True), v, zeros)
    assert not failures, failures


@requires_cuda
@pytest.mark.parametrize("value", ["0", "-2", "two", "3x"])
def test_bad_kv_splits_setting(ai8, monkeypatch, value):
    """The split-KV test hook (ATTENTION_INT8_KV_SPLITS) takes a positive integer, and says so otherwise."""
    monkeypatch.setenv("ATTENTION_INT8_KV_SPLITS", value)
    q, k, v = _inputs("cuda")
    with pytest.raises(ValueError, match="ATTENTION_INT8_KV_SPLITS must be a positive integer"):
        ai8.int8_attention_forward(q, k, v)


@requires_cuda
@pytest.mark.parametrize("kernel, kv_splits", [("auto", None), ("portable", None), ("auto", 3)])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_propagates(ai8, monkeypatch, kernel, kv_splits, where):
    """A NaN in the input shows up in exactly the outputs that depend on it, and nowhere else. With kv_splits
    (the Hopper kernel) the 150 keys are three splits, and the NaN key of V lies in the middle one."""
    select_kernel(monkeypatch, kernel)
    if kv_splits is not None:
        monkeypatch.setenv("ATTENTION_INT8_KV_SPLITS", str(kv_splits))
    q, k, v = make_qkv(Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=100, seqlen_kv=150, head_dim=128), "cuda")
    bad = torch.zeros(q.shape, dtype=torch.bool, device="cuda")
    if where == "q":
        q[1, 3, 17, 5] = math.nan
        bad[1, 3, 17] = True  # that query row
    elif where == "k":
        k[0, 1, 40, 7] = math.nan
        bad[0, 2:4] = True  # every row of the q heads reading k/v head 1 (through K's mean, and the key itself)
    else:
        v[1, 0, 99, 9] = math.nan
        bad[1, 0:2, :, 9] = True  # column 9 of every row that attends to key 99
    out, lse = ai8.int8_attention_forward(q, k, v, return_lse=True)
    assert out[bad].isnan().all() and torch.isfinite(out[~bad]).all()
    assert torch.equal(lse.isnan(), bad.all(dim=-1))  # the V case leaves the LSE finite
    ref = ai8.reference.int8_attention_reference(q, k, v)
    failures = reference_failures(out[~bad], ref[~bad], v.nan_to_num())
    assert not failures, failures


@requires_cuda
def test_concurrent_streams_and_threads(ai8):
    """Several threads, each on its own CUDA stream, running different problems at once: every result is
    bit-identical to the serial one (the op keeps no shared state and orders its work on the current stream)."""
    cases = [Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=700, seqlen_kv=1100, head_dim=d, is_causal=causal,
                  dtype=dtype, layout=layout)
             for d, causal, dtype, layout in ((64, True, torch.float16, "HND"), (96, False, torch.bfloat16, "NHD"),
                                              (128, True, torch.bfloat16, "HND"), (128, False, torch.float16, "NHD"))]
    inputs = [make_qkv(case, "cuda") for case in cases]

    def run(case, qkv):
        return ai8.int8_attention_forward(*qkv, is_causal=case.is_causal, tensor_layout=case.layout,
                                          return_lse=True)

    serial = [run(case, qkv) for case, qkv in zip(cases, inputs)]
    torch.cuda.synchronize()

    def worker(shift):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            order = [(i + shift) % len(cases) for i in range(len(cases))] * 3
            results = [(i, run(cases[i], inputs[i])) for i in order]
        stream.synchronize()
        return results

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for results in pool.map(worker, range(4)):
            for i, (out, lse) in results:
                assert torch.equal(out, serial[i][0]) and torch.equal(lse, serial[i][1]), cases[i]


@requires_cuda
@pytest.mark.parametrize("smooth_k", [True, False])
def test_back_to_back_calls(ai8, smooth_k):
    """Calls queued without a synchronization, each one's inputs written by a kernel just before it and its
    temporaries freed right after, so the caching allocator hands the next call the memory the previous
    one's launches used. On Hopper the op's later launches start under their predecessor's tail
    (programmatic dependent launch): every result must still equal the same call run on its own. N = 2048
    non-causal splits its tail on the H200 (176 tiles on 132 SMs), so its combine kernel is in the chain."""
    cases = [Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=n, seqlen_kv=n + 37, head_dim=d, is_causal=causal)
             for n, d, causal in ((300, 128, True), (1000, 64, False), (700, 128, False), (520, 96, True),
                                  (2048, 128, False))]
    bases = [make_qkv(case, "cuda") for case in cases]
    alone = []
    for case, qkv in zip(cases, bases):
        alone.append(ai8.int8_attention_forward(*qkv, is_causal=case.is_causal, smooth_k=smooth_k, return_lse=True))
        torch.cuda.synchronize()
    queued = []
    for i in range(3 * len(cases)):
        case, (q, k, v) = cases[i % len(cases)], bases[i % len(cases)]
        q, k, v = q * 1, k * 1, v * 1  # fresh copies from a kernel right before the call
        queued.append(ai8.int8_attention_forward(q, k, v, is_causal=case.is_causal, smooth_k=smooth_k, return_lse=True))
        del q, k, v
    torch.cuda.synchronize()
    for i, (out, lse) in enumerate(queued):
        assert torch.equal(out, alone[i % len(cases)][0]) and torch.equal(lse, alone[i % len(cases)][1]), cases[i % len(cases)]
