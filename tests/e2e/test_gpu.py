"""The CPU path's guarantees on a CUDA GPU (marker ``gpu``; skipped without CUDA).

Run on a GPU machine with ``python -m pytest -q -n 0 -m gpu tests/e2e/test_gpu.py``. Plans
are tiny, except one 8-variant granite-3.3-8b plan for prefill, host-time and
CUDA-graph tests, warmed into ``KERNEL_CACHE_TEST_GPU_CACHE`` when that is set
(``benchmarks/gpu_run.sh`` shares it with ``gpu_engine.py``); an AOTInductor CUDA
build takes about 70 s for the first variant of a process and 8-13 s for each
further one on an H200. Set ``CXX`` to a C++
compiler whose libstdc++ matches the runtime's (see docs/gpu.md); set
``KERNEL_CACHE_TEST_OTHER_CXX`` to another compiler to also check that warmup
never publishes an artifact that crashes on load.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kernel_cache import MissingVariantsError, load_plan, make_config
from kernel_cache.kernels.reference import (
    dequantize,
    fp8_quantize,
    reference_attention,
    reference_decode,
)
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key, device_arch, diff_components
from kernel_cache.store.disk_tier import DiskTier

from ..conftest import N_TINY, ROOT, TINY_LIMITS, TRACE, run_cli, tiny_args

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
    from kernel_cache.kernels.triton_decode import TritonBatchedDecode, split_plan

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


PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, num_blocks, query bucket,
    #  [(seq_len, real query_len), ...]): bucket edges, one token, partial chunks
    (32, 8, 128, 16, 64, 512, [(1024, 512), (512, 512), (1, 1), (1024, 1), (700, 300)]),
    (32, 8, 128, 128, 3, 256, [(384, 256), (257, 1), (129, 129)]),  # large blocks
    (4, 2, 8, 16, 2, 32, [(32, 32), (17, 5), (16, 16), (1, 1)]),  # the tiny test geometry
    (8, 1, 64, 7, 40, 100, [(280, 100), (100, 100), (150, 37)]),  # MQA, block_size 7
    (28, 4, 128, 16, 20, 64, [(320, 64), (70, 3)]),  # qwen2.5-7b: 7 heads per KV head
]


def _prefill_inputs(h, kvh, d, bs, nb, qb, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = nb + 7
    kc = torch.randn(p, bs, kvh, d, generator=g, device="cuda").to(dtype)
    vc = torch.randn(p, bs, kvh, d, generator=g, device="cuda").to(dtype)
    bt = torch.randperm(p, generator=g, device="cuda")[:nb].to(torch.int32)
    q = torch.randn(qb, h, d, generator=g, device="cuda").to(dtype)
    return q, kc, vc, bt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h,kvh,d,bs,nb,qb,cases", PREFILL_CASES)
def test_triton_prefill_matches_reference(h, kvh, d, bs, nb, qb, cases, dtype):
    """The Triton prefill kernel against the float32 SDPA reference, with the
    default tiles and others; bucket-padding rows are zeros."""
    from kernel_cache.kernels.tiles import cuda_prefill_defaults
    from kernel_cache.kernels.triton_prefill import TritonPagedAttention

    q, kc, vc, bt = _prefill_inputs(h, kvh, d, bs, nb, qb, dtype, seed=h + nb)
    g = h // kvh
    size = torch.tensor([], dtype=dtype).element_size()
    tiles = [cuda_prefill_defaults(qb, g, d, size), {"block_m": 64, "block_n": 32, "num_warps": 4}]
    if dtype != torch.float32:  # float32 tiles of 128 x 128 exceed shared memory
        tiles.append({"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2})
    for seq_len, real_q in cases:
        ref = reference_attention(q[:real_q], kc, vc, bt, seq_len)
        lens = [torch.tensor([x], dtype=torch.int32, device="cuda") for x in (seq_len, real_q)]
        for t in tiles:
            mod = TritonPagedAttention(h, kvh, d, query_len=qb, itemsize=size, **t)
            out = mod(q, kc, vc, bt, *lens)
            assert out.dtype == dtype and out.shape == (qb, h, d)
            err = rel_err(out[:real_q], ref)
            assert err < REL_TOL[dtype], (seq_len, real_q, t, err)
            assert real_q == qb or out[real_q:].abs().max() == 0  # padding rows: zeros


def test_triton_prefill_at_max_model_len_matches_reference():
    """granite-3.3-8b's largest prefill variant: a 2048-token chunk ending at
    max_model_len 8192 (block_size 16, 512 blocks), bf16."""
    from kernel_cache.kernels.triton_prefill import TritonPagedAttention

    q, kc, vc, bt = _prefill_inputs(32, 8, 128, 16, 512, 2048, torch.bfloat16, seed=5)
    mod = TritonPagedAttention(32, 8, 128, query_len=2048)
    for seq_len, real_q in [(8192, 2048), (8192, 1), (2048, 2048)]:
        lens = [torch.tensor([x], dtype=torch.int32, device="cuda") for x in (seq_len, real_q)]
        out = mod(q, kc, vc, bt, *lens)
        ref = reference_attention(q[:real_q], kc, vc, bt, seq_len)
        assert rel_err(out[:real_q], ref) < REL_TOL[torch.bfloat16], (seq_len, real_q)


def test_triton_prefill_one_page_tiles_through_aotinductor_and_a_cuda_graph(tmp_path):
    """block_size 128 (the engine's default) with 128-token KV tiles, the path that
    reads one block-table entry per tile: through torch.export + AOTInductor, and
    the op captured in a CUDA graph and replayed on new lengths."""
    from kernel_cache.kernels.triton_prefill import TritonPagedAttention

    q, kc, vc, bt = _prefill_inputs(32, 8, 128, 128, 8, 256, torch.bfloat16, seed=3)
    mod = TritonPagedAttention(32, 8, 128, query_len=256)
    assert (mod.block_n, kc.shape[1] % mod.block_n) == (128, 0)
    lens = [torch.tensor([x], dtype=torch.int32, device="cuda") for x in (1024, 256)]
    ep = torch.export.export(mod, (q, kc, vc, bt, *lens))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "p.pt2"))
    out = torch._inductor.aoti_load_package(path)(q, kc, vc, bt, *lens)
    ref = reference_attention(q, kc, vc, bt, 1024)
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mod(q, kc, vc, bt, *lens)  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = mod(q, kc, vc, bt, *lens)
    for seq_len, real_q in [(700, 200), (129, 1), (1024, 256)]:
        lens[0].fill_(seq_len)
        lens[1].fill_(real_q)
        graph.replay()
        ref = reference_attention(q[:real_q], kc, vc, bt, seq_len)
        assert rel_err(g_out[:real_q], ref) < REL_TOL[torch.bfloat16], (seq_len, real_q)
        assert real_q == 256 or g_out[real_q:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eager_paged_attention_on_cuda_matches_reference(dtype):
    from kernel_cache.kernels.plain import PagedAttention

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
    """The tiny plan warmed for CUDA in bfloat16, and warmup's report."""
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
    # one check process per compile worker that built something (--jobs 2)
    assert report["load_check"]["checked"] == n and 1 <= report["load_check"]["children"] <= 2
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
from kernel_cache.kernels.reference import reference_attention, reference_decode
from warmup.check.verify import compile_stack_loaded
cfg = make_config(sys.argv[1], device="cuda", max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))  # the plan gpu_cache warmed
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
mods = [m for m in ("triton", "kernel_cache.kernels.triton_decode") if m in sys.modules]
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
    assert doc["stats"]["loads"] == N_TINY
    assert sum(doc["stats"]["calls"].values()) == 5 + 3 * 2


