"""INT8 attention vs torch SDPA (flash and cuDNN backends): time, TFLOP/s, peak memory and accuracy.

    python benchmarks/bench_attention.py [--quick | --shapes KEY ...] [--out-dir benchmarks/out]
                                         [--append-results benchmarks/results-log.md]

Every method runs on the same inputs in one process. The INT8 time includes the quantization of Q and K (it
happens inside the op). Timed calls rotate over several input sets whose total size exceeds the L2 cache, so no
call reads inputs a previous call left in L2. Accuracy: cosine similarity and relative L1 against float64
attention on a slice of one input set. See benchmarks/RESULTS.md for the method.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import pathlib
import platform
import shlex
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from _load import ROOT, load_package


@dataclasses.dataclass(frozen=True)
class Shape:
    workload: str
    b: int
    hq: int
    hkv: int
    n: int
    d: int
    causal: bool

    @property
    def label(self):
        heads = f"{self.hq}" if self.hq == self.hkv else f"{self.hq}/{self.hkv}"
        return f"B{self.b} H{heads} N{self.n} D{self.d}" + (" causal" if self.causal else "")

    @property
    def flops(self):
        """Matmul FLOPs of QK^T and PV, counting only the visible half of a causal square."""
        return 4 * self.b * self.hq * self.n * self.n * self.d / (2 if self.causal else 1)


SHAPES = [
    Shape("image", 1, 24, 24, 4096, 128, False),
    Shape("image", 1, 24, 24, 4608, 128, False),  # FLUX 1024x1024: 4096 image + 512 text tokens
    Shape("video", 1, 24, 24, 16384, 128, False),
    Shape("video", 1, 40, 40, 32768, 128, False),
    Shape("llm prefill", 4, 32, 32, 2048, 128, True),
    Shape("llm prefill", 4, 32, 32, 8192, 128, True),
    Shape("llm prefill gqa", 4, 32, 8, 2048, 128, True),
    Shape("llm prefill gqa", 4, 32, 8, 8192, 128, True),
    Shape("d64", 16, 16, 16, 4096, 64, False),
    Shape("d96 llm prefill", 4, 32, 32, 4096, 96, True),  # Phi-3-mini: 32 heads of 96 channels
    Shape("d80 llm prefill", 4, 32, 32, 4096, 80, True),  # Phi-2: 32 heads of 80 channels
    Shape("d256 llm prefill gqa", 4, 16, 8, 4096, 256, True),  # Gemma-2-9B: 16 query and 8 K/V heads of 256
    Shape("d256", 1, 24, 24, 4096, 256, False),
]
QUICK_SHAPES = [SHAPES[i] for i in (0, 2, 5, 7, 8)]
# Short names of the shapes that RESULTS.md's per-version rows time (op_time.py, kernel_times.py): A, B, C, G
# and D are the letters those rows use; Dc (D = 64 causal) is not in the table above.
NAMED_SHAPES = {
    "A": SHAPES[0], "A4608": SHAPES[1], "B": SHAPES[2], "B32768": SHAPES[3], "C": SHAPES[4], "C8192": SHAPES[5],
    "G": SHAPES[6], "G8192": SHAPES[7], "D": SHAPES[8], "Dc": Shape("d64 causal", 4, 16, 16, 4096, 64, True),
    "P96": SHAPES[9], "P80": SHAPES[10], "P256": SHAPES[11], "I256": SHAPES[12],
}
SDPA_BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
METHODS = [*SDPA_BACKENDS, "int8"]
# ~200 us at the H200's 1.98 GHz: more than any method's host-side cost per call (INT8 51-75 us, cuDNN 27-33 us).
HOST_SPIN_CYCLES_PER_CALL = 400_000
ACCURACY_HEADS = 4  # query heads of batch 0 compared with float64 (a sample: heads are independent)


REMEDIES_OFF = dict(balance_channels=False, smooth_q=False)


def make_methods(ai8, shape, int8_options=None):
    """name -> (context manager factory, fn(q, k, v)). Layout HND, the same tensors for every method; the INT8
    op gets `int8_options` as keywords."""
    gqa = shape.hq != shape.hkv
    int8_options = int8_options or {}

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)

    def int8(q, k, v):
        return ai8.int8_attention_forward(q, k, v, is_causal=shape.causal, **int8_options)

    methods = {name: (functools.partial(sdpa_kernel, backend), sdpa) for name, backend in SDPA_BACKENDS.items()}
    methods["int8"] = (contextlib.nullcontext, int8)
    return methods


def named_shapes_parser(description, remedies_option=True):
    """The arguments of the scripts that look at the int8 op alone (op_time.py, kernel_times.py): SHAPE keys of
    NAMED_SHAPES, --dtype (a torch dtype name) and --remedies (off times the kernels as a build without issue 46's
    pre-pass work would)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", choices=sorted(NAMED_SHAPES), metavar="SHAPE",
                        help="keys of bench_attention.NAMED_SHAPES")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    if remedies_option:
        parser.add_argument("--remedies", choices=["on", "off"], default="on",
                            help="channel balancing and Q smoothing as by default (on) or both turned off")
    return parser


