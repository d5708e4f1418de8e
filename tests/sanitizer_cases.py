"""The op on the smallest and oddest shapes, small enough for compute-sanitizer:

    compute-sanitizer --tool memcheck python tests/sanitizer_cases.py    (also racecheck, synccheck, initcheck)

Covers N = 1, tails of the 128-row query and 64/128-key tiles (65, 129, 200), Nq > Nkv under the causal
mask, GQA/MQA, both layouts, D 64/96/128/256 (tests/_helpers.py: ODD_CASES) on both kernels, the Hopper kernel's
split-KV path and its combine (KV_SPLIT_CASES, forced 2 to 4 ways), the standalone quantizer, and K's centre
(each kind of tests/_helpers.py: center_inputs, sampling all keys and a strided sample). Exits non-zero if any
result disagrees with the references.
"""

import os
import sys

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    sys.exit("tests/sanitizer_cases.py runs the op on a CUDA GPU (under compute-sanitizer), and this machine has none")

from _helpers import (CENTER_KINDS, KERNELS, KV_SPLIT_CASES, ODD_CASES, center_inputs, check_case, check_quantize,
                      to_layout)
from conftest import load_package


def main():
    ai8 = load_package()
    generator = torch.Generator("cuda").manual_seed(0)
    failures = []
    for case in ODD_CASES:
        for kernel in KERNELS:
            os.environ["ATTENTION_INT8_FORCE_PORTABLE"] = "1" if kernel == "portable" else "0"
            failures += [f"{kernel} kernel: {f}" for f in check_case(ai8, case, generator)]
    os.environ["ATTENTION_INT8_FORCE_PORTABLE"] = "0"
    split_cases = tuple(zip((2, 3, 4, 2, 3), (*KV_SPLIT_CASES[:3], *KV_SPLIT_CASES[-2:])))  # the last: D = 96, 256
    for splits, case in split_cases:
        os.environ["ATTENTION_INT8_KV_SPLITS"] = str(splits)
        failures += [f"{splits} key splits: {f}" for f in check_case(ai8, case, generator)]
    del os.environ["ATTENTION_INT8_KV_SPLITS"]
    x = torch.randn(1, 3, 65, 96, device="cuda", generator=generator).half()
    mean = torch.randn(1, 3, 96, device="cuda", generator=generator)
    for layout, tokens_per_scale in (("HND", 1), ("NHD", ai8.KEY_TOKENS_PER_SCALE)):
        failures += check_quantize(ai8, to_layout(x, layout), mean, 0.5, layout, tokens_per_scale)
    for kind in CENTER_KINDS:
        for seqlen, head_dim in ((77, 96), (1000, 128)):
            k = center_inputs(ai8, kind, seqlen, head_dim, device="cuda")
            center, ref = ai8.key_center(k), ai8.reference.key_center(k)
            if not torch.equal(center.nan_to_num(), ref.nan_to_num()) or not torch.equal(center.isnan(), ref.isnan()):
                failures.append(f"key_center {kind} N{seqlen} D{head_dim}: differs from the reference")
    for failure in failures:
        print("FAIL", failure)
    print(f"{len(ODD_CASES) + len(split_cases)} attention cases, 2 quantizer cases and {2 * len(CENTER_KINDS)} centre cases: "
          f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
