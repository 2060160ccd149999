"""Key hygiene: what moves with a cache still hits, what changes the code misses.

A change of torch, device architecture, kernel source, dtype or compile option
is simulated by rewriting a real warmed cache as if it had been warmed with
that component different (``kc_helpers.rekey``); a kernel source edit is also
made for real, in a copy of the package run in a fresh process.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from kernel_cache import load_plan
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import BUILD_ONLY, RUNTIME_COMPONENTS, build_key
from kernel_cache.runtime.load import default_tiers
from kernel_cache.store.disk_tier import DiskTier
from warmup.check.explain import explain, short

from ..conftest import N_TINY, ROOT, TINY_VARIANTS, run_cli, tiny_args
from ..kc_helpers import engine_start, other_user_kwargs, rekey, world_readable_dir

pytestmark = pytest.mark.compile


def test_build_only_components_are_declared():
    assert BUILD_ONLY == ("cxx",)
    assert "compile_options" in RUNTIME_COMPONENTS and "cxx" not in RUNTIME_COMPONENTS


def test_moved_cache_hits_under_another_home_user_and_gpu_index(cache_copy, tiny_model):
    user_kwargs, user_env = other_user_kwargs()
    with world_readable_dir() as root:
        moved = root / "elsewhere" / "mounted-cache"
        moved.parent.mkdir()
        shutil.move(str(cache_copy), str(moved))
        model = root / "config.json"
        shutil.copy(tiny_model, model)
        home = root / "other-home"
        home.mkdir()
        if user_kwargs:  # the other user owns its copy of the cache
            for p in [home, moved, *moved.rglob("*")]:
                os.chown(p, 65534, 65534)
        env = {
            **os.environ,
            **user_env,
            "HOME": str(home),
            "CUDA_VISIBLE_DEVICES": "2",
            "KERNEL_CACHE_DIR": str(moved),
        }
        env.pop("KERNEL_CACHE_BUNDLE", None)
        doc = engine_start(model, "-", env=env, user_kwargs=user_kwargs)
    assert "missing" not in doc, doc
    assert doc["stats"]["loads"] == N_TINY and doc["stats"]["compiles"] == 0
    assert doc["stats"]["sources"] == {str(moved): N_TINY}
    assert doc["stats"]["build_only_accepted"] == {}  # an exact hit: same compiler here


@pytest.mark.parametrize(
    "component,value",
    [
        ("torch", "2.14.1"),
        ("device_arch", "x86_64/native 0badf00d"),
        ("sources", '{"kernel_cache/kernels/builtin.py":"0000000000000000"}'),
        ("dtype", "bfloat16"),
        ("compile_options", '{"max_autotune": true}'),
    ],
)
def test_a_changed_component_misses_and_explain_names_it(cache_copy, tiny_config, component, value):
    rekey(cache_copy, {component: value})
    rt = load_plan(tiny_config, cache_copy, strict=False)
    assert rt.counters["loads"] == 0  # never the artifact built under other conditions
    report = explain(tiny_config, default_tiers(cache_copy))
    assert report["misses"] == N_TINY and len(report["results"]) == N_TINY
    for r in report["results"]:
        best = r["nearest"][0]
        assert best["variant"] == r["variant"]
        assert [d["component"] for d in best["differences"]] == [component]
        here = build_key(tiny_config, Bucketer(tiny_config).variants[0]).as_dict()[component]
        if component == "sources":  # explain lists the files that differ
            assert best["lines"][0].startswith("sources: kernel_cache/kernels/builtin.py changed; ")
            assert "warmup/builder/compiler.py new" in best["lines"][0]
        elif component == "compile_options":  # field by field, both values
            assert best["lines"][0].startswith("compile_options: ")
            assert "max_autotune: false != true" in best["lines"][0]
        else:
            assert best["lines"] == [f"{component}: {short(here)} != {short(value)}"]


def test_explain_cli_names_torch_on_a_simulated_upgrade(cache_copy, tiny_model):
    rekey(cache_copy, {"torch": "2.14.1"})
    import torch

    proc = run_cli("explain", *tiny_args(tiny_model), "--cache-dir", cache_copy, check=True)
    assert f"{N_TINY} miss" in proc.stdout
    assert proc.stdout.count(f"torch: {torch.__version__} != 2.14.1") >= N_TINY
    proc = run_cli(
        "explain",
        *tiny_args(tiny_model),
        "--cache-dir",
        cache_copy,
        "--variant",
        "batched_decode:1:2:4",
        "--json",
        check=True,
    )
    r = json.loads(proc.stdout)["results"][0]
    assert r["status"] == "miss" and r["nearest"][0]["variant"] == "batched_decode:1:2:4"
    assert r["nearest"][0]["lines"] == [f"torch: {torch.__version__} != 2.14.1"]


def test_another_cxx_is_accepted_at_load_but_warmup_sees_a_miss(cache_copy, tiny_config):
    rekey(cache_copy, {"cxx": "gcc 99.1.0"})
    rt = load_plan(tiny_config, cache_copy)
    assert rt.counters["loads"] == N_TINY
    assert rt.build_only_accepted["cxx"]["stored"] == ["gcc 99.1.0"]
    tier = DiskTier(cache_copy)  # warmup checks the exact key: it would compile afresh
    assert all(
        tier.get(build_key(tiny_config, v).hexdigest) is None
        for v in Bucketer(tiny_config).variants
    )
    tier.close()
    report = explain(tiny_config, default_tiers(cache_copy), list(Bucketer(tiny_config).variants))
    assert {r["status"] for r in report["results"]} == {"hit"}
    assert report["results"][0]["accepted"]["cxx"]["stored"] == "gcc 99.1.0"


@pytest.mark.parametrize(
    "edited",
    [
        None,
        "kernel_cache/kernels/builtin.py",  # the kernel
        "kernel_cache/kernels/plain.py",  # the plain kernels the built-in ones extend
        "warmup/builder/compiler.py",  # the compile recipe (export and Inductor settings)
        "kernel_cache/config/recipe.py",  # the declared options, pinned environment, CPU targets
    ],
)
def test_an_edited_source_of_the_compile_path_misses_in_a_fresh_process(
    warm_cache, tiny_model, tmp_path, edited
):
    """A copy of the project with nothing changed hits from another install path;
    with one line added to a file of the compile path (same installed version)
    it misses everything, never loads the old artifact, and explain names the
    file under the ``sources`` component."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "kernel_cache", tree / "kernel_cache")
    shutil.copytree(ROOT / "warmup", tree / "warmup")
    if edited:
        k = tree / edited
        k.write_text(k.read_text() + "\n# an edit that changes no behaviour\n")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("KERNEL_CACHE_BUNDLE", None)
    doc = engine_start(tiny_model, warm_cache[0], env=env, cwd=tree)
    assert doc["kernel_cache"].startswith(str(tree)), doc["kernel_cache"]
    if not edited:
        assert doc["stats"]["loads"] == N_TINY and doc["stats"]["compiles"] == 0
        return
    assert len(doc["missing"]) == N_TINY and "stats" not in doc
    proc = subprocess.run(
        [sys.executable, "-m", "warmup.cli.main", "explain", *map(str, tiny_args(tiny_model))]
        + ["--cache-dir", str(warm_cache[0]), "--variant", TINY_VARIANTS[0], "--json"],
        capture_output=True,
        text=True,
        cwd=tree,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)["results"][0]
    assert r["status"] == "miss"
    assert [d["component"] for d in r["nearest"][0]["differences"]] == ["sources"]
    assert r["nearest"][0]["lines"] == [f"sources: {edited} changed"]


