"""Op time with issue 46's remedies on and off at named shapes, beside cuDNN's SDPA, in one run.

    python benchmarks/remedy_time.py [--dtype float16|bfloat16] [--rounds 3] [--min-seconds S] SHAPE [SHAPE ...]

SHAPE is a key of bench_attention.NAMED_SHAPES (all of them: `A A4608 B B32768 C C8192 G G8192 D Dc P96 P80 P256
I256`). Both remedies are on by default: channel balancing (`balance_channels`) and Q smoothing (`smooth_q`), which
each query head takes only where its Q has a shared offset, so standard-normal inputs time the defaults ("on": both
options, "off": neither) without it. Then every Q gets an offset of 2 randn(D) per head, which every head smooths,
and the op is timed with `smooth_q` on and off ("smoothed", "unsmoothed"; balancing on in both). Timing is
bench_attention's (rotating input sets larger than L2, a spin kernel ahead of each pass, median per-call time), in
`--rounds` interleaved rounds of the methods (the GPU's clocks drift within a run); each cell is the median over the
rounds. One line per shape:

    remedy_time SHAPE DTYPE on <us> off <us> cost <percent> cudnn <us> vs cudnn <ratio>x
                smoothed <us> unsmoothed <us> cost <percent>
"""

import functools
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import bench_attention as bench


def main():
    parser = bench.named_shapes_parser(__doc__, remedies_option=False)  # it times both
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.2, help="timed work per method and round, at least")
    args = parser.parse_args()

    def measure(key, shape, sets, op, ai8):
        def int8(options, q, k, v):
            return ai8.int8_attention_forward(q, k, v, is_causal=shape.causal, **options)

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal,
                                                      enable_gqa=shape.hq != shape.hkv)

        def median_us(methods):
            times = {name: [] for name in methods}
            for _ in range(args.rounds):
                for name, fn in methods.items():
                    times[name].append(bench.time_ms(fn, sets, args.min_seconds))
            return {name: statistics.median(t) * 1e3 for name, t in times.items()}

        us = median_us({"on": functools.partial(int8, {}),
                        "off": functools.partial(int8, bench.REMEDIES_OFF), "cudnn": cudnn})
        for q, _, _ in sets:  # a shared offset in every head: Q smoothing takes them all
            q.add_(2 * torch.randn(q.shape[0], q.shape[1], 1, q.shape[3], device=q.device, dtype=q.dtype))
        us |= median_us({"smoothed": functools.partial(int8, {}),
                         "unsmoothed": functools.partial(int8, dict(smooth_q=False))})
        print(f"remedy_time {key} {args.dtype} on {us['on']:.1f} off {us['off']:.1f} "
              f"cost {100 * (us['on'] / us['off'] - 1):+.1f}% cudnn {us['cudnn']:.1f} "
              f"vs cudnn {us['cudnn'] / us['on']:.2f}x smoothed {us['smoothed']:.1f} unsmoothed {us['unsmoothed']:.1f} "
              f"cost {100 * (us['smoothed'] / us['unsmoothed'] - 1):+.1f}%", flush=True)

    return bench.for_each_named_shape(args, "remedy_time", measure)


if __name__ == "__main__":
    sys.exit(main())
