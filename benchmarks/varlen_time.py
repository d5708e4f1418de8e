"""INT8 varlen attention on packed batches of mixed lengths, beside what a PyTorch user has without it.

    python benchmarks/varlen_time.py [--dtype float16|bfloat16] [--min-seconds S] [BATCH ...]

BATCH is a key of BATCHES (prefill, prefill-causal, video). Methods, on the same packed tensors:
- int8-varlen: `int8_attention_varlen`, one launch per kernel for the whole batch;
- int8-loop: `int8_attention_forward` on each sequence in turn (the dense op, NHD views of the packed tensors);
- torch-varlen: `torch.nn.attention.varlen.varlen_attn` (FlashAttention's varlen kernel), where torch has it;
- sdpa-loop: `torch.nn.functional.scaled_dot_product_attention` on each sequence in turn (default backends).

Timing is bench_attention's (input sets larger than L2, a spin kernel ahead of each pass, median per-call time).
TFLOP/s counts each sequence's QK^T and PV (half the square when causal), so the figures compare with
bench_attention's. Accuracy: cosine and relative L1 against float64 over the first heads of every sequence.
One line per batch and method, then each method's speed-up over sdpa-loop:

    varlen_time BATCH METHOD <us> us <TFLOP/s> TF cos <cosine> l1 <relative L1>
    varlen_time BATCH vs sdpa-loop: METHOD x<speed-up> ...
"""

import argparse
import inspect
import math
import sys

import torch
import torch.nn.functional as F

import bench_attention as bench
from _load import load_package

# name -> (sequence lengths, query heads, kv heads, head dim, causal). Lengths as a serving batch or a
# mixed-resolution video batch would pack them: uneven, not multiples of the 128-row tile.
BATCHES = {
    "prefill": ([3000, 517, 1900, 128, 4096, 777, 2600, 1400], 32, 8, 128, False),
    "prefill-causal": ([3000, 517, 1900, 128, 4096, 777, 2600, 1400], 32, 8, 128, True),
    "video": ([9360, 4680, 2340], 24, 24, 128, False),
}
ACCURACY_HEADS = 4


def offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def flops(lengths, hq, d, causal):
    return sum(4 * hq * n * n * d / (2 if causal else 1) for n in lengths)


def input_sets(lengths, hq, hkv, d, dtype, l2_bytes):
    total = sum(lengths)

    def one_set():
        return (torch.randn(total, hq, d, dtype=dtype, device="cuda"),
                *(torch.randn(total, hkv, d, dtype=dtype, device="cuda") for _ in range(2)))

    set_bytes = total * (2 * hq + 2 * hkv) * d * torch.finfo(dtype).bits // 8
    return [one_set() for _ in range(min(16, max(2, math.ceil(2 * l2_bytes / set_bytes))))]


def torch_varlen(causal):
    """torch's varlen_attn with causal masking spelled the way this torch spells it, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    mask = {"is_causal": causal} if "is_causal" in params else {"window_size": (-1, 0) if causal else (-1, -1)}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    return lambda *args: varlen_attn(*args, **mask, **gqa)


def make_methods(ai8, lengths, hq, hkv, causal):
    cu = offsets(lengths)
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    longest = max(lengths)

    def int8_varlen(q, k, v):
        return ai8.int8_attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=causal)

    def int8_loop(q, k, v):
        return torch.cat([ai8.int8_attention_forward(q[None, s:e], k[None, s:e], v[None, s:e], is_causal=causal,
                                                     tensor_layout="NHD")[0] for s, e in spans])

    def sdpa_loop(q, k, v):
        # 4-D views: SDPA's flash and cuDNN backends take no 3-D input.
        return torch.cat([F.scaled_dot_product_attention(
            q[None, s:e].transpose(1, 2), k[None, s:e].transpose(1, 2), v[None, s:e].transpose(1, 2),
            is_causal=causal, enable_gqa=hq != hkv)[0].transpose(0, 1) for s, e in spans])

    methods = {"int8-varlen": int8_varlen, "int8-loop": int8_loop}
    if (varlen := torch_varlen(causal)) is not None:
        methods["torch-varlen"] = lambda q, k, v: varlen(q, k, v, cu, cu, longest, longest)
    methods["sdpa-loop"] = sdpa_loop
    return methods, spans


def accuracy(ai8, out, q, k, v, spans, hq, hkv, causal):
    """(cosine, relative L1) against float64 over the first query heads of every sequence."""
    heads = max(ACCURACY_HEADS, hq // hkv)
    kv_heads = heads // (hq // hkv)
    got, ref = [], []
    for s, e in spans:
        ref.append(ai8.reference.attention_float64(q[None, s:e, :heads], k[None, s:e, :kv_heads],
                                                   v[None, s:e, :kv_heads], is_causal=causal,
                                                   tensor_layout="NHD")[0].flatten())
        got.append(out[s:e, :heads].double().flatten())
    return bench.accuracy(torch.cat(got)[None, None], torch.cat(ref)[None, None])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batches", nargs="*", metavar="BATCH", help=f"of {', '.join(BATCHES)}; default: all")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--min-seconds", type=float, default=0.3, help="timed work per method, at least")
    args = parser.parse_args()
    if unknown := set(args.batches) - set(BATCHES):
        parser.error(f"unknown BATCH {', '.join(sorted(unknown))}: expected some of {', '.join(BATCHES)}")
    if not torch.cuda.is_available():
        print("varlen_time: no CUDA GPU on this machine; nothing to measure")
        return 0
    ai8, _ = load_package()
    dtype = getattr(torch, args.dtype)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    for key in args.batches or sorted(BATCHES):
        lengths, hq, hkv, d, causal = BATCHES[key]
        sets = input_sets(lengths, hq, hkv, d, dtype, l2_bytes)
        methods, spans = make_methods(ai8, lengths, hq, hkv, causal)
        times = {}
        for name, fn in methods.items():
            try:
                times[name] = bench.time_ms(fn, sets, args.min_seconds)
                cos, rel_l1 = accuracy(ai8, fn(*sets[0]), *sets[0], spans, hq, hkv, causal)
            except Exception as error:  # a torch without this backend for this GPU / dtype
                print(f"varlen_time {key} {name} error {type(error).__name__}: {str(error).splitlines()[0][:160]}")
                continue
            print(f"varlen_time {key} {name} {times[name] * 1e3:.1f} us "
                  f"{flops(lengths, hq, d, causal) / times[name] / 1e9:.0f} TF "
                  f"cos {cos:.6f} l1 {rel_l1:.5f}", flush=True)
        if "sdpa-loop" in times:
            ratios = " ".join(f"{n} x{times['sdpa-loop'] / t:.2f}" for n, t in times.items() if n != "sdpa-loop")
            print(f"varlen_time {key} vs sdpa-loop: {ratios}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
