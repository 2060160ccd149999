"""An engine's own kernel for a slot: config, identity, errors, and (compile)
warmup, verify, engine start and a helper edit with the example package
``examples/custom_kernel`` (copied to a temporary directory on ``PYTHONPATH``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_cache.config.engine import config_to_cli, make_config
from kernel_cache.errors import CompileError, ConfigError
from kernel_cache.kernels.slots import SLOTS, kernel_path
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION, Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.plan.sources import source_files

from ..conftest import N_TINY, ROOT, TINY_LIMITS, run_cli, tiny_args

EXAMPLE = ROOT / "examples" / "custom_kernel"
DECODE = "kc_example_kernels.decode:SdpaDecode"
PREFILL = "kc_example_kernels.prefill:SdpaPrefill"


@pytest.fixture
def example(tmp_path, monkeypatch) -> Path:
    """A copy of the example package on ``sys.path`` and ``PYTHONPATH``; the
    folder that holds it."""
    site = tmp_path / "site"
    shutil.copytree(EXAMPLE / "kc_example_kernels", site / "kc_example_kernels")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    source_files.cache_clear()
    yield site
    source_files.cache_clear()
    for name in [m for m in sys.modules if m.startswith("kc_example_kernels")]:
        del sys.modules[name]


# -- configuration ------------------------------------------------------------


def test_kernels_is_a_sorted_immutable_config_field(tiny_model):
    cfg = make_config(
        str(tiny_model), kernels={"paged_attention": PREFILL, "batched_decode": DECODE}
    )
    assert cfg.kernels == (("batched_decode", DECODE), ("paged_attention", PREFILL))
    assert make_config(str(tiny_model)).kernels == ()
    again = type(cfg).model_validate_json(cfg.model_dump_json())
    assert again == cfg and hash(again) == hash(cfg)


@pytest.mark.parametrize(
    "kernels,says",
    [
        ({"flash": DECODE}, "unknown slot 'flash'; known slots: paged_attention, batched_decode"),
        ({"batched_decode": "not a path"}, "expected package.module:Factory"),
        ({"batched_decode": "pkg.mod:"}, "'pkg.mod:' is not an import path"),
        ([("batched_decode",)], "('batched_decode',) is not a (slot, path) pair"),
        (5, "5 is not a mapping"),
    ],
)
def test_bad_kernels_are_config_errors(tiny_model, kernels, says):
    with pytest.raises(ConfigError, match="kernels") as e:
        make_config(str(tiny_model), kernels=kernels)
    assert says in str(e.value)


def test_one_kernel_string_is_one_slot_not_its_characters(tiny_model):
    cfg = make_config(str(tiny_model), kernels=f"batched_decode={DECODE}")
    assert cfg.kernels == (("batched_decode", DECODE),)


def test_kernel_option_round_trips_through_config_to_cli(tiny_model):
    import argparse
    import shlex

    from warmup.cli.options import config_from_args, engine_options

    p = argparse.ArgumentParser()
    engine_options(p)
    argv = [*map(str, tiny_args(tiny_model)), "--kernel", f"batched_decode={DECODE}"]
    cfg = config_from_args(p.parse_args(argv))
    assert dict(cfg.kernels) == {"batched_decode": DECODE}
    rebuilt = config_from_args(p.parse_args(shlex.split(config_to_cli(cfg))))
    assert rebuilt == cfg
    with pytest.raises(ConfigError, match="--kernel 'batched_decode': expected SLOT="):
        config_from_args(p.parse_args([*argv, "--kernel", "batched_decode"]))


def test_built_in_kernels_are_the_slots_default_import_paths(tiny_config):
    for slot, spec in SLOTS.items():
        assert kernel_path(tiny_config, slot) == spec.default
        module, _, attr = spec.default.partition(":")
        factory = getattr(__import__(module, fromlist=[attr]), attr)
        from kernel_cache.kernels.builtin import build_module

        assert type(build_module(slot, 4, 2, 8)) is factory


def test_on_cuda_the_built_in_kernels_are_the_triton_ones_by_name_and_in_the_key(tiny_model):
    """A CUDA plan with no engine kernel names the Triton factories (the slots'
    CUDA defaults) in its keys and hashes their modules' sources, read without
    importing Triton; ``ls`` calls both devices' defaults built-in."""
    from kernel_cache.plan.keys import environment
    from warmup.cli.commands import _kernel_label

    cuda = make_config(str(tiny_model), **TINY_LIMITS, device="cuda", dtype="bfloat16")
    env = {**environment("cpu"), "device": "cuda", "device_arch": "sm_90 cuda 13.0 triton 3.6.0"}
    for slot, spec in SLOTS.items():
        assert kernel_path(cuda, slot) == spec.cuda_default != spec.default
        assert spec.cuda_default.startswith("kernel_cache.kernels.triton_")
        assert _kernel_label(spec.cuda_default) == _kernel_label(spec.default) == "built-in"
    for v in Bucketer(cuda).variants:
        key = build_key(cuda, v, env=env).as_dict()
        assert key["kernel"] == SLOTS[v.kernel].cuda_default
        module = SLOTS[v.kernel].cuda_default.partition(":")[0]
        assert f"kernel_cache/kernels/{module.rpartition('.')[2]}.py" in key["sources"]
    assert "triton" not in sys.modules


