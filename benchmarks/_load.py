"""Import attention_int8 from the local build (`make build` writes build/<variant>/attention_int8)."""

import importlib
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def find_build_dir() -> pathlib.Path:
    """build/<variant> for the running torch, e.g. build/torch211-cxx11-cu130-x86_64-linux."""
    major, minor = torch.__version__.split(".")[:2]
    cuda = "".join(torch.version.cuda.split(".")[:2])
    return ROOT / "build" / f"torch{major}{minor}-cxx11-cu{cuda}-x86_64-linux"


def load_package():
    """The package as the hub would load it (`kernels.get_local_kernel`) if `kernels` is installed, else imported
    from build/<variant> on sys.path. Returns (module, how it was loaded)."""
    build_dir = find_build_dir()
    if not (build_dir / "attention_int8" / "__init__.py").exists():
        raise SystemExit(f"{build_dir}/attention_int8 is missing: run `make build` first")
    try:
        from kernels import get_local_kernel
    except ImportError:
        sys.path.insert(0, str(build_dir))
        module, how = importlib.import_module("attention_int8"), "sys.path import"
    else:
        module, how = get_local_kernel(ROOT), "kernels.get_local_kernel"
    return module, f"{how} of {pathlib.Path(module.__file__).parent}"
