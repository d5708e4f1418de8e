"""int8_attention_varlen: argument checks (CPU) and, on a GPU, accuracy against per-sequence references."""

import math

import pytest
import torch

from _helpers import LSE_ATOL, accuracy_failures, lse_failures, reference_failures
from conftest import requires_cuda


def cu_seqlens(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed(lengths_q, lengths_k, heads_q=4, heads_kv=2, head_dim=64, dtype=torch.float16, device="cpu"):
    """Fresh packed q [sum Nq, Hq, D], k, v [sum Nk, Hkv, D], with K channel offsets that differ per sequence (so a
    centre shared across sequences would show), and the varlen arguments."""
    q = torch.randn(sum(lengths_q), heads_q, head_dim, device=device)
    k = torch.randn(sum(lengths_k), heads_kv, head_dim, device=device)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim, device=device)
    offsets = cu_seqlens(lengths_k).tolist()
    for a, b in zip(offsets, offsets[1:]):
        k[a:b] += 5 * torch.randn(1, heads_kv, head_dim, device=device)
    args = (cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device), max(lengths_q, default=0),
            max(lengths_k, default=0))
    return (q.to(dtype), k.to(dtype), v.to(dtype)), args


def per_sequence(dense, q, k, v, cu_q, cu_k, is_causal, **kwargs):
    """The varlen result composed from a dense reference: (out [total_q, Hq, D], lse [Hq, total_q])."""
    outs, lses = [], []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bounds_q) - 1):
        qs, ks, vs = (t[lo:hi].transpose(0, 1)[None] for t, lo, hi in (
            (q, bounds_q[b], bounds_q[b + 1]), (k, bounds_k[b], bounds_k[b + 1]), (v, bounds_k[b], bounds_k[b + 1])))
        out, lse = dense(qs, ks, vs, is_causal=is_causal, return_lse=True, **kwargs)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# Argument checks (before any device work, so they run on CPU)
# ---------------------------------------------------------------------------------------------------------------

def _replace(index, value):
    def build():
        (q, k, v), (cu_q, cu_k, max_q, max_k) = packed([3, 5], [4, 6])
        args = [q, k, v, cu_q, cu_k, max_q, max_k]
        args[index] = value(args[index]) if callable(value) else value
        return args
    return build


BAD_ARGS = {
    "q_4d": (_replace(0, lambda q: q[None]), ValueError, "3-D packed tensor"),
    "k_not_tensor": (_replace(1, 3.0), TypeError, "k must be a torch.Tensor"),
    "float32": (_replace(0, lambda q: q.float()), TypeError, "one dtype"),
    "heads": (_replace(0, lambda q: q[:, :3]), ValueError, "multiple of the number of k/v heads"),
    "head_dim": (_replace(0, lambda q: torch.randn(8, 4, 72, dtype=torch.float16)), ValueError, "head_dim"),
    "cu_int64": (_replace(3, lambda cu: cu.long()), TypeError, "cu_seqlens_q must be a torch.int32"),
    "cu_list": (_replace(4, [0, 4, 10]), TypeError, "cu_seqlens_k must be a torch.Tensor"),
    "cu_2d": (_replace(3, lambda cu: cu[None]), ValueError, "1-D tensor"),
    "cu_device": (_replace(3, lambda cu: cu.to("meta")), ValueError, "device of q"),
    "cu_first": (_replace(3, lambda cu: cu + 1), ValueError, "start at 0"),
    "cu_decreasing": (_replace(4, lambda cu: torch.tensor([0, 7, 6, 10], dtype=torch.int32)), ValueError,
                      "non-decreasing"),
    "cu_last": (_replace(4, lambda cu: torch.tensor([0, 4, 9], dtype=torch.int32)), ValueError, "end at"),
    "batch": (_replace(4, lambda cu: torch.tensor([0, 4, 6, 10], dtype=torch.int32)), ValueError,
              "same number of sequences"),
    "max_small": (_replace(6, 5), ValueError, "max_seqlen_k (5) is less than the longest sequence (6)"),
    "max_float": (_replace(5, 5.0), TypeError, "max_seqlen_q must be an int"),
    "cpu": (_replace(5, 5), ValueError, "runs on CUDA tensors"),
}


@pytest.mark.parametrize("case", BAD_ARGS)
def test_bad_arguments_raise(ai8, case):
    build, error, phrase = BAD_ARGS[case]
    with pytest.raises(error) as info:
        ai8.int8_attention_varlen(*build())
    assert phrase in str(info.value)


