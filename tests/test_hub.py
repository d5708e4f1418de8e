"""The hub side (CPU): the README's load snippet against an offline hub cache, the hub card and benchmark, the
release workflow's namespace guard and flake.lock commit, the pinned kernel-builder, and a newcomer's commands."""

import ast
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

from _hub_cache import hub_cache
from conftest import BUILD_DIR, ROOT

BUILD_TOML = tomllib.loads((ROOT / "build.toml").read_text())
REPO_ID = BUILD_TOML["general"]["hub"]["repo-id"]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"


def readme_snippet() -> str:
    """The README's first Python block that calls get_kernel: the one a newcomer copies."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    snippet = next((b for b in blocks if "get_kernel(" in b), None)
    assert snippet, "README.md has no ```python block that calls get_kernel("
    return snippet


def get_kernel_calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) or getattr(n.func, "attr", None)) == "get_kernel"]


# Runs the snippet's statements up to the get_kernel call; on a GPU the rest too, else it checks that every
# function the rest calls on the loaded kernel exists. Prints the loaded module's name.
RUN_SNIPPET = """
import ast, json, logging, os, sys, warnings
import torch
warnings.simplefilter("error")
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
tree = ast.parse(os.environ["SNIPPET"])
split = next(i for i, s in enumerate(tree.body) if "get_kernel(" in ast.unparse(s)) + 1
scope = {}
exec(compile(ast.Module(tree.body[:split], []), "README.md", "exec"), scope)
name = tree.body[split - 1].targets[0].id
rest = ast.Module(tree.body[split:], [])
if torch.cuda.is_available():
    exec(compile(rest, "README.md", "exec"), scope)
used = sorted({n.attr for n in ast.walk(rest) if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == name})
missing = [a for a in used if not callable(getattr(scope[name], a, None))]
print(json.dumps({"module": scope[name].__name__, "used": used, "missing": missing}))
"""


def test_readme_snippet_loads_from_an_offline_hub_cache(tmp_path):
    """The README's own snippet, run as written against a hub cache holding this build as the Hub serves it."""
    pytest.importorskip("kernels", reason="the kernels package is not installed")
    snippet = readme_snippet()
    calls = get_kernel_calls(ast.parse(snippet))
    assert len(calls) == 1
    kwargs = {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords}
    assert ast.literal_eval(calls[0].args[0]) == REPO_ID  # the namespace build.toml publishes to
    assert kwargs.get("version") == BUILD_TOML["general"]["version"] and kwargs.get("trust_remote_code") is True
    env = {**os.environ, **hub_cache(tmp_path, REPO_ID, BUILD_DIR, version=kwargs["version"]), "SNIPPET": snippet,
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("LOCAL_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", RUN_SNIPPET], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    report = json.loads(result.stdout)
    metadata = json.loads((BUILD_DIR / "metadata.json").read_text())
    assert report["module"] == metadata["id"]
    assert "int8_attention_forward" in report["used"] and not report["missing"], report


def tracked_text_files() -> list[pathlib.Path]:
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith((".py", ".md", ".yml", ".nix")) and (ROOT / n).is_file()]


def test_every_get_kernel_call_names_a_version():
    """kernels refuses a get_kernel call with a repo id alone, without version= or revision= (since 0.15): no
    snippet, docstring or test may show one."""
    # A call whose first argument is a string literal or a name (f-string templates in tests are left out).
    pattern = re.compile(r"""get_kernel\(\s*((?:"[^"\n]*"|'[^'\n]*'|[A-Za-z_][\w.]*)[^()]*)\)""")
    calls = [(path.relative_to(ROOT), m.group(1)) for path in tracked_text_files()
             for m in pattern.finditer(path.read_text(errors="replace"))]
    assert calls
    bad = [f"{path}: get_kernel({args})" for path, args in calls if not re.search(r"\b(version|revision)\s*=", args)]
    assert not bad, bad


