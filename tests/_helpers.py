"""Shared test helpers: accuracy metrics, input makers, output poisoning and the per-case kernel check."""

import dataclasses
import math

import pytest
import torch

# Accuracy of the INT8 scheme against exact float64 attention. Measured with the reference over the grid of
# tests/test_reference.py (standard normal inputs, N up to 1k, D 64-128, fp16/bf16): cos >= 0.99988,
# rel L1 <= 0.016, LSE within 0.054. The LSE's worst rows are causal rows that see a few keys: their LSE is
# little more than one logit, whose INT8 error no sum averages out (with per-token K scales instead of
# K's 64-key blocks the grid measured rel L1 <= 0.013 and LSE within 0.016). Inputs with a shared offset
# in Q ("q_shift") are the hardest: one query row against 8192 keys measures rel L1 0.016 on average, and
# 13 of 300 draws of 2 such rows (256 outputs) exceeded 0.02 (per-token K: 0.013 on average, 1 of 100
# draws above), so the GPU grid gives every case at least 16 query rows (reference: 0.0157 on average,
# at most 0.0184 in 100 draws of 16 rows).
COS_MIN = 0.9995
REL_L1_MAX = 0.02
LSE_ATOL = 0.1


def lse_ref_atol(dtype):
    """Kernel vs reference LSE. The reference (and the portable kernel) sum the fp32 P; the Hopper kernel sums
    on the tensor cores the P it rounded to the input dtype for P.V, each within half an ulp (eps / 2,
    relative), so ln(l) may differ by up to eps / 2. Beyond that only fp32 reassociation and rare INT8 ties
    differ (a CPU emulation of the online kernel: <= 5e-5), within 1e-3."""
    return 1e-3 + torch.finfo(dtype).eps / 2

KINDS = ("normal", "k_offset", "q_shift")

# SUPPORTED_HEAD_DIMS (test_errors.py holds the two equal), spelled out so that test ids need no package import.
HEAD_DIMS = (64, 80, 96, 128, 256)

# The binding runs the Hopper (wgmma) kernel on compute capability 9.0 (D = 96 on rows padded to 128) and the
# portable mma.sync kernel otherwise; ATTENTION_INT8_FORCE_PORTABLE=1 (read per call) forces the portable one.
KERNELS = ("auto", "portable")


def select_kernel(monkeypatch, kernel):
    monkeypatch.setenv("ATTENTION_INT8_FORCE_PORTABLE", "1" if kernel == "portable" else "0")


def kernel_params(cases):
    """pytest params (case, kernel) for every case and both kernel choices (on GPUs other than Hopper both are the
    portable kernel)."""
    return [pytest.param(case, kernel, id=f"{case}-{kernel}") for case in cases for kernel in KERNELS]


def metrics(out, ref):
    """Cosine similarity, relative L1 (sum|o - r| / sum|r|) and max abs error, in float64."""
    o, r = out.double().flatten(), ref.double().flatten()
    o_norm, r_norm, r_l1 = o.norm().item(), r.norm().item(), r.abs().sum().item()
    err = (o - r).abs()
    # An all-zero reference (every row masked) is matched only by an all-zero output.
    cos = (o @ r).item() / (o_norm * r_norm) if o_norm * r_norm > 0 else float(o_norm == r_norm)
    rel_l1 = err.sum().item() / r_l1 if r_l1 > 0 else (0.0 if err.sum().item() == 0 else math.inf)
    return {"cos": cos, "rel_l1": rel_l1, "max_abs": err.max().item() if err.numel() else 0.0}


def accuracy_failures(out, exact, what=""):
    """Why `out` is not an accurate INT8 attention result against the float64 `exact` ([] if it is)."""
    if not torch.isfinite(out).all():
        return [f"{what}: non-finite output"]
    m = metrics(out, exact)
    if m["cos"] >= COS_MIN and m["rel_l1"] <= REL_L1_MAX:
        return []
    return [f"{what}: cos {m['cos']:.6f} (min {COS_MIN}), rel L1 {m['rel_l1']:.4f} (max {REL_L1_MAX})"]


def assert_accurate(out, exact, what=""):
    failures = accuracy_failures(out, exact, what)
    assert not failures, failures[0]


def reference_bound(v, dtype):
    """Largest |kernel - reference| the scheme allows for one output element.

    Kernel and reference quantize to the same INT8 values (up to rare +-1 ties where the K means differ
    in the last fp32 bit) and compute the same fp32 logits. What remains: the kernel rounds P to the
    input dtype at a running row max and rescales, the reference at the final max; each weight is then
    within half an ulp (eps / 2, relative) of exact, so the weights differ by <= eps; the Hopper kernel
    divides by the sum of its rounded P (tensor cores), within eps / 2 of the fp32 sum: <= 1.5 eps, and the
    output by <= 1.5 eps * max|v| (softmax weights sum to 1). Rounding the two fp32 outputs to the dtype
    adds at most one more ulp <= eps * max|v|. A CPU emulation of the online kernel stays within
    0.2 * eps * max|v|.
    """
    return 3 * torch.finfo(dtype).eps * v.abs().max().item()


