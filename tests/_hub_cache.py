"""An offline Hugging Face hub cache holding one downloaded kernel version, laid out as huggingface_hub writes it."""

import hashlib
import os
import pathlib
import secrets
import shutil


def _etag(data: bytes, lfs: bool) -> str:
    """The blob name huggingface_hub stores a file under: the SHA-256 of an LFS file, else its git blob id."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_cache(root: pathlib.Path, repo_id: str, variant_dir: pathlib.Path, version: int = 1) -> dict[str, str]:
    """Caches `variant_dir` as build/<variant>/ of `repo_id` at a fresh commit that branch v<version> points to:

        kernels--<ns>--<name>/refs/v<version>                       the commit id
        kernels--<ns>--<name>/blobs/<etag>                          file contents
        kernels--<ns>--<name>/snapshots/<commit>/build/<variant>/…  relative symlinks to the blobs

    Returns the environment that points huggingface_hub (offline) at it.
    """
    repo = root / "hub" / f"kernels--{repo_id.replace('/', '--')}"
    commit = secrets.token_hex(20)
    snapshot = repo / "snapshots" / commit / "build" / variant_dir.name
    (repo / "blobs").mkdir(parents=True)
    for path in sorted(variant_dir.rglob("*")):
        rel = path.relative_to(variant_dir)
        if not path.is_file() or "__pycache__" in rel.parts:
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / _etag(data, lfs=path.suffix == ".so")
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / f"v{version}").write_text(commit)
    return {"HF_HUB_CACHE": str(root / "hub"), "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"}