def test_card_renders_with_usage():
    """CARD.md is the template kernel-builder fills (minijinja) into the hub page; jinja2 renders the same syntax."""
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    card = env.from_string((ROOT / "CARD.md").read_text()).render(
        repo_id=REPO_ID, version=BUILD_TOML["general"]["version"], license=BUILD_TOML["general"]["license"],
        has_benchmark=True, source=None, upstream=None, functions=[], layers=[])
    assert card.startswith("---\nlibrary_name: kernels\nlicense: apache-2.0\n")
    assert f'get_kernel("{REPO_ID}", version=1, trust_remote_code=True)' in card
    assert f"kernels benchmark {REPO_ID} --version 1" in card
    checks = (ROOT / "torch-ext" / "attention_int8" / "_checks.py").read_text()  # the head dims' one home
    head_dims = ast.literal_eval(re.search(r"^SUPPORTED_HEAD_DIMS = (.*)$", checks, re.MULTILINE).group(1))
    assert f"| head dims | {', '.join(map(str, head_dims))} |" in card


def test_hub_benchmark_is_discovered_by_kernels():
    """`kernels benchmark` finds benchmarks/benchmark*.py's Benchmark classes, each timed workload with its set-up."""
    benchmark_cli = pytest.importorskip("kernels._internals.cli.benchmark", reason="the kernels CLI is not installed")
    from kernels.benchmark import Benchmark

    scripts = benchmark_cli.discover_benchmark_scripts(".", ROOT)
    assert [s.name for s in scripts] == ["benchmark_attention.py"]
    classes = benchmark_cli.discover_benchmark_classes(scripts[0], ROOT)
    assert len(classes) == 1 and issubclass(classes[0], Benchmark)
    workloads = {n.removeprefix("benchmark_") for n in dir(classes[0]) if n.startswith("benchmark_")}
    assert workloads >= {"image", "video", "d64", "prefill_gqa"}
    for name in workloads:
        assert callable(getattr(classes[0], f"setup_{name}", None)), name
    verified = {n.removeprefix("verify_") for n in dir(classes[0]) if n.startswith("verify_")}
    assert verified <= workloads and len(verified) >= 3


