"""flash_attn_func / flash_attn_varlen_func: FlashAttention 2's interface, the one transformers' hub-kernel path calls.

The CPU tests run the CPU reference behind both functions; the model tests load this build through transformers' own
hub-kernel path (an offline hub cache, in a subprocess) with attn_implementation set to the hub string."""

import json
import os
import subprocess
import sys

import pytest
import torch

from _helpers import COS_MIN, REL_L1_MAX, assert_accurate, metrics
from _hub_cache import hub_cache
from conftest import BUILD_DIR, requires_cuda
from test_varlen import cu_seqlens, packed, per_sequence

REPO_ID = "your-namespace/attention-int8"


def nhd(b, hq, hkv, nq, nkv, d=64, dtype=torch.bfloat16):
    return (torch.randn(b, nq, hq, d, dtype=dtype), torch.randn(b, nkv, hkv, d, dtype=dtype),
            torch.randn(b, nkv, hkv, d, dtype=dtype))


# ---------------------------------------------------------------------------------------------------------------
# The functions on CPU tensors (the reference)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_on_cpu_is_the_reference(ai8, causal):
    q, k, v = nhd(2, 4, 2, 70, 130)
    out, lse, probs = ai8.flash_attn_func(q, k, v, softmax_scale=0.1, causal=causal, deterministic=True,
                                          return_attn_probs=True)
    ref, ref_lse = ai8.reference.int8_attention_reference(q, k, v, is_causal=causal, sm_scale=0.1,
                                                          tensor_layout="NHD", return_lse=True)
    assert probs is None and lse.shape == (2, 4, 70)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    exact = ai8.reference.attention_float64(q, k, v, is_causal=causal, sm_scale=0.1, tensor_layout="NHD")
    assert_accurate(out, exact, f"flash_attn_func causal={causal}")
    assert torch.equal(ai8.flash_attn_func(q, k, v, softmax_scale=0.1, causal=causal), out)


def test_flash_attn_varlen_func_on_cpu_is_the_reference(ai8):
    lengths_q, lengths_k = [40, 1, 0, 90], [40, 75, 3, 90]
    (q, k, v), (cu_q, cu_k, max_q, max_k) = packed(lengths_q, lengths_k, dtype=torch.bfloat16)
    # transformers passes the maximum lengths as one-element tensors for packed sequences
    out, lse, probs = ai8.flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(max_q), max_k, causal=True,
                                                 return_attn_probs=True)
    ref, ref_lse = per_sequence(ai8.reference.int8_attention_reference, q, k, v, cu_q, cu_k, True)
    assert probs is None and lse.shape == (4, sum(lengths_q))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    exact, _ = per_sequence(ai8.reference.attention_float64, q, k, v, cu_q, cu_k, True)
    assert_accurate(out, exact, "flash_attn_varlen_func")


def test_flash_attn_varlen_func_checks_like_the_op(ai8):
    (q, k, v), (cu_q, cu_k, max_q, max_k) = packed([3, 5], [4, 6], dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.int32"):
        ai8.flash_attn_varlen_func(q, k, v, cu_q, cu_k.long(), max_q, max_k)
    with pytest.raises(ValueError, match="max_seqlen_k \\(5\\) is less than the longest sequence \\(6\\)"):
        ai8.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, torch.tensor(5))
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        ai8.flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(5.0), max_k)
    with pytest.raises(TypeError, match="float16 or torch.bfloat16"):
        ai8.flash_attn_func(*(t[None].float() for t in (q, k, v)))


UNSUPPORTED = {
    "dropout_p": 0.1,
    "window_size": (15, 15),
    "softcap": 50.0,
    "alibi_slopes": torch.ones(4),
    "s_aux": torch.zeros(4),
}


@pytest.mark.parametrize("name", [*UNSUPPORTED, "block_table"])
def test_unsupported_options_raise_naming_them(ai8, name):
    (q, k, v), args = packed([3, 5], [4, 6], dtype=torch.bfloat16)
    value = UNSUPPORTED.get(name, torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=f"^{name} must be"):
        ai8.flash_attn_varlen_func(q, k, v, *args, **{name: value})
    if name != "block_table":  # flash_attn_func has no paged KV cache, as in FlashAttention
        with pytest.raises(ValueError, match=f"^{name} must be"):
            ai8.flash_attn_func(q[None], k[None], v[None], **{name: value})


