"""Accuracy of the scheme and its options on hard input classes, from the CPU reference (issues 43 and 46).

    python benchmarks/accuracy_reference.py [--seed S] [--draws 3] [--rows 256] [--quick] [--kernel]

Runs `reference.int8_attention_reference` (this kernel's scheme, exactly as the kernels compute it apart from
the order of fp32 sums) with fp16 or INT8 P.V and with Q smoothing (`smooth_q`) and channel balancing
(`balance_channels`) off and on, plus PyTorch's CPU `scaled_dot_product_attention` on the same fp16 tensors (fp16
in and out), against float64 attention of those fp16 inputs. Q has `--rows` query rows (a row subset: every row
sees all N keys, non-causal), B = 1, H = 2. Each cell: mean rel L1 over the draws [max] and the lowest cosine.
Draw i of a row uses seed S + i (S is printed; a fresh one each run unless given). No GPU needed.

With `--kernel` (a CUDA GPU): the kernels themselves on the same inputs, with both remedies (their default) and
without, beside SDPA on the GPU (its default backend) and the reference's default scheme.
"""

import argparse
import os

import torch

from _load import load_package

# name -> what is added to standard normal q, k, v (all fp16 in the end).
CLASSES = {
    "randn": "standard normal q, k, v",
    "q+1": "Q plus 1 randn(D) shared by its rows",
    "q+2": "Q plus 2 randn(D)",
    "q+5": "Q plus 5 randn(D)",
    "k+10": "K plus 10 randn(D) shared by its keys (the tests' k_offset)",
    "kout1x30": "1 K channel 30x the others",
    "kout4x10": "4 K channels 10x",
    "kout4x30": "4 K channels 30x",
    "kout8x10": "8 K channels 10x",
    "vt3": "V ~ Student-t(3)",
    "kout4x30,q+5": "4 K channels 30x and Q plus 5 randn(D)",
    "kout4x30,q+5,vt3": "all three",
}

# (class, N, D): issue 43's grid, then every class at N = 4096, D = 128.
ISSUE_43 = [(c, n, 128) for n in (2048, 8192) for c in ("randn", "q+1", "vt3")] + [(c, 4096, 64) for c in
                                                                                    ("randn", "q+1", "vt3")]
GRID = [(c, 4096, 128) for c in CLASSES] + ISSUE_43
QUICK = [(c, 2048, 128) for c in CLASSES]

VARIANTS = {  # column -> int8_attention_reference options (None: SDPA); "fp16 +both" is the kernels' default
    "SDPA fp16": None,
    "fp16": dict(smooth_q=False, balance_channels=False),
    "fp16 +Qs": dict(balance_channels=False),
    "fp16 +bal": dict(smooth_q=False),
    "fp16 +both": {},
    "int8": dict(pv_precision="int8", smooth_q=False, balance_channels=False),
    "int8 +both": dict(pv_precision="int8"),
}


KERNEL_VARIANTS = {  # column -> (what runs, its options); --kernel
    "SDPA fp16 (GPU)": ("sdpa", {}),
    "kernel": ("kernel", {}),
    "kernel, no remedies": ("kernel", dict(smooth_q=False, balance_channels=False)),
    "reference": ("reference", {}),
}


def make_inputs(name, seqlen, head_dim, rows, generator):
    """Fresh fp16 q [1, 2, rows, D], k and v [1, 2, seqlen, D] of input class `name`."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k, v = randn(1, 2, rows, head_dim), randn(1, 2, seqlen, head_dim), randn(1, 2, seqlen, head_dim)
    for part in name.split(","):
        if part.startswith("q+"):
            q = q + float(part[2:]) * randn(1, 2, 1, head_dim)
        elif part.startswith("k+"):
            k = k + float(part[2:]) * randn(1, 2, 1, head_dim)
        elif part.startswith("kout"):
            count, magnitude = part[4:].split("x")
            channels = torch.randperm(head_dim, generator=generator)[: int(count)]
            k[..., channels] *= float(magnitude)
        elif part == "vt3":  # Student-t(3) as normal / sqrt(chi2(3) / 3)
            v = v / (randn(3, 1, 2, seqlen, head_dim).square().mean(dim=0)).sqrt()
        elif part != "randn":
            raise ValueError(f"unknown input class part {part!r}")
    return q.half(), k.half(), v.half()


def metrics(out, exact):
    o, r = out.double().flatten(), exact.double().flatten()
    return ((o - r).abs().sum() / r.abs().sum()).item(), (o @ r / (o.norm() * r.norm())).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="first seed (default: a fresh one)")
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="every class at N = 2048 only")
    parser.add_argument("--kernel", action="store_true", help="the kernels on a CUDA GPU (KERNEL_VARIANTS)")
    args = parser.parse_args()
    if args.kernel and not torch.cuda.is_available():
        raise SystemExit("--kernel runs the kernels on a CUDA GPU, and this machine has none")
    variants = KERNEL_VARIANTS if args.kernel else {c: ("sdpa", {}) if o is None else ("reference", o)
                                                    for c, o in VARIANTS.items()}
    seed = int.from_bytes(os.urandom(3), "little") if args.seed is None else args.seed
    ai8, how = load_package()
    reference = ai8.reference
    print(f"reference: {how}; seeds {seed}..{seed + args.draws - 1}, {args.rows} query rows, B1 H2, fp16 inputs,"
          f" torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("cells: mean rel L1 over the draws [max] / lowest cos, against float64 attention\n")
    if args.kernel:
        print(f"GPU: {torch.cuda.get_device_name()}")
    print("| class | N | D | " + " | ".join(variants) + " |")
    print("|---|---|---|" + "---|" * len(variants))
    run = {"sdpa": torch.nn.functional.scaled_dot_product_attention, "kernel": ai8.int8_attention_forward,
           "reference": reference.int8_attention_reference}
    for name, seqlen, head_dim in QUICK if args.quick else GRID:
        results = {column: [] for column in variants}
        for draw in range(args.draws):
            generator = torch.Generator().manual_seed(seed + draw)
            q, k, v = make_inputs(name, seqlen, head_dim, args.rows, generator)
            exact = reference.attention_float64(q, k, v)
            for column, (what, options) in variants.items():
                on_gpu = args.kernel and what != "reference"
                inputs = [t.cuda() for t in (q, k, v)] if on_gpu else (q, k, v)
                results[column].append(metrics(run[what](*inputs, **options).cpu(), exact))
        cells = []
        for values in results.values():
            rel_l1 = [r for r, _ in values]
            cells.append(f"{sum(rel_l1) / len(rel_l1):.4f} [{max(rel_l1):.4f}] / {min(c for _, c in values):.5f}")
        print(f"| {name} | {seqlen} | {head_dim} | " + " | ".join(cells) + " |", flush=True)
    print("\nclasses: " + "; ".join(f"{name}: {what}" for name, what in CLASSES.items()))
    if args.kernel:
        print("columns: SDPA on the GPU's fp16 tensors; the kernels with their defaults (both remedies) and with"
              " smooth_q=False, balance_channels=False; the CPU reference of their default scheme")
    else:
        print("columns: SDPA fp16 = torch.nn.functional.scaled_dot_product_attention on the CPU fp16 tensors; fp16 /"
              " int8 = pv_precision without the remedies; +Qs = smooth_q; +bal = balance_channels; +both = both (the"
              " kernels' default)")


if __name__ == "__main__":
    main()