def test_naming_the_devices_built_in_kernel_is_the_same_plan(tiny_model):
    """``--kernel SLOT=<the built-in of this device>`` is the default config: same
    keys, fingerprint and command line; the CPU built-in named on CUDA is a choice."""
    from kernel_cache.plan.plan import Plan

    named = {slot: spec.default for slot, spec in SLOTS.items()}
    base = make_config(str(tiny_model), **TINY_LIMITS)
    same = make_config(str(tiny_model), **TINY_LIMITS, kernels=named)
    assert same == base and same.kernels == () and config_to_cli(same) == config_to_cli(base)
    assert Plan.build(same).fingerprint() == Plan.build(base).fingerprint()
    assert [i.hexdigest for i in Plan.build(same)] == [i.hexdigest for i in Plan.build(base)]
    cuda = make_config(str(tiny_model), **TINY_LIMITS, device="cuda", kernels=named)
    assert dict(cuda.kernels) == named  # the plain-PyTorch kernels on CUDA: kept
    cuda_named = {slot: spec.cuda_default for slot, spec in SLOTS.items()}
    assert (
        make_config(str(tiny_model), **TINY_LIMITS, device="cuda", kernels=cuda_named).kernels == ()
    )


# -- identity -----------------------------------------------------------------


def test_the_key_names_the_kernel_and_hashes_its_package_without_importing(example, tiny_model):
    base = make_config(str(tiny_model), **TINY_LIMITS)
    cfg = make_config(str(tiny_model), **TINY_LIMITS, kernels={"batched_decode": DECODE})
    for v in Bucketer(cfg).variants:
        mine, builtin = build_key(cfg, v).as_dict(), build_key(base, v).as_dict()
        files = json.loads(mine["sources"])
        if v.kernel == BATCHED_DECODE:
            assert mine["kernel"] == DECODE and builtin["kernel"] == SLOTS[BATCHED_DECODE].default
            assert {"kc_example_kernels/decode.py", "kc_example_kernels/paging.py"} <= set(files)
            assert "kc_example_kernels/prefill.py" not in files  # not imported by decode
        else:  # the other slot keeps its key
            assert mine == builtin
    assert not [m for m in sys.modules if m.startswith("kc_example_kernels")]
    before = build_key(cfg, Bucketer(cfg).variants[-1]).hexdigest
    helper = example / "kc_example_kernels" / "paging.py"
    helper.write_text(helper.read_text() + "\n# edited\n")
    source_files.cache_clear()
    assert build_key(cfg, Bucketer(cfg).variants[-1]).hexdigest != before


def test_a_kernel_module_that_cannot_be_found_is_a_clear_error(tiny_model):
    cfg = make_config(str(tiny_model), **TINY_LIMITS, kernels={"batched_decode": "kc_nowhere:F"})
    with pytest.raises(
        ConfigError,
        match="kernel batched_decode=kc_nowhere:F: cannot find module 'kc_nowhere'.*PYTHONPATH",
    ):
        build_key(cfg, Bucketer(cfg).variants[-1])