def test_transformers_passes_only_keywords_both_functions_take(ai8):
    """transformers reads flash_attn_varlen_func's signature to decide which keywords it passes to both functions;
    every one it would pass must be a parameter of each, with FlashAttention's name."""
    fa_utils = pytest.importorskip("transformers.modeling_flash_attention_utils")
    process = fa_utils._lazy_define_process_function(ai8.flash_attn_varlen_func)
    supports = process.keywords["supports_mapping"]
    assert all(supports[n] for n in ("dropout_p", "window_size", "softcap", "deterministic", "s_aux", "block_table",
                                     "max_seqlen_q", "max_seqlen_k"))
    kwargs = process(query_length=50, key_length=50, is_causal=True, sliding_window=16, softcap=30.0,
                     s_aux=torch.zeros(4), softmax_scale=0.125)
    q, k, v = nhd(1, 4, 4, 50, 50)
    with pytest.raises(ValueError, match="^window_size must be"):
        ai8.flash_attn_func(q, k, v, **kwargs)  # every keyword accepted; the first unsupported value named
    plain = process(query_length=50, key_length=50, is_causal=True, softmax_scale=0.125, max_seqlen_q=50,
                    max_seqlen_k=50)
    cu = cu_seqlens([50])
    out = ai8.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, **plain)
    assert torch.equal(out, ai8.flash_attn_func(q, k, v, causal=True, softmax_scale=0.125)[0])


# ---------------------------------------------------------------------------------------------------------------
# A tiny Llama through transformers' hub-kernel path (offline hub cache, subprocess: the hub paths are read at import)
# ---------------------------------------------------------------------------------------------------------------

# Builds the models, runs the cases and saves the logits; prints what transformers wired up.
RUN_MODELS = r"""
import copy, json, os, sys
import torch, transformers
import transformers.modeling_flash_attention_utils as fa_utils
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

torch.manual_seed(0)
name, device = os.environ["ATTN_IMPLEMENTATION"], os.environ["DEVICE"]
config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  max_position_embeddings=256)
# from_config sets attn_implementation on the config it is given: each model gets its own
int8 = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name,
                                                    dtype=torch.bfloat16).eval().to(device)
wired = {"attention": ALL_ATTENTION_FUNCTIONS[name].__name__,
         "flash_fn": f"{fa_utils._flash_fn.__module__}.{fa_utils._flash_fn.__name__}",
         "varlen_fn": f"{fa_utils._flash_varlen_fn.__module__}.{fa_utils._flash_varlen_fn.__name__}"}
models = {"int8": int8}
for key, dtype in (("exact", torch.float64), ("sdpa", torch.bfloat16)):
    models[key] = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                                                dtype=dtype).eval().to(device)
    models[key].load_state_dict(int8.state_dict())

ids = torch.randint(0, 256, (3, 40), device=device)
padded = torch.ones(3, 40, dtype=torch.long, device=device)
padded[1, 30:] = 0  # right padding
padded[2, :13] = 0  # left padding
left = torch.ones(3, 40, dtype=torch.long, device=device)
left[1, :9] = 0
left[2, :20] = 0
packed_positions = torch.cat([torch.arange(25), torch.arange(15)])[None].to(device)
results = {}
with torch.no_grad():
    for key, model in models.items():
        # a padded batch (varlen), a batch without padding (flash_attn_func), and 4 new tokens after a 36-token
        # prefill of a left-padded batch, through the KV cache (varlen with Nq < Nkv)
        cache = model(input_ids=ids[:, :36], attention_mask=left[:, :36], use_cache=True).past_key_values
        results[key] = {
            "padded": model(input_ids=ids, attention_mask=padded).logits,
            "unpadded": model(input_ids=ids).logits,
            "decode": model(input_ids=ids[:, 36:], attention_mask=left, past_key_values=cache).logits,
        }
        # two sequences packed in one row, told apart by position_ids (varlen); transformers' SDPA does not read
        # packing from position_ids, so the references run the sequences one at a time
        results[key]["packed"] = model(input_ids=ids[:1], position_ids=packed_positions).logits if key == "int8" \
            else torch.cat([model(input_ids=ids[:1, :25]).logits, model(input_ids=ids[:1, 25:]).logits], dim=1)
keep = {"padded": padded.bool(), "unpadded": torch.ones(3, 40, dtype=torch.bool), "decode": left[:, 36:].bool(),
        "packed": torch.ones(1, 40, dtype=torch.bool)}
torch.save({"results": {m: {c: t.cpu() for c, t in r.items()} for m, r in results.items()},
            "keep": {c: t.cpu() for c, t in keep.items()}}, os.environ["OUT"])

mistral = transformers.MistralConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16)
windowed = transformers.AutoModelForCausalLM.from_config(mistral, attn_implementation=name, dtype=torch.bfloat16)
windowed.to(device)
try:
    windowed(input_ids=ids)
    wired["sliding_window"] = "ran"
except ValueError as error:
    wired["sliding_window"] = str(error)
wired["int8_implementation"] = int8.config._attn_implementation
print(json.dumps(wired))
"""


