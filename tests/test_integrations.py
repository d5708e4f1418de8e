"""Key-padding masks, `sageattn`, transformers and diffusers integrations (CPU plumbing; GPU numbers)."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from _helpers import COS_MIN, REL_L1_MAX, assert_accurate, metrics
from conftest import requires_cuda


@pytest.fixture
def layers(ai8):
    ai8.layers._warned_reasons.clear()
    return ai8.layers


def recording_fallbacks(fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return out, [str(w.message) for w in record if str(w.message).startswith("attention_int8:")]


def qkv(b, hq, hkv, nq, nkv, d=64, dtype=torch.bfloat16, device="cpu"):
    return (torch.randn(b, hq, nq, d, dtype=dtype, device=device),
            torch.randn(b, hkv, nkv, d, dtype=dtype, device=device),
            torch.randn(b, hkv, nkv, d, dtype=dtype, device=device))


# ---------------------------------------------------------------------------------------------------------------
# Key-padding masks in int8_scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------------------------

def keep_mask(kind, b, nkv):
    """bool [B, Nkv]: "right" (unequal right padding), "equal" (the same right padding), "left", "holes"."""
    pos = torch.arange(nkv)
    lengths = torch.tensor([nkv, nkv - 37, 70][:b])
    if kind == "right":
        return pos < lengths[:, None]
    if kind == "equal":
        return (pos < nkv - 20).expand(b, nkv)
    if kind == "left":
        return pos >= (nkv - lengths)[:, None]
    return torch.rand(b, nkv) > 0.4


# name -> how the [B, Nkv] keep mask is given to SDPA
MASK_FORMS = {
    "bool_b11n": lambda keep: keep[:, None, None, :],
    "additive_b11n": lambda keep: torch.zeros(keep.shape).masked_fill(~keep, -math.inf)[:, None, None, :],
    "bool_expanded": lambda keep: keep[:, None, None, :].expand(-1, 4, 96, -1),
}


def per_row_reference(ai8, q, k, v, keep, fn):
    """`fn` (a dense reference) of each batch row over its kept keys."""
    return torch.cat([fn(q[b:b + 1], k[b:b + 1, :, keep[b]], v[b:b + 1, :, keep[b]]) for b in range(q.shape[0])])


@pytest.mark.parametrize("form", MASK_FORMS)
@pytest.mark.parametrize("kind", ["right", "equal", "left", "holes"])
def test_key_padding_mask_runs_reference_per_row(ai8, layers, kind, form):
    q, k, v = qkv(3, 4, 2, 96, 150)
    keep = keep_mask(kind, 3, 150)
    mask = MASK_FORMS[form](keep)
    out, msgs = recording_fallbacks(layers.int8_scaled_dot_product_attention, q, k, v, attn_mask=mask,
                                    enable_gqa=True, use_reference_on_cpu=True)
    assert msgs == []
    assert torch.equal(out, per_row_reference(ai8, q, k, v, keep, ai8.reference.int8_attention_reference))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double()
                                           if mask.is_floating_point() else mask, enable_gqa=True)
    assert_accurate(out, exact, f"{kind} {form}")


FALLBACK_MASKS = {
    "per_query": lambda: torch.rand(96, 150) > 0.5,
    "bias": lambda: torch.randn(3, 1, 1, 150),
    "empty_row": lambda: keep_mask("right", 3, 150).index_fill(0, torch.tensor([1]), False)[:, None, None, :],
}


@pytest.mark.parametrize("case", FALLBACK_MASKS)
def test_other_masks_fall_back_to_sdpa(layers, case):
    q, k, v = qkv(3, 4, 4, 96, 150)
    mask = FALLBACK_MASKS[case]()
    if mask.dtype == torch.bool and case == "per_query":
        mask[:, 0] = True  # SDPA's fully masked rows are NaN
    out, msgs = recording_fallbacks(layers.int8_scaled_dot_product_attention, q, k, v, attn_mask=mask.to(
        q.dtype) if mask.is_floating_point() else mask, use_reference_on_cpu=True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype) if mask.is_floating_point()
                                              else mask)
    assert len(msgs) == 1 and "attn_mask" in msgs[0], msgs
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)  # SDPA's own result, NaN rows too


# ---------------------------------------------------------------------------------------------------------------
# sageattn
# ---------------------------------------------------------------------------------------------------------------

def meta_qkv(layout, b=2, hq=8, hkv=2, nq=77, nkv=130, d=128):
    shape = (lambda h, n: (b, h, n, d)) if layout == "HND" else (lambda h, n: (b, n, h, d))
    return tuple(torch.empty(shape(h, n), dtype=torch.float16, device="meta") for h, n in ((hq, nq), (hkv, nkv),
                                                                                            (hkv, nkv)))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_sageattn_shapes_and_sage_keywords(ai8, layout):
    q, k, v = meta_qkv(layout)
    out, lse = ai8.sageattn(q, k, v, tensor_layout=layout, is_causal=True, return_lse=True, qk_quant_gran="per_warp",
                            pv_accum_dtype="fp32+fp32", smooth_k=False, smooth_v=True, quantization_backend="cuda")
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 8, 77) and lse.dtype == torch.float32


@pytest.mark.parametrize("kwargs, error, phrase", [
    (dict(dropout_p=0.1), TypeError, "unexpected keyword argument 'dropout_p'"),
    (dict(qk_quant_gran="per_tensor"), ValueError, "qk_quant_gran must be one of"),
    (dict(pv_accum_dtype="fp8"), ValueError, "pv_accum_dtype must be one of"),
    (dict(smooth_v=1), TypeError, "smooth_v must be a bool"),
    (dict(smooth_k=None), TypeError, "smooth_k must be a bool"),
    (dict(tensor_layout="BNHD"), ValueError, "tensor_layout"),
])
def test_sageattn_rejects_bad_keywords(ai8, kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        ai8.sageattn(*meta_qkv("HND"), **kwargs)


def test_sageattn_cpu_raises_and_masked_call_follows_sdpa(ai8, layers):
    q, k, v = (t.transpose(1, 2) for t in qkv(2, 4, 4, 64, 64))  # NHD
    with pytest.raises(ValueError, match="CUDA"):
        ai8.sageattn(q, k, v, tensor_layout="NHD")
    mask = torch.rand(2, 1, 64, 64) > 0.3
    mask[..., 0] = True
    out, msgs = recording_fallbacks(ai8.sageattn, q, k, v, tensor_layout="NHD", attn_mask=mask)
    assert len(msgs) == 1
    expected = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    assert torch.equal(out, expected.transpose(1, 2))
    with pytest.raises(ValueError, match="return_lse"):
        ai8.sageattn(q, k, v, tensor_layout="NHD", attn_mask=mask, return_lse=True)


# ---------------------------------------------------------------------------------------------------------------
# diffusers: the sage_hub backend, and Int8AttnProcessor on a Wan transformer
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def sage_hub(ai8, monkeypatch):
    """diffusers' sage_hub backend with this package's sageattn in its kernel slot (restored afterwards)."""
    dispatch = pytest.importorskip("diffusers.models.attention_dispatch")
    config = dispatch._HUB_KERNELS_REGISTRY[dispatch.AttentionBackendName.SAGE_HUB]
    monkeypatch.setattr(config, "kernel_fn", config.kernel_fn)
    registry = dispatch._AttentionBackendRegistry  # set_attention_backend also sets the process-wide default
    monkeypatch.setattr(registry, "_active_backend", registry._active_backend)
    assert ai8.layers.register_diffusers_backend() == "sage_hub"
    assert config.kernel_fn is ai8.sageattn
    return dispatch


def test_diffusers_sage_hub_call_pattern(sage_hub):
    q, k, v = meta_qkv("NHD", hkv=8)  # diffusers passes [B, N, H, D]
    out = sage_hub.dispatch_attention_fn(q, k, v, backend=sage_hub.AttentionBackendName.SAGE_HUB)
    assert out.shape == q.shape
    out, lse = sage_hub.dispatch_attention_fn(q, k, v, backend="sage_hub", attention_kwargs={"return_lse": True})
    assert out.shape == q.shape and lse.shape == (2, 8, 77)


WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
                  text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=24, added_kv_proj_dim=128, rope_max_seq_len=64)


def tiny_wan(device):
    """An image-to-video Wan transformer (rotary self-attention; cross-attention on image then text tokens) with
    random weights and inputs: (model, inputs)."""
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.WanTransformer3DModel(**WAN_CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():  # zero-initialized output layers would hide the attention
            p.add_(0.02 * torch.randn_like(p))
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 16, 16), timestep=torch.tensor([500, 200]),
                  encoder_hidden_states=torch.randn(2, 512, 32), encoder_hidden_states_image=torch.randn(2, 20, 24))
    return model.to(device), {name: t.to(device) for name, t in inputs.items()}


def run_model(model, inputs, dtype):
    model = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        return model(**{n: t.to(dtype) if t.is_floating_point() else t for n, t in inputs.items()},
                     return_dict=False)[0]


@pytest.mark.filterwarnings("ignore:.*kept in float32")
def test_wan_with_int8_processor_on_cpu(layers):
    model, inputs = tiny_wan("cpu")
    exact = run_model(model, inputs, torch.float64)
    int8_model = copy.deepcopy(model)
    int8_model.set_attn_processor(layers.Int8AttnProcessor(use_reference_on_cpu=True))
    out, msgs = recording_fallbacks(run_model, int8_model, inputs, torch.bfloat16)
    assert msgs == []
    assert out.dtype == torch.bfloat16
    assert_accurate(out, exact, "Wan I2V, Int8AttnProcessor (CPU reference)")
    assert not torch.equal(out, run_model(model, inputs, torch.bfloat16))  # the processor replaced SDPA's


def test_processor_rejects_hunyuan_forms(layers):
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoSingleTransformerBlock

    block = HunyuanVideoSingleTransformerBlock(num_attention_heads=2, attention_head_dim=64).to(torch.bfloat16)
    block.attn.set_processor(layers.Int8AttnProcessor(use_reference_on_cpu=True))
    rotary = tuple(torch.ones(40, 64) for _ in range(2))  # the latent tokens only
    with pytest.raises(ValueError, match="HunyuanVideo"):
        block.attn(torch.randn(1, 40, 128, dtype=torch.bfloat16), torch.randn(1, 8, 128, dtype=torch.bfloat16),
                   image_rotary_emb=rotary)
    assert diffusers


# ---------------------------------------------------------------------------------------------------------------
# transformers: transformers_attention in a Llama model
# ---------------------------------------------------------------------------------------------------------------

def test_hub_function_form_takes_the_flash_wrapper(ai8, monkeypatch):
    """transformers prefers a kernel's flash_attn_varlen_func to the function the hub string names, so
    ":transformers_attention" registers its FlashAttention wrapper over flash_attn_func / flash_attn_varlen_func
    (tests/test_flash_compat.py runs it)."""
    hub_kernels = pytest.importorskip("transformers.integrations.hub_kernels")
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    monkeypatch.setattr(hub_kernels, "get_kernel", lambda repo_id, **kwargs: ai8)
    name = "your-namespace/attention-int8:transformers_attention"
    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(AttentionMaskInterface, "_global_mapping", dict(AttentionMaskInterface._global_mapping))
    assert hub_kernels.load_and_register_attn_kernel(name) is ai8
    assert AttentionInterface._global_mapping[name] is flash_attention_forward
    assert AttentionMaskInterface._global_mapping[name] is flash_attention_mask  # 2-D key-padding masks


def tiny_llama(attn_implementation, dtype, state_dict=None):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def test_llama_padded_batch_matches_sdpa(ai8, layers, monkeypatch):
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(AttentionMaskInterface, "_global_mapping", dict(AttentionMaskInterface._global_mapping))
    calls = []

    def recorded(module, query, key, value, attention_mask, **kwargs):
        calls.append(None if attention_mask is None else tuple(attention_mask.shape))
        return ai8.transformers_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("int8", recorded)
    AttentionMaskInterface.register("int8", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    int8_model = tiny_llama("int8", torch.bfloat16)
    exact_model = tiny_llama("sdpa", torch.float64, int8_model.state_dict())
    sdpa_model = tiny_llama("sdpa", torch.bfloat16, int8_model.state_dict())

    ids = torch.randint(0, 256, (3, 40))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 30:] = 0  # right padding
    mask[2, :13] = 0  # left padding
    with torch.no_grad():
        logits, msgs = recording_fallbacks(lambda: int8_model(input_ids=ids, attention_mask=mask).logits)
        exact = exact_model(input_ids=ids, attention_mask=mask).logits
        sdpa = sdpa_model(input_ids=ids, attention_mask=mask).logits
    assert msgs == [] and calls == [(3, 40)] * 2  # both layers, on the 2-D padding mask
    kept = mask.bool()
    assert_accurate(logits[kept], exact[kept], "Llama logits, int8 vs float64")
    assert metrics(sdpa[kept], exact[kept])["cos"] >= COS_MIN  # the bar is one bf16 SDPA meets
    assert not torch.equal(logits[kept], sdpa[kept])


def kept_tokens_per_row(q, k, v, keep_q, keep_k, is_causal, fn):
    """`fn(q, k, v, is_causal)` (HND) of each batch row on its kept tokens, causal bottom-right over the kept
    tokens; padded queries 0."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        out[b:b + 1, :, keep_q[b]] = fn(q[b:b + 1, :, keep_q[b]], k[b:b + 1, :, keep_k[b]], v[b:b + 1, :, keep_k[b]],
                                         is_causal)
    return out


