"""Shared test set-up: import the package from the local build (`make build`) and mark GPU tests."""

import importlib
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # shared test helpers (_helpers.py)


def build_variant() -> str:
    """The kernels-hub variant name of the running torch, e.g. torch214-cxx11-cu130-x86_64-linux."""
    major, minor = torch.__version__.split(".")[:2]
    cuda = torch.version.cuda
    if cuda is None:
        raise RuntimeError("a CUDA build of torch is required to build and load attention_int8")
    cu = "".join(cuda.split(".")[:2])
    return f"torch{major}{minor}-cxx11-cu{cu}-x86_64-linux"


BUILD_DIR = ROOT / "build" / build_variant()


def load_package():
    """Import attention_int8 from build/<variant>/ (fails loudly if `make build` was not run)."""
    if not (BUILD_DIR / "attention_int8" / "__init__.py").exists():
        raise RuntimeError(f"{BUILD_DIR}/attention_int8 is missing: run `make build` first")
    if str(BUILD_DIR) not in sys.path:
        sys.path.insert(0, str(BUILD_DIR))
    return importlib.import_module("attention_int8")


@pytest.fixture(scope="session")
def ai8():
    return load_package()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