def test_the_closure_leaves_out_modules_the_compile_path_does_not_import():
    """The closure is read from the code: explain.py is not imported by the
    compile path, so editing it keeps every key (and the kernels, kernels/builtin.py
    and the kernels/plain.py it imports, are in it)."""
    from kernel_cache.plan.sources import source_files

    files = source_files()
    assert "kernel_cache/kernels/builtin.py" in files and "warmup/builder/compiler.py" in files
    assert "kernel_cache/kernels/plain.py" in files
    assert "warmup/check/explain.py" not in files and "warmup/builder/planner.py" not in files


def test_compile_options_this_torch_lacks_are_left_out():
    """torch 2.11 has no aot_inductor.enable_line_tables: the compiler must drop
    it there, not fail every compile."""
    from torch._inductor import config as inductor_config

    from warmup.builder.compiler import _has_option

    assert _has_option(inductor_config, "max_autotune")
    assert not _has_option(inductor_config, "aot_inductor.no_such_option")
    assert not _has_option(inductor_config, "no_such_group.option")


_REPIN = r"""
import json, os, sys, tempfile
from kernel_cache.errors import ConfigError
from warmup.builder import compiler

NAMES = ("AOT_INDUCTOR_DEBUG_COMPILE", "TRITON_PTXAS_PATH")
if sys.argv[1] == "blocks":  # jobs=0 warmups' blocks in one process
    from kernel_cache.config.engine import DEFAULT_MODEL, make_config
    from warmup.builder.pool import _in_process

    os.environ["AOT_INDUCTOR_DEBUG_COMPILE"] = "1"  # the caller's; the recipe removes it
    cache, tempfile.tempdir = tempfile.mkdtemp(), None  # as before any gettempdir()
    _in_process(make_config(DEFAULT_MODEL, use_env=False), [], cache, None, {})
    tempdir = tempfile.tempdir  # a warmup with nothing to build: the caller's, None
    seen, refused = [], None
    for device in ("cpu", "cpu", "cuda", "cpu"):
        try:
            with compiler.environment_pinned(device, "x86-64-v3", tempfile.mkdtemp()):
                import torch._inductor.config  # noqa: F401
                if not seen:
                    os.environ["TRITON_PTXAS_PATH"] = "/opt/bundled/ptxas"  # as Inductor, once
                seen.append([os.environ.get(k) for k in NAMES])
        except ConfigError as e:  # the CUDA recipe's values are not those imported
            refused = str(e)
    after = [os.environ.get(k) for k in NAMES]
    print(json.dumps([tempdir, seen, refused, after]))
elif sys.argv[1] == "repin":
    compiler.pin_environment("cpu", "x86-64-v3")
    import torch._inductor.config  # noqa: F401  (imported under the pinned environment)
    os.environ["TRITON_PTXAS_PATH"] = "/opt/bundled/ptxas"  # as Inductor sets it, once
    compiler.pin_environment("cpu", "x86-64-v3")
    print(os.environ.get("TRITON_PTXAS_PATH"))
else:
    os.environ["TORCHINDUCTOR_MAX_AUTOTUNE"] = "1"
    import torch._inductor.config  # noqa: F401  (imported before any pin)
    try:
        compiler.pin_environment("cpu", "x86-64-v3")
    except ConfigError as e:
        print("refused:", e)
"""