def test_gpu_cache_is_never_loaded_on_cpu_or_another_arch(gpu_cache, gpu_config):
    cpu_config = gpu_config.model_copy(update={"device": "cpu"})  # same dtype: bfloat16
    with pytest.raises(MissingVariantsError) as e:
        load_plan(cpu_config, gpu_cache[0])
    assert len(e.value.missing) == len(Bucketer(gpu_config).variants)
    v = Bucketer(gpu_config).variants[0]
    gpu_key, cpu_key = build_key(gpu_config, v), build_key(cpu_config, v)
    diff = {d.split(":")[0] for d in diff_components(gpu_key.as_dict(), cpu_key.as_dict())}
    # On CUDA paged_attention is the Triton prefill kernel: its factory, sources
    # and tiles are keyed; the CPU recipe adds its threads options (cpp.march is
    # in both: on CUDA it is the C++ wrapper's host target).
    assert v.kernel == "paged_attention"
    assert diff == {
        "device", "device_arch", "kernel", "sources", "launch_config", "compile_options",
    }  # fmt: skip
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


_BUILD_ONE_CUDA = r"""
import json, sys
from kernel_cache.config.engine import make_config
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from warmup.builder.planner import warmup
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, device="cuda", cpu_target=sys.argv[3])
v = [v for v in Bucketer(cfg).variants if str(v) == "batched_decode:1:2:4"][0]
r = warmup(cfg, sys.argv[2], jobs=1, progress=False, variants=[v])
print(json.dumps({"key": build_key(cfg, v).hexdigest, "compiled": r["compiled"],
                  "failed": r["failed"]}))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v3 is an x86-64 target")
def test_gpu_package_host_code_is_built_for_the_cpu_target_not_native(tmp_path, tiny_model):
    """One CUDA variant built with the default --cpu-target x86-64-v3, under an
    environment that asks for -march=native and AVX-512: the package's C++
    wrapper and kernel files carry Inductor's compile commands, each with
    -march=x86-64-v3 and none with -march=native; every AOTI_CPU_ISA the package
    records is AVX2; the entry records the target's CPU features and its key
    names the host target."""
    import io
    import zipfile

    from kernel_cache.config.recipe import CPU_TARGETS

    cache = tmp_path / "cache"
    env = {**os.environ, "TORCHINDUCTOR_CPP_MARCH": "native", "ATEN_CPU_CAPABILITY": "avx512"}
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_ONE_CUDA, str(tiny_model), str(cache), "x86-64-v3"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["compiled"] == 1 and not doc["failed"], doc
    tier = DiskTier(cache)
    try:
        entry = tier.get(doc["key"])
    finally:
        tier.close()
    meta = entry.meta
    assert meta["cpu_target"] == "x86-64-v3"
    assert meta["cpu_features"] == list(CPU_TARGETS["x86-64-v3"].features)
    arch = meta["components"]["device_arch"]
    assert arch.startswith("sm_") and arch.endswith(f" host {platform.machine()}/x86-64-v3")
    assert '"cpp.march": "x86-64-v3"' in meta["components"]["compile_options"]

    commands, isas = [], []
    with zipfile.ZipFile(io.BytesIO(entry.data)) as z:
        names = z.namelist()
        for name in names:
            if name.endswith(".cpp"):
                text = z.read(name).decode(errors="replace")
                commands += [
                    ln for ln in text.splitlines() if ln.startswith("// ") and " -o " in ln
                ]
            elif name.endswith("_metadata.json"):
                isas.append(json.loads(z.read(name))["AOTI_CPU_ISA"])
    compiles = [c for c in commands if " -c " in c]
    assert compiles, f"no compile command in the package's .cpp files: {names}"
    assert all("-march=x86-64-v3" in c for c in compiles), compiles
    assert not any("-march=native" in c for c in commands), commands
    assert isas and set(isas) == {"AVX2"}, isas


def test_gpu_two_builders_write_identical_bytes_and_a_rebuild_is_identical(tiny_model):
    """Two cold CUDA builds of the tiny plan's two kernels (one variant each),
    every builder path different (HOME, cwd, TMPDIR, the cache, the user as
    root): the same bytes under each key and no builder path in any member;
    then ``verify --rebuild`` compiles one again and finds it identical."""
    from ..kc_helpers import other_user_kwargs, world_readable_dir
    from ..warmup import test_reproducible as repro

    user_kwargs, user_env = other_user_kwargs()
    with world_readable_dir() as root:
        a = repro.make_builder(root, "builder-a", {}, {"PYTHONHASHSEED": "1"}, tiny_model)
        b = repro.make_builder(
            root, "builder-b", user_kwargs, {**user_env, "PYTHONHASHSEED": "2"}, tiny_model
        )
        # The builders share nothing, so they run at once (the GPU host has the cores).
        with ThreadPoolExecutor(2) as pool:
            reports = list(pool.map(lambda x: repro.warmup_as(x, *GPU), (a, b)))
        for report in reports:
            assert report["compiled"] == repro.N and report["failed"] == []
        ea, eb = repro.entries_of(a["cache"]), repro.entries_of(b["cache"])
        assert sorted(ea) == sorted(eb) and len(ea) == repro.N
        repro.assert_same_bytes_and_no_builder_path(a, b, ea, eb)
        proc = subprocess.run(
            [sys.executable, "-m", "warmup.cli.main", "verify", *tiny_args(a["model"]), *GPU]
            + [*repro.SUBSET, "--cache-dir", str(a["cache"]), "--json"]
            + ["--rebuild", "batched_decode:1:2:4"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr
        (r,) = json.loads(proc.stdout)
        assert r["identical"] and r["differs"] == [], r


def test_gpu_float16_plan_warms_and_verifies(tmp_path, tiny_model):
    cache = tmp_path / "cache"
    args = [*tiny_args(tiny_model), *SMALL, *GPU, "--dtype", "float16", "--cache-dir", cache]
    report = json.loads(run_cli("warmup", *args, "--json", check=True).stdout)
    assert report["compiled"] == 2 and report["failed"] == []
    report = json.loads(run_cli("verify", *args, "--json", check=True).stdout)
    assert report["ok"] is True and report["compiled"] == 0 and report["loaded"] == 2


def test_gpu_tune_of_triton_prefill_tiles_writes_an_entry_the_plan_uses(tmp_path, tiny_model):
    """``tune`` on CUDA times the prefill kernel's tiles: every candidate matches
    the reference, the table entry names its query bucket, and a plan under that
    table resolves the variant to the kept tiles."""
    out, variant = tmp_path / "prefill.json", "paged_attention:32:2:1"
    engine = [*tiny_args(tiny_model), *SMALL, *GPU]
    proc = run_cli(
        "tune", *engine, "--variants", variant, "--cache-dir", tmp_path / "c", "--out", out,
        "--block-m", "16,32", "--block-n", "16", "--num-warps", "4", "--num-stages", "2",
        "--rounds", "3", "--target-ms", "2", "--jobs", "2", "--json", check=True,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    (res,) = report["results"]
    tiles = [c["config"] for c in res["candidates"]]
    assert report["compiled"] == len(tiles) == 3 and tiles[0]["block_m"] == 64  # the defaults
    assert {c["block_m"] for c in tiles[1:]} == {16, 32}
    assert all(c["ok"] and c["max_abs_err"] < 0.05 for c in res["candidates"])
    (entry,) = json.loads(out.read_text())["entries"]
    assert (entry["kernel"], entry["query_len"], entry["config"]) == (
        "paged_attention", 32, res["config"],
    )  # fmt: skip
    proc = run_cli("plan", *engine, "--json", env={"KERNEL_CACHE_TUNING": str(out)}, check=True)
    launch = json.loads(proc.stdout)["launch"]
    assert launch[variant] == {"config": res["config"], "source": "env"}


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
    """With another toolchain (on the lent H200's CUDA image: /opt/gcc/bin/g++, whose packages
    crashed on load), each new artifact either loads in a fresh process and is
    published, or is reported (variant, compiler, fix) and not published."""
    from kernel_cache.plan.keys import cxx_toolchain

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


# -- granite-3.3-8b through dispatch: prefill, host time, CUDA graphs -----------------

#: 8 variants: prefill chunks of 512 and 2048 tokens and decode batches of 8 and 32
#: sequences, each at 4096 and 8192 KV tokens (block_size 16).
GRANITE_PLAN = [
    "--model", "granite-3.3-8b", "--device", "cuda", "--max-model-len", "8192",
    "--block-size", "16", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
    "--kv-buckets", "4096,8192", "--query-buckets", "512,2048", "--num-seqs-buckets", "8,32",
]  # fmt: skip
GRANITE_LIMITS = dict(
    max_model_len=8192,
    block_size=16,
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    kv_buckets=(4096, 8192),
    query_buckets=(512, 2048),
    num_seqs_buckets=(8, 32),
)
BS, H, KVH, D = 16, 32, 8, 128


@pytest.fixture(scope="module")
def granite_rt(tmp_path_factory):
    """The granite plan warmed (in ``KERNEL_CACHE_TEST_GPU_CACHE`` when set, so a
    benchmark run can share it; else a fresh directory) and loaded."""
    cache = os.environ.get("KERNEL_CACHE_TEST_GPU_CACHE") or tmp_path_factory.mktemp("granite")
    run_cli("warmup", *GRANITE_PLAN, "--cache-dir", cache, "--jobs", "4", check=True)
    cfg = make_config("granite-3.3-8b", device="cuda", **GRANITE_LIMITS)
    return load_plan(cfg, cache)


@pytest.fixture(scope="module")
def granite_pool():
    """A KV pool of 32 x 512 blocks and 32 block tables over a permutation of it."""
    g = torch.Generator(device="cuda").manual_seed(11)
    p = 32 * 512
    kc = torch.randn(p, BS, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(p, BS, KVH, D, generator=g, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(p, generator=g, device="cuda").to(torch.int32).reshape(32, 512)
    return kc, vc, bt


def _q(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, H, D, generator=g, device="cuda", dtype=torch.bfloat16)


def test_gpu_prefill_through_dispatch_matches_reference(granite_rt, granite_pool):
    """Bucket edges (512 @ 4096, 2048 @ 8192 = max_model_len), one token, and
    chunks padded inside their bucket, through load_plan's dispatch."""
    kc, vc, bt = granite_pool
    for seq_len, q in [(4096, 512), (8192, 2048), (1, 1), (8192, 1), (4097, 513), (600, 100)]:
        query = _q(q, seq_len + q)
        out = granite_rt.prefill(query, kc, vc, bt[3], seq_len)
        assert out.shape == (q, H, D)
        ref = reference_attention(query, kc, vc, bt[3], seq_len)
        assert rel_err(out, ref) < REL_TOL[torch.bfloat16], (seq_len, q)
    assert granite_rt.stats()["compiles"] == 0


