"""Packaging (CPU): the build has the kernels-hub layout and loads like a hub kernel.

Every loader runs in a fresh interpreter, so each one proves on its own that the .so registers the ops
(one process would load the library once and let a later loader ride on an earlier one).
"""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import torch

from conftest import BUILD_DIR, ROOT

BUILD_TOML = tomllib.loads((ROOT / "build.toml").read_text())
NAME = BUILD_TOML["general"]["name"]
PACKAGE = NAME.replace("-", "_")
REPO_ID = BUILD_TOML["general"]["hub"]["repo-id"]

# The op schemas of docs/DESIGN.md, without the namespace.
SCHEMAS = {
    "int8_attention_forward": "int8_attention_forward(Tensor q, Tensor k, Tensor v, bool is_causal=False, "
    'float? sm_scale=None, str tensor_layout="HND", bool smooth_k=True) -> Tensor',
    "int8_attention_forward_with_lse": "int8_attention_forward_with_lse(Tensor q, Tensor k, Tensor v, "
    'bool is_causal=False, float? sm_scale=None, str tensor_layout="HND", bool smooth_k=True) -> (Tensor, Tensor)',
    "quantize_int8": 'quantize_int8(Tensor x, Tensor? mean, float out_scale=1.0, str tensor_layout="HND", '
    "int tokens_per_scale=1) -> (Tensor, Tensor)",
    "key_center": 'key_center(Tensor k, str tensor_layout="HND") -> Tensor',
}

# Prints {op name: schema} for the ops of the loaded namespace; the loading code is prepended.
DUMP_SCHEMAS = """
import json, torch
names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith(ns + "::")]
print(json.dumps({n.split("::")[1]: str(getattr(getattr(torch.ops, ns), n.split("::")[1]).default._schema)
                  for n in names}))
"""


def run_python(code: str, **env: str) -> str:
    """Runs code in a fresh interpreter (offline: nothing here may reach the network); returns stdout."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    result = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"{code}\n--- stderr:\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def so() -> pathlib.Path:
    libs = sorted((BUILD_DIR / PACKAGE).glob("*.so"))
    if len(libs) != 1:
        pytest.fail(f"expected one extension in {BUILD_DIR / PACKAGE}, found {libs}: run `make build`")
    return libs[0]


@pytest.fixture(scope="module")
def namespace(so) -> str:
    return so.name.split(".")[0]


def test_build_toml_lists_every_source():
    """kernel-builder's Nix build sees only the files build.toml lists; the local build must not see more."""
    kernel_src = {s for k in BUILD_TOML["kernel"].values() for s in k["src"]}
    assert kernel_src == {p.relative_to(ROOT).as_posix() for p in (ROOT / "attention-int8").iterdir()}
    binding = {p.relative_to(ROOT).as_posix() for p in (ROOT / "torch-ext").glob("*.[ch]*") if p.is_file()}
    # kernel-builder generates registration.h and refuses to overwrite a listed one.
    assert set(BUILD_TOML["torch"]["src"]) == binding - {"torch-ext/registration.h"}


def test_build_toml_is_valid_for_kernel_builder():
    rust = pytest.importorskip("kernels._rust", reason="the kernels package validates build.toml")
    build = rust.Build.open(ROOT)  # raises on any field kernel-builder would reject
    assert build.general.backends == [rust.Backend.CUDA]


def test_variant_layout(so):
    assert {p.name for p in BUILD_DIR.iterdir()} == {"metadata.json", PACKAGE}
    sources = {p.name: p for p in (ROOT / "torch-ext" / PACKAGE).glob("*.py") if p.name != "_ops.py"}
    built = {p.name for p in (BUILD_DIR / PACKAGE).iterdir() if p.name != "__pycache__"}
    assert built == {*sources, "_ops.py", so.name}
    assert re.fullmatch(rf"_{PACKAGE}_cuda_\w+\.abi3\.so", so.name)
    for name, src in sources.items():
        assert (BUILD_DIR / PACKAGE / name).read_bytes() == src.read_bytes(), f"{name} is stale: run `make build`"


def test_namespace_is_the_git_revision(namespace):
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("no git commit: the build names the namespace after a content hash")
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert namespace == f"_{PACKAGE}_cuda_{head.stdout.strip()}" + ("_dirty" if dirty else "")


def test_ops_module_names_the_built_namespace(ai8, namespace):
    ops_module = sys.modules[f"{ai8.__name__}._ops"]
    assert ops_module.ops.name == namespace
    assert ops_module.add_op_namespace_prefix("quantize_int8") == f"{namespace}::quantize_int8"


# GPUs of compute capability 8.0 and newer by generation (what the README promises to run on).
GPU_CAPABILITIES = {"A100": (8, 0), "A10 / RTX 3090": (8, 6), "Jetson Orin": (8, 7), "L40 / RTX 4090": (8, 9),
                    "H100 / H200": (9, 0), "B200 / GB200": (10, 0), "B300": (10, 3), "RTX 5090": (12, 0),
                    "DGX Spark (GB10)": (12, 1)}


def test_every_gpu_generation_gets_kernel_code():
    """SASS runs on later minors of its own major only, PTX JITs upwards only: each generation needs one of the two.
    The portable kernel's capabilities, and the PTX the build embeds for them (scripts/build_local.py)."""
    spec = importlib.util.spec_from_file_location("build_local", ROOT / "scripts" / "build_local.py")
    build_local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_local)
    caps = build_local.Kernel("attention_int8", BUILD_TOML["kernel"]["attention_int8"]).capabilities

    def version(cap):
        return tuple(int(x) for x in cap.split("."))

    sass = [version(c) for c in caps if c[-1].isdigit()]
    ptx = version(build_local.ptx_capability(caps))
    for name, (major, minor) in GPU_CAPABILITIES.items():
        assert any(m == major and n <= minor for m, n in sass) or ptx <= (major, minor), (
            f"{name} (compute capability {major}.{minor}) has no SASS of its major and no PTX it can JIT: "
            f"add {major}.0 to build.toml")


