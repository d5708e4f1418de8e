"""Packaging (CPU): build.toml is what kernel-builder reads, and the build has the layout and metadata the
kernels library loads and verifies.

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

from conftest import BUILD_DIR, ROOT, built_extension

BUILD_TOML = tomllib.loads((ROOT / "build.toml").read_text())
NAME = BUILD_TOML["general"]["name"]
PACKAGE = NAME.replace("-", "_")
REPO_ID = BUILD_TOML["general"]["hub"]["repo-id"]

# The op schemas of docs/DESIGN.md, without the namespace.
SCHEMAS = {
    "int8_attention_forward": "int8_attention_forward(Tensor q, Tensor k, Tensor v, bool is_causal=False, "
    'float? sm_scale=None, str tensor_layout="HND", bool smooth_k=True, bool balance_channels=True, bool smooth_q=True) '
    "-> Tensor",
    "int8_attention_forward_with_lse": "int8_attention_forward_with_lse(Tensor q, Tensor k, Tensor v, "
    'bool is_causal=False, float? sm_scale=None, str tensor_layout="HND", bool smooth_k=True, '
    "bool balance_channels=True, bool smooth_q=True) -> (Tensor, Tensor)",
    "int8_attention_varlen_forward": "int8_attention_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool is_causal=False, float? sm_scale=None, "
    "bool smooth_k=True, bool balance_channels=True, bool smooth_q=True) -> Tensor",
    "int8_attention_varlen_forward_with_lse": "int8_attention_varlen_forward_with_lse(Tensor q, Tensor k, Tensor v, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool is_causal=False, "
    "float? sm_scale=None, bool smooth_k=True, bool balance_channels=True, bool smooth_q=True) -> (Tensor, Tensor)",
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


# Makes every Python warning an error and prints every log record of WARNING and above on stderr.
STRICT = """
import logging, sys, warnings
warnings.simplefilter("error")
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
"""


def run_python(code: str, *, cwd: pathlib.Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (offline: nothing here may reach the network); fails on a non-zero exit."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    result = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, f"{code}\n--- stderr:\n{result.stderr}"
    return result


def load_build_local():
    spec = importlib.util.spec_from_file_location("build_local", ROOT / "scripts" / "build_local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def so() -> pathlib.Path:
    return built_extension()


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


def test_build_toml_parses_without_warnings():
    """The kernels package's own build.toml parser (the one kernel-builder shares) accepts the file as it is: an
    older edition is upgraded in memory with a warning on stderr, a rejected field raises."""
    pytest.importorskip("kernels._rust", reason="the kernels package parses build.toml")
    code = STRICT + f"""