@pytest.fixture(scope="module")
def offline_hub(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("kernels", reason="the kernels package is not installed")
    env = {**os.environ, **hub_cache(tmp_path_factory.mktemp("hub"), REPO_ID, BUILD_DIR),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("LOCAL_KERNELS", None)
    return env


@pytest.mark.parametrize("attn_implementation, device", [
    (REPO_ID, "cpu"), (f"{REPO_ID}:flash_attn_varlen_func", "cpu"), (f"{REPO_ID}@v1", "cpu"),
    pytest.param(REPO_ID, "cuda", marks=requires_cuda)])
def test_llama_on_the_hub_string_matches_float64(offline_hub, tmp_path, attn_implementation, device):
    """CPU: the reference behind the functions; CUDA: the kernel."""
    out = tmp_path / "logits.pt"
    env = {**offline_hub, "ATTN_IMPLEMENTATION": attn_implementation, "DEVICE": device, "OUT": str(out)}
    result = subprocess.run([sys.executable, "-c", RUN_MODELS], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    wired = json.loads(result.stdout.splitlines()[-1])
    package = json.loads((BUILD_DIR / "metadata.json").read_text())["id"]  # the name kernels imports the build as
    assert wired["int8_implementation"] == attn_implementation
    assert wired["attention"] == "flash_attention_forward"  # transformers' FlashAttention wrapper
    assert wired["flash_fn"] == f"{package}._api.flash_attn_func"
    assert wired["varlen_fn"] == f"{package}._api.flash_attn_varlen_func"
    assert wired["sliding_window"].startswith("window_size must be (-1, -1)"), wired["sliding_window"]

    saved = torch.load(out)
    results, keep = saved["results"], saved["keep"]
    for case, kept in keep.items():
        int8, exact, sdpa = (results[m][case][kept] for m in ("int8", "exact", "sdpa"))
        m = metrics(int8, exact)
        assert m["cos"] >= COS_MIN and m["rel_l1"] <= REL_L1_MAX, (case, m)
        assert metrics(sdpa, exact)["cos"] >= COS_MIN, case  # the bar is one bf16 SDPA meets
        assert not torch.equal(int8, sdpa), case  # the INT8 functions ran, not SDPA


@requires_cuda
def test_functions_on_cuda_are_the_ops(ai8):
    q, k, v = (t.cuda() for t in nhd(2, 8, 2, 300, 300, d=128))
    out, lse, _ = ai8.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref, ref_lse = ai8.int8_attention_forward(q, k, v, is_causal=True, tensor_layout="NHD", return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    (q, k, v), (cu_q, cu_k, max_q, max_k) = packed([200, 1, 77], [200, 130, 77], dtype=torch.float16, device="cuda")
    out = ai8.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, softmax_scale=0.1)
    assert torch.equal(out, ai8.int8_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True,
                                                      sm_scale=0.1))
