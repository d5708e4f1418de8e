"""ABI check of the built extension(s) with kernel-abi-check (the library behind `kernel-builder check-abi`).

Enforced: only Python stable-ABI (abi3) symbols up to Python 3.9, so one .so serves every Python
>= 3.9. Reported: symbols newer than manylinux_2_28. Hub releases are built by kernel-builder with a
manylinux_2_28 toolchain; a local build links against the build host's glibc/libstdc++ (e.g. GCC 12
references __libc_single_threaded, GLIBC_2.32), which is fine for the machine that built it.

Usage: check_abi.py [SO ...]   (default: every .so under build/<variant>/)
"""

import pathlib
import sys

import kernel_abi_check

PYTHON_ABI = "3.9"
MANYLINUX = "manylinux_2_28"
BUILD = pathlib.Path(__file__).resolve().parent.parent / "build"


def main() -> int:
    paths = [pathlib.Path(p) for p in sys.argv[1:]] or sorted(
        p for p in BUILD.glob("*/**/*.so") if "_obj" not in p.relative_to(BUILD).parts
    )
    if not paths:
        print("check_abi: no built .so found; run `make build` first", file=sys.stderr)
        return 1
    failed = False
    for path in paths:
        obj = kernel_abi_check.ObjectFile(path)
        abi3 = obj.check_python_abi(PYTHON_ABI)
        manylinux = obj.check_manylinux(MANYLINUX)
        status = "FAIL" if abi3 else "ok"
        print(f"[abi] {status}: {path.name}: {len(abi3)} symbols outside the Python {PYTHON_ABI} stable ABI")
        for violation in abi3:
            print(f"[abi]   {violation}")
        for violation in manylinux:
            print(f"[abi]   note: {violation.name} needs {violation.dep} {violation.version} (> {MANYLINUX})")
        failed |= bool(abi3)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
