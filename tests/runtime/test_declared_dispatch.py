"""Dispatch of declared slots without compiling: each variant's runner is the
exported wrapper run eagerly (the same ``(*weights, *inputs)`` calling
convention as a loaded artifact), so bucket choice, padding, slicing, the
input checks and the weight checks are tested on their own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernel_cache.config.engine import make_config
from kernel_cache.errors import ShapeError
from kernel_cache.kernels.declared import state_spec, weights_as_inputs
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.runtime.declared import DeclaredSlots

from ..conftest import TINY_LIMITS


class Probe(nn.Module):
    """``x * w + table.sum(1)``: the output shows the padded rows' values."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x, table):
        return x * self.w + table.sum(1, keepdim=True).to(x.dtype)


class Eager:
    """A runner over the wrapper run eagerly; records what it was given."""

    def __init__(self, module):
        self.wrapper = weights_as_inputs(module)
        self.seen: list = []

    def run(self, args):
        self.seen.append([a.clone() for a in args])
        return [self.wrapper(*args)]


SPEC = {
    "name": "probe",
    "factory": "tests.runtime.test_declared_dispatch:Probe",
    "inputs": [
        {"name": "x", "shape": ["decode_seqs", 4], "dtype": "float32", "pad": -7.0},
        {"name": "table", "shape": ["decode_seqs", "kv_blocks"], "dtype": "int32", "pad": 0},
    ],
    "output_rows": "decode_seqs",
}


@pytest.fixture
def slots(tiny_model):
    cfg = make_config(
        str(tiny_model), **{**TINY_LIMITS, "max_num_seqs": 8, "kv_buckets": (16, 32)}, slots=[SPEC]
    )
    b = Bucketer(cfg)
    mod = Probe()
    runners = {v: Eager(mod) for v in b.variants if v.kernel == "probe"}
    params = {v: [list(p) for p in state_spec(mod)] for v in runners}
    return DeclaredSlots(cfg, b, runners, params), runners, mod


def test_call_picks_buckets_from_host_shapes_pads_and_slices(slots):
    ds, runners, mod = slots
    ds.bind("probe", mod)
    x = torch.arange(20.0).reshape(5, 4)
    table = torch.ones(5, 1, dtype=torch.int32)
    out = ds.call("probe", x, table)
    assert out.shape == (5, 4) and torch.equal(out, x * 2 + 1)
    (v,) = [v for v, r in runners.items() if r.seen]
    assert (v.num_seqs, v.num_blocks) == (8, 1)  # 5 sequences -> 8, 1 block -> 1
    w, px, pt = runners[v].seen[0]
    assert px.shape == (8, 4) and torch.equal(px[5:], torch.full((3, 4), -7.0))
    assert pt.shape == (8, 1) and not pt[5:].any()
    # a smaller call after a larger one: the row the larger call wrote is padding again
    ds.call("probe", torch.ones(6, 4), torch.ones(6, 1, dtype=torch.int32))
    assert torch.equal(ds.call("probe", x, table), x * 2 + 1)
    _, px, _ = runners[v].seen[-1]
    assert torch.equal(px[5:], torch.full((3, 4), -7.0))
    assert ds.calls() == {v: 3}


def test_a_full_contiguous_bucket_is_passed_as_is(slots):
    ds, runners, mod = slots
    ds.bind("probe", mod.state_dict())
    x, table = torch.ones(4, 4), torch.ones(4, 2, dtype=torch.int32)
    ds.call("probe", x, table)
    (r,) = [r for r in runners.values() if r.seen]
    assert torch.equal(r.seen[0][1], x)
    assert len([v for v in ds._slots["probe"].buffers]) == 0  # no buffer made


@pytest.mark.parametrize(
    "inputs, says",
    [
        (
            (torch.ones(3, 5), torch.ones(3, 1, dtype=torch.int32)),
            "input 'x' dim 1 is 5, declared 4",
        ),
        ((torch.ones(3, 4), torch.ones(2, 1, dtype=torch.int32)), "input 'table' dim 0 is 2"),
        ((torch.ones(3, 4), torch.ones(3, 1)), "input 'table' is [3, 1] torch.float32"),
        ((torch.ones(9, 4), torch.ones(9, 1, dtype=torch.int32)), "9 along decode_seqs is outside"),
        ((torch.ones(3, 4),), "takes 2 inputs (x, table), got 1"),
        ((torch.ones(3), torch.ones(3, 1, dtype=torch.int32)), "input 'x' is [3] torch.float32"),
        (([1.0] * 4, torch.ones(1, 1, dtype=torch.int32)), "input 'x' is a list; declared"),
    ],
)
def test_a_call_that_breaks_the_spec_is_refused_naming_the_input(slots, inputs, says):
    ds, _, mod = slots
    ds.bind("probe", mod)
    with pytest.raises(ShapeError) as e:
        ds.call("probe", *inputs)
    assert says in str(e.value)


