"""The CPU path's guarantees on a CUDA GPU (marker ``gpu``; skipped without CUDA).

Run on a GPU machine with ``python -m pytest -q -m gpu tests/test_gpu.py``. Plans
are tiny (an AOTInductor CUDA build takes about 70 s for the first variant of a
process and 8-9 s for each further one on an H200). Set ``CXX`` to a C++
compiler whose libstdc++ matches the runtime's (see the README); set
``KERNEL_CACHE_TEST_OTHER_CXX`` to another compiler to also check that warmup
never publishes an artifact that crashes on load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernel_cache import MissingVariantsError, load_plan, make_config
from kernel_cache.buckets import Bucketer
from kernel_cache.keys import build_key, device_arch, diff_components
from kernel_cache.reference import reference_attention, reference_decode
from kernel_cache.store import DiskTier

from .conftest import ROOT, TINY_LIMITS, TRACE, run_cli, tiny_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = ["--device", "cuda"]
#: A 2-variant slice of the tiny plan (one prefill, one decode variant).
SMALL = ["--kv-buckets", "32", "--query-buckets", "32"]
#: ||out - ref|| / ||ref|| accepted per dtype (METHOD.md: bf16 operands land
#: between 1e-3 and 1e-2, float32 far below 1e-3).
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


# -- kernels ---------------------------------------------------------------------

DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, num_blocks, num_seqs)
    (32, 8, 128, 16, 64, 5),  # granite-3.3-8b geometry
    (32, 8, 128, 128, 9, 3),  # large blocks, several splits
    (4, 2, 8, 16, 2, 4),  # the tiny test geometry (head_dim padded to 16)
    (8, 1, 64, 7, 40, 3),  # MQA, block_size not a power of two
    (28, 4, 128, 16, 300, 2),  # qwen2.5-7b, many splits
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h,kvh,d,bs,nb,s", DECODE_CASES)
def test_triton_decode_matches_reference(h, kvh, d, bs, nb, s, dtype):
    from kernel_cache.triton_decode import TritonBatchedDecode, split_plan

    g = torch.Generator(device="cuda").manual_seed(h * 7 + nb)
    p = nb * s + 5
    kc = torch.randn(p, bs, kvh, d, generator=g, device="cuda").to(dtype)
    vc = torch.randn(p, bs, kvh, d, generator=g, device="cuda").to(dtype)
    cap = nb * bs
    lens = [cap, 1, bs, max(1, cap - bs + 1), 0, 7][:s]  # edge, one token, a block, padded
    lens += [0] * (s - len(lens))
    bt = torch.randint(0, p, (s, nb), generator=g, device="cuda", dtype=torch.int32)
    q = torch.randn(s, h, d, generator=g, device="cuda").to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    real = [i for i, n in enumerate(lens) if n > 0]
    ref = reference_decode(q[real], kc, vc, bt[real], [lens[i] for i in real])
    for splits in (None, 1, min(3, nb), nb):
        out = TritonBatchedDecode(h, kvh, d, num_kv_splits=splits)(q, kc, vc, bt, seq_lens)
        assert out.dtype == dtype and out.shape == (s, h, d)
        assert torch.isfinite(out.float()).all()
        err = rel_err(out[real], ref)
        assert err < REL_TOL[dtype], (splits, split_plan(s, kvh, nb, bs, splits), err)
        pad = [i for i, n in enumerate(lens) if n == 0]
        assert not pad or out[pad].abs().max() == 0  # padded rows read nothing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eager_paged_attention_on_cuda_matches_reference(dtype):
    from kernel_cache.kernels import PagedAttention

    g = torch.Generator(device="cuda").manual_seed(1)
    h, kvh, d, bs, nb = 32, 8, 128, 16, 8
    kc = torch.randn(40, bs, kvh, d, generator=g, device="cuda").to(dtype)
    vc = torch.randn(40, bs, kvh, d, generator=g, device="cuda").to(dtype)
    bt = torch.randperm(40, device="cuda")[:nb].to(torch.int32)
    mod = PagedAttention(h, kvh, d)
    for seq_len, q_real in [(1, 1), (100, 37), (128, 128)]:
        q = torch.randn(q_real + 3, h, d, generator=g, device="cuda").to(dtype)
        args = [torch.tensor([x], dtype=torch.int32, device="cuda") for x in (seq_len, q_real)]
        out = mod(q, kc, vc, bt, *args)
        ref = reference_attention(q[:q_real], kc, vc, bt, seq_len)
        assert rel_err(out[:q_real], ref) < REL_TOL[dtype]


# -- warm up, restart, load --------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_cache(tmp_path_factory, tiny_model):
    """The tiny plan (6 variants) warmed for CUDA in bfloat16, and warmup's report."""
    cache = tmp_path_factory.mktemp("gpu") / "cache"
    proc = run_cli(
        "warmup",
        *tiny_args(tiny_model),
        *GPU,
        "--cache-dir",
        cache,
        "--jobs",
        "2",
        "--json",
        check=True,
    )
    return cache, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def gpu_config(tiny_model):
    return make_config(str(tiny_model), device="cuda", **TINY_LIMITS)


