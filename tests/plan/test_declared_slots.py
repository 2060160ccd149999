"""Declared slots without compiling: the spec, its refusals, the plan's variants
and their keys (what they cover, and that attention's keys do not move)."""

from __future__ import annotations

import json
import sys

import pytest

from kernel_cache.config.engine import make_config
from kernel_cache.config.slot_spec import SlotSpec, parse_slot_option
from kernel_cache.errors import ConfigError
from kernel_cache.plan.buckets import Bucketer, KernelVariant
from kernel_cache.plan.plan import Plan
from kernel_cache.plan.sources import source_files
from kernel_cache.store.disk_tier import DiskTier
from warmup.check.explain import explain

from ..conftest import TINY_LIMITS, run_cli, tiny_args

#: Environment components given, so no C++ compiler probe runs.
ENV = {"device": "cpu", "device_arch": "x86_64/x86-64-v3", "torch": "t", "python": "3", "cxx": "c"}

MLP = {
    "name": "mlp",
    "factory": "kc_slotpkg.mlp:make_mlp",
    "args": {"hidden": 8},
    "inputs": [{"name": "x", "shape": ["query_tokens", 8], "dtype": "float32"}],
    "output_rows": "query_tokens",
}


@pytest.fixture
def slotpkg(tmp_path, monkeypatch):
    """A factory package on ``sys.path`` (never imported here): ``mlp.py`` uses
    ``helper.py``."""
    pkg = tmp_path / "site" / "kc_slotpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("def act(x):\n    return x.relu()\n")
    (pkg / "mlp.py").write_text(
        "from torch import nn\nfrom kc_slotpkg.helper import act\n\n\n"
        "def make_mlp(hidden):\n    return nn.Linear(hidden, hidden)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    source_files.cache_clear()
    yield pkg
    source_files.cache_clear()


def cfg(tiny_model, *slots, **limits):
    return make_config(str(tiny_model), **{**TINY_LIMITS, **limits}, slots=list(slots))


def with_input(**inp) -> dict:
    return {**MLP, "inputs": [{**MLP["inputs"][0], **inp}]}


# -- the spec ------------------------------------------------------------------------


def test_a_spec_is_immutable_hashable_and_round_trips_through_json():
    spec = SlotSpec.model_validate(MLP)
    assert hash(spec) == hash(SlotSpec.model_validate(json.loads(spec.model_dump_json())))
    doc = json.loads(spec.model_dump_json())
    assert doc["args"] == {"hidden": 8}  # a mapping in JSON, as declared
    assert SlotSpec.model_validate(doc) == spec
    with pytest.raises(Exception, match="frozen"):
        spec.name = "other"


@pytest.mark.parametrize(
    "change, says",
    [
        ({"name": "paged_attention"}, "built-in slot; name the engine's implementation"),
        ({"name": "My-MLP"}, "lower-case identifier"),
        ({"factory": "not a path"}, "is not an import path"),
        ({"inputs": [{"name": "x", "shape": ["tokens"], "dtype": "float32"}]}, "'tokens'"),
        ({"inputs": [{"name": "x", "shape": [0], "dtype": "float32"}]}, "int >= 1"),
        ({"inputs": [{"name": "x", "shape": [4], "dtype": "float8"}]}, "dtype"),
        ({"inputs": []}, "declares no inputs"),
        ({"inputs": [MLP["inputs"][0], MLP["inputs"][0]]}, "input names given twice: x"),
        ({"output_rows": "decode_seqs"}, "output_rows='decode_seqs' is an axis no input follows"),
        (
            {"inputs": [{"name": "x", "shape": ["query_tokens", 10**20], "dtype": "float32"}]},
            "at most 2147483647",
        ),
        (
            {"inputs": [{"name": "x", "shape": ["query_tokens"], "dtype": "int32", "pad": 1e10}]},
            "pad 10000000000.0 is not an int32",
        ),
        (
            {"inputs": [{"name": "x", "shape": ["query_tokens"], "dtype": "int64", "pad": 0.5}]},
            "pad 0.5 is not an int64",
        ),
        (
            {"inputs": [{"name": "x", "shape": ["query_tokens"], "dtype": "bool", "pad": 2}]},
            "pad 2.0 is not a bool",
        ),
        (
            {"inputs": [{"name": "x", "shape": ["query_tokens"], "dtype": "float16", "pad": 1e6}]},
            "pad 1000000.0 is beyond float16",
        ),
    ],
)
def test_a_bad_spec_is_refused_naming_what_and_where(tiny_model, change, says):
    with pytest.raises(ConfigError, match="slots") as e:
        cfg(tiny_model, {**MLP, **change})
    assert says in str(e.value)


def test_a_dimension_on_an_axis_the_plan_lacks_is_refused_naming_slot_input_axis_and_fix(
    tiny_model,
):
    spec = with_input(shape=[8, "decode_seqs"])
    spec["output_rows"] = None
    with pytest.raises(ConfigError) as e:
        cfg(tiny_model, spec, max_num_seqs=2)  # below min_batched_seqs 4: no decode buckets
    msg = str(e.value)
    for part in ("slot 'mlp'", "input 'x'", "dim 1", "decode_seqs", "--min-batched-seqs 2"):
        assert part in msg, msg
    assert cfg(tiny_model, spec, max_num_seqs=2, min_batched_seqs=2).slots  # the fix works


def test_the_same_refusal_on_the_command_line_is_an_error_not_a_traceback(tiny_model, tmp_path):
    spec = with_input(shape=["decode_seqs", 8])
    spec["output_rows"] = "decode_seqs"
    path = tmp_path / "slots.json"
    path.write_text(json.dumps([spec]))
    args = [a if a != "4" else "2" for a in tiny_args(tiny_model)]  # --max-num-seqs 2
    proc = run_cli("plan", *args, "--slot", f"@{path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "slot 'mlp': input 'x' dim 0 follows the decode_seqs axis" in proc.stderr


def test_slot_option_takes_json_or_a_file_and_names_the_flag_on_bad_input(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(MLP))
    assert parse_slot_option(json.dumps(MLP)) == parse_slot_option(f"@{tmp_path}/one.json")
    with pytest.raises(ConfigError, match=r"--slot '\{nope': not JSON"):
        parse_slot_option("{nope")
    with pytest.raises(ConfigError, match="--slot '@/nowhere.json': cannot read"):
        parse_slot_option("@/nowhere.json")
    with pytest.raises(ConfigError, match=r"--slot .*inputs.0.dtype='f8'"):
        parse_slot_option(json.dumps(with_input(dtype="f8")))


def test_a_slot_file_not_utf8_or_nested_too_deep_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match=r"--slot '@.*bin.json': cannot read .*not UTF-8"):
        parse_slot_option(f"@{tmp_path}/bin.json")
    (tmp_path / "deep.json").write_text("[" * 200_000)
    with pytest.raises(ConfigError, match=r"--slot @.*deep.json: not JSON \(nested too deep"):
        parse_slot_option(f"@{tmp_path}/deep.json")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_factory_argument_that_is_not_a_finite_number_is_refused(value):
    """``args`` are part of the key's JSON: Python's parser takes ``NaN`` and
    ``Infinity``, which no JSON reader does (and NaN is not equal to itself)."""
    text = json.dumps(MLP).replace('"hidden": 8', f'"hidden": {value}')
    with pytest.raises(ConfigError, match=r"args.*'hidden'.*not a finite number"):
        parse_slot_option(text)


def test_one_name_declared_twice_differently_is_refused(tiny_model):
    with pytest.raises(ConfigError, match="slot 'mlp' declared twice"):
        cfg(tiny_model, MLP, with_input(dtype="bfloat16"))


# -- the plan ------------------------------------------------------------------------


def test_each_kind_of_dimension_gives_the_variants_of_the_axes_it_follows(tiny_model):
    spec = {
        **MLP,
        "inputs": [
            {"name": "x", "shape": ["query_tokens", 8], "dtype": "float32"},  # axis, fixed
            {"name": "tables", "shape": ["decode_seqs", "kv_blocks"], "dtype": "int32"},
            {"name": "pool", "shape": ["dynamic:pool", 8], "dtype": "bfloat16"},  # dynamic
        ],
    }
    b = Bucketer(cfg(tiny_model, spec))
    mine = [v for v in b.variants if v.kernel == "mlp"]
    want = [
        (q, nb, s)
        for q in b.query_buckets
        for nb in b.num_blocks_buckets
        for s in b.num_seqs_buckets
    ]
    assert [(v.query_len, v.num_blocks, v.num_seqs) for v in mine] == want
    fixed_only = with_input(shape=[8])
    fixed_only["output_rows"] = None
    assert [str(v) for v in Bucketer(cfg(tiny_model, fixed_only)).variants[-1:]] == ["mlp:0:0:0"]


def test_plan_lists_slot_variants_by_name_and_attention_keys_do_not_move(tiny_model, slotpkg):
    base = Plan.build(cfg(tiny_model), ENV, log_launch=False)
    plan = Plan.build(cfg(tiny_model, MLP), ENV, log_launch=False)
    names = [str(v) for v in plan.variants]
    assert names == [*map(str, base.variants), "mlp:1:0:0", "mlp:32:0:0"]
    for item in base:  # declaring a slot changes no attention key
        assert plan.key(item.variant) == item.key
    assert base.fingerprint() == Bucketer(cfg(tiny_model)).fingerprint()
    assert plan.fingerprint() != base.fingerprint()
    item = plan.find("mlp:32:0:0")
    assert item.variant == KernelVariant.parse("mlp:32:0:0") and item.launch == {}
    comps = item.key.as_dict()
    assert comps["kernel"] == "kc_slotpkg.mlp:make_mlp" and comps["dtype"] == "x=float32"
    assert {"kc_slotpkg/mlp.py", "kc_slotpkg/helper.py"} <= set(json.loads(comps["sources"]))
    assert not [m for m in sys.modules if m.startswith("kc_slotpkg")]  # read, not imported


@pytest.mark.parametrize(
    "changed",
    [
        with_input(shape=["query_tokens", 16]),
        with_input(dtype="bfloat16"),
        with_input(pad=-1.0),
        {**MLP, "args": {"hidden": 16}},
        {**MLP, "output_rows": None},
    ],
    ids=["shape", "dtype", "pad", "args", "output_rows"],
)
def test_the_key_covers_the_declared_spec(tiny_model, slotpkg, changed):
    a = Plan.build(cfg(tiny_model, MLP), ENV, log_launch=False).find("mlp:32:0:0").key
    b = Plan.build(cfg(tiny_model, changed), ENV, log_launch=False).find("mlp:32:0:0").key
    assert a != b
    assert {n for n, v in a.components if dict(b.components)[n] != v} <= {"geometry", "dtype"}


def test_an_edit_to_the_factorys_helper_misses_and_explain_names_the_file(
    tiny_model, slotpkg, tmp_path
):
    config = cfg(tiny_model, MLP)
    plan = Plan.build(config, log_launch=False)
    item = plan.find("mlp:32:0:0")
    from .test_plan import fake_cache

    fake_cache(tmp_path / "cache", plan)  # an entry under every key of the plan
    helper = slotpkg / "helper.py"
    helper.write_text(helper.read_text() + "\n# edited\n")
    source_files.cache_clear()
    assert Plan.build(config, log_launch=False).find("mlp:32:0:0").key != item.key
    tier = DiskTier(tmp_path / "cache", read_only=True)
    try:
        doc = explain(config, [tier], [item.variant])
    finally:
        tier.close()
    (result,) = doc["results"]
    assert result["status"] == "miss"
    lines = [line for n in result["nearest"] for line in n["lines"]]
    assert any("kc_slotpkg/helper.py changed" in line for line in lines), lines


def test_plan_command_lists_declared_slot_variants(tiny_model, slotpkg, tmp_path):
    path = tmp_path / "slots.json"
    path.write_text(json.dumps([MLP]))
    env = {"PYTHONPATH": str(slotpkg.parent)}
    proc = run_cli("plan", *tiny_args(tiny_model), "--slot", f"@{path}", env=env, check=True)
    assert "kernel mlp: kc_slotpkg.mlp:make_mlp" in proc.stdout
    assert "  mlp:1:0:0\n  mlp:32:0:0\n" in proc.stdout
    assert ", 2 mlp)" in proc.stdout


def test_explain_refuses_an_unknown_kernel_and_says_why_a_slot_variant_is_not_in_the_plan(
    tiny_model, slotpkg, tmp_path
):
    config = cfg(tiny_model, MLP)
    with pytest.raises(ConfigError, match="no kernel 'foo' in this plan; its kernels: "
                       "paged_attention, batched_decode, mlp"):  # fmt: skip
        explain(config, [], [KernelVariant.parse("foo:1:0:0")])
    doc = explain(config, [], [KernelVariant.parse("mlp:5:2:0")])
    (r,) = doc["results"]
    assert r["status"] == "not_in_plan"
    assert "query_len 5 is not a query_tokens bucket of this plan (1, 32)" in r["reason"]
    assert "mlp follows no kv_blocks axis, so its num_blocks is 0" in r["reason"]


def test_a_factory_named_by_entry_point_is_keyed_by_its_import_path(tiny_model, slotpkg):
    dist = slotpkg.parent / "kc_slotpkg-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kc-slotpkg\n")
    ep = "[kernel_cache.kernels]\nkc_slot_mlp = kc_slotpkg.mlp:make_mlp\n"
    (dist / "entry_points.txt").write_text(ep)
    by_name = Plan.build(cfg(tiny_model, {**MLP, "factory": "kc_slot_mlp"}), ENV, log_launch=False)
    by_path = Plan.build(cfg(tiny_model, MLP), ENV, log_launch=False)
    key = by_name.find("mlp:32:0:0").key
    assert key.as_dict()["kernel"] == MLP["factory"]
    assert key == by_path.find("mlp:32:0:0").key  # one factory, one key, however named
