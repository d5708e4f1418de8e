"""Time of the INT8 op alone, quantization included, at named shapes: the figure RESULTS.md's per-version rows
compare between builds.

    python benchmarks/op_time.py [--dtype float16|bfloat16] [--remedies on|off] [--tag NAME] [--min-seconds S]
                                 SHAPE [SHAPE ...]

SHAPE is a key of bench_attention.NAMED_SHAPES (A, A4608, B, B32768, C, C8192, G, G8192, D, Dc, P96). Timing and
accuracy are bench_attention's (rotating input sets larger than L2, a spin kernel ahead of each pass, median
per-call time; cosine and relative L1 against float64 on a slice), without the SDPA baselines.

The script loads the build of the tree it lives in (build/<variant> next to it), so two builds compare by
running each tree's copy in turn in one device call, in interleaved rounds (the GPU's clocks drift within a
call): `python old/benchmarks/op_time.py --tag old A C; python benchmarks/op_time.py --tag new A C; ...`.
One line per shape:

    op_time TAG SHAPE DTYPE <us> us <TFLOP/s> TF cos <cosine> l1 <relative L1>
"""

import sys

import bench_attention as bench


def main():
    parser = bench.named_shapes_parser(__doc__)
    parser.add_argument("--tag", default="int8", help="a label for this build in the output lines")
    parser.add_argument("--min-seconds", type=float, default=0.3, help="timed work per shape, at least")
    args = parser.parse_args()

    def measure(key, shape, sets, op, ai8):
        ms = bench.time_ms(op, sets, args.min_seconds)
        cos, rel_l1 = bench.accuracy(op(*sets[0]), bench.float64_slice(ai8, *sets[0], shape))
        print(f"op_time {args.tag} {key} {args.dtype} {ms * 1e3:.1f} us {shape.flops / ms / 1e9:.0f} TF "
              f"cos {cos:.6f} l1 {rel_l1:.5f}", flush=True)

    return bench.for_each_named_shape(args, "op_time", measure)


if __name__ == "__main__":
    sys.exit(main())
