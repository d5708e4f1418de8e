"""Why K's centre is a trimmed mean of sampled keys: its accuracy against the exact token mean's, on the CPU.

    python benchmarks/smoothing_center.py [--seqlen 2048] [--heads 2] [--seed 0]

Subtracting any vector c from every key shifts each logit row by q . c, which the softmax ignores; only the
INT8 range of K depends on c. The exact token mean needs a pass over all of K before the quantizer; the kernels
take the centre from a sample of 128 keys (reference.key_center: the sample's mean without its 4 keys farthest
from the plain mean). This runs the reference scheme (`int8_attention_reference` with smooth_k=False on K - c)
for c = the exact mean, the plain mean of the same sample, and the centre, on several kinds of K, and prints
cosine similarity / relative L1 against float64 attention (non-causal and causal). No GPU needed.
"""

import argparse

import torch

from _load import load_package

KINDS = {
    "normal": "standard normal",
    "offset": "plus 10 randn(D) shared by all keys",
    "rope": "offset 5 randn(D), then rotary position embedding",
    "rope_big": "offset 20 randn(D), then rotary position embedding",
    "sink": "offset, and key 0 twenty times larger",
    "drift": "offset plus one that drifts linearly over the sequence",
    "sinks4": "offset, and four keys twenty times larger",
    "skew": "offset plus exponentially distributed (skewed) channels",
}


def rope(x, base=10000.0):
    n, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(n, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def make_qkv(kind, heads, seqlen, generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    shape, d = (1, heads, seqlen, 128), 128
    q, k, v = randn(*shape), randn(*shape), randn(*shape)
    offset = randn(1, heads, 1, d)
    if kind == "offset":
        k = k + 10 * offset
    elif kind in ("rope", "rope_big"):
        k = rope(k + (5 if kind == "rope" else 20) * offset)
        q = rope(q + randn(1, heads, 1, d))
    elif kind == "sink":
        k = k + 10 * offset
        k[:, :, 0] *= 20
    elif kind == "drift":
        k = k + 10 * offset + 5 * torch.linspace(-1, 1, seqlen)[:, None] * randn(1, heads, 1, d)
    elif kind == "sinks4":
        k = k + 10 * offset
        k[:, :, torch.arange(4) * (seqlen // 4)] *= 20
    elif kind == "skew":
        k = k + 10 * offset - 3 * torch.rand(*shape, generator=generator).log()
    return tuple(t.half() for t in (q, k, v))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    reference = load_package()[0].reference
    generator = torch.Generator().manual_seed(args.seed)
    centres = {"exact mean": lambda k: k.double().mean(dim=-2).float(),
               "sample mean": lambda k: k[:, :, reference.center_sample(k.shape[2])].double().mean(dim=-2).float(),
               "centre": reference.key_center}
    print("kind      causal  " + "  ".join(f"{name:>16s}" for name in centres) + "   (cos / rel L1)")
    for kind in KINDS:
        q, k, v = make_qkv(kind, args.heads, args.seqlen, generator)
        for causal in (False, True):
            exact = reference.attention_float64(q, k, v, is_causal=causal).double()
            cells = []
            for centre in centres.values():
                out = reference.int8_attention_reference(q, k.float() - centre(k)[:, :, None], v, is_causal=causal,
                                                         smooth_k=False).double()
                cos = torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0).item()
                rel_l1 = ((out - exact).abs().sum() / exact.abs().sum()).item()
                cells.append(f"{cos:.5f} / {rel_l1:.4f}")
            print(f"{kind:9s} {int(causal):6d}  " + "  ".join(f"{c:>16s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
