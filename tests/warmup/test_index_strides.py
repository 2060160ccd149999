"""The stride analysis's results kept beside the precompiled headers
(``warmup.builder.index_strides``): a second process compiling the same variant
computes none of the strides the first kept, counted by wrapping torch's own
function in the child, compiles none of the wrapper's interface that the first
kept (``warmup.builder.wrapper_split``, compile commands counted the same way),
and writes the same bytes. The file is read bounded, of
the process's versions only, and never evaluated: a kept stride is a tree of
allowed sympy classes that must encode back to itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sympy

from warmup.builder import index_strides
from warmup.builder.index_strides import (
    FILE_NAME,
    IndexStrides,
    decode,
    encode,
    expr_key,
    load,
    save,
)

from ..conftest import ROOT, TINY_LIMITS
from ..kc_helpers import entries_of

#: A compile in this process (``jobs=0``) of the variants in argv[3:] into the
#: cache argv[2], torch's ``stride_at`` (what the analysis runs for each stride
#: it computes) and the C++ compile commands torch runs counted; prints
#: ``{"stride_at": N, "compiled": N, "commands": [...]}``.
_COUNTED = """
import json, sys
import torch._inductor.cpp_builder as cpp_builder
import torch._inductor.sizevars as sizevars
calls = [0]
commands = []
stride_at = sizevars.stride_at
def counted(*args, **kwargs):
    calls[0] += 1
    return stride_at(*args, **kwargs)
sizevars.stride_at = counted
run = cpp_builder._run_compile_cmd
def recorded(cmd_line, cwd):
    commands.append(cmd_line)
    return run(cmd_line, cwd)
cpp_builder._run_compile_cmd = recorded
from kernel_cache.config.engine import make_config
from kernel_cache.plan.buckets import KernelVariant
from warmup.builder.planner import warmup
cfg = make_config(sys.argv[1], **json.loads(sys.argv[2]))
variants = [KernelVariant.parse(v) for v in sys.argv[4:]]
report = warmup(cfg, sys.argv[3], jobs=0, progress=False, variants=variants)
print(json.dumps({"stride_at": calls[0], "compiled": report["compiled"], "commands": commands}))
"""


@pytest.mark.compile
def test_a_second_process_computes_no_kept_stride_nor_interface_and_writes_the_same_bytes(
    tmp_path, tiny_model
):
    pch = tmp_path / "pch"
    pch.mkdir(mode=0o700)
    shared = os.environ.get("KERNEL_CACHE_PCH_DIR")  # the run's headers, without its strides
    for f in Path(shared).iterdir() if shared and Path(shared).is_dir() else ():
        if f.suffix in (".h", ".gch"):
            shutil.copy2(f, pch / f.name)
    env = {**os.environ, "KERNEL_CACHE_PCH_DIR": str(pch), "PYTHONHASHSEED": "0"}
    limits = json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in TINY_LIMITS.items()})

    def compile_in_a_process(cache) -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", _COUNTED, str(tiny_model), limits, str(cache)]
            + ["batched_decode:1:2:4"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    first = compile_in_a_process(tmp_path / "a")
    kept = IndexStrides.model_validate_json((pch / FILE_NAME).read_text()).strides
    assert first["compiled"] == 1 and first["stride_at"] >= len(kept) > 0
    second = compile_in_a_process(tmp_path / "b")
    assert second["compiled"] == 1
    assert second["stride_at"] == first["stride_at"] - len(kept)
    a, b = entries_of(tmp_path / "a"), entries_of(tmp_path / "b")
    assert a == b and len(a) == 1  # same key, same bytes

    def compiles(commands: list[str], source: str) -> int:
        return sum(" -c " in c and c.split(" -o ")[0].endswith(source) for c in commands)

    # the wrapper's interface: compiled by the first process and kept, not by the second
    assert compiles(first["commands"], "/aoti_interface.cpp") == 1
    assert compiles(second["commands"], "/aoti_interface.cpp") == 0
    kept_objects = list((pch / "aoti-interface").glob("*.o"))
    assert len(kept_objects) == 1
    for run in (first, second):  # the wrapper's own part, then joined with the kept object
        assert compiles(run["commands"], ".wrapper.cpp") == 1
        joins = [c for c in run["commands"] if " -r " in c]
        assert len(joins) == 1 and joins[0].endswith(str(kept_objects[0]))


_PARTIAL = '{"format": "kernel-cache-index-strides/1", "strides": {}}'


def _versions_doc(strides: dict[str, int], **changes) -> str:
    torch_v, sympy_v = index_strides.versions()
    fields = {"torch": torch_v, "sympy": sympy_v, "strides": strides, **changes}
    return IndexStrides(**fields).model_dump_json()


def test_save_then_load_round_trips_the_newest_value_wins_and_the_oldest_go(tmp_path, monkeypatch):
    save(tmp_path, {"a": 1, "b": 0})
    save(tmp_path, {"b": 5, "c": -2})  # a recomputed stride replaces a kept one
    assert load(tmp_path) == {"a": 1, "b": 5, "c": -2}
    monkeypatch.setattr(index_strides, "MAX_ENTRIES", 4)
    save(tmp_path, {f"k{i}": i for i in range(10)})
    assert load(tmp_path) == {f"k{i}": i for i in range(6, 10)}  # the newest four
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME, "locks"]  # no temp file


def test_a_file_of_more_results_than_the_bound_is_not_used(tmp_path, monkeypatch):
    (tmp_path / FILE_NAME).write_text(_versions_doc({f"k{i}": i for i in range(5)}))
    monkeypatch.setattr(index_strides, "MAX_ENTRIES", 4)
    assert load(tmp_path) == {}


def test_save_writes_through_no_link(tmp_path):
    """A link at the lock's folder: nothing saved, its target untouched; the
    file is written through a temporary file created anew (``mkstemp``), never
    through a link at a guessable name."""
    victim = tmp_path / "victim"
    victim.mkdir()
    folder = tmp_path / "pch"
    folder.mkdir()
    os.symlink(victim, folder / "locks")
    save(folder, {"a": 1})
    assert list(victim.iterdir()) == [] and not (folder / FILE_NAME).exists()
    os.unlink(folder / "locks")
    target = tmp_path / "target"
    target.write_text("precious")
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # a fixed temporary name
        os.symlink(target, folder / f".{FILE_NAME}.{pid}.tmp")
    save(folder, {"a": 1})
    assert target.read_text() == "precious" and load(folder) == {"a": 1}


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda: _versions_doc({"a": 1}, torch="0.0.1 other"), id="other torch"),
        pytest.param(lambda: _versions_doc({"a": 1}, sympy="0.1"), id="other sympy"),
        pytest.param(lambda: _PARTIAL, id="partial"),
        pytest.param(lambda: _versions_doc({"a": 1}).replace("1}", '"1+1"}'), id="not an integer"),
        pytest.param(lambda: "__import__('os').system('false')", id="code"),
    ],
)
def test_a_file_of_other_versions_or_shape_is_not_used(tmp_path, content):
    (tmp_path / FILE_NAME).write_text(content())
    assert load(tmp_path) == {}


def test_a_large_file_is_read_only_to_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(index_strides, "MAX_BYTES", 1 << 16)
    with open(tmp_path / FILE_NAME, "wb") as f:
        f.truncate(200 << 20)  # sparse: 200 MiB that cost no disk
    rchar = _rchar()
    assert load(tmp_path) == {}
    assert _rchar() - rchar < 1 << 18  # counted by the kernel: the bound, not the file


def _rchar() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_fifo_or_a_link_at_the_name_is_not_read(tmp_path):
    os.mkfifo(tmp_path / FILE_NAME)
    done = threading.Event()
    result = {}

    def read():
        result["fifo"] = load(tmp_path)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(10), "load() blocked on a FIFO"
    assert result["fifo"] == {}
    os.unlink(tmp_path / FILE_NAME)
    real = tmp_path / "real.json"
    real.write_text(_versions_doc({"a": 1}))
    os.symlink(real, tmp_path / FILE_NAME)
    assert load(tmp_path) == {}


def test_keys_tell_apart_assumptions_and_function_classes():
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    x = sympy.Symbol("x0", integer=True, nonnegative=True)
    y = sympy.Symbol("x0", integer=True)
    assert expr_key(x) != expr_key(y)
    assert expr_key(FloorDiv(x, 16)) != expr_key(ModularIndexing(x, 1, 16))
    assert expr_key(FloorDiv(x, 16)) == expr_key(FloorDiv(x, sympy.Integer(16)))
    assert "torch.utils._sympy.functions.FloorDiv(" in expr_key(FloorDiv(x, 16))


def _prefill_like():
    """A stride of the shape the tiny prefill's analysis returns: an unevaluated
    product (two integer factors kept apart) of torch's index functions."""
    from torch.utils._sympy.functions import FloorDiv, Min, ModularIndexing

    d0 = sympy.Symbol("d0", integer=True, nonnegative=True)
    u0, u1 = sympy.Symbol("u0", integer=True), sympy.Symbol("u1", integer=True)
    inner = Min(u0 + Min(0, u1 - 1), 16 * FloorDiv(u0 + u1 + 15, 16))
    term = ModularIndexing(d0 + inner, 1, 16)
    return sympy.Add(
        sympy.Mul(sympy.Integer(-1), sympy.Integer(16), term, evaluate=False),
        sympy.Mul(sympy.Integer(16), ModularIndexing(d0 + inner + 1, 1, 16)),
    )


