"""The FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``) on the CPU.

The kernels read a ``float8_e4m3fn`` pool as ``float(stored) * scale`` (vLLM's
per-tensor ``k_scale`` and ``v_scale``); each is checked against the float32
SDPA reference run on the DEQUANTIZED pool, with random block tables that repeat
pool blocks. Also: the quantization's own error (what fp8 costs against the
unquantized values), the key (fp8 and auto plans never share an entry; auto
keeps the component it always had), ``explain`` naming the change, dispatch's
errors, and the Triton kernels under Triton's CPU interpreter (skipped without
triton). One test (marker ``compile``) warms, loads and dispatches an fp8 tiny plan.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from kernel_cache import Bucketer, ConfigError, ShapeError, make_config
from kernel_cache.kernels.builtin import RealKVBatchedDecode, RealKVPagedAttention
from kernel_cache.kernels.plain import BatchedDecode, PagedAttention
from kernel_cache.kernels.reference import (
    dequantize,
    fp8_quantize,
    reference_attention,
    reference_decode,
)
from kernel_cache.plan.keys import build_key, diff_components
from kernel_cache.runtime.dispatch import AttentionRuntime

from ..conftest import TINY_LIMITS, run_cli, tiny_args

FP8 = torch.float8_e4m3fn
#: Max abs error against the float32 reference on the dequantized pool, per model
#: dtype (query and output). Measured on these inputs (q, k, v standard normal;
#: K and V scales 0.02 and 0.03; 20 seeds of prefill and split-KV decode):
#: float32 at most 7.2e-7; bfloat16 at most 1.1e-2 (the query and the output in
#: bfloat16, and the real-KV prefill's dequantized K/V rounded to it);
#: docs/usage.md, "FP8 KV cache".
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
H, KVH, D, BS = 8, 2, 16, 16


def _pool(p, seed, k_scale=0.02, v_scale=0.03, d=D):
    """``(k fp8, v fp8, k_scale [1], v_scale [1], k, v)``: a standard-normal pool of
    ``p`` blocks stored with the two scales, and the values before quantization."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(p, BS, KVH, d, generator=g)
    v = torch.randn(p, BS, KVH, d, generator=g)
    ks, vs = torch.tensor([k_scale]), torch.tensor([v_scale])
    return fp8_quantize(k, k_scale), fp8_quantize(v, v_scale), ks, vs, k, v


def test_quantize_is_vllms_semantics_and_its_error_is_fp8s():
    """stored = fp8(x / scale), read = float(stored) * scale: the round trip is
    within e4m3's half ulp (2**-4 relative) of x; out-of-range values saturate."""
    x = torch.randn(4096) * 3
    s = 0.05  # |x| / s stays below 448
    stored = fp8_quantize(x, s)
    assert stored.dtype == FP8
    assert torch.equal(stored, (x / s).to(FP8))  # in range: no saturation here
    back = dequantize(stored, torch.tensor([s]))
    assert back.dtype == torch.float32
    assert ((back - x).abs() <= x.abs() * 2**-4 + 2**-9 * s).all()
    big = fp8_quantize(torch.tensor([1e6, -1e6]), 1.0)  # saturated, not NaN
    assert big.float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_kernels_read_fp8_pool_as_dequantized(dtype):
    """The plain kernel and the real-KV kernel (its compiled formulation, run
    eagerly) on an fp8 pool, block tables with repeated ids, chunks at and inside
    the bucket: each within ATOL of the reference on the dequantized pool."""
    kc, vc, ks, vs, _, _ = _pool(9, seed=1)
    kd, vd = dequantize(kc, ks), dequantize(vc, vs)
    g = torch.Generator().manual_seed(2)
    nb, qb = 4, 32
    errs = []
    for seq_len, real_q in [(64, 32), (64, 1), (40, 17), (1, 1), (33, 32)]:
        bt = torch.randint(0, 9, (nb,), generator=g, dtype=torch.int32)
        bt[2] = bt[0]  # a pool block listed twice
        q = torch.randn(qb, H, D, generator=g).to(dtype)
        args = (q, kc, vc, bt, torch.tensor([seq_len]), torch.tensor([real_q]), ks, vs)
        ref = reference_attention(q[:real_q], kd, vd, bt, seq_len)
        for out in (
            PagedAttention(H, KVH, D)(*args),
            RealKVPagedAttention(H, KVH, D).real_blocks(*args),
        ):
            assert out.dtype == dtype and out.shape == (qb, H, D)
            errs.append(float((out[:real_q].float() - ref).abs().max()))
    assert max(errs) < ATOL[dtype], errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernels_read_fp8_pool_as_dequantized(dtype):
    """Single-pass and split-KV decode (the plain kernel, and the real-KV module
    eagerly) on an fp8 pool: random tables with repeats, a padded row (zeros)."""
    kc, vc, ks, vs, _, _ = _pool(13, seed=3)
    kd, vd = dequantize(kc, ks), dequantize(vc, vs)
    g = torch.Generator().manual_seed(4)
    s, nb = 5, 4
    bt = torch.randint(0, 13, (s, nb), generator=g, dtype=torch.int32)
    bt[:, 3] = bt[:, 1]  # repeats in every row
    lens = torch.tensor([64, 1, 17, 0, 50], dtype=torch.int32)
    q = torch.randn(s, H, D, generator=g).to(dtype)
    real = [0, 1, 2, 4]
    ref = reference_decode(q[real], kd, vd, bt[real], lens[real].tolist())
    mods = [
        BatchedDecode(H, KVH, D),
        BatchedDecode(H, KVH, D, num_kv_splits=2, blocks_per_chunk=1),
        RealKVBatchedDecode(H, KVH, D, num_kv_splits=4),
    ]
    for mod in mods:
        out = mod(q, kc, vc, bt, lens, ks, vs)
        assert out.dtype == dtype and out.shape == (s, H, D)
        assert float((out[real].float() - ref).abs().max()) < ATOL[dtype]
        assert out[3].abs().max() == 0  # the padded row


