"""A CUDA artifact's host code (the package's C++ wrapper) is built for the
``--cpu-target``, named in its key and checked at engine start, as a CPU
artifact's is. Runs without a GPU: the GPU part of ``device_arch`` is stood in
for (``recipe.gpu_arch``, the value an H200 gives: docs/results/gpu-h200/env.txt);
``tests/e2e/test_gpu.py`` builds a real CUDA package and reads its compile commands."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kernel_cache.config import recipe
from kernel_cache.config.engine import make_config
from kernel_cache.config.recipe import CPU_TARGETS, ISA_FLAGS, compile_environment, compile_options
from kernel_cache.errors import CorruptEntryError, CpuTargetError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key, diff_components
from kernel_cache.plan.tables import arch_family, table_filename
from kernel_cache.runtime.load import check_cpu_features, load_plan
from kernel_cache.store.disk_tier import DiskTier, Entry, make_meta

from ..conftest import ROOT, TINY_LIMITS

H200 = "sm_90 cuda 13.0 triton 3.6.0"
x86_only = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="x86-64-v3 is an x86-64 target"
)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``device_arch('cuda', ...)`` as on an H200, without a GPU."""
    recipe.device_arch.cache_clear()
    monkeypatch.setattr(recipe, "gpu_arch", lambda: H200)
    yield H200
    recipe.device_arch.cache_clear()


@pytest.fixture
def cuda_config(tiny_model):
    return make_config(str(tiny_model), device="cuda", **TINY_LIMITS)


@x86_only
@pytest.mark.parametrize("target", ["x86-64-v3", "native"])
def test_cuda_compile_options_and_environment_name_the_cpu_target(target):
    """Options and environment of a CUDA compile carry the target's -march and
    vector ISA; a builder's TORCHINDUCTOR_CPP_MARCH or ATEN_CPU_CAPABILITY does
    not reach the compile."""
    opts = compile_options("cuda", target)
    assert opts["cpp.march"] == recipe.resolve_cpu_target(target).march
    assert "cpp.threads" not in opts  # the CPU kernels' thread options stay CPU-only
    env = compile_environment(
        {"TORCHINDUCTOR_CPP_MARCH": "native", "ATEN_CPU_CAPABILITY": "avx512", "PATH": "/bin"},
        "cuda",
        target,
    )
    assert "TORCHINDUCTOR_CPP_MARCH" not in env
    if target == "x86-64-v3":
        assert opts["cpp.march"] == "x86-64-v3" and "native" not in json.dumps(opts)
        assert env["ATEN_CPU_CAPABILITY"] == "avx2" and opts["cpp.vec_isa_ok"] is True
    else:  # native: the best this CPU has (probed), as on the CPU
        assert "ATEN_CPU_CAPABILITY" not in env and "cpp.vec_isa_ok" not in opts
    # The same but for the cubins' line tables, which name builder paths.
    cuda_env, cpu_env = (
        compile_environment({}, "cuda", target),
        compile_environment({}, "cpu", target),
    )
    assert cuda_env == {**cpu_env, "TRITON_DISABLE_LINE_INFO": "1"}
    assert opts["aot_inductor.embed_kernel_binary"] is True
    assert "aot_inductor.embed_kernel_binary" not in compile_options("cpu", target)


_WRAPPER_COMMAND = r"""
import json, os, sys
from kernel_cache.config.recipe import compile_environment, compile_options
env = compile_environment(dict(os.environ), "cuda", sys.argv[1])
os.environ.clear(); os.environ.update(env)
import torch._inductor.config as inductor_config
import torch.utils.cpp_extension as cpp_extension
cpp_extension.CUDA_HOME = sys.argv[2]  # a CPU-only torch has none; only paths are printed
from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
from torch._inductor.cpu_vec_isa import pick_vec_isa
out = {}
for name, opts in (("unset", {}), ("recipe", compile_options("cuda", sys.argv[1]))):
    with inductor_config.patch(opts):
        options = CppTorchDeviceOptions(vec_isa=pick_vec_isa(), device_type="cuda", aot_mode=True)
        out[name] = CppBuilder(name="o", sources="i", BuildOption=options).get_command_line()
out["isa"] = str(pick_vec_isa()).upper()
print(json.dumps(out))
"""