def workflow_step(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    return next(s for job in jobs.values() for s in job["steps"] if s.get("name") == name)


def run_step(step: dict, cwd: pathlib.Path, output: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs a workflow step's script as the runner would; its outputs land in `output`."""
    output.write_text("")
    return subprocess.run(["bash", "-c", step["run"]], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "GITHUB_OUTPUT": str(output), **env})


@pytest.mark.parametrize("input_repo_id, build_toml_repo_id, expected", [
    ("", "alice/attention-int8", "alice/attention-int8"),
    ("bob-org/attention-int8", "your-namespace/attention-int8", "bob-org/attention-int8"),
    ("", "your-namespace/attention-int8", None),
    ("kernels-community/attention-int8", "alice/attention-int8", None),
    ("", "kernels-community/attention-int8", None),
    ("no-namespace", "alice/attention-int8", None),
])
def test_release_refuses_kernels_community(tmp_path, input_repo_id, build_toml_repo_id, expected):
    """The release uploads to the repo_id input, else build.toml's repo-id, and never to kernels-community or
    the placeholder namespace."""
    step = workflow_step("Resolve the hub repository")
    (tmp_path / "build.toml").write_text((ROOT / "build.toml").read_text().replace(REPO_ID, build_toml_repo_id))
    result = run_step(step, tmp_path, tmp_path / "github-output", {"INPUT_REPO_ID": input_repo_id})
    if expected is None:
        assert result.returncode != 0 and "::error::" in result.stdout, result.stdout + result.stderr
    else:
        assert result.returncode == 0, result.stdout + result.stderr
        assert (tmp_path / "github-output").read_text() == f"repo_id={expected}\n"


def test_release_commits_the_namespace_and_flake_lock(tmp_path):
    """Without a flake.lock, the release locks the flake, commits it with a repo_id input written into build.toml,
    pushes the commit to release/<ref> and builds that commit; `nix` is a stand-in that writes a lock file."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    step = workflow_step("Commit the namespace and flake.lock the release is built from")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    origin, work, bin_dir = tmp_path / "origin.git", tmp_path / "work", tmp_path / "bin"
    subprocess.run([*git, "init", "-q", "--bare", str(origin)], check=True)
    subprocess.run([*git, "init", "-q", str(work)], check=True)
    shutil.copy(ROOT / "build.toml", work)
    shutil.copy(ROOT / "flake.nix", work)
    subprocess.run([*git, "add", "."], cwd=work, check=True)
    subprocess.run([*git, "commit", "-qm", "release"], cwd=work, check=True)
    subprocess.run([*git, "remote", "add", "origin", str(origin)], cwd=work, check=True)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=work, capture_output=True, text=True).stdout.strip()
    bin_dir.mkdir()
    (bin_dir / "nix").write_text('#!/bin/sh\n[ "$1 $2" = "flake lock" ] && echo \'{"version": 7}\' > flake.lock\n')
    (bin_dir / "nix").chmod(0o755)
    env = {"REPO_ID": "alice/attention-int8", "GITHUB_SHA": sha, "GITHUB_REF_NAME": "v1.0.0",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = run_step(step, work, tmp_path / "github-output", env)
    assert result.returncode == 0, result.stdout + result.stderr
    built = (tmp_path / "github-output").read_text().removeprefix("sha=").strip()
    pushed = subprocess.run(["git", "rev-parse", "release/v1.0.0"], cwd=origin, capture_output=True, text=True)
    assert pushed.stdout.strip() == built != sha
    files = subprocess.run(["git", "show", "--name-only", "--format=", f"{sha}..{built}"], cwd=work,
                           capture_output=True, text=True, check=True).stdout.split()
    assert sorted(files) == ["build.toml", "flake.lock"]
    released = subprocess.run(["git", "show", f"{built}:build.toml"], cwd=work, capture_output=True, text=True)
    assert tomllib.loads(released.stdout)["general"]["hub"]["repo-id"] == "alice/attention-int8"
    assert subprocess.run(["git", "status", "--porcelain"], cwd=work, capture_output=True, text=True).stdout == ""


def test_release_uploads_with_kernel_builder():
    script = workflow_step("Build, check and upload via Hugging Face Jobs")["with"]["script"]
    assert re.search(r'^kernel-builder upload --repo-id "\$\{REPO_ID\}" .* \.$', script, re.MULTILINE), script
    assert 'git checkout "${{ needs.prepare.outputs.sha }}"' in script


def test_flake_pins_kernel_builder_to_a_commit():
    url = re.search(r'kernel-builder\.url = "([^"]+)"', (ROOT / "flake.nix").read_text()).group(1)
    assert re.fullmatch(r"github:huggingface/kernels/[0-9a-f]{40}", url), url
    if not (ROOT / "flake.lock").exists():
        assert "nix flake lock" in workflow_step("Commit the namespace and flake.lock the release is built from")["run"]


def test_requirements_pin_the_kernels_version_the_package_needs():
    """The pin is a lower bound the test environment meets; kernels.__version__ is what the loader checks."""
    kernels = pytest.importorskip("kernels")
    pin = re.search(r"^kernels(\[[\w,]+\])?>=([\d.]+)$", (ROOT / "requirements-dev.txt").read_text(), re.MULTILINE)
    assert pin, "requirements-dev.txt does not pin a minimum kernels version"
    installed = tuple(int(x) for x in re.match(r"[\d.]+", kernels.__version__).group().rstrip(".").split("."))
    assert installed >= tuple(int(x) for x in pin.group(2).split(".")) >= (0, 16)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_reports_skip_reasons():
    result = subprocess.run(["make", "-n", "test", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    pytest_line = next(line for line in result.stdout.splitlines() if "-m pytest" in line)
    assert " -rs " in f" {pytest_line} ", pytest_line


def test_sanitizer_cases_without_a_gpu_exits_with_a_message():
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "sanitizer_cases.py")], capture_output=True,
                            text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "CUDA GPU" in result.stderr