def test_fp8_error_against_the_unquantized_cache_is_fps_not_the_kernels():
    """What fp8 costs: against the reference on the ORIGINAL (unquantized) values
    the decode differs by the quantization (about 2**-5 relative per element),
    far above the kernel's own error on the dequantized pool (float32 ulps)."""
    kc, vc, ks, vs, k, v = _pool(6, seed=5)
    g = torch.Generator().manual_seed(6)
    bt = torch.randperm(6, generator=g)[:4].to(torch.int32)[None].repeat(2, 1)
    lens = [64, 30]
    q = torch.randn(2, H, D, generator=g)
    out = BatchedDecode(H, KVH, D)(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), ks, vs)
    own = (out - reference_decode(q, dequantize(kc, ks), dequantize(vc, vs), bt, lens)).abs().max()
    fp8 = (out - reference_decode(q, k, v, bt, lens)).abs().max()
    assert own < 1e-5 < 1e-3 < fp8 < 0.1, (own, fp8)


# -- the plan, the key, explain ------------------------------------------------------


def test_kv_cache_dtype_is_in_the_key_and_auto_keeps_todays_keys(tiny_config):
    """An fp8 plan's keys differ from the auto plan's, in the dtype component only,
    which names the KV dtype; auto's dtype component is the model dtype alone (the
    value every key had before the option), and its plan fingerprint is the one
    computed without the field."""
    import hashlib

    fp8 = tiny_config.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})
    assert tiny_config.kv_cache_dtype == "auto" and not tiny_config.kv_fp8
    for v in Bucketer(tiny_config).variants:
        a, b = build_key(tiny_config, v), build_key(fp8, v)
        assert a.hexdigest != b.hexdigest
        assert dict(a.components)["dtype"] == "float32"
        assert dict(b.components)["dtype"] == "float32 kv_cache_dtype=fp8_e4m3"
        assert diff_components(b.as_dict(), a.as_dict()) == [
            "dtype: float32 kv_cache_dtype=fp8_e4m3 != float32"
        ]
    auto = Bucketer(tiny_config)
    doc = {
        "config": {
            k: v
            for k, v in tiny_config.model_dump(mode="json").items()
            if k not in ("kv_cache_dtype", "slots")  # fields left out at their defaults
        },
        "num_blocks_buckets": auto.num_blocks_buckets,
        "query_buckets": auto.query_buckets,
        "num_seqs_buckets": auto.num_seqs_buckets,
    }
    old = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    assert auto.fingerprint() == old != Bucketer(fp8).fingerprint()


