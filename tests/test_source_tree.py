"""The package's sources without a build (CPU): `attention_int8.reference` imports as part of the package.

The build generates `_ops.py` (the op namespace); the source tree has none. The package's .py files are copied
without it, so the test also holds where a Nix build has written `_ops.py` into torch-ext/.
"""

import shutil
import subprocess
import sys

import torch
import torch.nn.functional as F

from _helpers import Case, assert_accurate, make_qkv
from conftest import ROOT

# Runs in a fresh interpreter: the session's `attention_int8` is the build's, imported under the same name.
CODE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import attention_int8
from attention_int8 import reference

assert reference.__name__ == "attention_int8.reference", reference.__name__
q, k, v = torch.load(sys.argv[2])
torch.save(reference.int8_attention_reference(q, k, v, is_causal=True), sys.argv[3])
try:
    attention_int8.int8_attention_forward
except AttributeError as error:
    print(error)
"""


def test_reference_imports_without_a_build(tmp_path):
    package = tmp_path / "src" / "attention_int8"
    package.mkdir(parents=True)
    for py in (ROOT / "torch-ext" / "attention_int8").glob("*.py"):
        if py.name != "_ops.py":
            shutil.copy2(py, package)
    assert (package / "reference.py").exists() and not (package / "_ops.py").exists()
    q, k, v = make_qkv(Case(heads_q=4, heads_kv=2, seqlen_q=150, seqlen_kv=150, head_dim=128), "cpu")
    torch.save((q, k, v), tmp_path / "qkv.pt")

    result = subprocess.run([sys.executable, "-c", CODE, str(package.parent), str(tmp_path / "qkv.pt"),
                             str(tmp_path / "out.pt")], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "needs the built kernel" in result.stdout and "make build" in result.stdout, result.stdout

    out = torch.load(tmp_path / "out.pt")
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_accurate(out, exact, "the source tree's reference")