def sdpa_bottom_right(q, k, v, is_causal):
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2]) if is_causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def transformers_padding_mask(b, nkv):
    mask = torch.ones(b, nkv, dtype=torch.long)
    mask[1, nkv - 23:] = 0  # right padding
    mask[2, :31] = 0  # left padding
    return mask


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("nq", [90, 5])  # prefill, and 5 new tokens after a cache
def test_transformers_padding_mask_runs_reference_on_kept_tokens(ai8, layers, nq, is_causal):
    q, k, v = qkv(3, 4, 2, nq, 90)
    mask = transformers_padding_mask(3, 90)
    keep_k = mask.bool()
    out, msgs = recording_fallbacks(ai8.transformers_attention, None, q, k, v, mask, is_causal=is_causal)
    assert msgs == [] and out[1] is None
    expected = kept_tokens_per_row(q, k, v, keep_k[:, 90 - nq:], keep_k, is_causal,
                                   lambda *a: ai8.reference.int8_attention_reference(*a))
    assert torch.equal(out[0], expected.transpose(1, 2))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("nq", [90, 5])
def test_transformers_padding_mask_fallback_equals_sdpa_on_kept_tokens(ai8, layers, nq, is_causal):
    q, k, v = (t.float() for t in qkv(3, 4, 2, nq, 90))  # float32: the kernel takes 16-bit inputs only
    mask = transformers_padding_mask(3, 90)
    mask[0, 40] = 0  # a hole: the mask goes to SDPA as it is, ranks counting kept tokens
    keep_k = mask.bool()
    out, msgs = recording_fallbacks(ai8.transformers_attention, None, q, k, v, mask, is_causal=is_causal)
    assert len(msgs) == 1 and "float16 or torch.bfloat16" in msgs[0], msgs
    expected = kept_tokens_per_row(q, k, v, keep_k[:, 90 - nq:], keep_k, is_causal, sdpa_bottom_right)
    torch.testing.assert_close(out[0], expected.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_transformers_attention_rejects_unsupported(ai8):
    q, k, v = qkv(1, 4, 4, 8, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        ai8.transformers_attention(None, q, k, v, None, sliding_window=4)
    with pytest.raises(ValueError, match="\\[B, Nkv\\]"):
        ai8.transformers_attention(None, q, k, v, torch.ones(1, 9))


# ---------------------------------------------------------------------------------------------------------------
# GPU numbers
# ---------------------------------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("kind", ["right", "left", "holes"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_key_padding_mask_kernel_matches_float64(ai8, layers, kind, dtype):
    q, k, v = qkv(3, 8, 2, 200, 300, 128, dtype, "cuda")
    keep = keep_mask(kind, 3, 300).cuda()
    out, msgs = recording_fallbacks(layers.int8_scaled_dot_product_attention, q, k, v, attn_mask=keep[:, None, None],
                                    enable_gqa=True)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep[:, None, None],
                                           enable_gqa=True)
    assert msgs == []
    assert_accurate(out, exact, f"{kind} {dtype}")


@requires_cuda
@pytest.mark.parametrize("is_causal", [False, True])
def test_padding_masks_run_one_varlen_call(ai8, layers, is_causal):
    """Both padding-mask entry points give the varlen op's result on the packed kept tokens, bit for bit."""
    q, k, v = qkv(3, 8, 2, 200, 200, 128, torch.bfloat16, "cuda")
    mask = transformers_padding_mask(3, 200).cuda()
    mask[0, 150:170] = 0  # a hole
    keep = mask.bool()
    pack = lambda t: t.transpose(1, 2)[keep]  # [total, H, D]
    cu = torch.zeros(4, dtype=torch.int32, device="cuda")
    cu[1:] = keep.sum(dim=-1).cumsum(0)
    longest = int(keep.sum(dim=-1).max())
    packed = ai8.int8_attention_varlen(pack(q), pack(k), pack(v), cu, cu, longest, longest, is_causal=is_causal)
    out, msgs = recording_fallbacks(ai8.transformers_attention, None, q, k, v, mask, is_causal=is_causal)
    assert msgs == [] and torch.equal(out[0][keep], packed) and not out[0][~keep].any()
    if not is_causal:  # SDPA takes no mask with is_causal; its queries are all kept
        out, msgs = recording_fallbacks(layers.int8_scaled_dot_product_attention, q, k, v,
                                        attn_mask=keep[:, None, None], enable_gqa=True)
        cu_q = torch.arange(4, dtype=torch.int32, device="cuda") * 200
        expected = ai8.int8_attention_varlen(q.transpose(1, 2).reshape(600, 8, 128), pack(k), pack(v), cu_q, cu,
                                             200, longest)
        assert msgs == [] and torch.equal(out, expected.view(3, 200, 8, 128).transpose(1, 2))


@requires_cuda
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_sageattn_kernel_matches_float64(ai8, layout):
    q, k, v = qkv(2, 8, 2, 300, 300, 128, torch.float16, "cuda")
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out, lse = ai8.sageattn(q, k, v, tensor_layout=layout, is_causal=True, return_lse=True)
    exact, exact_lse = ai8.reference.attention_float64(q, k, v, is_causal=True, tensor_layout=layout,
                                                       return_lse=True)
    assert_accurate(out, exact, f"sageattn {layout}")
    assert (lse - exact_lse).abs().max().item() <= 0.1
    assert torch.equal(out, ai8.int8_attention_forward(q, k, v, is_causal=True, tensor_layout=layout))


@requires_cuda
@pytest.mark.filterwarnings("ignore:.*kept in float32")
def test_wan_on_sage_hub_backend_and_processor_match_float64(ai8, layers, sage_hub):
    model, inputs = tiny_wan("cuda")
    exact = run_model(model, inputs, torch.float64)
    backend_model = copy.deepcopy(model)
    backend_model.set_attention_backend("sage_hub")
    processor_model = copy.deepcopy(model)
    processor_model.set_attn_processor(layers.Int8AttnProcessor())
    for name, m in (("sage_hub backend", backend_model), ("Int8AttnProcessor", processor_model)):
        out, msgs = recording_fallbacks(run_model, m, inputs, torch.bfloat16)
        assert msgs == []
        assert_accurate(out, exact, f"Wan I2V, {name}")


@requires_cuda
def test_llama_padded_batch_on_kernel(ai8, monkeypatch):
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(AttentionMaskInterface, "_global_mapping", dict(AttentionMaskInterface._global_mapping))
    AttentionInterface.register("int8", ai8.transformers_attention)
    AttentionMaskInterface.register("int8", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    int8_model = tiny_llama("int8", torch.float16).cuda()
    exact_model = tiny_llama("sdpa", torch.float64, int8_model.state_dict()).cuda()
    ids = torch.randint(0, 256, (3, 300), device="cuda")
    mask = torch.ones(3, 300, dtype=torch.long, device="cuda")
    mask[1, 250:] = 0
    mask[2, :77] = 0
    with torch.no_grad():
        logits, msgs = recording_fallbacks(lambda: int8_model(input_ids=ids, attention_mask=mask).logits)
        exact = exact_model(input_ids=ids, attention_mask=mask).logits
    kept = mask.bool()
    assert msgs == []
    m = metrics(logits[kept], exact[kept])
    assert m["cos"] >= COS_MIN and m["rel_l1"] <= REL_L1_MAX, m