def for_each_named_shape(args, tool, measure):
    """Calls measure(key, shape, input sets, INT8 op, package) for each SHAPE of `args` (named_shapes_parser's),
    one shape's input sets alive at a time (they exceed L2, and a long shape's take GBs). Without a GPU, says so
    under the name `tool` and measures nothing. Returns the exit status."""
    if not torch.cuda.is_available():
        print(f"{tool}: no CUDA GPU on this machine; nothing to measure")
        return 0
    ai8, _ = load_package()
    dtype = getattr(torch, args.dtype)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    for key in args.shapes:
        shape = NAMED_SHAPES[key]
        sets = input_sets(shape, dtype, l2_bytes)
        options = REMEDIES_OFF if getattr(args, "remedies", "on") == "off" else {}
        measure(key, shape, sets, make_methods(ai8, shape, options)["int8"][1], ai8)
        del sets
        torch.cuda.empty_cache()
    return 0


def input_sets(shape, dtype, l2_bytes):
    """Enough independent (q, k, v) sets that one pass over them streams more than twice the L2 cache."""
    def one_set():
        q = torch.randn(shape.b, shape.hq, shape.n, shape.d, dtype=dtype, device="cuda")
        k, v = (torch.randn(shape.b, shape.hkv, shape.n, shape.d, dtype=dtype, device="cuda") for _ in range(2))
        return q, k, v

    first = one_set()
    set_bytes = sum(t.numel() * t.element_size() for t in first) + first[0].numel() * first[0].element_size()
    count = min(16, max(2, math.ceil(2 * l2_bytes / set_bytes)))
    return [first] + [one_set() for _ in range(count - 1)]


def time_ms(fn, sets, min_seconds):
    """Median per-call time over passes through all sets: CUDA events around each pass, the GPU's time.

    A spin kernel ahead of each pass holds the GPU until the host has queued the whole pass, so the first
    call's host-side cost (checks, allocation, launches: RESULTS.md v21) is not counted as GPU time, for
    any method; in a model the host runs ahead of the GPU the same way."""
    for inputs in sets:  # warm-up: first-call set-up, autotuning, lazy loading
        fn(*inputs)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    while len(samples) < 5 or (sum(samples) * len(sets) < 1e3 * min_seconds and len(samples) < 100):
        torch.cuda._sleep(HOST_SPIN_CYCLES_PER_CALL * len(sets))
        start.record()
        for inputs in sets:
            fn(*inputs)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / len(sets))
    return statistics.median(samples)


