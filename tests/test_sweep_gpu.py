"""Seeded randomized shape sweep on the GPU against the float64 and INT8 references.

Shapes and values are seeded, so a failure reproduces exactly; the odd shapes of _helpers.ODD_CASES (the
ones tests/sanitizer_cases.py runs under compute-sanitizer) come first.
"""

import random

import pytest
import torch

from _helpers import HEAD_DIMS, KINDS, ODD_CASES, Case, check_case, kernel_params, select_kernel
from conftest import requires_cuda

pytestmark = requires_cuda

SEED = 20261202


def _random_cases(count):
    rng = random.Random(SEED)
    for _ in range(count):
        heads_kv, group = rng.choice((1, 2, 3)), rng.choice((1, 2, 4))
        yield Case(batch=rng.choice((1, 2, 3)), heads_q=heads_kv * group, heads_kv=heads_kv,
                   seqlen_q=int(2 ** rng.uniform(0, 12)), seqlen_kv=int(2 ** rng.uniform(0, 12)),  # 1 .. 4095
                   head_dim=rng.choice(HEAD_DIMS), is_causal=rng.random() < 0.5,
                   dtype=rng.choice((torch.float16, torch.bfloat16)), layout=rng.choice(("HND", "NHD")),
                   kind=rng.choice(KINDS))


CASES = list(ODD_CASES) + list(_random_cases(60))


@pytest.mark.parametrize("case, kernel", kernel_params(CASES))
def test_sweep(ai8, monkeypatch, case, kernel):
    select_kernel(monkeypatch, kernel)
    failures = check_case(ai8, case, torch.Generator("cuda").manual_seed(SEED + CASES.index(case)))
    assert not failures, failures
