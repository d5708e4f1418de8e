"""Why P.V stays in fp16/bf16: the accuracy of lower-precision P.V, emulated on the CPU.

    python benchmarks/pv_precision.py [--seqlen 4096] [--heads 2] [--seed 0]

Q.K^T is quantized exactly as the kernels do it (`reference._quantized_operands`, `reference._logits`); P is
then computed with the exact row max, and P.V runs with P and V rounded to: fp16 (the kernels), FP8 e4m3 (P
scaled by 448, V by one scale per channel: SageAttention 2's scheme), or INT8 (P by 127, V per channel),
accumulated in fp32 and normalized by the exact row sums. Prints cosine similarity and relative L1 against
float64 attention on standard-normal fp16 inputs (D = 128), the inputs of the accuracy bars (cos >= 0.9995,
rel L1 <= 0.02). No GPU needed.
"""

import argparse

import torch

from _load import load_package


def per_channel(x, qmax, rounding):
    """x rounded with one scale per channel (the last dim), the largest |x| of a channel mapped to qmax."""
    scale = x.abs().amax(dim=-2, keepdim=True) / qmax
    return rounding(x / scale) * scale


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ai8, _ = load_package()
    reference = ai8.reference
    torch.manual_seed(args.seed)
    head_dim = 128
    q, k, v = (torch.randn(1, args.heads, args.seqlen, head_dim, dtype=torch.float16) for _ in range(3))
    exact = reference.attention_float64(q, k, v)
    q_q, q_scale, k_q, k_scale, _, _ = reference._quantized_operands(q, k, 1, head_dim ** -0.5, True)
    logits, _ = reference._logits(q_q, q_scale, k_q, k_scale)
    p = torch.exp2(logits - logits.amax(dim=-1, keepdim=True))  # (0, 1]
    row_sum = p.sum(dim=-1, keepdim=True)
    v = v.float()

    def e4m3(x):
        return x.to(torch.float8_e4m3fn).float()

    p_e4m3, v_e4m3 = e4m3(p * 448) / 448, per_channel(v, 448, e4m3)
    variants = {
        "fp16 P, fp16 V (the kernels)": (p.half().float(), v),
        "e4m3 P, e4m3 V": (p_e4m3, v_e4m3),
        "e4m3 P, fp16 V": (p_e4m3, v),
        "fp16 P, e4m3 V": (p.half().float(), v_e4m3),
        "int8 P, int8 V": (torch.round(p * 127) / 127, per_channel(v, 127, torch.round)),
    }
    print(f"B1 H{args.heads} N{args.seqlen} D{head_dim} fp16 randn, seed {args.seed}")
    for name, (p_rounded, v_rounded) in variants.items():
        out = ((p_rounded @ v_rounded) / row_sum).double()
        cos = torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0).item()
        rel_l1 = ((out - exact).abs().sum() / exact.abs().sum()).item()
        print(f"  {name:30s} cos {cos:.5f}  rel L1 {rel_l1:.4f}")


if __name__ == "__main__":
    main()
