"""The link contract between the binding and the kernels (CPU).

The bug report's link failures: an `inline` launcher (never emitted, so the binding's call stays
undefined), a launcher defined with `int64_t timestep` but declared with `int` (two different
symbols), and functions declared `static` in one file and extern in another. Here the one header
attention-int8/attention_int8.h declares every launcher, both sides include it, both compile with
-Wmissing-declarations -Werror, and these tests check the result and that the defense still bites.
"""

import json
import pathlib
import re
import shutil
import subprocess

import pytest

from conftest import BUILD_DIR, ROOT, built_extension

HEADER = ROOT / "attention-int8" / "attention_int8.h"
BINDING = ROOT / "torch-ext" / "torch_binding.cpp"
OBJ_DIR = ROOT / "build" / "_obj" / BUILD_DIR.name  # the local build's objects and their commands

pytestmark = pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")


def symbols(path, *flags: str) -> dict[str, set[str]]:
    """Demangled symbol names of an object or library, by nm type letter (T defined, U undefined...)."""
    out = subprocess.run(["nm", "-C", *flags, str(path)], capture_output=True, text=True, check=True).stdout
    by_type: dict[str, set[str]] = {}
    for match in re.finditer(r"^\s*[0-9a-f]*\s+([A-Za-z])\s+(.+)$", out, re.M):
        by_type.setdefault(match[1], set()).add(match[2])
    return by_type


def launchers() -> list[str]:
    names = re.findall(r"^cudaError_t (launch_\w+)\(", HEADER.read_text(), re.M)
    assert names, f"no launcher declarations found in {HEADER}"
    return names


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return symbols(built_extension(), "-D", "--defined-only").get("T", set())


def test_launchers_are_exported_with_the_header_signatures(exported):
    for name in launchers():
        assert len([s for s in exported if s.startswith(f"attention_int8::{name}(")]) == 1, name
    assert "attention_int8::launch_attention_forward(attention_int8::AttentionParams const&, CUstream_st*)" in exported
    assert "attention_int8::launch_quantize(attention_int8::QuantizeParams const&, attention_int8::PackedSequences " \
        "const&, CUstream_st*)" in exported


def test_every_kernel_symbol_the_binding_calls_is_defined(exported):
    binding_obj = OBJ_DIR / "torch-ext_torch_binding.cpp.o"
    if not binding_obj.exists():
        pytest.skip("no local-build object of the binding (a kernel-builder build)")
    called = {s for s in symbols(binding_obj, "--undefined-only").get("U", set()) if s.startswith("attention_int8::")}
    assert called, "the binding calls no launcher"
    assert called <= exported


def test_binding_takes_the_launchers_from_the_header():
    source = BINDING.read_text()
    assert re.search(r'#include\s+"[^"]*attention_int8\.h"', source)
    assert not re.search(r"\bcudaError_t\s+(\w+::)*launch_\w+\s*\(", source), "the binding redeclares a launcher"
    stamp = OBJ_DIR / "torch-ext_torch_binding.cpp.cmd"
    if stamp.exists():
        assert {"-Wall", "-Wextra", "-Werror", "-Wmissing-declarations"} <= set(json.loads(stamp.read_text()))


def launcher(extra_parameter: str = "") -> str:
    return f"launch_attention_forward(const AttentionParams&, cudaStream_t{extra_parameter}) {{ return cudaSuccess; }}"


# A use of the launcher, so that the compiler checks its linkage rather than drop it as unused.
CALLER = "cudaError_t launch_quantize(const QuantizeParams&, const PackedSequences&, cudaStream_t s) " \
    "{ return launch_attention_forward({}, s); }"


@pytest.mark.parametrize(
    "code, error",
    [
        # The report's `int64_t timestep` definition against an `int` declaration: a second overload.
        ("cudaError_t " + launcher(", int64_t"), r"no previous declaration"),
        ("static cudaError_t " + launcher() + "\n" + CALLER, r"declared .extern. and later .static."),
        ("inline cudaError_t " + launcher(), None),  # compiles, but defines no symbol: caught above
    ],
    ids=["signature-drift", "static", "inline"],
)
def test_build_flags_reject_a_launcher_the_header_does_not_declare(tmp_path, code, error):
    stamp = OBJ_DIR / "attention-int8_quantize.cu.cmd"
    if not stamp.exists():
        pytest.skip("no local-build nvcc command (a kernel-builder build)")
    cmd = json.loads(stamp.read_text())
    # The build's own nvcc command, for one GPU target only (the host side is what is tested).
    gencodes = [c for c in cmd if c.startswith("-gencode")]
    cmd = [c for c in cmd[: cmd.index("-c")] if c not in gencodes[1:]]
    src, obj = tmp_path / "launcher.cu", tmp_path / "launcher.o"
    src.write_text(f'#include "attention_int8.h"\nnamespace attention_int8 {{\n{code}\n}}\n')
    result = subprocess.run([*cmd, f"-I{HEADER.parent}", "-c", str(src), "-o", str(obj)],
                            capture_output=True, text=True)
    output = result.stdout + result.stderr
    if error is not None:
        assert result.returncode != 0 and re.search(error, output), output
    else:
        assert result.returncode == 0, output
        assert not [s for s in symbols(obj, "--defined-only").get("T", set()) if "launch_attention_forward" in s]


def test_libstdcxx_is_shared(ai8):
    """A libstdc++ linked statically into the extension (toolchain wrappers that add -static-libstdc++)
    keeps uninitialised iostream facets: the first error message the binding formats segfaults."""
    so = next(pathlib.Path(ai8.__file__).parent.glob("_attention_int8_*.abi3.so"))
    needed = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in needed
    symbols = subprocess.run(["nm", "-C", "--defined-only", str(so)], capture_output=True, text=True, check=True).stdout
    assert "std::ostream::_M_insert" not in symbols