def test_weights_are_checked_at_bind_naming_the_parameter(slots):
    ds, _, mod = slots
    with pytest.raises(ShapeError, match=r"no weights; runtime.bind\('probe'"):
        ds.call("probe", torch.ones(1, 4), torch.ones(1, 1, dtype=torch.int32))
    with pytest.raises(ShapeError, match=r"parameter 'w' is \[5\] torch.float32|'w' is \[5\]"):
        ds.bind("probe", {"w": torch.ones(5)})
    with pytest.raises(ShapeError, match=r"parameter 'w' is \[4\] bfloat16.*\[4\] float32"):
        ds.bind("probe", {"w": torch.ones(4, dtype=torch.bfloat16)})
    with pytest.raises(ShapeError, match=r"missing \[\], unexpected \['v'\]"):
        ds.bind("probe", {"w": torch.ones(4), "v": torch.ones(1)})
    with pytest.raises(ShapeError, match="no declared slot 'mlp' in this plan"):
        ds.bind("mlp", mod)
    ds.bind("probe", {"w": torch.ones(4)})  # the right shapes: taken


# -- export (no compile) -----------------------------------------------------------


class OneRow(nn.Module):
    """Returns one row whatever the bucket (breaks ``output_rows``)."""

    def forward(self, x):
        return x[:1]


def test_export_lifts_no_weight_and_records_the_state_it_takes(tiny_model):
    from warmup.builder.compiler import export_declared

    cfg = make_config(str(tiny_model), **TINY_LIMITS, slots=[SPEC])
    (v, *_) = [v for v in Bucketer(cfg).variants if v.kernel == "probe"]
    info: dict = {}
    ep = export_declared(cfg.slot("probe"), v, info)
    assert len(ep.state_dict) == 0 and len(ep.constants) == 0  # nothing baked in
    kinds = [s.kind.name for s in ep.graph_signature.input_specs]
    assert kinds == ["USER_INPUT"] * 3  # w, x, table
    assert info["slot_params"] == [("w", [4], "float32")]


@pytest.mark.parametrize(
    "change, says",
    [
        ({"factory": "tests.runtime.test_declared_dispatch:nowhere"}, "has no attribute"),
        (
            {"inputs": [{"name": "x", "shape": ["decode_seqs", 4], "dtype": "float32"}]},
            "forward failed on example inputs ['x [4, 4] torch.float32']: TypeError",
        ),
        (
            {
                "factory": "tests.runtime.test_declared_dispatch:OneRow",
                "inputs": [{"name": "x", "shape": ["decode_seqs", 4], "dtype": "float32"}],
            },
            "output_rows=decode_seqs: the output's dim 0 must be the bucket, 4; "
            "forward returned [1, 4]",
        ),
    ],
)
def test_a_bad_factory_is_a_compile_error_naming_the_slot(tiny_model, change, says):
    from kernel_cache.errors import CompileError
    from warmup.builder.compiler import export_declared

    cfg = make_config(str(tiny_model), **TINY_LIMITS, slots=[{**SPEC, **change}])
    (v, *_) = [v for v in Bucketer(cfg).variants if v.kernel == "probe"]
    with pytest.raises(CompileError) as e:
        export_declared(cfg.slot("probe"), v)
    factory = change.get("factory", SPEC["factory"])
    assert f"slot probe={factory}: " in str(e.value) and says in str(e.value)


def test_prepared_weights_run_one_checkpoint_of_several_without_rebinding(slots):
    ds, _, mod = slots
    ds.bind("probe", mod)
    layer2 = ds.prepare("probe", {"w": torch.full((4,), 3.0)})
    x, table = torch.ones(4, 4), torch.zeros(4, 1, dtype=torch.int32)
    assert torch.equal(ds.call("probe", x, table, weights=layer2), x * 3)
    assert torch.equal(ds.call("probe", x, table), x * 2)  # the bound ones are unchanged
    with pytest.raises(ShapeError, match="parameter 'w' is \\[2\\]"):
        ds.prepare("probe", {"w": torch.ones(2)})


def test_weights_prepared_for_another_slot_are_refused_naming_both_slots(tiny_model):
    other = {**SPEC, "name": "other"}
    cfg = make_config(
        str(tiny_model),
        **{**TINY_LIMITS, "max_num_seqs": 8, "kv_buckets": (16, 32)},
        slots=[SPEC, other],
    )
    b, mod = Bucketer(cfg), Probe()
    runners = {v: Eager(mod) for v in b.variants if v.kernel in ("probe", "other")}
    ds = DeclaredSlots(cfg, b, runners, {v: [list(p) for p in state_spec(mod)] for v in runners})
    theirs = ds.prepare("other", mod)
    x, table = torch.ones(4, 4), torch.zeros(4, 1, dtype=torch.int32)
    with pytest.raises(ShapeError) as e:
        ds.call("probe", x, table, weights=theirs)
    msg = str(e.value)
    assert "prepared for slot 'other'" in msg and "runtime.prepare('probe'" in msg, msg