def test_a_kept_stride_comes_back_as_the_same_tree():
    for expr in (sympy.Integer(-3), sympy.Rational(1, 2), sympy.Symbol("u1", integer=True)):
        assert decode(encode(expr)) == expr
    expr = _prefill_like()
    tree = encode(expr)
    back = decode(json.loads(json.dumps(tree)))
    assert back == expr and hash(back) == hash(expr) and encode(back) == tree
    from torch._inductor.codegen.cpp_utils import cexpr_index

    assert cexpr_index(back) == cexpr_index(expr)  # the C++ it prints


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param(["os.system", "false"], id="a class outside the allowed ones"),
        pytest.param(["torch.utils._sympy.functions.sympy", 1], id="not a class"),
        pytest.param(["builtins.eval", "1"], id="eval"),
        pytest.param(["Symbol", "x", {"integer": True}], id="not encoding back"),
        pytest.param(["Symbol", 3, {}], id="a bad symbol"),
        pytest.param(["Symbol", '0); system("id"); //', {"commutative": True}], id="C++ name"),
        pytest.param(True, id="a bool"),
        pytest.param("1 + 1", id="a string"),
        pytest.param([], id="empty"),
    ],
)
def test_a_tree_that_is_not_a_kept_stride_is_computed_again(tree):
    assert decode(tree) is None


def test_a_stride_of_another_class_is_not_kept_nor_an_index_of_one_keyed():
    x = sympy.Symbol("x", integer=True)
    assert encode(sympy.sin(x)) is None and encode(sympy.Dummy("d")) is None
    f, g = sympy.Function("f"), sympy.Function("f", integer=True)  # unequal, no module
    assert f(x) != g(x) and expr_key(f(x)) is None and expr_key(g(x)) is None
    assert index_strides.Strides({}).key(f(x), x, 4) is None