def test_make_config_refuses_an_unknown_kv_cache_dtype():
    with pytest.raises(ConfigError) as e:
        make_config("llama-3.2-1b", kv_cache_dtype="fp8_e5m2")
    assert "kv_cache_dtype='fp8_e5m2'" in str(e.value)
    assert "accepted values: auto, fp8_e4m3" in str(e.value)


def test_cli_plan_and_explain_name_the_kv_cache_dtype(tiny_model, tiny_config, tmp_path):
    """``plan --kv-cache-dtype fp8_e4m3`` builds the fp8 plan; ``explain`` of it
    over a cache holding the auto plan's entries names the dtype component."""
    from kernel_cache.store.disk_tier import DiskTier, make_meta

    tier = DiskTier(tmp_path / "cache")
    try:
        for v in Bucketer(tiny_config).variants:
            key = build_key(tiny_config, v)
            tier.put(key.hexdigest, b"x" * 64, make_meta(key, str(v), b"x" * 64, 1.0))
    finally:
        tier.close()
    flag = ["--kv-cache-dtype", "fp8_e4m3", "--query-buckets", "32"]
    plan = run_cli("plan", *tiny_args(tiny_model), *flag, "--json", check=True)
    assert json.loads(plan.stdout)["config"]["kv_cache_dtype"] == "fp8_e4m3"
    text = run_cli("plan", *tiny_args(tiny_model), *flag, check=True).stdout
    assert "float32 on cpu, KV cache fp8_e4m3" in text.splitlines()[0]
    proc = run_cli("explain", *tiny_args(tiny_model), *flag, "--cache-dir", tmp_path / "cache")
    assert "dtype: float32 kv_cache_dtype=fp8_e4m3 != float32" in proc.stdout, proc.stdout
    bad = run_cli("plan", *tiny_args(tiny_model), "--kv-cache-dtype", "int8")
    assert bad.returncode != 0 and "fp8_e4m3" in bad.stderr


# -- dispatch --------------------------------------------------------------------------


class _Eager:
    """A loaded runner stand-in: the eager kernel behind ``run(list)``, counting
    the inputs it was given."""

    def __init__(self, mod):
        self.mod, self.seen = mod, []

    def run(self, args):
        self.seen.append(len(args))
        with torch.no_grad():
            return [self.mod(*args)]


def _runtime(cfg):
    b = Bucketer(cfg)
    c = cfg
    runners = {
        v: _Eager(
            (PagedAttention if v.kernel == "paged_attention" else BatchedDecode)(
                c.num_heads, c.num_kv_heads, c.head_dim
            )
        )
        for v in b.variants
    }
    return AttentionRuntime(cfg, b, runners), runners


@pytest.fixture(scope="module")
def fp8_cfg(tiny_model):
    return make_config(str(tiny_model), kv_cache_dtype="fp8_e4m3", **TINY_LIMITS)


def test_dispatch_passes_the_scales_to_the_kernel(fp8_cfg):
    """Through dispatch (eager kernels as the runners): prefill and decode on an
    fp8 pool with 0-d and [1] scales match the reference on the dequantized pool;
    each kernel got the scales as its last two inputs."""
    rt, runners = _runtime(fp8_cfg)
    kc, vc, ks, vs, _, _ = _pool(7, seed=8, k_scale=0.05, v_scale=0.01, d=8)  # tiny geometry
    kd, vd = dequantize(kc, ks), dequantize(vc, vs)
    g = torch.Generator().manual_seed(9)
    for seq_len, q in [(32, 32), (17, 5), (1, 1)]:
        bt = torch.tensor([3, 3], dtype=torch.int32)
        query = torch.randn(q, 4, 8, generator=g)
        out = rt.prefill(query, kc, vc, bt, seq_len, k_scale=ks, v_scale=vs.reshape(()))
        ref = reference_attention(query, kd, vd, bt, seq_len)
        assert (out - ref).abs().max() < 1e-5
    lens = [32, 1, 20]
    bt = torch.randint(0, 7, (3, 2), generator=g, dtype=torch.int32)
    query = torch.randn(3, 4, 8, generator=g)
    out = rt.decode(query, kc, vc, bt, lens, k_scale=ks, v_scale=vs)
    assert (out - reference_decode(query, kd, vd, bt, lens)).abs().max() < 1e-5
    assert {n for r in runners.values() for n in r.seen} == {7, 8}  # 5 + 2, 6 + 2