import kernels._rust as rust
build = rust.Build.open({str(ROOT)!r})
assert build.general.backends == [rust.Backend.CUDA], build.general.backends
"""
    result = run_python(code)
    assert result.stderr == "", result.stderr
    assert BUILD_TOML["general"]["edition"] == 6
    assert {k["language"] for k in BUILD_TOML["kernel"].values()} == {"cpp-cuda"}


def test_build_toml_parser_rejects_an_edition_5_kernel(tmp_path):
    """The check above can fail: the same file with edition 5's `backend` key is refused by the same parser."""
    pytest.importorskip("kernels._rust", reason="the kernels package parses build.toml")
    text = (ROOT / "build.toml").read_text()
    assert 'language = "cpp-cuda"' in text
    (tmp_path / "build.toml").write_text(text.replace('language = "cpp-cuda"', 'backend = "cuda"'))
    result = subprocess.run([sys.executable, "-c", f"import kernels._rust as r; r.Build.open({str(tmp_path)!r})"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "language" in result.stderr, result.stderr


def test_local_build_reads_the_capabilities_and_ptx_from_build_toml():
    """scripts/build_local.py compiles each kernel for build.toml's capabilities as written, PTX only for the
    "+PTX" ones, and the objects of the last build were compiled with exactly those flags."""
    build_local = load_build_local()
    config = build_local.Config(ROOT / "build.toml")
    assert {k.name: k.capabilities for k in config.kernels} == {
        name: sorted(section["cuda-capabilities"], key=build_local._cap_key)
        for name, section in BUILD_TOML["kernel"].items()}
    portable = next(k for k in config.kernels if k.name == "attention_int8")
    flags = build_local.gencode_flags(portable.capabilities)
    assert [f for f in flags if "code=compute_" in f] == ["-gencode=arch=compute_120,code=compute_120"]
    assert {f.split("code=sm_")[1] for f in flags if "code=sm_" in f} == {"80", "86", "89", "90", "100", "120"}
    obj_dir = ROOT / "build" / "_obj" / BUILD_DIR.name
    if not list(obj_dir.glob("attention-int8_*.cu.cmd")):
        pytest.skip("no local-build nvcc command (a kernel-builder build)")
    # The build may have compiled a CUDA_CAPABILITIES subset; metadata.json records which.
    built = set(json.loads((BUILD_DIR / "metadata.json").read_text())["backend"]["archs"])
    for kernel in config.kernels:
        for src in (s for s in kernel.src if s.suffix == ".cu"):
            stamp = obj_dir / (src.relative_to(ROOT).as_posix().replace("/", "_") + ".cmd")
            used = [a for a in json.loads(stamp.read_text()) if a.startswith("-gencode=")]
            assert used == build_local.gencode_flags([c for c in kernel.capabilities if c in built]), src.name


def built_files() -> set[str]:
    return {p.relative_to(BUILD_DIR).as_posix() for p in BUILD_DIR.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_variant_layout(so):
    """kernel-builder's layout: the package's files in the variant directory itself, beside metadata.json, plus
    the compatibility package <name>/__init__.py."""
    sources = {p.name: p for p in (ROOT / "torch-ext" / PACKAGE).glob("*.py") if p.name != "_ops.py"}
    assert built_files() == {*sources, "_ops.py", so.name, "metadata.json", f"{PACKAGE}/__init__.py"}
    assert so.parent == BUILD_DIR
    assert re.fullmatch(rf"_{PACKAGE}_cuda_\w+\.abi3\.so", so.name)
    for name, src in sources.items():
        assert (BUILD_DIR / name).read_bytes() == src.read_bytes(), f"{name} is stale: run `make build`"


def test_compatibility_package_is_the_build(namespace):
    """`import attention_int8` with the variant directory on sys.path (how kernel-builder's test shells and older
    loaders import it) gives the build's package, registered once under its kernel id."""
    code = f"""
import sys
sys.path.insert(0, {str(BUILD_DIR)!r})
import attention_int8
assert attention_int8 is sys.modules[{namespace!r}], attention_int8
assert attention_int8.ops.name == {namespace!r}
assert callable(attention_int8.int8_attention_forward) and callable(attention_int8.reference.int8_attention_reference)
"""
    run_python(code, cwd=ROOT / "tests")


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
    """SASS runs on later minors of its own major only, PTX JITs upwards only: each generation needs one of the two,
    from the portable kernel's build.toml capabilities; a GPU after the last generation runs the "+PTX" one."""
    caps = BUILD_TOML["kernel"]["attention_int8"]["cuda-capabilities"]

    def version(cap):
        return tuple(int(x) for x in cap.removesuffix("+PTX").split("."))

    sass = [version(c) for c in caps if c.removesuffix("+PTX")[-1].isdigit()]
    ptx = [version(c) for c in caps if c.endswith("+PTX")]
    assert ptx, "no capability embeds PTX, so GPUs newer than the list get no kernel"
    for name, (major, minor) in {**GPU_CAPABILITIES, "a later GPU": (13, 0)}.items():
        assert any(m == major and n <= minor for m, n in sass) or min(ptx) <= (major, minor), (
            f"{name} (compute capability {major}.{minor}) has no SASS of its major and no PTX it can JIT: "
            f"add {major}.0 to build.toml")


def test_metadata(namespace):
    metadata = json.loads((BUILD_DIR / "metadata.json").read_text())
    caps = {c for k in BUILD_TOML["kernel"].values() for c in k["cuda-capabilities"]}
    assert metadata["name"] == NAME
    assert metadata["id"] == namespace
    assert metadata["version"] == BUILD_TOML["general"]["version"]
    assert metadata["license"] == BUILD_TOML["general"]["license"]
    assert metadata["build-layout"] == "files"
    assert metadata["backend"]["type"] == "cuda"
    assert set(metadata["backend"]["archs"]) <= caps and metadata["backend"]["archs"]
    # The digest covers every file of the variant except metadata.json itself.
    assert metadata["digest"]["algorithm"] == "sha256"
    assert set(metadata["digest"]["files"]) == built_files() - {"metadata.json"}
    pin = re.search(r"^kernels(\[[\w,]+\])?>=([\d.]+)$", (ROOT / "requirements-dev.txt").read_text(), re.MULTILINE)
    assert pin and metadata["kernels-minver"] == pin.group(2)


def test_metadata_loads_with_kernels(namespace):
    """kernels parses metadata.json, and the digest the build wrote is the one kernels computes from the files."""
    rust = pytest.importorskip("kernels._rust", reason="the kernels package parses metadata.json")
    parsed = rust.Metadata.read_from_file(BUILD_DIR / "metadata.json")
    assert (parsed.id, parsed.name.python_name, parsed.backend.backend_type) == (namespace, PACKAGE, rust.Backend.CUDA)
    assert parsed.build_layout == rust.BuildLayout.FILES and parsed.version == BUILD_TOML["general"]["version"]
    parsed.digest.validate(rust.Digest.hash_variant(rust.DigestAlgorithm.SHA256, BUILD_DIR))  # raises on a mismatch


def check_schemas(registered: dict[str, str], namespace: str):
    assert set(SCHEMAS) <= set(registered)
    for name, schema in SCHEMAS.items():
        assert registered[name] == str(torch._C.parse_schema(f"{namespace}::{schema}"))


def test_load_library_registers_the_schemas(so, namespace):
    registered = json.loads(run_python(f"import torch\ntorch.ops.load_library({str(so)!r})\nns = {namespace!r}\n"
                                       + DUMP_SCHEMAS).stdout)
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


def test_get_local_kernel_loads_without_warnings(namespace):
    """Loading through get_local_kernel verifies the digest and emits no warning (a missing digest, a dirty
    provenance or an unknown metadata field would each log one)."""
    pytest.importorskip("kernels", reason="the kernels package is not installed")
    build = ROOT / "build"
    code = STRICT + f"import kernels, pathlib\nns = kernels.get_local_kernel(pathlib.Path({str(build)!r})).__name__\n"
    result = run_python(code + DUMP_SCHEMAS)
    assert result.stderr == "", result.stderr
    check_schemas(json.loads(result.stdout), namespace)


def test_get_local_kernel_refuses_a_modified_build(tmp_path):
    """The digest is checked: a copy of the build with one changed file does not load."""
    pytest.importorskip("kernels", reason="the kernels package is not installed")
    copy = tmp_path / "build" / BUILD_DIR.name
    shutil.copytree(BUILD_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "layers.py", "a") as f:
        f.write("\n")
    code = f"import kernels, pathlib\nkernels.get_local_kernel(pathlib.Path({str(tmp_path / 'build')!r}))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0 and "layers.py" in result.stderr and "digest" in result.stderr, result.stderr


@pytest.mark.parametrize("source", ["hf-cache", "LOCAL_KERNELS"])
def test_get_kernel_from_the_hub_offline(source, namespace, tmp_path):
    """get_kernel(repo_id, version=1, trust_remote_code=True), served by a downloaded snapshot or by a LOCAL_KERNELS
    override, loads without a warning."""
    pytest.importorskip("kernels", reason="the kernels package is not installed")
    from _hub_cache import hub_cache

    env = hub_cache(tmp_path, REPO_ID, BUILD_DIR) if source == "hf-cache" else {"LOCAL_KERNELS": f"{REPO_ID}={ROOT}"}
    code = STRICT + f"import kernels\nmodule = kernels.get_kernel({REPO_ID!r}, version=1, trust_remote_code=True)\n"
    result = run_python(code + "ns = module.__name__\n" + DUMP_SCHEMAS, **env)
    assert result.stderr == "", result.stderr
    check_schemas(json.loads(result.stdout), namespace)


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