def test_metadata(namespace):
    metadata = json.loads((BUILD_DIR / "metadata.json").read_text())
    caps = {c for k in BUILD_TOML["kernel"].values() for c in k["cuda-capabilities"]}
    assert metadata["name"] == NAME
    assert metadata["id"] == namespace
    assert metadata["version"] == BUILD_TOML["general"]["version"]
    assert metadata["backend"]["type"] == "cuda"
    archs = [a.removesuffix("+PTX") for a in metadata["backend"]["archs"]]
    assert set(archs) <= caps and archs


def test_metadata_loads_with_kernels(namespace):
    rust = pytest.importorskip("kernels._rust", reason="the kernels package parses metadata.json")
    parsed = rust.Metadata.read_from_file(BUILD_DIR / "metadata.json")
    assert (parsed.id, parsed.name.python_name, parsed.backend.backend_type) == (namespace, PACKAGE, rust.Backend.CUDA)


def check_schemas(registered: dict[str, str], namespace: str):
    assert set(SCHEMAS) <= set(registered)
    for name, schema in SCHEMAS.items():
        assert registered[name] == str(torch._C.parse_schema(f"{namespace}::{schema}"))


def test_load_library_registers_the_schemas(so, namespace):
    registered = json.loads(run_python(f"import torch\ntorch.ops.load_library({str(so)!r})\nns = {namespace!r}\n"
                                       + DUMP_SCHEMAS))
    check_schemas(registered, namespace)


def test_ops_have_cuda_and_meta_kernels(ai8, namespace):
    for name in SCHEMAS:
        for key in ("CUDA", "Meta"):  # Meta: shapes for FakeTensor / torch.compile
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{name}", key), (name, key)


def test_timestep_argument_is_gone(ai8, namespace):
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith(namespace + "::")]
    assert names
    for name in names:
        schema = getattr(getattr(torch.ops, namespace), name.split("::")[1]).default._schema
        assert not [a.name for a in schema.arguments if "timestep" in a.name], str(schema)


def test_get_local_kernel(namespace):
    pytest.importorskip("kernels", reason="the kernels package is not installed")
    code = f"import kernels, pathlib\nns = kernels.get_local_kernel(pathlib.Path({str(ROOT / 'build')!r})).__name__\n"
    registered = json.loads(run_python(code + DUMP_SCHEMAS))
    check_schemas(registered, namespace)


def fake_hub_cache(tmp_path: pathlib.Path) -> dict[str, str]:
    """A Hugging Face cache holding a downloaded v1 of the hub repo: build/<variant> at a commit."""
    commit = "0" * 39 + "1"
    repo = tmp_path / "hub" / f"kernels--{REPO_ID.replace('/', '--')}"
    shutil.copytree(BUILD_DIR, repo / "snapshots" / commit / "build" / BUILD_DIR.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(commit)
    return {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}


@pytest.mark.parametrize("source", ["hf-cache", "LOCAL_KERNELS"])
def test_get_kernel_from_the_hub_offline(source, namespace, tmp_path):
    """get_kernel(repo_id, version=1), served by a downloaded snapshot or by a LOCAL_KERNELS override."""
    pytest.importorskip("kernels", reason="the kernels package is not installed")
    env = fake_hub_cache(tmp_path) if source == "hf-cache" else {"LOCAL_KERNELS": f"{REPO_ID}={ROOT}"}
    code = f"import kernels\nmodule = kernels.get_kernel({REPO_ID!r}, version=1)\nns = module.__name__\n"
    registered = json.loads(run_python(code + DUMP_SCHEMAS, **env))
    check_schemas(registered, namespace)


def test_kernel_abi_check(so):
    pytest.importorskip("kernel_abi_check", reason="the kernel-abi-check package is not installed")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_abi.py"), str(so)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_hardcoded_home_directories():
    """The bug report's first build failure: a Makefile pointing at one user's home directory."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    assert files
    # Bracketed letters keep these patterns from matching their own source line.
    pattern = re.compile(r"/hom[e]/[A-Za-z0-9_.-]+|/roo[t]/|/User[s]/[A-Za-z0-9_.-]+|codespac[e]")
    hits = []
    for name in files:
        path = ROOT / name
        data = path.read_bytes() if path.is_file() else b""
        if b"\0" not in data:
            hits += [f"{name}: {m.group()}" for m in pattern.finditer(data.decode("utf-8", "replace"))]
    assert not hits


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("has_profile", [True, False])
def test_makefile_finds_nix_through_home(tmp_path, has_profile):
    profile = tmp_path / ".nix-profile" / "etc" / "profile.d" / "nix.sh"
    if has_profile:
        profile.parent.mkdir(parents=True)
        profile.write_text("")
    probe = tmp_path / "probe.mk"
    probe.write_text("probe:\n\t@echo '$(NIX_ENV)'\n")
    result = subprocess.run(["make", "-s", "-f", "Makefile", "-f", str(probe), "probe", f"PYTHON={sys.executable}"],
                            cwd=ROOT, env={**os.environ, "HOME": str(tmp_path)}, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == (f". {profile};" if has_profile else "")
