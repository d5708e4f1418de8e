"""Shared test set-up: import the package from the local build (`make build`), mark GPU and hub CI tests."""

import importlib.util
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # shared test helpers (_helpers.py)


def pytest_configure(config):
    # kernel-builder's `nix run .#ci-test` runs `pytest -m kernels_ci` on tests/: the fast GPU smoke set.
    config.addinivalue_line("markers", "kernels_ci: fast GPU smoke tests that kernel-builder's CI test target runs")


def build_variant() -> str:
    """The kernels-hub variant name of the running torch, e.g. torch214-cxx11-cu130-x86_64-linux."""
    major, minor = torch.__version__.split(".")[:2]
    cuda = torch.version.cuda
    if cuda is None:
        raise RuntimeError("a CUDA build of torch is required to build and load attention_int8")
    cu = "".join(cuda.split(".")[:2])
    return f"torch{major}{minor}-cxx11-cu{cu}-x86_64-linux"


BUILD_DIR = ROOT / "build" / build_variant()


def built_extension() -> pathlib.Path:
    """The build's one extension, build/<variant>/_attention_int8_cuda_<rev>.abi3.so."""
    libs = sorted(BUILD_DIR.glob("*.so"))
    if len(libs) != 1:
        pytest.fail(f"expected one extension in {BUILD_DIR}, found {libs}: run `make build`")
    return libs[0]


def load_package():
    """Import attention_int8 from build/<variant>/ (fails loudly if `make build` was not run).

    The package files lie in the variant directory itself, as kernel-builder lays them out.
    """
    if "attention_int8" in sys.modules:
        return sys.modules["attention_int8"]
    init = BUILD_DIR / "__init__.py"
    if not init.exists():
        raise RuntimeError(f"{BUILD_DIR} holds no attention_int8 package: run `make build` first")
    spec = importlib.util.spec_from_file_location("attention_int8", init, submodule_search_locations=[str(BUILD_DIR)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["attention_int8"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def ai8():
    return load_package()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                   reason="needs compute capability 9.0")
