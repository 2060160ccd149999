"""Same key => same code: the key names exactly what the compile depends on.

- Environment settings that change Inductor's code generation: a build under
  each must have the default build's key *and* its generated code (the C++
  sources in the package, with the compile commands Inductor writes into them,
  build paths normalized), or another key.
- The ``sources`` closure covers every project file a compile executes.
- The CPU kernels' two files (``kernels/plain.py``, ``kernels/builtin.py``) are in
  every key, and an edit to either changes exactly its hash there.
- An artifact built for a CPU target this CPU cannot run is refused at engine start.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kernel_cache.config.recipe import (
    COUNTS,
    HASH_SEED,
    ISA_FLAGS,
    PINNED,
    classify,
    compile_environment,
    cpu_features,
)
from kernel_cache.errors import CpuTargetError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.plan.sources import source_files
from kernel_cache.runtime.load import load_plan
from kernel_cache.store.disk_tier import DiskTier
from warmup.check.verify import verify_plan

from ..conftest import N_TINY, ROOT, plain_args, run_cli

# -- same key => same code ----------------------------------------------------
_BUILD_ONE = r"""
import json, sys
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.config.engine import make_config
from kernel_cache.plan.keys import build_key
from warmup.builder.planner import warmup
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,), cpu_target=sys.argv[3])
v = [v for v in Bucketer(cfg).variants if str(v) == "batched_decode:1:2:4"][0]
r = warmup(cfg, sys.argv[2], jobs=1, progress=False, variants=[v])
print(json.dumps({"key": build_key(cfg, v).hexdigest, "compiled": r["compiled"],
                  "failed": r["failed"]}))
"""

_HASHED_NAME = re.compile(r"c[a-z0-9]{51}")


def _generated_code(cache: Path, key: str) -> list[str]:
    """The package's C++ sources (Inductor appends its compile commands to
    them), with build paths and content-hashed file names normalized."""
    tier = DiskTier(cache)
    try:
        data = tier.get(key).data
    finally:
        tier.close()
    out = []
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for name in sorted(z.namelist()):
            if name.endswith(".cpp"):
                text = z.read(name).decode()
                text = re.sub(r"/tmp/kernel_cache-inductor-[^/\s]+", "<SCRATCH>", text)
                text = re.sub(r"/tmp/torchinductor_[^/\s]+", "<INDUCTOR>", text)
                out.append(_HASHED_NAME.sub("<H>", text))
    return sorted(out)


def _build(tiny_model, cache: Path, extra_env: dict, cpu_target="x86-64-v3") -> dict:
    env = {**os.environ, **extra_env}
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_ONE, str(tiny_model), str(cache), cpu_target],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["compiled"] == 1 and not doc["failed"], doc
    return doc


#: Settings that change Inductor's CPU code when they reach it (each was seen
#: to: no OpenMP region, -O0 -g, autotuned templates, another -march).
CODEGEN_SETTINGS = [
    {"OMP_NUM_THREADS": "1"},
    {"AOT_INDUCTOR_DEBUG_COMPILE": "1"},
    {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"},
    {"TORCHINDUCTOR_CPP_MARCH": "x86-64"},
    {"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "0", "ATEN_CPU_CAPABILITY": "default"},
]


@pytest.fixture(scope="module")
def default_build(warm_cache, tiny_config):
    """The key and code of ``batched_decode:1:2:4`` as the run's warm cache has
    it: built by ``kernel-cache warmup`` in the test run's own environment."""
    (v,) = [v for v in Bucketer(tiny_config).variants if str(v) == "batched_decode:1:2:4"]
    key = build_key(tiny_config, v).hexdigest
    return key, _generated_code(warm_cache[0], key)


@pytest.mark.compile
def test_same_key_means_same_code_under_codegen_settings(tiny_model, tmp_path, default_build):
    """Every setting of :data:`CODEGEN_SETTINGS` at once in one builder's
    environment (one compile): the same key must give the same code."""
    key, code = default_build
    setting = {k: v for s in CODEGEN_SETTINGS for k, v in s.items()}
    doc = _build(tiny_model, tmp_path / "cache", setting)
    if doc["key"] == key:
        assert _generated_code(tmp_path / "cache", doc["key"]) == code
    else:  # another key is allowed; then it must name another build
        assert _generated_code(tmp_path / "cache", doc["key"]) != code


