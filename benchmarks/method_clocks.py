"""Each method (SDPA flash, SDPA cuDNN, INT8) run alone at named shapes, with the SM clock and board power that
nvidia-smi reads meanwhile: under the card's power cap every method settles at a clock of its own, and that is
part of what bench_attention.py's ratios measure (RESULTS.md v72).

    python benchmarks/method_clocks.py [--dtype float16|bfloat16] [--seconds S] SHAPE [SHAPE ...]

SHAPE is a key of bench_attention.NAMED_SHAPES. Each method runs its input sets back to back for S seconds (after
one warm-up pass); the clock and power are the medians of nvidia-smi's 100 ms samples after the first 0.5 s. One
line per shape and method:

    SHAPE METHOD <ms> ms/call <TFLOP/s> TF  SM <MHz> MHz  <W> W  <temperature range> C  <samples> samples
"""

import datetime
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import bench_attention as bench

SETTLE_SECONDS = 0.5  # samples before this are the previous method's state


def run_alone(fn, sets, seconds):
    """Calls fn on the sets back to back for `seconds`; returns (start, end, ms per call)."""
    for inputs in sets:  # warm-up
        fn(*inputs)
    torch.cuda.synchronize()
    start, calls = time.time(), 0
    while time.time() - start < seconds:
        for inputs in sets:
            fn(*inputs)
        calls += len(sets)
        torch.cuda.synchronize()
    end = time.time()
    return start, end, (end - start) * 1e3 / calls


def read_samples(path):
    """(epoch seconds, SM MHz, W, degrees C) per nvidia-smi line; its timestamps are the machine's local time."""
    samples = []
    for line in open(path):
        fields = [field.strip() for field in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((stamp, float(fields[1]), float(fields[2]), float(fields[3])))
        except (ValueError, IndexError):  # a header or a partial line
            continue
    return samples


def main():
    parser = bench.named_shapes_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="how long each method runs alone")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("method_clocks: no CUDA GPU on this machine; nothing to measure")
        return 0
    ai8, _ = bench.load_package()
    dtype = getattr(torch, args.dtype)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                                "--format=csv,noheader,nounits", "-lms", "100"], stdout=log)
        windows = []
        try:
            for key in args.shapes:
                shape = bench.NAMED_SHAPES[key]
                sets = bench.input_sets(shape, dtype, l2_bytes)
                for name, (context, fn) in bench.make_methods(ai8, shape).items():
                    with context():
                        windows.append((key, name, shape, *run_alone(fn, sets, args.seconds)))
                del sets
                torch.cuda.empty_cache()
        finally:
            smi.terminate()
            smi.wait()
        samples = read_samples(log.name)
    for key, name, shape, start, end, ms in windows:
        inside = [s for s in samples if start + SETTLE_SECONDS <= s[0] <= end]
        if not inside:
            print(f"{key} {name} {ms:.3f} ms/call: no nvidia-smi samples")
            continue
        temperatures = [s[3] for s in inside]
        print(f"{key:7} {name:11} {ms:8.3f} ms/call {shape.flops / ms / 1e9:5.0f} TF  "
              f"SM {statistics.median(s[1] for s in inside):5.0f} MHz  {statistics.median(s[2] for s in inside):4.0f} W  "
              f"{min(temperatures):.0f}-{max(temperatures):.0f} C  {len(inside)} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
