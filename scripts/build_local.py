"""Non-Nix build of the kernel into the kernels-hub layout, with nvcc and the installed torch.

Reads the sources and CUDA capabilities from build.toml (the file kernel-builder reads), compiles the
.cu files and the torch binding in parallel with warnings as errors, links the abi3 extension and
assembles the variant directory as kernel-builder lays it out:
    build/torch<XY>-cxx11-cu<ZZ>-<arch>-<os>/{metadata.json, *.py, _ops.py, _attention_int8_cuda_<rev>.abi3.so}
    build/torch<XY>-cxx11-cu<ZZ>-<arch>-<os>/attention_int8/__init__.py   (the compatibility package)
which `kernels.get_local_kernel(Path("build"))` and `torch.ops.load_library` both load. metadata.json records
the digest of every file, as `kernel-builder hash` writes it, so the loader can verify the build.

Environment: CUDA_CAPABILITIES="9.0 12.0" builds a subset (quick device builds), MAX_JOBS caps the
parallel compiles, CUDA_HOME (default /usr/local/cuda) picks the toolkit, HOST_CXX the host
compiler (default g++: see host_cxx). `--import-check` only imports the built package in a fresh interpreter.
"""

import argparse
import base64
import concurrent.futures
import hashlib
import importlib.util
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import torch

TORCH_DIR = pathlib.Path(torch.__file__).parent
ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
PTX = "+PTX"  # build.toml's marker of a capability whose PTX is embedded next to its SASS


class Kernel:
    """One [kernel.<name>] section in C++/CUDA; capabilities as written, e.g. "9.0a" or "12.0+PTX"."""

    def __init__(self, name: str, section: dict):
        self.name = name
        self.src = [ROOT / s for s in section["src"]]
        self.include_dirs = [ROOT / d for d in section.get("include", [])]
        self.capabilities = sorted(section["cuda-capabilities"], key=_cap_key)


class Config:
    """What build.toml says, narrowed to the torch extension with CUDA kernels."""

    def __init__(self, path: pathlib.Path):
        toml = tomllib.loads(path.read_text())
        general = toml["general"]
        self.name = general["name"]
        self.python_name = self.name.replace("-", "_")
        self.version = general["version"]
        self.license = general["license"]
        self.torch_src = [ROOT / s for s in toml["torch"]["src"]]
        self.kernels = [Kernel(n, k) for n, k in toml.get("kernel", {}).items() if k["language"] == "cpp-cuda"]


def _cap_key(cap: str) -> tuple[int, int, str]:
    """Orders "8.0" < "9.0" < "9.0a" < "12.0"; a/f suffixes are arch- and family-specific targets."""
    target = cap.removesuffix(PTX)
    major, minor = target.rstrip("af").split(".")
    return int(major), int(minor), cap[len(target.rstrip("af")):]


def capabilities(kernel: Kernel) -> list[str]:
    """The kernel's capabilities, narrowed by CUDA_CAPABILITIES="9.0 12.0" (which also selects 9.0a and 12.0+PTX).

    A kernel the override leaves without any (e.g. a Hopper-only one) keeps its own: its launchers
    must still link, and the binding only calls them on GPUs they were built for.
    """
    wanted = set(os.environ.get("CUDA_CAPABILITIES", "").replace(",", " ").replace(";", " ").split())
    return [c for c in kernel.capabilities if c.removesuffix(PTX).rstrip("af") in wanted] or kernel.capabilities


def gencode_flags(caps: list[str]) -> list[str]:
    """SASS for every capability, and PTX for the "+PTX" ones, as kernel-builder compiles them."""
    flags = []
    for cap in caps:
        arch = cap.removesuffix(PTX).replace(".", "")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if cap.endswith(PTX):
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    return flags


def metadata_archs(kernels: list[Kernel]) -> list[str]:
    """Every compiled capability in build.toml's notation, which is also the one the kernels loader reads."""
    return sorted({c for kernel in kernels for c in capabilities(kernel)}, key=_cap_key)


def kernels_minver() -> str:
    """The oldest kernels library the build supports: requirements-dev.txt's pin, the one home of that number."""
    requirements = (ROOT / "requirements-dev.txt").read_text()
    pins = re.findall(r"^kernels(?:\[[\w,]+\])?>=([\d.]+)\s*$", requirements, re.MULTILINE)
    if len(pins) != 1:
        sys.exit("requirements-dev.txt must pin the kernels library as one `kernels>=X.Y.Z` line")
    return pins[0]


