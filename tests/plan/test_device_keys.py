"""A cache warmed for a GPU is never loaded on the CPU, and explain names why.

Runs on the CPU: the warmed tiny cache is rewritten as if it had been warmed on
an H200 (``kc_helpers.rekey``, the components recorded there:
``docs/results/gpu-h200/env.txt``). ``tests/e2e/test_gpu.py`` checks the same with
real CUDA artifacts on a GPU.
"""

import pytest

from kernel_cache import load_plan
from kernel_cache.plan.keys import cxx_compiler_id, device_arch
from kernel_cache.runtime.load import default_tiers
from warmup.check.explain import explain

from ..conftest import N_TINY, run_cli
from ..kc_helpers import rekey

pytestmark = pytest.mark.compile

H200 = {"device": "cuda", "device_arch": "sm_90 cuda 13.0 triton 3.6.0"}


def test_gpu_warmed_cache_misses_on_cpu_and_explain_names_device(cache_copy, tiny_config):
    rekey(cache_copy, H200)
    rt = load_plan(tiny_config, cache_copy, strict=False)
    assert rt.counters["loads"] == 0
    report = explain(tiny_config, default_tiers(cache_copy))
    assert report["misses"] == N_TINY
    for r in report["results"]:
        best = r["nearest"][0]
        assert best["variant"] == r["variant"]
        assert [d["component"] for d in best["differences"]] == ["device", "device_arch"]
        assert best["lines"][0] == "device: cpu != cuda"
        assert best["lines"][1].startswith(f"device_arch: {device_arch('cpu')} != sm_90")


def test_cxx_component_names_compiler_build_and_libstdcxx():
    value = cxx_compiler_id()
    assert value == "none" or (" (build " in value and "; libstdc++ " in value), value


def test_cuda_without_a_gpu_is_a_clear_error_not_a_torch_assertion(tmp_path):
    """On this CPU-only CI, --device cuda must say why and what to do."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from kernel_cache import make_config
    from kernel_cache.errors import ConfigError

    with pytest.raises(ConfigError, match=r"device='cuda': .*use --device cpu"):
        load_plan(make_config("llama-3.2-1b", device="cuda"), tmp_path)
    proc = run_cli("warmup", "--device", "cuda", "--max-model-len", "256", "--cache-dir", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "device='cuda'" in proc.stderr and "--device cpu" in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_cuda_plan_without_a_gpu_says_the_launch_config_is_not_resolved(tmp_path):
    """``plan --device cuda`` on a CPU-only machine prints the buckets, says why no
    launch table follows, and still refuses a bad KERNEL_CACHE_TUNING."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    args = ("plan", "--device", "cuda", "--max-model-len", "256")
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "launch config: not resolved (no usable CUDA device here" in proc.stdout
    proc = run_cli(*args, env={"KERNEL_CACHE_TUNING": '{"entries": 1}'})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "KERNEL_CACHE_TUNING (inline JSON): entries=1: Input should be a list" in proc.stderr