@pytest.mark.compile
@x86_only
def test_inductor_builds_the_cuda_wrapper_with_the_recipes_march(tmp_path):
    """The command line Inductor would compile a CUDA package's C++ wrapper with
    (its own builder, no GPU needed): -march=native without the recipe's
    options, -march=x86-64-v3 and AVX2 with them; the ISA it would record as
    AOTI_CPU_ISA is AVX2, whatever the builder's environment asked for."""
    cuda_home = tmp_path / "cuda"
    (cuda_home / "include").mkdir(parents=True)
    env = {**os.environ, "TORCHINDUCTOR_CPP_MARCH": "native", "ATEN_CPU_CAPABILITY": "avx512"}
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER_COMMAND, "x86-64-v3", str(cuda_home)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "-march=native" in doc["unset"].split()  # what the recipe used to leave
    recipe_flags = doc["recipe"].split()
    assert "-march=x86-64-v3" in recipe_flags and "-march=native" not in recipe_flags
    assert "-mavx2" in recipe_flags and not any(f.startswith("-mavx512") for f in recipe_flags)
    assert doc["isa"] == "AVX2"


@x86_only
def test_cuda_key_names_the_host_target(fake_gpu, cuda_config):
    v3 = recipe.device_arch("cuda", "x86-64-v3")
    native = recipe.device_arch("cuda", "native")
    assert v3 == f"{H200} host {platform.machine()}/x86-64-v3"
    assert native.startswith(f"{H200} host {platform.machine()}/native ")
    # the launch tables still find the GPU's architecture
    assert arch_family(v3) == arch_family(native) == "sm_90"
    assert table_filename(v3) == "sm_90.json"
    v = Bucketer(cuda_config).variants[-1]
    native_config = cuda_config.model_copy(update={"cpu_target": "native"})
    a, b = build_key(cuda_config, v), build_key(native_config, v)
    assert a.hexdigest != b.hexdigest
    changed = {d.split(":")[0] for d in diff_components(a.as_dict(), b.as_dict())}
    assert changed == {"device_arch", "compile_options"}


def _cuda_entry(key: str, features) -> Entry:
    meta = {"key": key, "cpu_target": "x86-64-v3"}
    if features is not None:
        meta["cpu_features"] = features
    return Entry(key=key, meta=meta, data=b"", where="/cache/x")


def test_a_cuda_entry_needing_a_missing_instruction_or_recording_none_is_refused(cuda_config):
    have = recipe.cpu_features()
    if not have:
        pytest.skip("no /proc/cpuinfo here")
    lacking = next(f for f in ISA_FLAGS if f not in have)
    v = Bucketer(cuda_config).variants[0]
    check_cpu_features(cuda_config, v, _cuda_entry("a" * 64, sorted(have)))  # runs here
    with pytest.raises(CpuTargetError) as e:
        check_cpu_features(cuda_config, v, _cuda_entry("a" * 64, [*sorted(have), lacking]))
    assert str(v) in str(e.value) and lacking in str(e.value) and "--cpu-target" in str(e.value)
    with pytest.raises(CorruptEntryError, match="must record its cpu_features"):
        check_cpu_features(cuda_config, v, _cuda_entry("a" * 64, None))


def test_engine_start_refuses_a_cuda_artifact_this_cpu_cannot_run(fake_gpu, cuda_config, tmp_path):
    """A disk cache holding the CUDA plan's first variant under its real key,
    recorded as needing an instruction this CPU lacks: engine start raises
    CpuTargetError before it loads any code (no GPU is needed to get there)."""
    have = recipe.cpu_features()
    if not have:
        pytest.skip("no /proc/cpuinfo here")
    lacking = next(f for f in ISA_FLAGS if f not in have)
    v = Bucketer(cuda_config).variants[0]
    key = build_key(cuda_config, v)
    features = [*CPU_TARGETS["x86-64-v3"].features, lacking]
    data = b"not a package: never loaded"
    meta = make_meta(key, str(v), data, 1.0, cpu_target="x86-64-v3", cpu_features=features)
    tier = DiskTier(tmp_path / "cache")
    try:
        tier.put(key.hexdigest, data, meta)
    finally:
        tier.close()
    with pytest.raises(CpuTargetError) as e:
        load_plan(cuda_config, tmp_path / "cache", strict=False)
    assert str(v) in str(e.value) and lacking in str(e.value)