def variant_digest(variant_dir: pathlib.Path) -> dict:
    """SHA-256 of every file of the variant, base64, by relative path: the digest `kernel-builder hash` records.

    metadata.json (which holds the digest) and its signature are left out, as are Python bytecode files,
    which the interpreter writes beside the sources after the build.
    """
    files = {}
    for path in sorted(variant_dir.rglob("*")):
        rel = path.relative_to(variant_dir)
        if (not path.is_file() or rel.as_posix() in ("metadata.json", "metadata.json.sigstore")
                or "__pycache__" in rel.parts or path.suffix == ".pyc"):
            continue
        files[rel.as_posix()] = base64.b64encode(hashlib.sha256(path.read_bytes()).digest()).decode()
    return {"algorithm": "sha256", "files": files}


def variant_name() -> str:
    """The hub variant this torch loads, e.g. torch214-cxx11-cu130-x86_64-linux."""
    if torch.version.cuda is None:
        sys.exit(f"torch {torch.__version__} has no CUDA support: install a CUDA build of torch")
    major, minor = torch.__version__.split(".")[:2]
    cuda = "".join(torch.version.cuda.split(".")[:2])
    abi = "cxx11" if torch.compiled_with_cxx11_abi() else "cxx98"
    return f"torch{major}{minor}-{abi}-cu{cuda}-{platform.machine()}-{platform.system().lower()}"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def revision(sources: list[pathlib.Path]) -> str:
    """Short HEAD commit (+ "_dirty" for uncommitted changes to tracked files), as Nix builds name it.

    Without a commit (a fresh `git init`, or a source tarball) the sources' content hash stands in,
    so the op namespace still changes whenever the code does.
    """
    rev = _git("rev-parse", "--short=7", "HEAD")
    if rev is None:
        digest = hashlib.sha256()
        for src in sorted(sources):
            digest.update(src.read_bytes())
        rev = f"src{digest.hexdigest()[:7]}"
    elif _git("status", "--porcelain", "--untracked-files=no"):
        rev += "_dirty"
    return re.sub(r"\W", "_", rev)


def cuda_home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")


def wheel_cuda_includes() -> list[pathlib.Path]:
    """Headers of the CUDA libraries torch's nvidia-* wheels ship (cusparse.h, cublas_v2.h, ...).

    ATen/cuda headers include them, and a minimal toolkit (nvcc + cudart) lacks them.
    """
    spec = importlib.util.find_spec("nvidia")
    locations = spec.submodule_search_locations if spec and spec.submodule_search_locations else []
    return sorted(p for loc in locations for p in pathlib.Path(loc).glob("*/include"))


def torch_cxx_standard(torch_include: pathlib.Path) -> str:
    """c++20 for torch whose ATen.h demands it (2.14 and newer), else c++17, as torch's cpp_extension picks."""
    aten = (torch_include / "ATen" / "ATen.h").read_text()
    return "c++20" if "C++20 or later" in aten else "c++17"