def _host_and_gpu_ms(call, n=40):
    """(host ms per call while enqueuing n calls back to back, GPU ms per call)."""
    import time

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t0) * 1e3 / n
    b.record()
    b.synchronize()
    return host, a.elapsed_time(b) / n


def test_gpu_dispatch_never_waits_for_the_gpu(granite_rt, granite_pool):
    """A call returns once its work is enqueued: host time per call is below the
    GPU time per call (decode 32 x 8192, prefill 2048 @ 8192)."""
    kc, vc, bt = granite_pool
    q32, lens = _q(32, 1), [8192] * 32
    q2k = _q(2048, 2)
    calls = {
        "decode": lambda: granite_rt.decode(q32, kc, vc, bt, lens),
        "prefill": lambda: granite_rt.prefill(q2k, kc, vc, bt[0], 8192),
    }
    for name, call in calls.items():
        host, gpu = _host_and_gpu_ms(call)
        print(f"{name}: host {host * 1e3:.1f} us per call, GPU {gpu * 1e3:.1f} us per call")
        assert host < gpu, (name, host, gpu)


def _decode_case(rt, pool, s, nb, seed):
    """Static buffers for one decode bucket, a graph captured over them, its output."""
    kc, vc, bt = pool
    q = _q(s, seed)
    tables = bt[:s, :nb].contiguous()
    lens = torch.full((s,), nb * BS, dtype=torch.int32, device="cuda")
    host = [nb * BS] * s  # the bucket's edge: picks the bucket, passes the checks
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rt.decode(q, kc, vc, tables, host, device_seq_lens=lens)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = rt.decode(q, kc, vc, tables, host, device_seq_lens=lens)
    return g, out, q, tables, lens