def test_gpu_warmup_compiles_checks_and_publishes_the_plan(gpu_cache, gpu_config):
    _, report = gpu_cache
    n = len(Bucketer(gpu_config).variants)
    assert (report["compiled"], report["failed"]) == (n, [])
    assert report["load_check"]["checked"] == n and report["load_check"]["children"] == 1
    tier = DiskTier(gpu_cache[0])
    try:
        metas = list(tier.iter_meta())
    finally:
        tier.close()
    assert len(metas) == n
    for m in metas:
        assert m["components"]["device"] == "cuda" and m["components"]["dtype"] == "bfloat16"
        arch = m["components"]["device_arch"]
        assert arch == device_arch("cuda") and arch.startswith("sm_") and "triton" in arch
        assert "libstdc++" in m["components"]["cxx"]


def test_gpu_verify_in_fresh_process_zero_compiles(gpu_cache, tiny_model, gpu_config):
    proc = run_cli(
        "verify", *tiny_args(tiny_model), *GPU, "--cache-dir", gpu_cache[0], "--json", check=True
    )
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["compiled"] == 0
    assert report["loaded"] == len(Bucketer(gpu_config).variants)
    assert report["max_abs_err"] <= 3e-2


ENGINE_SCRIPT = r"""
import json, sys, torch
from kernel_cache import load_plan, make_config
from kernel_cache.reference import reference_attention, reference_decode
from kernel_cache.verify import compile_stack_loaded
cfg = make_config(sys.argv[1], device="cuda", max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32)
rt = load_plan(cfg, sys.argv[2])
g = torch.Generator().manual_seed(3)
P, dev, dt = 11, "cuda", torch.bfloat16
kc = torch.randn(P, 16, 2, 8, generator=g).to(dev, dt)
vc = torch.randn(P, 16, 2, 8, generator=g).to(dev, dt)
errs = []
def rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm())
for seq_len, q in [(1, 1), (16, 16), (17, 5), (32, 32), (30, 1)]:
    bt = torch.randperm(P, generator=g)[:2].to(dev, torch.int32)
    query = torch.randn(q, 4, 8, generator=g).to(dev, dt)
    out = rt.prefill(query, kc, vc, bt, seq_len)
    assert out.shape == (q, 4, 8) and out.device.type == "cuda"
    errs.append(rel(out, reference_attention(query, kc, vc, bt, seq_len)))
for lens in ([5], [1, 16, 32], [32, 17, 2, 9]):
    bt = torch.randint(0, P, (len(lens), 3), generator=g, dtype=torch.int32).to(dev)
    query = torch.randn(len(lens), 4, 8, generator=g).to(dev, dt)
    for form in (lens, torch.tensor(lens)):
        out = rt.decode(query, kc, vc, bt, form)
        assert out.shape == (len(lens), 4, 8)
        errs.append(rel(out, reference_decode(query, kc, vc, bt, lens)))
torch.cuda.synchronize()
mods = [m for m in ("triton", "kernel_cache.triton_decode") if m in sys.modules]
print(json.dumps({"max_rel_err": max(errs), "stats": rt.stats(),
                  "compile_stack": compile_stack_loaded(), "triton_modules": mods}))
"""