def compile_commands(config: Config, ops_name: str, obj_dir: pathlib.Path, jobs: int):
    """(object, command) for every translation unit: each .cu for its kernel's capabilities, then the binding."""
    cuda = cuda_home()
    defines = [
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        "-DUSE_CUDA=1",
        "-DCUDA_KERNEL",  # kernel-builder defines both for CUDA builds
    ]
    cu_files = [(k, s) for k in config.kernels for s in k.src if s.suffix == ".cu"]
    nvcc = [
        str(cuda / "bin" / "nvcc"), "-std=c++17", "-O3", "-lineinfo", "--expt-relaxed-constexpr",
        "-Werror", "all-warnings",
        # Host side too: a launcher defined with a signature the header does not declare is an error.
        "-Xcompiler", "-fPIC,-fno-gnu-unique,-Wall,-Wextra,-Wmissing-declarations,-Werror",
        # nvcc compiles one gencode target per thread; share the cores among the .cu files.
        f"--threads={max(1, jobs // max(1, len(cu_files)))}",
        *defines,
    ]
    # torch, Python and CUDA headers are -isystem: warnings as errors apply to our code only.
    torch_include = TORCH_DIR / "include"
    system = [torch_include, torch_include / "torch" / "csrc" / "api" / "include", sysconfig.get_paths()["include"],
              cuda / "include", *wheel_cuda_includes()]
    cxx = [
        # The binding must use the C++ standard its torch was built with (C++17 headers compiled as C++20
        # can disagree with libtorch on inline code); the torch-free .cu files stay at C++17.
        host_cxx(), f"-std={torch_cxx_standard(torch_include)}", "-O3", "-fPIC", "-fno-gnu-unique",
        "-Wall", "-Wextra", "-Werror", "-Wmissing-declarations",
        # Only the binding names the namespace, so a new revision does not recompile the kernels.
        f"-DTORCH_EXTENSION_NAME={ops_name}", "-DPy_LIMITED_API=0x03090000", *defines,
        *(f"-I{d}" for k in config.kernels for d in k.include_dirs), *(f"-isystem{d}" for d in system),
    ]
    units = [(s, [*nvcc, *gencode_flags(capabilities(k)), *(f"-I{d}" for d in k.include_dirs)])
             for k, s in cu_files]
    units += [(s, cxx) for s in config.torch_src if s.suffix == ".cpp"]
    return [
        (obj, [*base, "-c", str(src), "-o", str(obj)])
        for src, base in units
        for obj in [obj_dir / (src.relative_to(ROOT).as_posix().replace("/", "_") + ".o")]
    ]


def host_cxx() -> str:
    """The C++ compiler for the binding and the link: HOST_CXX, else plain g++ from PATH.

    Not $CXX: images set it to wrappers that add -static-libstdc++ (the H200 image does), and an
    extension with its own libstdc++ crashes inside torch (see check_shared_libstdcxx).
    """
    return os.environ.get("HOST_CXX") or "g++"


def check_shared_libstdcxx(so: pathlib.Path) -> None:
    """Fail the build if the extension carries its own libstdc++ instead of linking the shared one."""
    dynamic = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    if "libstdc++.so" not in dynamic:
        sys.exit(f"{so} does not link libstdc++.so dynamically (was it linked with -static-libstdc++?); "
                 "its iostreams would crash inside torch. Set HOST_CXX to a plain g++.")


def up_to_date(obj: pathlib.Path, cmd: list[str], inputs: list[pathlib.Path]) -> bool:
    """An object is reused only if it is newer than every input and was built by the same command."""
    stamp = obj.with_suffix(".cmd")
    return (
        obj.exists()
        and stamp.exists()
        and json.loads(stamp.read_text()) == cmd
        and all(obj.stat().st_mtime >= i.stat().st_mtime for i in inputs)
    )


