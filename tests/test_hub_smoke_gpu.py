"""The fast GPU smoke set that kernel-builder's `nix run .#ci-test` runs (`pytest -m kernels_ci`): the kernel loaded
the way a user loads it, `kernels.get_kernel(repo_id, version=...)`, served by LOCAL_KERNELS (ci-test sets it to
the fresh build; otherwise it points at this checkout's build/), then checked against float64 attention and the
PyTorch reference of the scheme."""

import os
import tomllib

import pytest
import torch

from _helpers import Case, check_case
from conftest import ROOT, requires_cuda

GENERAL = tomllib.loads((ROOT / "build.toml").read_text())["general"]

pytestmark = [pytest.mark.kernels_ci, requires_cuda]

CASES = [
    Case(batch=2, heads_q=4, heads_kv=4, seqlen_q=300, seqlen_kv=300, head_dim=128, is_causal=True),
    Case(heads_q=8, heads_kv=2, seqlen_q=129, seqlen_kv=777, head_dim=64, dtype=torch.bfloat16, layout="NHD",
         kind="k_offset"),
    Case(heads_q=3, heads_kv=3, seqlen_q=200, seqlen_kv=200, head_dim=96, kind="q_shift"),
]


@pytest.fixture(scope="module")
def hub_kernel():
    kernels = pytest.importorskip("kernels")
    with pytest.MonkeyPatch.context() as env:
        if "LOCAL_KERNELS" not in os.environ:
            env.setenv("LOCAL_KERNELS", f"{GENERAL['hub']['repo-id']}={ROOT}")
        return kernels.get_kernel(GENERAL["hub"]["repo-id"], version=GENERAL["version"], trust_remote_code=True)


def test_loaded_through_the_hub_loader(hub_kernel):
    assert hub_kernel.__name__ == hub_kernel.ops.name  # kernels names the module after the build's kernel id
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{hub_kernel.ops.name}::int8_attention_forward", "CUDA")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_accurate(hub_kernel, case):
    failures = check_case(hub_kernel, case)
    assert not failures, failures
