"""What importing the runtime and running the tensor-free commands imports.

Each case runs in a fresh interpreter and reads ``sys.modules`` at exit: an
engine's ``import kernel_cache`` and ``make_config`` import no torch, and the
commands that need no tensors (``--help``, ``--version``, ``ls``, ``stats``,
``gc``, ``clear``, ``keygen``, ``plan``, ``explain``) never import it either.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

import kernel_cache

from .conftest import ROOT

#: Run ``kernel-cache ARGV`` (``warmup.cli.main`` as ``__main__``) and print, at
#: exit, which of the heavy modules the process imported, as JSON on stderr's last line.
CLI = """
import atexit, json, runpy, sys
HEAVY = ("torch", "torch.export", "torch._dynamo", "torch._inductor", "triton")
atexit.register(lambda: print(json.dumps([m for m in HEAVY if m in sys.modules]), file=sys.stderr))
sys.argv = ["kernel-cache", *json.loads(sys.argv[1])]
runpy.run_module("warmup.cli.main", run_name="__main__", alter_sys=True)
"""


def imported_by(code: str) -> list[str]:
    """The heavy modules a fresh ``python -c code`` has imported when it ends."""
    probe = (
        f"{code}\nimport sys\n"
        "print([m for m in ('torch', 'torch.export', 'torch._dynamo', 'triton') "
        "if m in sys.modules])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return eval(proc.stdout.strip().splitlines()[-1])


def cli_imports(argv: list[str]) -> tuple[int, list[str], str]:
    """``(exit status, heavy modules imported, stdout)`` of ``kernel-cache ARGV``."""
    proc = subprocess.run(
        [sys.executable, "-c", CLI, json.dumps(argv)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    return proc.returncode, json.loads(proc.stderr.strip().splitlines()[-1]), proc.stdout


def test_import_kernel_cache_imports_no_torch():
    assert imported_by("import kernel_cache") == []


def test_make_config_imports_no_torch():
    code = "from kernel_cache import load_plan, make_config\nmake_config('llama-3.2-1b')"
    assert imported_by(code) == []


def test_load_plan_imports_torch_but_not_its_compile_stack():
    # the dispatcher needs torch; what loading imports is counted by test_compile_counter
    code = "import kernel_cache\nkernel_cache.AttentionRuntime"
    heavy = imported_by(code)
    assert "torch" in heavy and "torch._dynamo" not in heavy


def test_the_public_names_resolve_lazily_and_unknown_ones_fail():
    assert set(kernel_cache.__all__) <= set(dir(kernel_cache))
    for name in kernel_cache.__all__:
        module = importlib.import_module(kernel_cache._LAZY[name])
        assert getattr(kernel_cache, name) is getattr(module, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kernel_cache.nope  # noqa: B018
    ns = {}
    exec("from kernel_cache import *", ns)
    assert set(kernel_cache.__all__) <= set(ns)


def test_warmup_package_resolves_its_entry_point_lazily():
    assert imported_by("import warmup") == []
    code = (
        "import warmup\nfrom warmup.builder.planner import warmup as w\n"
        "assert warmup.warmup is w\nfrom warmup import warmup as w2\nassert w2 is w"
    )
    imported_by(code)
    import warmup

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        warmup.nope  # noqa: B018


def test_torch_version_without_torch_is_torch_version():
    code = (
        "import sys\nfrom kernel_cache.plan.keys import torch_version\n"
        "v = torch_version()\nassert 'torch' not in sys.modules\n"
        "import torch\nassert v == torch.__version__ and type(v) is str, (v, torch.__version__)"
    )
    assert "torch" in imported_by(code)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["plan"],
        ["plan", "--json"],
        ["warmup", "--help"],
        ["keygen", "--help"],
        ["tune", "--help"],
    ],
    ids=" ".join,
)
def test_tensor_free_commands_import_no_torch(argv):
    rc, heavy, out = cli_imports(argv)
    assert rc == 0 and heavy == [] and out


@pytest.mark.parametrize(
    "argv",
    [
        ["ls"],
        ["stats"],
        ["gc", "--max-size", "1G"],
        ["clear"],
        ["explain"],
        ["gc", "--max-size", "1G", "--keep-plan", ""],
    ],
    ids=" ".join,
)
def test_housekeeping_and_explain_import_no_torch(argv, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    rc, heavy, _ = cli_imports([*argv, "--cache-dir", str(cache)])
    assert rc == 0 and heavy == []


def test_keygen_imports_no_torch(tmp_path):
    rc, heavy, _ = cli_imports(["keygen", str(tmp_path / "k")])
    assert rc == 0 and heavy == []


def test_warmup_s_check_of_the_cache_imports_no_torch():
    """The warmup process sorts its plan into cached and to-do, then leaves the
    compiles to its workers: what a cached entry must record is found without
    torch (about 1 s of CPU a warmup)."""
    code = (
        "from kernel_cache.config.engine import make_config\n"
        "from warmup.builder.worker import recorded_cpu_features\n"
        "assert recorded_cpu_features(make_config('llama-3.2-1b'))"
    )
    assert imported_by(code) == []


def test_engine_start_without_remote_urls_imports_no_remote_tier(tmp_path):
    # load_plan on an empty cache, no KERNEL_CACHE_REDIS_URL / _S3_URL: the remote
    # tiers' modules (and their pydantic models) are not imported
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    code = (
        "import sys\nfrom kernel_cache import load_plan, make_config\n"
        f"load_plan(make_config('llama-3.2-1b'), cache_dir={str(cache)!r}, strict=False)\n"
        "mods = ('kernel_cache.store.redis', 'kernel_cache.store.s3', "
        "'kernel_cache.store.s3_client', 'kernel_cache.store.s3_objects', "
        "'kernel_cache.store.s3_manifest', "
        "'kernel_cache.store.remote_base', 'redis', 'boto3')\n"
        "print([m for m in mods if m in sys.modules])"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_CACHE_")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