def test_decode_sequence_by_sequence_passes_the_scales(tiny_model):
    """A plan without decode-batch buckets (max_num_seqs below min_batched_seqs)
    decodes through prefill, one sequence at a time: the scales go along."""
    cfg = make_config(
        str(tiny_model), kv_cache_dtype="fp8_e4m3", **{**TINY_LIMITS, "max_num_seqs": 2}
    )
    rt, _ = _runtime(cfg)
    assert not rt.bucketer.num_seqs_buckets
    kc, vc, ks, vs, _, _ = _pool(5, seed=17, d=8)
    g = torch.Generator().manual_seed(18)
    bt = torch.tensor([[2, 2], [4, 0]], dtype=torch.int32)
    query = torch.randn(2, 4, 8, generator=g)
    out = rt.decode(query, kc, vc, bt, [30, 3], k_scale=ks, v_scale=vs)
    ref = reference_decode(query, dequantize(kc, ks), dequantize(vc, vs), bt, [30, 3])
    assert (out - ref).abs().max() < ATOL[torch.float32]


def test_dispatch_errors_name_the_input_and_the_fix(fp8_cfg, tiny_config):
    rt, _ = _runtime(fp8_cfg)
    kc, vc, ks, vs, _, _ = _pool(3, seed=10, d=8)
    q, bt = torch.zeros(1, 4, 8), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ShapeError, match=r"v_scale is missing: this plan's KV pool is float8"):
        rt.prefill(q, kc, vc, bt, 1, k_scale=ks)
    with pytest.raises(ShapeError, match=r"k_scale=0.5 is a float; expected a 1-element"):
        rt.decode(q, kc, vc, bt[None], [1], k_scale=0.5, v_scale=vs)
    with pytest.raises(ShapeError, match=r"k_scale is \(2,\) torch.float32 on cpu; expected"):
        rt.prefill(q, kc, vc, bt, 1, k_scale=torch.ones(2), v_scale=vs)
    with pytest.raises(ShapeError, match=r"v_scale is \(1,\) torch.float64"):
        rt.prefill(q, kc, vc, bt, 1, k_scale=ks, v_scale=vs.double())
    with pytest.raises(
        ShapeError,
        match=r"key_cache is torch.float32; the plan's KV pool is "
        r"torch.float8_e4m3fn \(dtype=float32, kv_cache_dtype=fp8_e4m3\): pass a pool of "
        r"torch.float8_e4m3fn, or warm up and load a plan with --kv-cache-dtype auto",
    ):
        rt.prefill(q, kc.float(), vc.float(), bt, 1, k_scale=ks, v_scale=vs)
    auto, _ = _runtime(tiny_config)
    with pytest.raises(
        ShapeError,
        match=r"k_scale was given, but this plan's KV pool is "
        r"torch.float32 \(kv_cache_dtype=auto\).*--kv-cache-dtype fp8_e4m3",
    ):
        auto.prefill(q, kc.float(), vc.float(), bt, 1, k_scale=ks, v_scale=vs)
    with pytest.raises(
        ShapeError,
        match=r"value_cache is torch.float8_e4m3fn; the plan's KV "
        r"pool is torch.float32 \(dtype=float32, kv_cache_dtype=auto\).*--kv-cache-dtype fp8_e4m3",
    ):
        auto.prefill(q, kc.float(), vc, bt, 1)