def test_a_kernel_module_with_a_syntax_error_is_a_clear_error(tmp_path, monkeypatch, tiny_model):
    (tmp_path / "kc_broken.py").write_text("def f(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source_files.cache_clear()
    cfg = make_config(str(tiny_model), **TINY_LIMITS, kernels={"batched_decode": "kc_broken:F"})
    with pytest.raises(
        ConfigError, match=r"batched_decode=kc_broken:F: cannot read its sources.*SyntaxError"
    ):
        build_key(cfg, Bucketer(cfg).variants[-1])


def test_an_entry_point_name_resolves_through_package_metadata(example, tiny_model):
    dist = example / "kc_example_kernels-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kc-example-kernels\n")
    ep = f"[kernel_cache.kernels]\nsdpa_decode = {DECODE}\n"
    (dist / "entry_points.txt").write_text(ep)
    cfg = make_config(str(tiny_model), **TINY_LIMITS, kernels={"batched_decode": "sdpa_decode"})
    assert kernel_path(cfg, BATCHED_DECODE) == DECODE
    assert build_key(cfg, Bucketer(cfg).variants[-1]).as_dict()["kernel"] == DECODE
    bad = make_config(str(tiny_model), kernels={"batched_decode": "nope"})
    with pytest.raises(ConfigError, match="entry point of group 'kernel_cache.kernels'"):
        kernel_path(bad, BATCHED_DECODE)


# -- a bad factory --------------------------------------------------------------

BAD = """
import torch
from torch import nn

NOT_CALLABLE = 3

def not_a_module(**kw):
    return "a string"

class WrongShape(nn.Module):
    def __init__(self, num_heads, num_kv_heads, head_dim, **launch):
        super().__init__()
    def forward(self, query, key_cache, value_cache, block_tables, seq_lens):
        return query[:, :1]

class WrongDtype(WrongShape):
    def forward(self, query, key_cache, value_cache, block_tables, seq_lens):
        return query.double()

class Raises(WrongShape):
    def __init__(self, **kw):
        raise RuntimeError("no GPU of mine here")

class StarArgs(WrongShape):
    def forward(self, query, *rest):
        return query

class StarExtra(WrongShape):  # every input named; *extra stays empty
    def forward(self, query, key_cache, value_cache, block_tables, seq_lens, *extra):
        return query

class NoExport(WrongShape):
    def forward(self, query, key_cache, value_cache, block_tables, seq_lens):
        if int(seq_lens.sum()) > 3:  # data-dependent Python branch
            return query * 2
        return query
"""