def test_gpu_engine_start_dispatch_matches_reference_without_compiling(gpu_cache, tiny_model):
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, str(tiny_model), str(gpu_cache[0])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["max_rel_err"] < 1e-2
    assert doc["stats"]["compiles"] == 0 and doc["compile_stack"] == []
    assert doc["triton_modules"] == []  # loading needs neither Triton nor the kernel source
    assert doc["stats"]["loads"] == 6
    assert sum(doc["stats"]["calls"].values()) == 5 + 3 * 2


def test_gpu_cache_is_never_loaded_on_cpu_or_another_arch(gpu_cache, gpu_config):
    cpu_config = gpu_config.model_copy(update={"device": "cpu"})  # same dtype: bfloat16
    with pytest.raises(MissingVariantsError) as e:
        load_plan(cpu_config, gpu_cache[0])
    assert len(e.value.missing) == len(Bucketer(gpu_config).variants)
    v = Bucketer(gpu_config).variants[0]
    gpu_key, cpu_key = build_key(gpu_config, v), build_key(cpu_config, v)
    diff = diff_components(gpu_key.as_dict(), cpu_key.as_dict())
    assert [d.split(":")[0] for d in diff] == ["device", "device_arch"]
    other = build_key(gpu_config, v, overrides={"device_arch": "sm_80 cuda 12.4 triton 3.1.0"})
    tier = DiskTier(gpu_cache[0])
    try:
        assert tier.get(gpu_key.hexdigest) is not None
        assert tier.get(other.hexdigest) is None
    finally:
        tier.close()
    assert [d.split(":")[0] for d in diff_components(gpu_key.as_dict(), other.as_dict())] == [
        "device_arch"
    ]


def test_gpu_float16_plan_warms_and_verifies(tmp_path, tiny_model):
    cache = tmp_path / "cache"
    args = [*tiny_args(tiny_model), *SMALL, *GPU, "--dtype", "float16", "--cache-dir", cache]
    report = json.loads(run_cli("warmup", *args, "--json", check=True).stdout)
    assert report["compiled"] == 2 and report["failed"] == []
    report = json.loads(run_cli("verify", *args, "--json", check=True).stdout)
    assert report["ok"] is True and report["compiled"] == 0 and report["loaded"] == 2


@pytest.mark.skipif(not TRACE.exists(), reason="Azure trace not beside the checkout")
def test_gpu_replay_on_trace_slice_has_zero_compiles(gpu_cache, tiny_model):
    proc = subprocess.run(
        [
            sys.executable,
            "examples/replay_trace.py",
            *tiny_args(tiny_model),
            *GPU,
            "--cache-dir",
            str(gpu_cache[0]),
            "--trace",
            str(TRACE),
            "--limit",
            "40",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["requests"] == 40 and doc["compiles"] == 0
    assert doc["kernel_calls"] == sum(doc["calls_per_variant"].values()) > 40


@pytest.mark.skipif(
    not os.environ.get("KERNEL_CACHE_TEST_OTHER_CXX"),
    reason="set KERNEL_CACHE_TEST_OTHER_CXX to a second C++ compiler",
)
def test_gpu_warmup_with_other_compiler_never_publishes_a_crashing_artifact(tmp_path, tiny_model):
    """With another toolchain (on the H200 image: /opt/gcc/bin/g++, whose packages
    crashed on load), each new artifact either loads in a fresh process and is
    published, or is reported (variant, compiler, fix) and not published."""
    from kernel_cache.keys import cxx_toolchain

    cxx = os.environ["KERNEL_CACHE_TEST_OTHER_CXX"]
    print("compiler in use:", cxx_toolchain(), "other:", cxx_toolchain(cxx))
    cache = tmp_path / "cache"
    args = [*tiny_args(tiny_model), *SMALL, *GPU, "--cache-dir", cache]
    proc = run_cli("warmup", *args, "--json", env={"CXX": cxx})
    report = json.loads(proc.stdout)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))
    assert report["load_check"]["checked"] == 2
    for f in report["failed"]:  # a load-check failure names the compiler and the fix
        err = f["error"]
        assert ("not published" in err and cxx in err and "CXX=" in err) or err.startswith(
            ("AOTInductor failed", "torch.export failed")
        ), err
    assert proc.returncode == (1 if report["failed"] else 0)
    verify = json.loads(run_cli("verify", *args, "--json", env={"CXX": cxx}).stdout)
    assert verify["loaded"] == report["compiled"]  # only what passed the check is there
    assert len(verify["missing"]) == len(report["failed"])