def test_meta_shapes(ai8):
    q, k, v = (torch.empty(n, h, 128, dtype=torch.bfloat16, device="meta") for n, h in ((9, 8), (13, 2), (13, 2)))
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = ai8.int8_attention_varlen(q, k, v, cu, cu, 8, 8, is_causal=True, return_lse=True)
    assert out.shape == (9, 8, 128) and out.dtype == torch.bfloat16 and lse.shape == (8, 9)
    assert lse.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# Numbers (CUDA)
# ---------------------------------------------------------------------------------------------------------------

# (lengths of q, lengths of k, causal, head dim, dtype): tails of the 64-key blocks, an empty query sequence, an
# empty key sequence (its rows output 0), Nq > Nk under the causal mask, GQA.
VARLEN_CASES = [
    ([100, 1, 257, 64], [100, 1, 257, 64], True, 128, torch.float16),
    ([37, 0, 200], [300, 65, 129], False, 64, torch.bfloat16),
    ([65, 130], [33, 130], True, 96, torch.float16),
    ([16, 48, 20], [0, 500, 70], False, 128, torch.bfloat16),
]


@requires_cuda
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_varlen_matches_per_sequence_references(ai8, case):
    lengths_q, lengths_k, causal, head_dim, dtype = case
    (q, k, v), (cu_q, cu_k, max_q, max_k) = packed(lengths_q, lengths_k, 8, 2, head_dim, dtype, "cuda")
    q_poisoned = torch.full((q.shape[0] + 64, *q.shape[1:]), math.nan, dtype=dtype, device="cuda")
    q_poisoned[:q.shape[0]] = q  # reads past the packed q would bring NaN in
    out, lse = ai8.int8_attention_varlen(q_poisoned[:q.shape[0]], k, v, cu_q, cu_k, max_q, max_k, is_causal=causal,
                                         return_lse=True)
    ref, ref_lse = per_sequence(ai8.reference.int8_attention_reference, q, k, v, cu_q, cu_k, causal)
    exact, exact_lse = per_sequence(ai8.reference.attention_float64, q, k, v, cu_q, cu_k, causal)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (q.shape[1], q.shape[0])
    failures = accuracy_failures(out, exact, "vs float64") + reference_failures(out, ref, v, "vs reference")
    failures += lse_failures(lse, exact_lse, LSE_ATOL, "LSE vs float64")
    assert not failures, failures
    # Each sequence is its own problem: the packed result equals the dense op on that sequence alone.
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    b = len(lengths_q) - 1
    alone = ai8.int8_attention_forward(q[None, bounds_q[b]:], k[None, bounds_k[b]:], v[None, bounds_k[b]:],
                                       is_causal=causal, tensor_layout="NHD")
    assert torch.equal(out[bounds_q[b]:], alone[0])


@requires_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sequences_stay_apart(ai8, head_dim):
    """A non-finite key or value of one sequence reaches no other sequence's rows (its key block is its own, and the
    V rows after a sequence's last key are not multiplied into it), while that sequence's own rows turn NaN."""
    lengths = [70, 50, 90]
    (q, k, v), (cu_q, cu_k, max_q, max_k) = packed(lengths, lengths, 4, 2, head_dim, torch.float16, "cuda")
    k[70, 1, 3] = math.inf  # sequence 1's first key: inside sequence 0's last 64-key block if blocks straddled
    v[71, 0, 5] = math.nan  # read into sequence 0's last key tile if its rows past the end were used
    out = ai8.int8_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    for b, (lo, hi) in enumerate(((0, 70), (70, 120), (120, 210))):
        alone = ai8.int8_attention_forward(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], tensor_layout="NHD")[0]
        if b == 1:
            assert out[lo:hi].isnan().any()
        else:
            assert torch.isfinite(out[lo:hi]).all() and torch.equal(out[lo:hi], alone), b


@requires_cuda
def test_op_clamps_malformed_offsets(ai8):
    """The raw op does not read cu_seqlens on the host; offsets past the tensors must not make a kernel read or write
    outside them (compute-sanitizer runs this file's cases too), and the call must finish without a CUDA error."""
    (q, k, v), _ = packed([40, 40], [40, 40], 4, 2, 64, torch.float16, "cuda")
    bad = torch.tensor([0, 1000, -5], dtype=torch.int32, device="cuda")
    for is_causal in (False, True):
        out, lse = ai8.ops.int8_attention_varlen_forward_with_lse(q, k, v, bad, bad, 1000, 1000, is_causal)
        torch.cuda.synchronize()
        assert out.shape == q.shape and lse.shape == (4, 80)