def test_a_scale_that_is_no_number_gets_a_fix_that_works(fp8_cfg):
    """A list or a string as a scale: the suggested tensor is one the check takes
    (``torch.tensor([[0.5]])`` of a list would be refused as a [1, 1] tensor)."""
    rt, _ = _runtime(fp8_cfg)
    kc, vc, ks, vs, _, _ = _pool(3, seed=10, d=8)
    q, bt = torch.zeros(1, 4, 8), torch.zeros(2, dtype=torch.int32)
    for bad in ([0.5], "0.5", (0.5,)):
        with pytest.raises(ShapeError) as e:
            rt.prefill(q, kc, vc, bt, 1, k_scale=bad, v_scale=vs)
        msg = str(e.value)
        assert f"k_scale={bad!r} is a {type(bad).__name__}" in msg
        fix = msg.rsplit(": ", 1)[1]
        assert fix == "torch.tensor([s], dtype=torch.float32, device='cpu')", msg
    # a number keeps its value in the fix, and the fix is accepted
    with pytest.raises(ShapeError) as e:
        rt.prefill(q, kc, vc, bt, 1, k_scale=0.5, v_scale=vs)
    fix = str(e.value).rsplit(": ", 1)[1]
    rt.prefill(q, kc, vc, bt, 1, k_scale=eval(fix, {"torch": torch}), v_scale=vs)


# -- the Triton kernels under Triton's CPU interpreter --------------------------------

#: Run in a fresh process with TRITON_INTERPRET=1 (read when triton.jit wraps the
#: kernels, so before anything imports them). Triton 3.6's interpreter converts a
#: loaded scalar used as a ``range`` bound with ``int()`` of a 1-element 1-D
#: array, which numpy 2.4 refuses: the patch reads its one element instead.
#: Queries are float32: the interpreter's numpy has no bfloat16 (fp8 pools are
#: uint8 there, converted by the interpreter's own fp8 routines).
INTERPRETED = r"""
import json, sys
import triton.runtime.interpreter as interp
orig = interp._patch_lang_tensor
def patched(tensor, scope):
    orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interp._patch_lang_tensor = patched
import torch
from tests.kernels.test_fp8_kv import CASES
print(json.dumps(CASES[sys.argv[1]]()))
"""


def _interpreted(case: str) -> list:
    """Run ``CASES[case]`` under Triton's interpreter in a fresh process: its errors."""
    import subprocess
    import sys

    from ..conftest import ROOT

    pytest.importorskip("triton")
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED, case],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _decode_case() -> list:
    from kernel_cache.kernels.triton_decode import launch_decode

    kc, vc, ks, vs, _, _ = _pool(12, seed=11)
    g = torch.Generator().manual_seed(12)
    bt = torch.randint(0, 12, (4, 4), generator=g, dtype=torch.int32)
    bt[:, 2] = bt[:, 0]  # repeated ids
    lens = torch.tensor([64, 1, 0, 37], dtype=torch.int32)
    q = torch.randn(4, H, D, generator=g)
    real = [0, 1, 3]
    ref = reference_decode(q[real], dequantize(kc, ks), dequantize(vc, vs), bt[real], [64, 1, 37])
    res = []
    for splits in (1, 3):
        out = launch_decode(q, kc, vc, bt, lens, D**-0.5, splits, ks, vs, wrap=lambda f: f)
        res.append([splits, float((out[real] - ref).abs().max()), float(out[2].abs().max())])
    return res


def _prefill_case() -> list:
    from kernel_cache.kernels.triton_prefill import launch_prefill

    kc, vc, ks, vs, _, _ = _pool(10, seed=13)
    kd, vd = dequantize(kc, ks), dequantize(vc, vs)
    g = torch.Generator().manual_seed(14)
    bt = torch.tensor([4, 4, 9, 1, 0, 4], dtype=torch.int32)  # repeated ids
    q = torch.randn(32, H, D, generator=g)
    res = []
    for seq_len, real_q in [(90, 20), (32, 32)]:
        ref = reference_attention(q[:real_q], kd, vd, bt, seq_len)
        lens = [torch.tensor([x], dtype=torch.int32) for x in (seq_len, real_q)]
        for block_n in (16, 32):  # one page per tile; two pages gathered per tile
            out = launch_prefill(
                q, kc, vc, bt, *lens, D**-0.5, 32, block_n, 4, 1, ks, vs, wrap=lambda f: f
            )
            pad = float(out[real_q:].abs().max()) if real_q < 32 else 0.0
            res.append([seq_len, block_n, float((out[:real_q] - ref).abs().max()), pad])
    return res


CASES = {"decode": _decode_case, "prefill": _prefill_case}


def test_triton_decode_reads_fp8_pool_under_the_interpreter():
    """The CUDA decode kernel's code, one split and three, on an fp8 pool with
    repeated block ids and a padded row (zeros), against the reference on the
    dequantized pool."""
    res = _interpreted("decode")
    assert len(res) == 2
    for splits, err, pad in res:
        assert err < ATOL[torch.float32] and pad == 0, (splits, err, pad)


