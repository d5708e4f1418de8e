"""GPU time of each kernel the INT8 op launches (K centre, K quantizer, attention, split combine), per call, at
named shapes: where an op time goes. RESULTS.md's rows call this breakdown "kprof".

    python benchmarks/kernel_times.py [--dtype float16|bfloat16] [--remedies on|off] [--passes N] SHAPE [SHAPE ...]

SHAPE is a key of bench_attention.NAMED_SHAPES. The calls rotate over bench_attention's input sets (larger than
L2) behind a spin kernel, as in the op timing; torch.profiler records the kernels' device times, and each
kernel's total is divided by the number of calls. One line per shape:

    kernel_times SHAPE DTYPE: <kernel> <us>us x<launches per call>; ...
"""

import collections
import re
import sys

import torch

import bench_attention as bench


def kernel_name(signature):
    """`void ns::(anonymous namespace)::attention_fwd_sm90_kernel<Traits<...>>(params)` -> `attention_fwd_sm90_kernel`."""
    head = re.split(r"[<(]", signature.replace("(anonymous namespace)::", ""), maxsplit=1)[0]
    return head.split()[-1].split("::")[-1] if head.strip() else signature[:60]


def main():
    parser = bench.named_shapes_parser(__doc__)
    parser.add_argument("--passes", type=int, default=4, help="profiled passes over the input sets")
    args = parser.parse_args()

    def measure(key, shape, sets, op, ai8):
        for inputs in sets:  # warm-up
            op(*inputs)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.passes):
                torch.cuda._sleep(bench.HOST_SPIN_CYCLES_PER_CALL * len(sets))
                for inputs in sets:
                    op(*inputs)
            torch.cuda.synchronize()
        total_us, launches = collections.defaultdict(float), collections.Counter()
        for event in prof.events():
            # torch.cuda._sleep's kernel (named spin_kernel or sleep) holds the GPU while a pass is queued: not the op's
            if event.device_type == torch.autograd.DeviceType.CUDA and not re.search(r"sleep|spin_kernel", event.name):
                name = kernel_name(event.name)
                total_us[name] += event.device_time
                launches[name] += 1
        calls = args.passes * len(sets)
        parts = [f"{name} {total_us[name] / calls:.1f}us x{launches[name] / calls:.0f}"
                 for name in sorted(total_us, key=total_us.get, reverse=True)]
        print(f"kernel_times {key} {args.dtype}: " + "; ".join(parts), flush=True)

    return bench.for_each_named_shape(args, "kernel_times", measure)


if __name__ == "__main__":
    sys.exit(main())
