"""attention_int8.layers: the SDPA-compatible function, the kernels-hub layer and the diffusers processor."""

import copy
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ROOT, requires_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.fixture
def layers(ai8):
    """`attention_int8.layers` with its warn-once registry emptied, so each test sees its own first warnings."""
    ai8.layers._warned_reasons.clear()
    return ai8.layers


def cos_sim(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def run_recording_fallbacks(fn, *args, **kwargs):
    """fn's result and the attention_int8 fallback warnings it emitted."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return out, [str(w.message) for w in record if str(w.message).startswith("attention_int8:")]


def qkv(b, hq, hkv, nq, nkv, d, dtype, device, d_v=None):
    q = torch.randn(b, hq, nq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, nkv, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, nkv, d if d_v is None else d_v, dtype=dtype, device=device)
    return q, k, v


# ---------------------------------------------------------------------------------------------------------------
# int8_scaled_dot_product_attention: fallbacks
# ---------------------------------------------------------------------------------------------------------------

def _masked(device):
    q, k, v = qkv(2, 4, 4, 64, 80, 64, torch.float16, device)
    mask = torch.rand(64, 80, device=device) > 0.5
    mask[:, 0] = True  # every query sees a key: SDPA's fully masked rows are NaN
    return (q, k, v), dict(attn_mask=mask)


def _grad(device):
    q, k, v = qkv(1, 2, 2, 32, 32, 64, torch.float16, device)
    return (q.requires_grad_(), k, v), {}


# name -> (inputs builder, a phrase of the expected warning)
FALLBACKS = {
    "attn_mask": (_masked, "attn_mask"),
    "dropout": (lambda dev: (qkv(2, 4, 4, 64, 64, 64, torch.float16, dev), dict(dropout_p=0.25)), "dropout"),
    "3-D": (lambda dev: ((torch.randn(4, 64, 64, dtype=torch.float16, device=dev),) * 3, {}), "4-D"),
    "float32": (lambda dev: (qkv(1, 2, 2, 64, 64, 64, torch.float32, dev), {}), "float16 or torch.bfloat16"),
    "head_dim_72": (lambda dev: (qkv(1, 2, 2, 64, 64, 72, torch.float16, dev), {}), "head_dim 72"),
    "v_head_dim": (lambda dev: (qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, dev, d_v=128), {}), "same shape"),
    "negative_scale": (lambda dev: (qkv(1, 2, 2, 64, 64, 64, torch.float16, dev), dict(scale=-0.125)), "sm_scale"),
    "causal_nq_ne_nkv": (lambda dev: (qkv(1, 2, 2, 48, 96, 64, torch.float16, dev), dict(is_causal=True)),
                         "top-left"),
    "requires_grad": (_grad, "require grad"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FALLBACKS)
def test_fallback_equals_sdpa_and_warns_once(layers, case, device):
    build, phrase = FALLBACKS[case]
    args, kwargs = build(device)
    seed = torch.seed()  # dropout: the kernel-path call and SDPA draw the same mask
    # The CPU reference is requested: only the unsupported feature may send the call to SDPA.
    out, msgs = run_recording_fallbacks(layers.int8_scaled_dot_product_attention, *args, **kwargs,
                                        use_reference_on_cpu=True)
    torch.manual_seed(seed)
    expected = F.scaled_dot_product_attention(*args, **kwargs)
    _, msgs_again = run_recording_fallbacks(layers.int8_scaled_dot_product_attention, *args, **kwargs)

    assert len(msgs) == 1 and phrase in msgs[0], msgs
    assert msgs_again == [], "a reason warns only once"
    assert out.dtype == expected.dtype
    # equal_nan: SDPA's flash and cuDNN backends return NaN for a negative scale, and the fallback is SDPA's result.
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def test_cpu_without_reference_falls_back(layers):
    q, k, v = qkv(2, 4, 2, 64, 96, 64, torch.bfloat16, "cpu")
    out, msgs = run_recording_fallbacks(layers.int8_scaled_dot_product_attention, q, k, v, enable_gqa=True)
    assert len(msgs) == 1 and "cpu" in msgs[0]
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_each_reason_warns_once(layers):
    fp32 = qkv(1, 2, 2, 16, 16, 64, torch.float32, "cpu")
    d72 = qkv(1, 2, 2, 16, 16, 72, torch.float16, "cpu")
    _, msgs = run_recording_fallbacks(
        lambda: [layers.int8_scaled_dot_product_attention(*inputs) for inputs in (fp32, d72, fp32, d72, d72)])
    assert len(msgs) == 2 and "bfloat16" in msgs[0] and "head_dim 72" in msgs[1], msgs


@pytest.mark.filterwarnings("ignore:attention_int8")
@pytest.mark.parametrize("device", DEVICES)
def test_head_count_mismatch_raises_like_sdpa(layers, device):
    q, k, v = qkv(1, 4, 2, 32, 32, 64, torch.float16, device)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError):
        layers.int8_scaled_dot_product_attention(q, k, v)


# ---------------------------------------------------------------------------------------------------------------
# int8_scaled_dot_product_attention: quantized paths (CPU reference, CUDA kernel)
# ---------------------------------------------------------------------------------------------------------------

# (B, Hq, Hkv, Nq, Nkv, D, is_causal)
SHAPES = [
    (2, 4, 4, 128, 128, 64, False),
    (1, 6, 2, 96, 200, 128, False),
    (1, 3, 3, 130, 130, 96, True),
    (2, 8, 2, 257, 257, 128, True),
]
DTYPES = [torch.float16, torch.bfloat16]


def check_close_to_float64(out, q, k, v, is_causal):
    """Within INT8 quantization error of exact attention (SDPA's semantics, in float64)."""
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal,
                                         enable_gqa=True)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    cos = cos_sim(out, ref)
    rel_l1 = ((out.double() - ref).abs().sum() / ref.abs().sum()).item()
    assert cos >= 0.9995 and rel_l1 <= 0.02, (cos, rel_l1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_on_cpu(ai8, layers, shape, dtype):
    b, hq, hkv, nq, nkv, d, causal = shape
    q, k, v = qkv(b, hq, hkv, nq, nkv, d, dtype, "cpu")
    out, msgs = run_recording_fallbacks(layers.int8_scaled_dot_product_attention, q, k, v, is_causal=causal,
                                        enable_gqa=True, use_reference_on_cpu=True)
    assert msgs == []
    assert torch.equal(out, ai8.reference.int8_attention_reference(q, k, v, is_causal=causal))
    check_close_to_float64(out, q, k, v, causal)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_sdpa(layers, shape, dtype):
    b, hq, hkv, nq, nkv, d, causal = shape
    q, k, v = qkv(b, hq, hkv, nq, nkv, d, dtype, "cuda")
    out, msgs = run_recording_fallbacks(layers.int8_scaled_dot_product_attention, q, k, v, is_causal=causal,
                                        enable_gqa=True)
    assert msgs == []
    check_close_to_float64(out, q, k, v, causal)
    assert torch.equal(layers.Int8Attention()(q, k, v, None, 0.0, causal, None, True), out)
    # Strided views (heads interleaved with tokens, as a [B, N, H, D] projection transposed) read in place.
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert torch.equal(layers.int8_scaled_dot_product_attention(*views, is_causal=causal, enable_gqa=True), out)


# ---------------------------------------------------------------------------------------------------------------
# Int8AttnProcessor
# ---------------------------------------------------------------------------------------------------------------

class FakeAttention(nn.Module):
    """The attributes diffusers' Attention / FluxAttention modules expose to their processors."""

    def __init__(self, processor, dim=256, heads=4, *, kv_heads=None, cross_dim=None, qk_norm=False, joint=False,
                 to_out=True, residual_connection=False, rescale_output_factor=1.0):
        super().__init__()
        head_dim = dim // heads
        kv_dim = (kv_heads or heads) * head_dim
        self.processor, self.heads = processor, heads
        self.residual_connection, self.rescale_output_factor = residual_connection, rescale_output_factor
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(cross_dim or dim, kv_dim)
        self.to_v = nn.Linear(cross_dim or dim, kv_dim)
        if qk_norm:
            self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
        if joint:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
            self.norm_added_q, self.norm_added_k = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
            self.to_add_out = nn.Linear(dim, dim)
        if to_out:
            self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.RMSNorm):  # non-trivial norm weights
                    module.weight.uniform_(0.5, 1.5)
            for module in (getattr(self, "to_out", [None])[0], getattr(self, "to_add_out", None)):
                if module is not None:  # a shared output bias would inflate the output's cosine similarity
                    module.bias.zero_()

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def sdpa_processor(attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
    """An SDPA processor written independently of Int8AttnProcessor: [B, H, N, D] layout, complex rotary."""
    batch = hidden_states.shape[0]
    head_dim = attn.to_q.out_features // attn.heads
    joint = hasattr(attn, "add_q_proj") and encoder_hidden_states is not None
    source = hidden_states if encoder_hidden_states is None or joint else encoder_hidden_states

    def heads(x, norm=None):
        x = x.view(batch, x.shape[1], -1, head_dim).transpose(1, 2)
        return x if norm is None else norm(x)

    q = heads(attn.to_q(hidden_states), getattr(attn, "norm_q", None))
    k = heads(attn.to_k(source), getattr(attn, "norm_k", None))
    v = heads(attn.to_v(source))
    if joint:
        q = torch.cat([heads(attn.add_q_proj(encoder_hidden_states), attn.norm_added_q), q], dim=2)
        k = torch.cat([heads(attn.add_k_proj(encoder_hidden_states), attn.norm_added_k), k], dim=2)
        v = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), v], dim=2)
    if image_rotary_emb is not None:
        cos, sin = image_rotary_emb
        rotation = torch.complex(cos[:, ::2].double(), sin[:, ::2].double())

        def rotate(x):
            pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
            return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)

        q, k = rotate(q), rotate(k)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=True)
    out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)
    if joint:
        n_context = encoder_hidden_states.shape[1]
        context, out = out[:, :n_context], out[:, n_context:]
        context = attn.to_add_out(context)
    if hasattr(attn, "to_out"):
        out = attn.to_out[1](attn.to_out[0](out))
    if attn.residual_connection:
        out = out + hidden_states
    out = out / attn.rescale_output_factor
    return (out, context) if joint else out


