"""Shared test set-up: import the package from the local build (`make build`) and mark GPU tests."""

import importlib.util
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
    """Import attention_int8 from build/<variant>/ (fails loudly if `make build` was not run).

    The local build nests the package (build/<variant>/attention_int8/); kernel-builder's Nix build may
    lay it out flat (build/<variant>/__init__.py). Both are accepted.
    """
    if "attention_int8" in sys.modules:
        return sys.modules["attention_int8"]
    package_dir = BUILD_DIR / "attention_int8"
    if not (package_dir / "__init__.py").exists():
        package_dir = BUILD_DIR
    init = package_dir / "__init__.py"
    if not init.exists():
        raise RuntimeError(f"{BUILD_DIR} holds no attention_int8 package: run `make build` first")
    spec = importlib.util.spec_from_file_location("attention_int8", init, submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["attention_int8"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def ai8():
    return load_package()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