@pytest.fixture
def bad_kernels(tmp_path, monkeypatch) -> Path:
    site = tmp_path / "bad_site"
    (site / "kc_bad_kernels").mkdir(parents=True)
    (site / "kc_bad_kernels" / "__init__.py").write_text(BAD)
    (site / "kc_broken").mkdir()
    (site / "kc_broken" / "__init__.py").write_text("import kc_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    yield site
    for name in [m for m in sys.modules if m.startswith(("kc_bad_kernels", "kc_broken"))]:
        del sys.modules[name]


@pytest.mark.parametrize(
    "path,says",
    [
        ("kc_broken:F", "cannot import 'kc_broken': ModuleNotFoundError"),
        ("kc_bad_kernels:Missing", "has no attribute 'Missing'"),
        ("kc_bad_kernels:NOT_CALLABLE", "is a int, not callable"),
        ("kc_bad_kernels:not_a_module", "returned a str, not a torch.nn.Module"),
        ("kc_bad_kernels:Raises", "the factory raised RuntimeError: no GPU of mine here"),
        (
            "kc_bad_kernels:WrongShape",
            "forward returned [4, 1, 8] torch.float32, expected [4, 4, 8]",
        ),
        ("kc_bad_kernels:WrongDtype", "returned [4, 4, 8] torch.float64, expected [4, 4, 8] torch"),
        ("kc_bad_kernels:StarArgs", "forward takes the slot's inputs into *rest; torch.export"),
    ],
)
def test_a_bad_factory_fails_before_export_naming_slot_and_path(
    bad_kernels, tiny_model, path, says
):
    from warmup.builder.compiler import compile_with_options

    cfg = make_config(str(tiny_model), **TINY_LIMITS, kernels={"batched_decode": path})
    v = Bucketer(cfg).variants[-1]
    with pytest.raises(CompileError) as e:
        compile_with_options(cfg, v, {})
    msg = str(e.value)
    assert msg.startswith(f"{v}: kernel batched_decode={path}: ") and says in msg
    assert "Traceback" not in msg


def test_star_args_are_refused_only_where_they_would_take_an_input(bad_kernels, tiny_model):
    """``*extra`` after every input of the slot exports (it stays empty); in an
    fp8 plan the scales would land in it, and the refusal's signature lists them."""
    from kernel_cache.kernels.slots import build, check_output
    from kernel_cache.runtime.inputs import make_inputs

    path = "kc_bad_kernels:StarExtra"
    for dtype, refused in (("auto", False), ("fp8_e4m3", True)):
        cfg = make_config(
            str(tiny_model), **TINY_LIMITS, kernels={"batched_decode": path}, kv_cache_dtype=dtype
        )
        v = Bucketer(cfg).variants[-1]
        mod = build(BATCHED_DECODE, path, num_heads=4, num_kv_heads=2, head_dim=8)
        args = make_inputs(cfg, v, seed=0)
        if not refused:
            check_output(BATCHED_DECODE, path, mod, args)
            continue
        with pytest.raises(CompileError) as e:
            check_output(BATCHED_DECODE, path, mod, args)
        msg = str(e.value)
        assert "into *extra; torch.export gives each of the 7 inputs" in msg, msg
        assert "seq_lens [S] int32, k_scale [1] float32, v_scale [1] float32) ->" in msg, msg


def test_a_kernel_without_the_scales_in_an_fp8_plan_is_told_about_them(bad_kernels, tiny_model):
    """A kernel written for the slot's inputs alone (WrongShape's forward takes
    five), warmed for an fp8 plan, which passes k_scale and v_scale after them:
    the error says so and names both fixes, beyond Python's argument count."""
    from warmup.builder.compiler import compile_with_options

    path = "kc_bad_kernels:WrongShape"
    cfg = make_config(
        str(tiny_model),
        **TINY_LIMITS,
        kernels={"batched_decode": path},
        kv_cache_dtype="fp8_e4m3",
    )
    v = Bucketer(cfg).variants[-1]
    with pytest.raises(CompileError) as e:
        compile_with_options(cfg, v, {})
    msg = str(e.value)
    assert msg.startswith(f"{v}: kernel batched_decode={path}: forward failed"), msg
    assert "TypeError" in msg and "kv_cache_dtype is fp8_e4m3" in msg, msg
    assert "k_scale [1] float32, v_scale [1] float32" in msg, msg
    assert "--kv-cache-dtype auto" in msg and "Traceback" not in msg, msg


def test_a_kernel_that_does_not_export_gets_the_exporters_first_lines(bad_kernels, tiny_model):
    from warmup.builder.compiler import EXPORT_LINES, compile_with_options

    cfg = make_config(
        str(tiny_model), **TINY_LIMITS, kernels={"batched_decode": "kc_bad_kernels:NoExport"}
    )
    v = Bucketer(cfg).variants[-1]
    with pytest.raises(CompileError) as e:
        compile_with_options(cfg, v, {})
    msg = str(e.value)
    assert msg.startswith(f"torch.export failed for {v} (kernel batched_decode=kc_bad_kernels:")
    assert "data" in msg.lower() and len(msg.splitlines()) <= EXPORT_LINES + 1


@pytest.mark.compile
def test_warmup_reports_a_bad_kernel_as_failed_variants_not_a_crash(
    bad_kernels, tiny_model, tmp_path
):
    bad = ["--kernel", "batched_decode=kc_bad_kernels:not_a_module"]
    bad += ["--kernel", "paged_attention=kc_broken:F"]
    proc = run_cli("warmup", *tiny_args(tiny_model), *bad, "--cache-dir", tmp_path / "c", "--json")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    failed = {r["variant"]: r["error"] for r in json.loads(proc.stdout)["results"]}
    assert len(failed) == N_TINY
    for v, err in failed.items():
        if v.startswith(BATCHED_DECODE):
            assert (
                "kernel batched_decode=kc_bad_kernels:not_a_module: the factory returned a str"
                in err
            )
        else:
            assert "kernel paged_attention=kc_broken:F: cannot import 'kc_broken'" in err


# -- warm, verify, load (compiles) ---------------------------------------------

ENGINE = r"""
import json, sys, torch
from kernel_cache import load_plan, make_config
from kernel_cache.errors import MissingVariantsError
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,), kernels=json.loads(sys.argv[3]))
doc = {}
try:
    rt = load_plan(cfg, sys.argv[2])
except MissingVariantsError as e:
    doc["missing"] = sorted(str(v) for v in e.missing)
    doc["command"] = e.command
else:
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(9, 16, 2, 8, generator=g), torch.randn(9, 16, 2, 8, generator=g)
    q = torch.randn(3, 4, 8, generator=g)
    bt = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    out = rt.decode(q, kc, vc, bt, [5, 17, 32])
    from kernel_cache.kernels.reference import reference_decode
    ref = reference_decode(q, kc, vc, bt, [5, 17, 32])
    doc["err"] = float((out - ref).abs().max())
doc["imported"] = [m for m in sys.modules if m.startswith("kc_example_kernels")]
print(json.dumps(doc))
"""


def engine_start(model, cache, kernels: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), str(cache), json.dumps(kernels)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _warm_verify_load(tiny_model, cache, slot, path, tmp_path) -> dict:
    log = tmp_path / "compiles.log"
    kernel = ["--kernel", f"{slot}={path}"]
    args = [*tiny_args(tiny_model), *kernel, "--cache-dir", cache]
    env = {"KERNEL_CACHE_TEST_COMPILE_LOG": str(log)}
    warm = run_cli("warmup", *args, "--jobs", "1", "--json", env=env, check=True)
    compiled = sorted(line.split()[1] for line in log.read_text().splitlines())
    # the other slot's variants were in the copied cache: only this slot compiled
    assert compiled == sorted(r["variant"] for r in json.loads(warm.stdout)["results"]
                              if r["status"] == "compiled")  # fmt: skip
    assert compiled and all(v.startswith(slot) for v in compiled)
    verify = json.loads(run_cli("verify", *args, "--json", check=True).stdout)
    assert verify["ok"] and verify["kernels"][slot] == path, verify
    assert verify["max_abs_err"] <= 1e-4
    text = run_cli("verify", *args, check=True).stdout
    assert f"kernel {slot}: {path}" in text
    ls = json.loads(run_cli("ls", "--cache-dir", cache, "--json", check=True).stdout)
    held = {r["variant"]: r["kernel"] for r in ls if r["variant"] in compiled}
    assert set(held.values()) == {path}
    plan = json.loads(run_cli("plan", *tiny_args(tiny_model), *kernel, "--json").stdout)
    assert plan["kernels"][slot] == path
    return {"compiled": compiled}


@pytest.mark.compile
def test_warm_verify_and_load_an_engines_paged_attention(example, tiny_model, cache_copy, tmp_path):
    out = _warm_verify_load(tiny_model, cache_copy, PAGED_ATTENTION, PREFILL, tmp_path)
    assert len(out["compiled"]) == 2
    doc = engine_start(tiny_model, cache_copy, {"paged_attention": PREFILL})
    assert doc["imported"] == [] and "missing" not in doc, doc


@pytest.mark.compile
def test_warm_verify_and_load_an_engines_batched_decode_then_edit_its_helper(
    example, tiny_model, cache_copy, tmp_path
):
    """An engine's ``batched_decode`` is warmed, verified and loaded (engine
    start imports none of its modules); then an edit to the kernel's helper
    misses, ``explain`` names the file, and warmup recompiles exactly its
    variants. (One test: the edit needs the warmed entries.)"""
    kernels = {"batched_decode": DECODE}
    first = _warm_verify_load(tiny_model, cache_copy, BATCHED_DECODE, DECODE, tmp_path)
    doc = engine_start(tiny_model, cache_copy, kernels)
    assert doc["imported"] == [] and "missing" not in doc, doc  # engine start imports none
    assert doc["err"] < 1e-4
    # the built-in plan is still there, and the engine's kernel is not taken for it
    assert "missing" not in engine_start(tiny_model, cache_copy, {})

    helper = example / "kc_example_kernels" / "paging.py"
    helper.write_text(helper.read_text() + "\nEDITED = True\n")
    doc = engine_start(tiny_model, cache_copy, kernels)
    assert (
        doc["missing"] == first["compiled"]
        and f"--kernel batched_decode={DECODE}" in doc["command"]
    )
    args = [
        *tiny_args(tiny_model),
        "--kernel",
        f"batched_decode={DECODE}",
        "--cache-dir",
        cache_copy,
    ]
    explain = run_cli("explain", *args, check=True).stdout
    assert "sources: kc_example_kernels/paging.py changed" in explain, explain
    log = tmp_path / "again.log"
    env = {"KERNEL_CACHE_TEST_COMPILE_LOG": str(log)}
    run_cli("warmup", *args, "--jobs", "1", env=env, check=True)
    assert sorted(line.split()[1] for line in log.read_text().splitlines()) == first["compiled"]
    assert "missing" not in engine_start(tiny_model, cache_copy, kernels)


def test_ls_shows_the_kernel_import_path_in_full(monkeypatch, capsys):
    """docs/custom_kernels.md: ``ls``'s kernel column names the import path each entry holds
    (a 160-column table cut it to ``kc_example_kernels.decode:SdpaDec…``)."""
    import argparse

    from warmup.cli import commands

    row = {
        "variant": "batched_decode:1:1:4",
        "model": "4h/2kv/d8 bs16",
        "dtype": "float32",
        "device": "cpu",
        "device_arch": "x86_64/x86-64-v3",
        "key": "612ba077f0f6c73fba886b582c92bda3",
        "size": 455791,
        "compile_seconds": 4.88,
        "created": 1796105627.5,
        "last_used": 1796105649.0,
        "kernel": DECODE,
        "status": "ok",
    }
    rows = [row, {**row, "kernel": PREFILL, "variant": "paged_attention:32:2:1"}]
    monkeypatch.setattr(commands, "_rows", lambda args: ("/cache", rows))
    # An 80-column terminal; COLUMNS is what shutil.get_terminal_size reads first.
    monkeypatch.setenv("COLUMNS", "80")
    assert commands.cmd_ls(argparse.Namespace(json=False, bundle=None)) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    # the kernel column's cells, top to bottom: a path folded over lines joins up
    column = "".join(ln.split("│")[5].strip() for ln in out.splitlines() if ln.count("│") > 5)
    assert DECODE in column and PREFILL in column


# -- verify's diagnosis of a kernel that breaks the slot contract ---------------

#: An engine's decode that forgets the padded rows: a row with seq_lens == 0
#: attends to KV position 0 (its first block's first token) instead of returning zeros.
UNZEROED = """
import math

import torch
import torch.nn.functional as F
from torch import nn


class UnzeroedDecode(nn.Module):
    def __init__(self, num_heads, num_kv_heads, head_dim, **launch):
        super().__init__()
        self.groups = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def gather(self, cache, tables):
        blocks = cache[tables.long()]  # [S, NB, B, KVH, D]
        s, nb, b, kvh, d = blocks.shape
        kv = blocks.reshape(s, nb * b, kvh, d).repeat_interleave(self.groups, dim=2)
        return kv.transpose(1, 2).float()  # [S, H, T, D]

    def forward(self, query, key_cache, value_cache, block_tables, seq_lens):
        k, v = self.gather(key_cache, block_tables), self.gather(value_cache, block_tables)
        t = torch.arange(k.shape[2], device=seq_lens.device, dtype=torch.int32)
        mask = (t[None, :] < seq_lens.clamp(min=1)[:, None])[:, None, None, :]
        q = query.float().unsqueeze(2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.squeeze(2).to(query.dtype)
"""
UNZEROED_PATH = "kc_unzeroed.decode:UnzeroedDecode"


@pytest.fixture
def unzeroed(tmp_path, monkeypatch) -> dict:
    """The package ``kc_unzeroed`` (:data:`UNZEROED`) on ``sys.path``; the
    environment that puts it on a child's ``PYTHONPATH``."""
    site = tmp_path / "unzeroed-site"
    (site / "kc_unzeroed").mkdir(parents=True)
    (site / "kc_unzeroed" / "__init__.py").write_text("")
    (site / "kc_unzeroed" / "decode.py").write_text(UNZEROED)
    monkeypatch.syspath_prepend(str(site))
    source_files.cache_clear()
    yield {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    source_files.cache_clear()
    sys.modules.pop("kc_unzeroed.decode", None)
    sys.modules.pop("kc_unzeroed", None)


def _padded_row_value(config, variant) -> tuple[int, float]:
    """The padded row of verify's inputs for ``variant`` and the max abs value
    :data:`UNZEROED` puts there: the values of KV position 0 of its table."""
    from kernel_cache.runtime.inputs import make_inputs

    q, kc, vc, bt, lens = make_inputs(config, variant, seed=1)
    (row,) = [i for i, n in enumerate(lens.tolist()) if n == 0]
    return row, float(vc[int(bt[row, 0]), 0].abs().max())


def test_verify_row_check_flags_padded_rows_by_the_contract():
    """check_rows: decode's padded rows against zeros, prefill's for being finite."""
    import torch

    from warmup.check.verify import check_rows

    ref = torch.zeros(4, 2, 3)
    out = ref.clone()
    out[3] = 0.5  # the padded decode row
    out[1, 0, 0] = 1e-6  # within float32's tolerance
    rows = check_rows(BATCHED_DECODE, out, ref, {"real": [0, 1, 2], "padded": [3]}, 1e-4)
    assert [(r["kind"], r["rows"], r["differing"]) for r in rows] == [
        ("real", 3, []),
        ("padded", 1, [3]),
    ]
    assert rows[1]["max_abs_err"] == 0.5 and "zeros" in rows[1]["must_hold"]
    out = ref.clone()
    out[2, 1, 1] = float("nan")  # a padded prefill row: never compared, but must be finite
    out[3] = 7.0  # another padded prefill row: any finite value is fine
    rows = check_rows(PAGED_ATTENTION, out, ref, {"real": [0, 1], "padded": [2, 3]}, 1e-4)
    assert [(r["kind"], r["differing"], r["max_abs_err"]) for r in rows] == [
        ("real", [], 0.0),
        ("padded", [2], None),
    ]


def test_verify_blames_the_artifact_when_its_kernel_run_eagerly_is_right(tiny_config):
    """A built-in variant whose compiled output is wrong in a real row while the
    kernel run eagerly is right: cause 'artifact', and the fix says to remove
    the entry before a warmup (a warmup alone finds it cached)."""
    from types import SimpleNamespace

    from kernel_cache.plan.plan import Plan
    from kernel_cache.runtime.inputs import make_inputs
    from warmup.check.verify import _Oracle

    (item,) = [i for i in Plan.build(tiny_config) if str(i.variant) == "batched_decode:1:2:4"]
    oracle = _Oracle(tiny_config)
    args = make_inputs(tiny_config, item.variant, seed=1)
    wrong = oracle._reference(item, args).clone()
    wrong[0] += 0.25

    class Runner:
        def run(self, inputs):
            return [wrong]

    err, rows = oracle.check(item, Runner())
    assert abs(err - 0.25) < 1e-5
    assert {r["kind"]: r["differing"] for r in rows} == {"real": [0], "padded": []}
    entry = SimpleNamespace(key="ab" * 32, where="/cache/x")
    m = oracle.diagnose(item, err, rows, SimpleNamespace(entry=entry), None)
    assert m["cause"] == "artifact" and "abababababababab in /cache/x" in m["fix"]
    assert "remove it" in m["fix"] and "kernel-cache warmup --model" in m["fix"]


@pytest.mark.compile
def test_verify_names_the_padded_rows_and_the_contract_of_an_engine_kernel_that_breaks_it(
    unzeroed, tiny_model, tiny_config, cache_copy, tmp_path
):
    """An engine's decode that returns non-zeros in padded rows: warmup compiles
    its variant (the built-in prefill is in the copied cache), and verify's
    JSON and text name the padded row, its value, the contract, and the kernel
    as the fix, with no warmup command (a warmup cannot repair it)."""
    log = tmp_path / "compiles.log"
    env = {**unzeroed, "KERNEL_CACHE_TEST_COMPILE_LOG": str(log)}
    args = [
        *tiny_args(tiny_model),
        "--kernel",
        f"batched_decode={UNZEROED_PATH}",
        "--cache-dir",
        cache_copy,
    ]
    run_cli("warmup", *args, "--jobs", "2", "--json", env=env, check=True)
    compiled = sorted(line.split()[1] for line in log.read_text().splitlines())
    assert compiled == ["batched_decode:1:2:4"]

    proc = run_cli("verify", *args, "--json", env=env)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert not report["ok"] and report["loaded"] == N_TINY and report.get("repair") is None
    assert sorted(m["variant"] for m in report["mismatched"]) == compiled
    for m in report["mismatched"]:
        variant = next(v for v in Bucketer(tiny_config).variants if str(v) == m["variant"])
        row, value = _padded_row_value(tiny_config, variant)
        kinds = {r["kind"]: r for r in m["rows"]}
        assert (kinds["padded"]["rows"], kinds["padded"]["differing"]) == (1, [row])
        assert abs(kinds["padded"]["max_abs_err"] - value) < 1e-5 and value > 0.1
        assert "zeros" in kinds["padded"]["must_hold"]
        assert (kinds["real"]["rows"], kinds["real"]["differing"]) == (3, [])
        assert kinds["real"]["max_abs_err"] < 1e-4
        assert "a padded row (seq_lens[s] == 0) returns zeros" in m["contract"]
        assert m["cause"] == "kernel" and m["kernel"] == UNZEROED_PATH
        assert f"{UNZEROED_PATH}: fix the kernel" in m["fix"]
    assert "kernel-cache warmup" not in proc.stdout + proc.stderr

    text = run_cli("verify", *args, env=env)
    out = text.stdout + text.stderr
    assert text.returncode == 1 and f"verify FAILED: {N_TINY}/{N_TINY} loaded" in out, out
    assert "padded rows: 1 of 1 differ (rows 3)" in out
    assert "real rows: 0 of 3 differ" in out
    assert "must hold zeros" in out and "returns zeros" in out
    assert "kernel-cache warmup" not in out and "repair:" not in out


CUSTOM_OP_DECODE = '''"""The example decode, its output through a custom op (torch.library)."""
import torch

from kc_example_kernels.decode import SdpaDecode


@torch.library.custom_op("kc_test_ops::scaled", mutates_args=())
def scaled(x: torch.Tensor, g: float) -> torch.Tensor:
    return x * g


@scaled.register_fake
def _(x, g):
    return torch.empty_like(x)


class OpDecode(SdpaDecode):
    def forward(self, query, key_cache, value_cache, block_tables, seq_lens):
        out = super().forward(query, key_cache, value_cache, block_tables, seq_lens)
        return scaled(out, 1.0)
'''


@pytest.mark.compile
def test_a_kernel_that_calls_a_python_custom_op_is_not_published(example, tiny_model, cache_copy):
    """A graph that calls a Python ``torch.library`` custom op runs it through
    AOTInductor's proxy executor, which needs the op registered in the loading
    process: warmup's load check (a fresh process) loads the package whole, as
    engine start does, and refuses it naming the op, rather than publishing an
    artifact whose first call fails; engine start then reports it missing."""
    (example / "kc_example_kernels" / "opdecode.py").write_text(CUSTOM_OP_DECODE)
    path = "kc_example_kernels.opdecode:OpDecode"
    args = [*tiny_args(tiny_model), "--kernel", f"batched_decode={path}", "--cache-dir"]
    proc = run_cli("warmup", *args, cache_copy, "--jobs", "1")
    assert proc.returncode == 1
    assert "failed batched_decode:1:2:4: not published" in proc.stderr, proc.stderr
    assert "kc_test_ops::scaled" in proc.stderr
    doc = engine_start(tiny_model, cache_copy, {"batched_decode": path})
    assert doc["missing"] == ["batched_decode:1:2:4"], doc