def rotary_emb(n, head_dim, device):
    """FLUX-style (cos, sin), each [n, head_dim], every angle repeated for its (even, odd) pair."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return tuple(f(angles).repeat_interleave(2, dim=-1).float().to(device) for f in (torch.cos, torch.sin))


# name -> (FakeAttention kwargs, uses encoder states, rotary, mask); dim 256 so heads of 64 or 128 channels.
PROCESSOR_CASES = {
    "self": (dict(heads=4), False, False, False),
    "self_gqa": (dict(heads=4, kv_heads=2), False, False, False),
    "self_residual": (dict(heads=2, residual_connection=True, rescale_output_factor=2.0), False, False, False),
    "cross": (dict(heads=2, cross_dim=96), True, False, False),
    "cross_masked": (dict(heads=2, cross_dim=96), True, False, True),
    "flux_double": (dict(heads=2, qk_norm=True, joint=True), True, True, False),
    "flux_single": (dict(heads=2, qk_norm=True, to_out=False), False, True, False),
}


def processor_inputs(case, dtype, device, n=96, n_context=40):
    kwargs, with_context, with_rotary, with_mask = PROCESSOR_CASES[case]
    dim = 256
    context_dim = kwargs.get("cross_dim", dim)
    # Scaled so that even without q/k norms the logits spread over a few units (a non-flat softmax).
    hidden = 3 * torch.randn(2, n, dim, dtype=dtype, device=device)
    context = 3 * torch.randn(2, n_context, context_dim, dtype=dtype, device=device) if with_context else None
    n_total = n + n_context if kwargs.get("joint") else n
    rotary = rotary_emb(n_total, dim // kwargs["heads"], device) if with_rotary else None
    mask = (torch.rand(2, 1, 1, n_context, device=device) > 0.3) if with_mask else None
    return dict(hidden_states=hidden, encoder_hidden_states=context, attention_mask=mask, image_rotary_emb=rotary)


def run_both_processors(layers, case, dtype, device, ref_dtype, use_reference_on_cpu=False):
    """(Int8AttnProcessor outputs, fallback warnings, sdpa_processor outputs on a `ref_dtype` copy)."""
    attn = FakeAttention(layers.Int8AttnProcessor(use_reference_on_cpu), **PROCESSOR_CASES[case][0])
    attn = attn.to(device, dtype)
    ref_attn = copy.deepcopy(attn).to(ref_dtype)
    ref_attn.processor = sdpa_processor
    inputs = processor_inputs(case, dtype, device)
    with torch.no_grad():
        out, msgs = run_recording_fallbacks(attn, **inputs)
        ref_inputs = {name: t.to(ref_dtype) if t is not None and t.is_floating_point() else t
                      for name, t in inputs.items() if name != "image_rotary_emb"}
        ref = ref_attn(**ref_inputs, image_rotary_emb=inputs["image_rotary_emb"])
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    assert len(outs) == len(refs)
    return outs, msgs, refs


@pytest.mark.parametrize("case", PROCESSOR_CASES)
def test_processor_fallback_equals_sdpa_processor(layers, case):
    outs, msgs, refs = run_both_processors(layers, case, torch.float32, "cpu", torch.float32)
    assert len(msgs) == 1
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("case", ["self_gqa", "flux_double", "flux_single"])
def test_processor_reference_on_cpu(layers, case):
    outs, msgs, refs = run_both_processors(layers, case, torch.bfloat16, "cpu", torch.float64,
                                           use_reference_on_cpu=True)
    assert msgs == []
    for out, ref in zip(outs, refs):
        assert out.dtype == torch.bfloat16 and cos_sim(out, ref) >= 0.9995


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["self", "self_gqa", "cross", "flux_double", "flux_single"])
def test_processor_kernel_matches_float64_sdpa_processor(layers, case, dtype):
    outs, msgs, refs = run_both_processors(layers, case, dtype, "cuda", torch.float64)
    assert msgs == []
    for out, ref in zip(outs, refs):
        assert out.dtype == dtype and cos_sim(out, ref) >= 0.9995


def test_processor_rejects_unet_modules(layers):
    attn = FakeAttention(layers.Int8AttnProcessor())
    attn.group_norm = nn.GroupNorm(8, 256)
    with pytest.raises(NotImplementedError):
        attn(torch.randn(1, 8, 256))


# ---------------------------------------------------------------------------------------------------------------
# Int8Attention through kernels' layer mapping
# ---------------------------------------------------------------------------------------------------------------

def docstring_sdpa_module(layers, kernels):
    """The SDPA module of `Int8Attention`'s docstring, built from the docstring's own code."""
    doc = layers.Int8Attention.__doc__
    code = textwrap.dedent(doc.split("e.g.::\n", 1)[1].split("\n\n    ", 1)[0].strip("\n"))
    namespace = {"use_kernel_forward_from_hub": kernels.use_kernel_forward_from_hub, "nn": nn, "F": F}
    exec(code, namespace)
    return namespace["ScaledDotProductAttention"]


@pytest.mark.parametrize("device", DEVICES)
def test_kernelize_swaps_in_int8_attention(ai8, layers, device):
    kernels = pytest.importorskip("kernels")
    ScaledDotProductAttention = docstring_sdpa_module(layers, kernels)

    # Mapped for the test's device: kernels resolves "cuda" mappings by the GPU's capability. On CPU the layer
    # is loaded and validated all the same, and then falls back to SDPA.
    mapping = {"ScaledDotProductAttention": {
        device: kernels.LocalLayerRepository(repo_path=ROOT, layer_name="Int8Attention")}}
    inference, training = ScaledDotProductAttention(), ScaledDotProductAttention()
    with kernels.use_kernel_mapping(mapping):
        kernels.kernelize(inference, mode=kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE, device=device)
        kernels.kernelize(training, mode=kernels.Mode.TRAINING, device=device)
    assert inference.forward.__qualname__ == "Int8Attention.forward"
    assert training.forward.__qualname__ == "ScaledDotProductAttention.forward"  # no backward: the module's own

    q, k, v = qkv(2, 4, 4, 64, 64, 128, torch.float16, device)
    out, msgs = run_recording_fallbacks(inference, q, k, v, None, 0.0, True, 0.05)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.05)
    if device == "cpu":
        assert len(msgs) == 1 and "on cpu" in msgs[0], msgs
        assert torch.equal(out, sdpa)
    else:
        assert msgs == []
        assert torch.equal(out, ai8.int8_attention_forward(q, k, v, is_causal=True, sm_scale=0.05))
    # The module kernelize left alone runs its own forward, which passes every argument on to SDPA.
    assert torch.equal(training(q, k, v, None, 0.0, True, 0.05), sdpa)


# ---------------------------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs
# ---------------------------------------------------------------------------------------------------------------

class TinyAttentionModel(nn.Module):
    """Fused QKV projection -> int8_scaled_dot_product_attention on strided views -> output projection."""

    def __init__(self, layers, use_reference_on_cpu, dim=512, heads=4):
        super().__init__()
        self.sdpa, self.use_reference_on_cpu, self.heads = layers.int8_scaled_dot_product_attention, \
            use_reference_on_cpu, heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        out = self.sdpa(q, k, v, is_causal=True, use_reference_on_cpu=self.use_reference_on_cpu)
        return self.out(out.transpose(1, 2).flatten(2))


def tiny_flux_attention(layers, use_reference_on_cpu):
    return FakeAttention(layers.Int8AttnProcessor(use_reference_on_cpu), heads=2, qk_norm=True, joint=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("build", [TinyAttentionModel, tiny_flux_attention])
def test_torch_compile_fullgraph(layers, build, device):
    on_cpu = device == "cpu"
    model = build(layers, on_cpu).to(device, torch.bfloat16)
    if isinstance(model, TinyAttentionModel):
        inputs = dict(x=torch.randn(2, 300, 512, device=device, dtype=torch.bfloat16))
    else:
        inputs = processor_inputs("flux_double", torch.bfloat16, device)
    torch._dynamo.reset()
    # fullgraph: any graph break raises. On CPU (the reference path) the eager backend checks just that.
    compiled = torch.compile(model, fullgraph=True, backend="eager" if on_cpu else "inductor")
    with torch.no_grad():
        eager, out = model(**inputs), compiled(**inputs)
    eager, out = (eager, out) if isinstance(eager, tuple) else ((eager,), (out,))
    for e, o in zip(eager, out):
        # Inductor may round the projections differently, which can move an INT8 rounding boundary.
        assert o.shape == e.shape and cos_sim(o, e) >= 0.9999


# Causal, and non-causal with a split-KV tail on the H200 (176 tiles of 192 rows on 132 SMs: a tail of 44 split
# 3 ways, then the combine kernel, all captured in the graph).
@requires_cuda
@pytest.mark.parametrize("shape", [(2, 8, 2, 512, 512, 128, True), (2, 8, 2, 2048, 2048, 128, False)], ids=str)
def test_cuda_graph_replay(ai8, layers, shape):
    b, hq, hkv, nq, nkv, d, causal = shape
    static = qkv(b, hq, hkv, nq, nkv, d, torch.float16, "cuda")

    def step():
        return layers.int8_scaled_dot_product_attention(*static, is_causal=causal, enable_gqa=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as the CUDA-graph docs prescribe
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for _ in range(2):
        fresh = qkv(b, hq, hkv, nq, nkv, d, torch.float16, "cuda")
        for buffer, t in zip(static, fresh):
            buffer.copy_(t)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # The forward is deterministic, so a replay equals an eager call bit for bit.
        assert torch.equal(static_out, ai8.int8_attention_forward(*fresh, is_causal=causal))