def test_triton_prefill_reads_fp8_pool_under_the_interpreter():
    """The CUDA prefill kernel's code, tiles inside one page (block_n == block_size)
    and tiles over two pages (block_n 32, block_size 16), on an fp8 pool with
    repeated ids; bucket-padding rows are zeros."""
    res = _interpreted("prefill")
    assert len(res) == 4
    for seq_len, block_n, err, pad in res:
        assert err < ATOL[torch.float32] and pad == 0, (seq_len, block_n, err, pad)


# -- compiled ---------------------------------------------------------------------------


@pytest.mark.compile
def test_fp8_tiny_plan_warms_loads_and_dispatches_like_the_reference(tiny_model, tmp_path):
    """The tiny plan with ``--kv-cache-dtype fp8_e4m3``, cut to one query bucket
    (32): warmup compiles its 2 variants for the CPU (real-KV prefill over
    dequantized blocks, the plain decode kernel), ``verify`` passes, and an
    engine start dispatches prefill and decode on an fp8 pool (repeated block
    ids) within ATOL of the reference on the dequantized pool, with zero
    compiles; the artifacts take the scales as inputs (two scales, two
    results)."""
    from kernel_cache import load_plan

    cache = tmp_path / "cache"
    flag = ["--kv-cache-dtype", "fp8_e4m3", "--query-buckets", "32"]
    run_cli(
        "warmup", *tiny_args(tiny_model), *flag, "--cache-dir", cache, "--jobs", "1", check=True
    )
    verify = run_cli("verify", *tiny_args(tiny_model), *flag, "--cache-dir", cache, "--json")
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"] is True, verify.stdout
    cfg = make_config(
        str(tiny_model), kv_cache_dtype="fp8_e4m3", **TINY_LIMITS, query_buckets=(32,)
    )
    rt = load_plan(cfg, cache)
    kc, vc, ks, vs, _, _ = _pool(9, seed=15, d=8)
    kd, vd = dequantize(kc, ks), dequantize(vc, vs)
    g = torch.Generator().manual_seed(16)
    errs = []
    for seq_len, q in [(32, 32), (17, 5), (1, 1), (30, 1)]:
        bt = torch.tensor([5, 5], dtype=torch.int32)
        query = torch.randn(q, 4, 8, generator=g)
        out = rt.prefill(query, kc, vc, bt, seq_len, k_scale=ks, v_scale=vs)
        errs.append(float((out - reference_attention(query, kd, vd, bt, seq_len)).abs().max()))
    # A NaN key among the positions a prefill sees: the compiled kernel recomputes
    # the chunk with the plain kernel (its non-finite branch, given the scales),
    # NaN where the reference on the dequantized pool is NaN, equal elsewhere.
    bt, query = torch.tensor([5, 5], dtype=torch.int32), torch.randn(5, 4, 8, generator=g)
    kn = kc.clone()
    kn.view(torch.uint8)[5, 3, 0, 0] = 0x7F  # e4m3's NaN, position 3 of block 5
    out = rt.prefill(query, kn, vc, bt, 17, k_scale=ks, v_scale=vs)
    ref = reference_attention(query, dequantize(kn, ks), vd, bt, 17)
    assert ref.isnan().any() and torch.equal(out.isnan(), ref.isnan())
    errs.append(float((out - ref)[ref.isfinite()].abs().max()))
    lens = [32, 1, 20, 16]
    bt = torch.randint(0, 9, (4, 2), generator=g, dtype=torch.int32)
    bt[:, 1] = bt[:, 0]
    query = torch.randn(4, 4, 8, generator=g)
    out = rt.decode(query, kc, vc, bt, lens, k_scale=ks, v_scale=vs)
    errs.append(float((out - reference_decode(query, kd, vd, bt, lens)).abs().max()))
    assert max(errs) < ATOL[torch.float32], errs
    doubled = rt.decode(query, kc, vc, bt, lens, k_scale=ks, v_scale=vs * 2)
    assert torch.allclose(doubled, out * 2, atol=1e-5)  # v_scale read at call time
    assert rt.stats()["compiles"] == 0