def peak_mib(fn, inputs):
    """Peak memory a call allocates beyond its inputs (output and workspace), in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def float64_slice(ai8, q, k, v, shape):
    """Exact attention for batch 0 and the first query heads (a sample: heads are computed independently)."""
    group = shape.hq // shape.hkv
    heads = max(ACCURACY_HEADS, group)
    kv_heads = slice(0, heads // group)
    return ai8.reference.attention_float64(q[:1, :heads], k[:1, kv_heads], v[:1, kv_heads], is_causal=shape.causal)


def accuracy(out, ref):
    """(cosine similarity, relative L1) of out against the float64 slice."""
    got = out[:1, :ref.shape[1]].double()
    cos = F.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    rel_l1 = ((got - ref).abs().sum() / ref.abs().sum()).item()
    return cos, rel_l1


def bench_shape(ai8, shape, dtype, l2_bytes, min_seconds):
    sets = input_sets(shape, dtype, l2_bytes)
    ref = float64_slice(ai8, *sets[0], shape)
    results = {}
    for name, (context, fn) in make_methods(ai8, shape).items():
        try:
            with context():
                ms = time_ms(fn, sets, min_seconds)
                mib = peak_mib(fn, sets[0])
                cos, rel_l1 = accuracy(fn(*sets[0]), ref)
        except Exception as error:  # a backend that does not take this shape / dtype / GPU
            first_line = (str(error).splitlines() or [""])[0]
            results[name] = {"error": f"{type(error).__name__}: {first_line[:200]}"}
            continue
        results[name] = {"ms": ms, "tflops": shape.flops / ms / 1e9, "peak_mib": mib, "cos": cos,
                         "rel_l1": rel_l1}
    del sets, ref
    torch.cuda.empty_cache()
    return results


def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def markdown_table(rows):
    columns = ["workload", "B, H, N, D", "dtype", "flash TFLOP/s", "cuDNN TFLOP/s", "INT8 TFLOP/s",
               "INT8 speedup vs best SDPA", "INT8 cos", "INT8 rel L1", "best SDPA rel L1",
               "peak MiB flash / cuDNN / INT8"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        res = {name: row["results"][name] for name in METHODS}
        timed = [name for name in SDPA_BACKENDS if "ms" in res[name]]
        best = min(timed, key=lambda name: res[name]["ms"]) if timed else None
        speedup = res[best]["ms"] / res["int8"]["ms"] if best and "ms" in res["int8"] else None
        cells = [row["workload"], row["label"], row["dtype"],
                 *(fmt(res[name].get("tflops"), ".0f") for name in METHODS),
                 fmt(speedup, ".2f") + ("x" if speedup else ""),
                 fmt(res["int8"].get("cos"), ".5f"), fmt(res["int8"].get("rel_l1"), ".4f"),
                 fmt(res[best]["rel_l1"] if best else None, ".4f"),
                 " / ".join(fmt(res[name].get("peak_mib"), ".0f") for name in METHODS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment():
    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "command": "python " + shlex.join(sys.argv),
    }


def plot(rows, path):
    """TFLOP/s against N, one panel per dtype: a colour per method, a marker per workload (its shapes joined by a
    line in N). A method that did not run a shape leaves its point out."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    dtypes = sorted({row["dtype"] for row in rows}, reverse=True)  # float16 first

    def workload(row):
        return f"{row['workload']}, D{row['d']}"

    workloads = list(dict.fromkeys(map(workload, rows)))
    markers = dict(zip(workloads, "osD^vP*Xph"))
    colors = {name: f"C{i}" for i, name in enumerate(METHODS)}
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(12, 5 * len(dtypes)), squeeze=False)
    for ax, dtype in zip(axes[:, 0], dtypes):
        for key in workloads:
            points = sorted((row for row in rows if row["dtype"] == dtype and workload(row) == key),
                            key=lambda row: row["n"])
            for name in METHODS:
                xy = [(row["n"], row["results"][name]["tflops"]) for row in points if "tflops" in row["results"][name]]
                if xy:
                    ax.plot(*zip(*xy), color=colors[name], marker=markers[key], linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{dtype} forward, quantization included", xlabel="N (query and key tokens)",
               ylabel="TFLOP/s (matmul-equivalent)")
        ax.grid(alpha=0.3)
        ax.legend(handles=[Line2D([], [], color=c, label=n) for n, c in colors.items()] +
                  [Line2D([], [], color="gray", marker=m, linestyle="none", label=w) for w, m in markers.items()],
                  fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: no point hidden
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a handful of shapes, float16 only")
    parser.add_argument("--shapes", nargs="+", choices=sorted(NAMED_SHAPES), metavar="SHAPE",
                        help="only these keys of NAMED_SHAPES (both dtypes unless --quick)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "benchmarks" / "out")
    parser.add_argument("--append-results", type=pathlib.Path, metavar="MARKDOWN",
                        help="append the results block to this file (e.g. benchmarks/results-log.md)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU on this machine; nothing to benchmark")
        return 0

    ai8, loaded_from = load_package()
    env = environment()
    print(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}; attention_int8: "
          f"{loaded_from}")
    shapes = [NAMED_SHAPES[key] for key in args.shapes] if args.shapes else QUICK_SHAPES if args.quick else SHAPES
    dtypes = [torch.float16] if args.quick else [torch.float16, torch.bfloat16]
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            results = bench_shape(ai8, shape, dtype, l2_bytes, min_seconds=0.1 if args.quick else 0.3)
            row = {**dataclasses.asdict(shape), "label": shape.label, "dtype": str(dtype).removeprefix("torch."),
                   "results": results}
            rows.append(row)
            summary = "  ".join(f"{name} {res['tflops']:.0f}" if "tflops" in res else f"{name} n/a"
                                for name, res in results.items())
            print(f"{shape.workload:>16} {shape.label:<28} {row['dtype']:<9} TFLOP/s: {summary}", flush=True)
            for name, res in results.items():
                if "error" in res:
                    print(f"    {name}: {res['error']}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_attention.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    plot_path = plot(rows, args.out_dir / "bench_attention.png")
    table = markdown_table(rows)
    block = (f"### {env['date']}: {env['gpu']}\n\n"
             f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, Python {env['python']}. "
             f"Command: `{env['command']}`\n\n{table}\n")
    (args.out_dir / "bench_attention.md").write_text(block)
    if args.append_results:
        with args.append_results.open("a") as results_file:
            results_file.write("\n" + block)
    print(f"\nwrote {args.out_dir}/bench_attention.{{json,md}}" + (f", {plot_path}" if plot_path else ""))
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