def reference_failures(out, ref, v, what=""):
    bound = reference_bound(v, out.dtype)
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    return [] if err <= bound else [f"{what}: max |kernel - reference| {err:.3e} > bound {bound:.3e}"]


def lse_failures(lse, ref_lse, atol, what=""):
    """LSE must match including its infinities (-inf for rows without a visible key)."""
    same_inf = torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    err = (lse.double() - ref_lse.double())[finite].abs().max().item() if finite.any() else 0.0
    if same_inf and torch.isfinite(lse[finite]).all() and err <= atol:
        return []
    return [f"{what}: LSE max error {err:.3e} (atol {atol:.1e}), -inf rows match: {same_inf}"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem. `kind`: "normal" (standard normal q, k, v), "k_offset" (K plus a per-channel
    offset 10 * randn(D) shared by all keys: what smoothing is for) or "q_shift" (Q plus randn(D))."""

    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    seqlen_q: int = 128
    seqlen_kv: int = 128
    head_dim: int = 64
    is_causal: bool = False
    dtype: torch.dtype = torch.float16
    layout: str = "HND"
    kind: str = "normal"

    def __str__(self):
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"B{self.batch}-H{self.heads_q}/{self.heads_kv}-N{self.seqlen_q}/{self.seqlen_kv}-D{self.head_dim}"
                f"{'-causal' if self.is_causal else ''}-{dtype}-{self.layout}-{self.kind}")


def to_layout(x_hnd, layout):
    """A dense tensor in `layout` holding the values of x_hnd [B, H, N, D]."""
    return x_hnd if layout == "HND" else x_hnd.transpose(1, 2).contiguous()


def make_qkv(case, device="cpu", generator=None):
    """Fresh q, k, v for `case`, dense in its layout (pass a seeded `generator` to reproduce them)."""
    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    b, d = case.batch, case.head_dim
    q = randn(b, case.heads_q, case.seqlen_q, d)
    k = randn(b, case.heads_kv, case.seqlen_kv, d)
    v = randn(b, case.heads_kv, case.seqlen_kv, d)
    if case.kind == "k_offset":
        k = k + 10 * randn(b, case.heads_kv, 1, d)
    elif case.kind == "q_shift":
        q = q + randn(b, case.heads_q, 1, d)
    elif case.kind != "normal":
        raise ValueError(f"unknown input kind {case.kind!r}")
    return tuple(to_layout(t.to(case.dtype), case.layout) for t in (q, k, v))


def activation_inputs(k_outliers=0, q_offset=0, seqlen=1024, rows=256, head_dim=128, device="cpu", generator=None):
    """Fresh fp16 q [1, 2, rows, D], k, v [1, 2, seqlen, D] of real activations' two hard classes (issue 46):
    K with 4 random outlier channels `k_outliers` times the others' scale, and Q plus a shared offset of
    `q_offset` * randn(D) (0: that class off)."""
    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    q, k, v = randn(1, 2, rows, head_dim), randn(1, 2, seqlen, head_dim), randn(1, 2, seqlen, head_dim)
    if k_outliers:
        k[..., torch.randperm(head_dim, generator=generator, device=device)[:4]] *= k_outliers
    if q_offset:
        q = q + q_offset * randn(1, 2, 1, head_dim)
    return q.half(), k.half(), v.half()


CENTER_KINDS = ("k_offset", "sinks", "ties", "inf", "nan")


def center_inputs(ai8, kind, seqlen=4096, head_dim=128, dtype=torch.float16, device="cpu"):
    """Fresh K [2, 3, seqlen, head_dim] with a channel offset shared by its keys, plus one feature of its centre
    (reference.key_center) in every head: "sinks" makes as many sampled keys 20x larger as the centre leaves
    out, "ties" copies the largest sampled key over the 5 largest (ties keep them all), "inf" / "nan" puts one
    non-finite value in a sampled key."""
    k = torch.randn(2, 3, seqlen, head_dim, device=device) + 10 * torch.randn(2, 3, 1, head_dim, device=device)
    sample = ai8.reference.center_sample(seqlen)
    n = len(sample)
    far = sample[torch.randperm(n)[: max(1, n // ai8.reference.CENTER_TRIM_DIVISOR)]]
    if kind == "sinks":
        k[:, :, far] *= 20
    elif kind == "ties":
        k[:, :, sample[-5:]] = 30 * k[:, :, sample[:1]]
    elif kind in ("inf", "nan"):
        k[:, :, far[0], head_dim // 3] = math.inf if kind == "inf" else math.nan
    elif kind != "k_offset":
        raise ValueError(f"unknown centre input kind {kind!r}")
    return k.to(dtype)


def poison_like(t):
    """A tensor like t filled with NaN: any element a kernel fails to write stays visibly wrong."""
    return torch.full_like(t, math.nan)


def check_case(ai8, case, generator=None):
    """Run the op on `case` (CUDA) and return every way it disagrees with the references ([] if none)."""
    q, k, v = make_qkv(case, "cuda", generator)
    kwargs = dict(is_causal=case.is_causal, tensor_layout=case.layout, return_lse=True)
    out, lse = ai8.int8_attention_forward(q, k, v, **kwargs)
    ref, ref_lse = ai8.reference.int8_attention_reference(q, k, v, **kwargs)
    exact, exact_lse = ai8.reference.attention_float64(q, k, v, **kwargs)
    what = str(case)
    failures = []
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        failures.append(f"{what}: output {tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}")
    failures += accuracy_failures(out, exact, what)
    failures += reference_failures(out, ref, v, what)
    failures += lse_failures(lse, ref_lse, lse_ref_atol(case.dtype), what + " vs reference")
    failures += lse_failures(lse, exact_lse, LSE_ATOL, what + " vs float64")
    return failures


def check_quantize(ai8, x, mean=None, out_scale=1.0, layout="HND", tokens_per_scale=1):
    """The quantizer op against the reference: deterministic fp32 arithmetic on both sides (IEEE division,
    round-half-even, the same mean tensor), so int8 values and scales must be bit-identical."""
    x_q, scale = ai8.quantize_int8(x, mean, out_scale=out_scale, tensor_layout=layout, tokens_per_scale=tokens_per_scale)
    ref_q, ref_scale = ai8.reference.quantize_int8(x if layout == "HND" else x.transpose(1, 2), mean, out_scale,
                                                   tokens_per_scale)
    what = f"quantize {tuple(x.shape)} {layout} mean={mean is not None} tokens_per_scale={tokens_per_scale}"
    failures = []
    if x_q.shape != ref_q.shape or x_q.dtype != torch.int8 or scale.dtype != torch.float32:
        failures.append(f"{what}: got {tuple(x_q.shape)} {x_q.dtype}, {scale.dtype}")
    elif not (torch.equal(x_q, ref_q) and torch.equal(scale, ref_scale)):
        failures.append(f"{what}: {(x_q != ref_q).sum().item()} int8 values and "
                        f"{(scale != ref_scale).sum().item()} scales differ")
    return failures


# Small and odd shapes: single rows, tails of the 128-row query tile and 64-key tile, Nq > Nkv under the
# causal mask (rows with no key), GQA/MQA, both layouts, every head dim and dtype. Used by the GPU sweep
# and by tests/sanitizer_cases.py (compute-sanitizer).
ODD_CASES = (
    Case(heads_q=1, heads_kv=1, seqlen_q=1, seqlen_kv=1),
    Case(seqlen_q=1, seqlen_kv=200, head_dim=96, dtype=torch.bfloat16),
    Case(seqlen_q=65, seqlen_kv=65, head_dim=128, is_causal=True),
    Case(seqlen_q=129, seqlen_kv=129, is_causal=True, layout="NHD", dtype=torch.bfloat16),
    Case(seqlen_q=200, seqlen_kv=65, is_causal=True, head_dim=96),
    Case(seqlen_q=129, seqlen_kv=1, is_causal=True, head_dim=128, layout="NHD"),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=65, seqlen_kv=129, head_dim=128, layout="NHD"),
    Case(batch=2, heads_q=3, heads_kv=1, seqlen_q=200, seqlen_kv=200, is_causal=True, dtype=torch.bfloat16),
    Case(heads_q=4, heads_kv=1, seqlen_q=64, seqlen_kv=129, head_dim=96, layout="NHD", kind="k_offset"),
    Case(seqlen_q=65, seqlen_kv=129, head_dim=256, is_causal=True, dtype=torch.bfloat16),
    Case(heads_q=2, heads_kv=1, seqlen_q=129, seqlen_kv=65, head_dim=80, is_causal=True, kind="q_shift"),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_kv=77, head_dim=256, layout="NHD", kind="k_offset"),
)


# Split-KV, the Hopper kernel's (elsewhere these run unsplit): ATTENTION_INT8_KV_SPLITS=n splits every non-causal
# tile's key tiles (64 keys) n ways. 1000 keys = 16 tiles (uneven thirds; the masked tail in the last split),
# 200 = 4 (one tile a split at n = 4), 130 = 3 (n = 4 capped at 3); causal attention is never split. D = 96: the
# combine's rows of 24 threads straddle its 128-thread blocks; D = 256: a block holds 2 rows of 64.
KV_SPLIT_CASES = [
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_kv=1000, head_dim=128),
    Case(heads_q=8, heads_kv=1, seqlen_q=129, seqlen_kv=200, head_dim=64, dtype=torch.bfloat16, layout="NHD",
         kind="k_offset"),
    Case(heads_q=2, heads_kv=2, seqlen_q=16, seqlen_kv=130, head_dim=128, dtype=torch.bfloat16, kind="q_shift"),
    Case(batch=2, heads_q=4, heads_kv=4, seqlen_q=500, seqlen_kv=700, head_dim=64, is_causal=True),
    Case(batch=2, heads_q=3, heads_kv=3, seqlen_q=200, seqlen_kv=777, head_dim=96, layout="NHD", kind="k_offset"),
    Case(heads_q=4, heads_kv=2, seqlen_q=130, seqlen_kv=500, head_dim=256, dtype=torch.bfloat16),
]