class Rows(nn.Module):
    """``x * w`` over rows of a dynamic width: no padding but the rows'."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((1,), 3.0))

    def forward(self, x):
        return x * self.w


def test_a_dynamic_dimension_s_new_size_replaces_the_buffer_not_adds_one(tiny_model):
    """An input with a bucket axis and a dynamic dimension: calls of many widths
    keep one padded buffer per variant and input, so memory does not grow with
    the widths an engine has passed."""
    spec = {
        "name": "rows",
        "factory": "tests.runtime.test_declared_dispatch:Rows",
        "inputs": [{"name": "x", "shape": ["decode_seqs", "dynamic"], "dtype": "float32"}],
        "output_rows": "decode_seqs",
    }
    cfg = make_config(str(tiny_model), **{**TINY_LIMITS, "max_num_seqs": 8}, slots=[spec])
    b = Bucketer(cfg)
    mod = Rows()
    runners = {v: Eager(mod) for v in b.variants if v.kernel == "rows"}
    ds = DeclaredSlots(cfg, b, runners, {v: [list(p) for p in state_spec(mod)] for v in runners})
    ds.bind("rows", mod)
    for width in range(1, 30):
        x = torch.randn(5, width)
        assert torch.equal(ds.call("rows", x), x * 3)
    assert len(ds._slots["rows"].buffers) == 1


class Scaled(nn.Module):
    """``pool * scale[:, None]``: two inputs sharing the dynamic dimension ``pool``."""

    def forward(self, pool, scale):
        return pool * scale[:, None]


def test_inputs_sharing_a_dynamic_name_with_different_sizes_are_refused(tiny_model):
    """A compiled artifact does not check that dimensions sharing ``dynamic:NAME``
    agree (one of 40 rows scaled by 3 values read past the end of ``scale``):
    the call refuses them, naming both inputs, the dims, the sizes and the name."""
    spec = {
        "name": "scaled",
        "factory": "tests.runtime.test_declared_dispatch:Scaled",
        "inputs": [
            {"name": "pool", "shape": ["dynamic:pool", 8], "dtype": "float32"},
            {"name": "scale", "shape": ["dynamic:pool"], "dtype": "float32"},
        ],
    }
    cfg = make_config(str(tiny_model), **TINY_LIMITS, slots=[spec])
    b, mod = Bucketer(cfg), Scaled()
    runners = {v: Eager(mod) for v in b.variants if v.kernel == "scaled"}
    ds = DeclaredSlots(cfg, b, runners, {v: [] for v in runners})
    ds.bind("scaled", {})
    assert ds.call("scaled", torch.ones(5, 8), torch.full((5,), 2.0)).shape == (5, 8)
    with pytest.raises(ShapeError) as e:
        ds.call("scaled", torch.ones(40, 8), torch.full((3,), 2.0))
    msg = str(e.value)
    for part in ("input 'scale' dim 0 is 3", "input 'pool' dim 0 is 40", "dynamic:pool"):
        assert part in msg, msg
    assert all(len(seen) == 1 for seen in (r.seen for r in runners.values()))


def test_weights_prepared_by_another_runtime_are_checked_not_trusted(tiny_model):
    """Two loaded plans, one slot name, different parameter shapes: weights one
    prepared are refused by the other, not run unchecked (an artifact does not
    check its inputs' shapes)."""
    limits = {**TINY_LIMITS, "max_num_seqs": 8, "kv_buckets": (16, 32)}
    cfg = make_config(str(tiny_model), **limits, slots=[SPEC])
    b = Bucketer(cfg)
    mod, small = Probe(), {"w": torch.ones(2)}
    runners = {v: Eager(mod) for v in b.variants if v.kernel == "probe"}
    ours = DeclaredSlots(cfg, b, runners, {v: [list(p) for p in state_spec(mod)] for v in runners})
    theirs = DeclaredSlots(cfg, b, runners, {v: [["w", [2], "float32"]] for v in runners})
    prepared = theirs.prepare("probe", small)
    x, table = torch.ones(4, 4), torch.zeros(4, 1, dtype=torch.int32)
    with pytest.raises(
        ShapeError, match=r"parameter 'w' is \[2\] float32, but the slot was built for \[4\]"
    ):
        ours.call("probe", x, table, weights=prepared)