def run(cmd: list[str]) -> str | None:
    """Runs a compiler; returns its command line and output if it failed."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    return f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}" if result.returncode else None


def build(config: Config) -> pathlib.Path:
    variant = variant_name()
    kernel_src = [s for k in config.kernels for s in k.src]
    package_py = sorted(p for p in (ROOT / "torch-ext" / config.python_name).glob("*.py") if p.name != "_ops.py")
    ops_name = f"_{config.python_name}_cuda_{revision(config.torch_src + kernel_src + package_py)}"
    obj_dir = BUILD / "_obj" / variant
    obj_dir.mkdir(parents=True, exist_ok=True)
    jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)

    # Headers are not tracked per object: any change to a listed source rebuilds everything.
    inputs = [*config.torch_src, *kernel_src, ROOT / "build.toml", ROOT / "torch-ext" / "registration.h"]
    commands = compile_commands(config, ops_name, obj_dir, jobs)
    todo = [(obj, cmd) for obj, cmd in commands if not up_to_date(obj, cmd, inputs)]
    archs = metadata_archs(config.kernels)
    print(f"[build] {variant}, namespace {ops_name}, archs {' '.join(archs)}: "
          f"{len(todo)} of {len(commands)} objects to compile with {jobs} jobs", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run, cmd): (obj, cmd) for obj, cmd in todo}
        failures = []
        for future in concurrent.futures.as_completed(futures):
            obj, cmd = futures[future]
            if future.result() is not None:
                failures.append(future.result())
            else:
                obj.with_suffix(".cmd").write_text(json.dumps(cmd))  # also read by the tests
                print(f"[build] compiled {obj.name}", flush=True)
    if failures:
        sys.exit("\n\n".join(failures))

    so = obj_dir / "extension.so"  # installed under its revision's name below
    link_dirs = [TORCH_DIR / "lib", cuda_home() / "lib64"]
    # The same libraries torch.utils.cpp_extension links; no rpath: importing torch loads them first.
    libs = ["c10", "torch", "torch_cpu", "torch_cuda", "c10_cuda", "cudart"]
    # libstdc++ must be the process's shared one: a copy linked statically into the extension (some
    # toolchain wrappers add -static-libstdc++) has its own uninitialised iostream facets, and the first
    # error message formatted in the binding segfaults. The explicit -lstdc++ resolves every C++ runtime
    # symbol against libstdc++.so before any static archive is considered; check_shared_libstdcxx verifies.
    failure = run([host_cxx(), "-shared", *(str(o) for o, _ in commands), "-o", str(so),
                   *(f"-L{d}" for d in link_dirs), *(f"-l{lib}" for lib in libs),
                   "-Wl,--push-state,--no-as-needed", "-lstdc++", "-Wl,--pop-state"])
    if failure:
        sys.exit(failure)
    check_shared_libstdcxx(so)

    variant_dir = BUILD / variant
    shutil.rmtree(variant_dir, ignore_errors=True)  # no stale .so or .py of an earlier revision
    variant_dir.mkdir(parents=True)
    for py in package_py:
        shutil.copy2(py, variant_dir)
    (variant_dir / "_ops.py").write_text(
        "import torch\n"
        f"from . import {ops_name}\n"
        f"ops = torch.ops.{ops_name}\n\n\n"
        "def add_op_namespace_prefix(op_name: str) -> str:\n"
        '    """Prefix an op name with the namespace of this build."""\n'
        f'    return f"{ops_name}::{{op_name}}"\n'
    )
    shutil.copy2(so, variant_dir / f"{ops_name}.abi3.so")
    compat = variant_dir / config.python_name
    compat.mkdir()
    (compat / "__init__.py").write_text(COMPAT_INIT.format(kernel_id=ops_name))
    metadata = {
        "name": config.name,
        "id": ops_name,
        "version": config.version,
        "license": config.license,
        "build-layout": "files",
        "kernels-minver": kernels_minver(),
        "python-depends": [],
        "kernel-depends": [],
        "backend": {"type": "cuda", "archs": archs},
        "digest": variant_digest(variant_dir),
    }
    (variant_dir / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    print(f"[build] wrote {variant_dir.relative_to(ROOT)} (torch {torch.__version__})", flush=True)
    return variant_dir


# The package directory kernel-builder keeps in each variant for older loaders and `import attention_int8` with
# the variant on sys.path: it imports the variant's package under the build's kernel id, the module name the
# kernels library gives it too, so both ways of loading share one module.
COMPAT_INIT = '''"""Compatibility package: the build in the parent directory."""

import importlib.util
import pathlib
import sys

_KERNEL_ID = "{kernel_id}"
if _KERNEL_ID not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_KERNEL_ID, pathlib.Path(__file__).parent.parent / "__init__.py")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_KERNEL_ID] = _module
    try:
        _spec.loader.exec_module(_module)
    except BaseException:
        del sys.modules[_KERNEL_ID]
        raise
# The import statement returns what sys.modules holds under this name once this file has run.
sys.modules[__name__] = sys.modules[_KERNEL_ID]
'''


def import_check(config: Config) -> None:
    """Import the built package in a fresh interpreter, as a hub loader would, and name its ops."""
    variant_dir = BUILD / variant_name()
    code = (
        "import importlib, importlib.util, sys, torch\n"
        f"spec = importlib.util.spec_from_file_location({config.python_name!r}, {str(variant_dir / '__init__.py')!r})\n"
        "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "ops = importlib.import_module(spec.name + '._ops').ops\n"
        "print(f'[import-check] {spec.origin}: torch.ops.{ops.name}')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--import-check", action="store_true", help="only import the built package")
    args = parser.parse_args()
    config = Config(ROOT / "build.toml")
    if not args.import_check:
        build(config)
    import_check(config)


if __name__ == "__main__":
    main()