@pytest.mark.compile
def test_another_cpu_target_is_another_key_and_other_code(tiny_model, tmp_path, default_build):
    """The control: the comparison above sees a real difference of the code."""
    key, code = default_build
    doc = _build(tiny_model, tmp_path / "cache", {}, cpu_target="native")
    assert doc["key"] != key
    other = _generated_code(tmp_path / "cache", doc["key"])
    assert other != code
    assert any("march=native" in c for c in other)
    assert not any("march=native" in c for c in code)


def test_every_inductor_environment_variable_is_pinned():
    """Inductor's config reads its settings from the environment at import:
    every such variable of the installed torch must be pinned by warmup."""
    import torch._inductor.config as cfg

    names = set(
        re.findall(r"""environ\.get\(\s*["']([A-Z0-9_]+)["']""", Path(cfg.__file__).read_text())
    )
    names |= set(
        re.findall(r"""os\.getenv\(\s*["']([A-Z0-9_]+)["']""", Path(cfg.__file__).read_text())
    )
    assert len(names) > 50  # the scan found the config's variables
    unpinned = sorted(n for n in names if classify(n).action not in (PINNED, COUNTS))
    assert unpinned == [], unpinned
    assert classify("CXX").action == COUNTS
    env = compile_environment(
        {n: "1" for n in names} | {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"},
        "cpu",
        "x86-64-v3",
    )
    assert set(env) == {"PATH", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY", "CXX", "PYTHONHASHSEED"}
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["PYTHONHASHSEED"] == HASH_SEED


def test_linker_variables_that_reach_the_package_are_pinned():
    """GNU ld writes ``LD_RUN_PATH`` into a link without ``-rpath`` (Inductor's) as
    the .so's RUNPATH: a build with it set wrote other bytes under the same key."""
    assert classify("LD_RUN_PATH").action == PINNED
    env = compile_environment({"LD_RUN_PATH": "/opt/x", "PATH": "/usr/bin"}, "cpu", "x86-64-v3")
    assert "LD_RUN_PATH" not in env


@pytest.mark.slow
# -- the sources closure --------------------------------------------------------
def test_the_sources_closure_covers_every_project_file_a_compile_runs(tiny_config):
    """Export a variant under a profiler and record every file of kernel_cache/
    and warmup/ whose code ran: each must be hashed into the key."""
    from warmup.builder.compiler import export_variant, module_for

    ran: set[str] = set()
    roots = {str(ROOT / "kernel_cache"), str(ROOT / "warmup")}

    def profile(frame, event, arg):
        f = frame.f_code.co_filename
        if event == "call" and any(f.startswith(r) for r in roots):
            ran.add(str(Path(f).relative_to(ROOT)))

    for v in (Bucketer(tiny_config).variants[0], Bucketer(tiny_config).variants[-1]):
        sys.setprofile(profile)
        try:
            module_for(tiny_config, v)
            export_variant(tiny_config, v)
        finally:
            sys.setprofile(None)
    assert {"kernel_cache/kernels/builtin.py", "kernel_cache/kernels/plain.py"} <= ran
    assert "warmup/builder/compiler.py" in ran
    missing = sorted(ran - set(source_files()))
    assert missing == [], f"files the compile ran but the key does not hash: {missing}"


_SOURCES_OF = r"""
import json, sys
from kernel_cache.plan.sources import kernel_source_files, sources_component
from kernel_cache.config.kernel_paths import BUILTIN
print(json.dumps({"cpu": {s: json.loads(sources_component(kernel=cpu, slot=s))
                          for s, (cpu, _) in BUILTIN.items()},
                  "cuda": {s: json.loads(sources_component(kernel=cuda, slot=s))
                           for s, (_, cuda) in BUILTIN.items()},
                  "own": {s: kernel_source_files(cpu, s) for s, (cpu, _) in BUILTIN.items()}}))
"""


@pytest.mark.parametrize(
    "edited", ["kernel_cache/kernels/builtin.py", "kernel_cache/kernels/plain.py"]
)
def test_the_kernel_modules_are_in_every_key_and_an_edit_changes_it(tmp_path, edited):
    """The CPU kernels are two files, the plain kernels (``kernels/plain.py``) and
    the real-KV kernels built on them (``kernels/builtin.py``): both are in the
    ``sources`` component of every slot's key on both devices, and in the CPU
    built-in's own files (read from its import path). A line added to either, in
    a copy of the project run in a fresh process, changes that file's hash, and
    only that one, in every key."""
    tree = tmp_path / "tree"
    for pkg in ("kernel_cache", "warmup"):
        shutil.copytree(ROOT / pkg, tree / pkg, ignore=shutil.ignore_patterns("__pycache__"))

    def sources() -> dict:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = subprocess.run(
            [sys.executable, "-c", _SOURCES_OF], capture_output=True, text=True, env=env,
            cwd=tmp_path, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    before = sources()
    pair = {"kernel_cache/kernels/builtin.py", "kernel_cache/kernels/plain.py"}
    for device in ("cpu", "cuda"):
        for slot, files in before[device].items():
            assert pair <= set(files), (device, slot, sorted(files))
    for slot, files in before["own"].items():
        assert pair <= set(files), (slot, sorted(files))
    k = tree / edited
    k.write_text(k.read_text() + "\n# an edit that changes no behaviour\n")
    after = sources()
    for device in ("cpu", "cuda"):
        for slot, files in after[device].items():
            changed = sorted(f for f in files if files[f] != before[device][slot].get(f))
            assert changed == [edited], (device, slot, changed)


# -- the CPU target at engine start ------------------------------------------------
@pytest.mark.compile
def test_an_artifact_needing_a_missing_instruction_is_refused_at_engine_start(
    plain_cache_copy, plain_config, tiny_model
):
    """Rewrite one entry's recorded CPU features (metadata and its checksum
    are rewritten together by the tier) to need a flag this CPU lacks. The
    plain kernels' build: the refusal and the repair hold for any kernel, and
    the repair verify prints must name the engine's kernels to rebuild it."""
    have = cpu_features()
    if not have:
        pytest.skip("no /proc/cpuinfo here")
    lacking = next(f for f in ISA_FLAGS if f not in have)
    v = Bucketer(plain_config).variants[0]
    key = build_key(plain_config, v).hexdigest
    tier = DiskTier(plain_cache_copy)
    try:
        e = tier.get(key)
        assert e.meta["cpu_target"] == "x86-64-v3" and "avx2" in e.meta["cpu_features"]
        tier.put(key, e.data, {**e.meta, "cpu_features": e.meta["cpu_features"] + [lacking]})
    finally:
        tier.close()
    with pytest.raises(CpuTargetError) as info:
        load_plan(plain_config, plain_cache_copy)
    msg = str(info.value)
    assert str(v) in msg and lacking in msg and "--cpu-target" in msg
    report = verify_plan(plain_config, plain_cache_copy)
    assert not report["ok"] and [u["variant"] for u in report["unrunnable"]] == [str(v)]
    proc = run_cli("verify", *plain_args(tiny_model), "--cache-dir", plain_cache_copy)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert lacking in proc.stderr and ", 1 cannot run here, " in proc.stdout
    # The repair verify prints works: warmup sees that the entry records other
    # features than its key's target, quarantines it and builds it again.
    repair = proc.stderr.split("repair: kernel-cache ")[1].split()
    report = json.loads(run_cli(*repair, "--json", "--quiet", check=True).stdout)
    assert report["compiled"] == 1 and [q["variant"] for q in report["quarantined"]] == [str(v)]
    assert load_plan(plain_config, plain_cache_copy).counters["loads"] == N_TINY


def test_docs_list_the_environment_rules_the_code_applies():
    from kernel_cache.config.recipe import rules_markdown

    assert rules_markdown() in (ROOT / "docs" / "keys.md").read_text()


def test_the_config_accepts_exactly_the_recipes_cpu_targets():
    import typing

    from kernel_cache.config.engine import EngineConfig, make_config
    from kernel_cache.config.recipe import CPU_TARGET_NAMES
    from kernel_cache.errors import ConfigError

    ann = EngineConfig.model_fields["cpu_target"].annotation
    assert typing.get_args(ann) == CPU_TARGET_NAMES
    with pytest.raises(ConfigError, match="cpu_target"):
        make_config("llama-3.2-1b", cpu_target="x86-64-v4")