def _prefill_case(rt, pool, qb, nb, seed):
    kc, vc, bt = pool
    q = _q(qb, seed)
    table = bt[seed % 32, :nb].contiguous()
    lens = [torch.tensor([x], dtype=torch.int32, device="cuda") for x in (nb * BS, qb)]
    kw = {"device_seq_len": lens[0], "device_query_len": lens[1]}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rt.prefill(q, kc, vc, table, nb * BS, **kw)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = rt.prefill(q, kc, vc, table, nb * BS, **kw)
    return g, out, q, table, lens


def test_gpu_cuda_graphs_of_decode_and_prefill_replay_new_inputs(granite_rt, granite_pool):
    """Capture decode (8 x 4096, 32 x 8192) and prefill (512 @ 4096, 2048 @ 8192)
    in CUDA graphs; replay; then write new queries, block tables, lengths and KV
    contents into the captured buffers and replay again: each output matches the
    reference for the inputs of that replay."""
    kc, vc, bt = granite_pool
    dec = {
        (s, nb): _decode_case(granite_rt, granite_pool, s, nb, s) for s, nb in [(8, 256), (32, 512)]
    }
    pre = {
        (q, nb): _prefill_case(granite_rt, granite_pool, q, nb, q)
        for q, nb in [(512, 256), (2048, 512)]
    }
    gen = torch.Generator(device="cuda").manual_seed(7)
    for step in range(2):
        if step:  # new contents in every captured buffer, and in the KV pool
            kc.copy_(torch.randn(kc.shape, generator=gen, device="cuda", dtype=kc.dtype))
            for (s, nb), (_, _, q, tables, lens) in dec.items():
                q.copy_(_q(s, 100 + s))
                tables.copy_(bt[torch.randperm(32, generator=gen, device="cuda")[:s], :nb])
                cap = nb * BS
                lens.copy_(torch.randint(1, cap + 1, (s,), generator=gen, device="cuda"))
                lens[0] = cap
            for (qb, nb), (_, _, q, table, lens) in pre.items():
                q.copy_(_q(qb, 200 + qb))
                table.copy_(bt[5, :nb])
                lens[0].fill_(nb * BS - 37)
                lens[1].fill_(qb // 2)
        for g, *_ in (*dec.values(), *pre.values()):
            g.replay()
        torch.cuda.synchronize()
        for (s, nb), (_, out, q, tables, lens) in dec.items():
            ref = reference_decode(q, kc, vc, tables, lens.tolist())
            assert rel_err(out, ref) < REL_TOL[torch.bfloat16], (step, s, nb)
        for (qb, nb), (_, out, q, table, lens) in pre.items():
            seq_len, real = (int(x) for x in lens)
            ref = reference_attention(q[:real], kc, vc, table, seq_len)
            assert rel_err(out[:real], ref) < REL_TOL[torch.bfloat16], (step, qb, nb)
            assert real == qb or out[real:].abs().max() == 0
    assert granite_rt.stats()["compiles"] == 0


def test_gpu_capture_with_host_lengths_is_refused(granite_rt, granite_pool):
    """Host lengths would be baked into a graph: under capture dispatch asks for
    device lengths instead (and a later eager call still works)."""
    from kernel_cache import ShapeError

    kc, vc, bt = granite_pool
    q = _q(8, 3)
    tables = bt[:8, :256].contiguous()
    granite_rt.decode(q, kc, vc, tables, [4096] * 8)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(ShapeError, match="device_seq_lens"):
        with torch.cuda.graph(g):
            granite_rt.decode(q, kc, vc, tables, [4096] * 8)
    out = granite_rt.decode(q, kc, vc, tables, [4096] * 8)
    ref = reference_decode(q, kc, vc, tables, [4096] * 8)
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "copied"])
def test_gpu_host_lengths_through_the_staging_ring_match_reference(
    granite_rt, granite_pool, mapped
):
    """Host lengths reach the kernel through the pinned staging rows, read in
    place by the kernel (mapped) or copied to the device per call: more than
    two laps of the ring of decode and of prefill calls, each with new lengths,
    enqueued back to back; sampled outputs match the reference for the lengths
    of their own call (a row rewritten before its kernel ran would not)."""
    from kernel_cache.runtime.dispatch import RING, AttentionRuntime, mapped_pinned_reads

    if mapped and not mapped_pinned_reads(torch.device("cuda")):
        pytest.skip("kernels cannot read pinned host memory on this machine")
    kc, vc, bt = granite_pool
    rt = AttentionRuntime(granite_rt.config, granite_rt.bucketer, granite_rt._runners)
    rt.map_pinned_lengths = mapped
    gen = torch.Generator().manual_seed(5)
    q8, q512 = _q(8, 21), _q(512, 22)
    tables, table = bt[8:16, :256].contiguous(), bt[20, :256].contiguous()
    kept = []
    for step in range(2 * RING + 20):
        lens = torch.randint(1, 4097, (8,), generator=gen).tolist()
        seq_len = int(torch.randint(512, 4097, (1,), generator=gen))
        dec = rt.decode(q8, kc, vc, tables, lens)
        pre = rt.prefill(q512, kc, vc, table, seq_len)
        if step % 16 == 5:
            kept.append((dec, lens, pre, seq_len))
    assert all((s.ring_args is not None) == mapped for s in rt._slots.values())
    torch.cuda.synchronize()
    for dec, lens, pre, seq_len in kept:
        assert rel_err(dec, reference_decode(q8, kc, vc, tables, lens)) < 1e-2, lens
        ref = reference_attention(q512, kc, vc, table, seq_len)
        assert rel_err(pre, ref) < REL_TOL[torch.bfloat16], seq_len


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "copied"])
def test_gpu_decode_of_two_sequences_gets_one_lengths_argument(mapped):
    """A decode bucket of 2 sequences has 2 lengths, like prefill: its kernel still
    gets one ``[2]`` lengths tensor holding the host lengths, padded with 0
    (recorded by a stub runner, so no artifact is needed)."""
    from kernel_cache import AttentionRuntime
    from kernel_cache.plan.buckets import BATCHED_DECODE, KernelVariant

    limits = {**GRANITE_LIMITS, "max_num_seqs": 2, "num_seqs_buckets": (2,)}
    cfg = make_config("granite-3.3-8b", device="cuda", **limits)
    v = KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=256, num_seqs=2)
    seen = []

    class Recorder:
        def run(self, args):
            seen.append([a.clone() for a in args[3:]])
            return [torch.zeros(2, H, D, device="cuda", dtype=torch.bfloat16)]

    rt = AttentionRuntime(cfg, Bucketer(cfg), {v: Recorder()})
    rt.map_pinned_lengths = mapped
    kc = torch.zeros(4, BS, KVH, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.zeros(2, 256, device="cuda", dtype=torch.int32)
    for lens in ([4000, 17], [3]):
        n = len(lens)
        rt.decode(_q(n, 1), kc, kc, tables[:n], lens)
    torch.cuda.synchronize()
    assert [[t.tolist() for t in args] for args in seen] == [
        [[[0] * 256] * 2, [4000, 17]],
        [[[0] * 256] * 2, [3, 0]],
    ]


# -- the FP8 KV cache (kv_cache_dtype fp8_e4m3) -------------------------------------


def _fp8_pool(p, bs, kvh, d, g):
    """A standard-normal pool stored in ``float8_e4m3fn`` with per-tensor scales
    ``amax / 448`` (as vLLM calibrates them), and its dequantized float32 copy:
    ``(kc, vc, k_scale [1], v_scale [1], kd, vd)``, all on the GPU."""
    k = torch.randn(p, bs, kvh, d, generator=g, device="cuda")
    v = torch.randn(p, bs, kvh, d, generator=g, device="cuda")
    ks, vs = (k.abs().amax() / 448).reshape(1), (v.abs().amax() / 448).reshape(1)
    kc, vc = fp8_quantize(k, ks), fp8_quantize(v, vs)
    return kc, vc, ks, vs, dequantize(kc, ks), dequantize(vc, vs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h,kvh,d,bs,nb,s", DECODE_CASES)
def test_triton_decode_fp8_matches_reference(h, kvh, d, bs, nb, s, dtype):
    """The Triton decode kernel on an fp8 pool (random block tables, repeats
    included; every split count) against the float32 reference on the
    dequantized pool, within the bound of the query's dtype; padded rows zeros."""
    from kernel_cache.kernels.triton_decode import TritonBatchedDecode

    g = torch.Generator(device="cuda").manual_seed(h * 5 + nb)
    p = nb * s + 5
    kc, vc, ks, vs, kd, vd = _fp8_pool(p, bs, kvh, d, g)
    cap = nb * bs
    lens = [cap, 1, bs, max(1, cap - bs + 1), 0, 7][:s]
    lens += [0] * (s - len(lens))
    bt = torch.randint(0, p, (s, nb), generator=g, device="cuda", dtype=torch.int32)
    bt[:, -1] = bt[:, 0]  # a block listed twice in every row
    q = torch.randn(s, h, d, generator=g, device="cuda").to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    real = [i for i, n in enumerate(lens) if n > 0]
    ref = reference_decode(q[real], kd, vd, bt[real], [lens[i] for i in real])
    for splits in (None, 1, min(3, nb), nb):
        mod = TritonBatchedDecode(h, kvh, d, num_kv_splits=splits)
        out = mod(q, kc, vc, bt, seq_lens, ks, vs)
        assert out.dtype == dtype and out.shape == (s, h, d)
        err = rel_err(out[real], ref)
        assert err < REL_TOL[dtype], (splits, err)
        pad = [i for i, n in enumerate(lens) if n == 0]
        assert not pad or out[pad].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,kvh,d,bs,nb,qb,cases", PREFILL_CASES)
def test_triton_prefill_fp8_matches_reference(h, kvh, d, bs, nb, qb, cases, dtype):
    """The Triton prefill kernel on an fp8 pool, block tables drawn with repeats,
    default tiles and 128 x 128 tiles (block_size 128: one page per tile; 16: a
    gathered tile), against the float32 reference on the dequantized pool."""
    from kernel_cache.kernels.tiles import cuda_prefill_defaults
    from kernel_cache.kernels.triton_prefill import TritonPagedAttention

    g = torch.Generator(device="cuda").manual_seed(h + nb + 1)
    p = nb + 7
    kc, vc, ks, vs, kd, vd = _fp8_pool(p, bs, kvh, d, g)
    bt = torch.randint(0, p, (nb,), generator=g, device="cuda", dtype=torch.int32)
    bt[nb // 2] = bt[0]  # a repeated block
    q = torch.randn(qb, h, d, generator=g, device="cuda").to(dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    tiles = [
        cuda_prefill_defaults(qb, h // kvh, d, size),
        {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    ]
    for seq_len, real_q in cases:
        ref = reference_attention(q[:real_q], kd, vd, bt, seq_len)
        lens = [torch.tensor([x], dtype=torch.int32, device="cuda") for x in (seq_len, real_q)]
        for t in tiles:
            mod = TritonPagedAttention(h, kvh, d, query_len=qb, itemsize=size, **t)
            out = mod(q, kc, vc, bt, *lens, ks, vs)
            assert out.dtype == dtype and out.shape == (qb, h, d)
            err = rel_err(out[:real_q], ref)
            assert err < REL_TOL[dtype], (seq_len, real_q, t, err)
            assert real_q == qb or out[real_q:].abs().max() == 0


def test_gpu_fp8_plan_warms_dispatches_and_replays_new_scales(tmp_path, tiny_model):
    """The tiny plan with --kv-cache-dtype fp8_e4m3 on CUDA: warmup and verify pass;
    through load_plan's dispatch, prefill and decode on an fp8 pool match the
    reference on the dequantized pool with zero compiles; a decode captured in a
    CUDA graph with device lengths and tensor scales, replayed after the scales
    (and lengths) are rewritten in place, matches the reference for the new
    scales: the artifact reads them at call time."""
    cache = tmp_path / "cache"
    flag = ["--kv-cache-dtype", "fp8_e4m3"]
    run_cli("warmup", *tiny_args(tiny_model), *GPU, *flag, "--cache-dir", cache, check=True)
    proc = run_cli("verify", *tiny_args(tiny_model), *GPU, *flag, "--cache-dir", cache, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"] is True, proc.stdout
    cfg = make_config(str(tiny_model), device="cuda", kv_cache_dtype="fp8_e4m3", **TINY_LIMITS)
    rt = load_plan(cfg, cache)
    g = torch.Generator(device="cuda").manual_seed(21)
    kc, vc, ks, vs, kd, vd = _fp8_pool(11, 16, 2, 8, g)
    dt = torch.bfloat16
    for seq_len, n in [(1, 1), (17, 5), (32, 32), (30, 1)]:
        bt = torch.randint(0, 11, (2,), generator=g, device="cuda", dtype=torch.int32)
        query = torch.randn(n, 4, 8, generator=g, device="cuda").to(dt)
        out = rt.prefill(query, kc, vc, bt, seq_len, k_scale=ks, v_scale=vs)
        assert rel_err(out, reference_attention(query, kd, vd, bt, seq_len)) < REL_TOL[dt]
    tables = torch.randint(0, 11, (4, 2), generator=g, device="cuda", dtype=torch.int32)
    tables[:, 1] = tables[:, 0]
    query = torch.randn(4, 4, 8, generator=g, device="cuda").to(dt)
    lens = torch.tensor([32, 1, 17, 9], dtype=torch.int32, device="cuda")
    out = rt.decode(query, kc, vc, tables, lens.tolist(), k_scale=ks, v_scale=vs)
    assert rel_err(out, reference_decode(query, kd, vd, tables, lens.tolist())) < REL_TOL[dt]
    k_dev, v_dev = ks.clone(), vs.clone()  # the engine's scale tensors, captured
    edge = [32] * 4

    def call():
        return rt.decode(
            query, kc, vc, tables, edge, device_seq_lens=lens, k_scale=k_dev, v_scale=v_dev
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = call()
    for kmul, vmul, new_lens in [(1.0, 1.0, [32, 1, 17, 9]), (3.0, 0.5, [5, 32, 2, 16])]:
        k_dev.copy_(ks * kmul)
        v_dev.copy_(vs * vmul)
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_decode(
            query, dequantize(kc, k_dev), dequantize(vc, v_dev), tables, new_lens
        )
        assert rel_err(g_out, ref) < REL_TOL[dt], (kmul, vmul)
    assert rt.stats()["compiles"] == 0