def test_a_second_pin_keeps_what_the_compile_stack_set_and_refuses_a_stale_import():
    """Each compile re-pins the environment: variables Inductor sets once per process
    (``TRITON_PTXAS_PATH``, behind a functools.cache) survive the second pin, so a
    worker's later variants use the same tools; a compile stack imported under a
    pinned variable the recipe removes is still refused."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_PTXAS_PATH", None)
    env.pop("TORCHINDUCTOR_MAX_AUTOTUNE", None)
    run = [sys.executable, "-c", _REPIN]
    again = subprocess.run([*run, "repin"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "/opt/bundled/ptxas"
    stale = subprocess.run([*run, "stale"], capture_output=True, text=True, env=env, timeout=300)
    assert stale.returncode == 0, stale.stderr
    assert "refused:" in stale.stdout and "TORCHINDUCTOR_MAX_AUTOTUNE" in stale.stdout


def test_compiles_in_the_callers_process_give_its_environment_back_between_blocks():
    """``jobs=0`` blocks in one process (:func:`environment_pinned`): a pinned
    variable of the caller's is removed in every block, though each gave the
    caller's environment back, and after one that was refused (the CUDA
    recipe's values, the stack imported under the CPU one's: the message names
    each); what the compile stack set once in the first block is there in the
    later ones; after the blocks the caller's environment is its own, and a
    warmup leaves the caller's ``tempfile.tempdir`` as it was."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("TRITON_PTXAS_PATH", "AOT_INDUCTOR_DEBUG_COMPILE"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-c", _REPIN, "blocks"], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    tempdir, seen, refused, after = json.loads(proc.stdout.splitlines()[-1])
    assert tempdir is None
    assert seen == [[None, "/opt/bundled/ptxas"]] * 3
    assert refused and "unset then, '1' now" in refused and "fresh worker process" in refused
    assert after == ["1", None]
