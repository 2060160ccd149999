"""One door to torch's private API (kernel_cache/torch_compat.py for the runtime,
warmup/torch_compat.py for the build).

- No other module of ``kernel_cache`` or ``warmup`` names a private torch name,
  by any of the ways Python can reach one (an AST scan of every module, and of
  its comments); the scan is shown to find each way in a planted module.
- Every name in the two tables resolves in the installed torch.
- The runtime's names taken away from the real torch objects: the loader
  (missing, or other arguments), the CPU runner, the compile counters and the
  CUDA-graph capture query each raise TorchAPIDriftError naming the torch
  version, the name and the fix; a load is never called a corrupt entry, and
  the entry's files stay as they were (counted on disk), through engine start
  and through warmup's check of a cached entry.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import re
import subprocess
import sys
import tokenize
import types
import zipfile
from pathlib import Path

import pytest
import torch

from kernel_cache import load_plan
from kernel_cache import torch_compat as runtime_compat
from kernel_cache.errors import CorruptEntryError, TorchAPIDriftError
from kernel_cache.plan.plan import Plan
from kernel_cache.runtime.compiles import CompileCounter
from kernel_cache.runtime.package import load_package
from kernel_cache.store.disk_tier import DiskTier
from kernel_cache.store.entry import make_meta

from ..conftest import ROOT

#: The two modules allowed to name torch's private API.
DOORS = {"kernel_cache/torch_compat.py", "warmup/torch_compat.py"}

#: A private torch name written out: ``torch._x``, ``torch.a.b._x``.
PRIVATE_TEXT = re.compile(r"\btorch(?:\.\w+)*\._[A-Za-z0-9]")
_ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    """A private attribute or module name (``_x``; ``__x__`` is Python's own)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(_private(p) for p in parts[1:])


def _root(node: ast.AST) -> str | None:
    """The name an expression's attribute / call / subscript chain starts from."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_uses(source: str, filename: str = "<src>") -> list[str]:
    """Every place ``source`` names a private torch name, as ``line: what``:
    ``import torch._x`` and ``from torch._x import y``; ``from torch import
    _x``; an attribute ``_x`` of anything reached from a name bound by an
    import of torch (``torch._C``, ``torch.ops.aten._op``, ``cpp_builder._f``
    after ``from torch._inductor import cpp_builder``, ``t._x`` after ``import
    torch as t``); ``getattr``/``setattr``/``hasattr``/``delattr`` on such an
    object with a private or computed name; and any string or comment that
    writes out a private torch name (``importlib.import_module("torch._x")``,
    ``sys.modules["torch._x"]``, a docstring)."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    bound: set[str] = set()  # names an import of torch bound in this module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "torch":
                    continue
                if _private_module(a.name):
                    found.append(f"{node.lineno}: import {a.name}")
                bound.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            if _private_module(node.module):
                found.append(f"{node.lineno}: from {node.module} import")
            for a in node.names:
                if _private(a.name):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
                bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _root(node) in bound:
            found.append(f"{node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ACCESSORS
            and len(node.args) >= 2
            and _root(node.args[0]) in bound
        ):
            name = node.args[1]
            literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
            if not literal or _private(name.value):
                found.append(f"{node.lineno}: {node.func.id}(..., {ast.unparse(name)})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if PRIVATE_TEXT.search(node.value):
                found.append(f"{node.lineno}: {PRIVATE_TEXT.search(node.value).group()!r}")
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and PRIVATE_TEXT.search(tok.string):
            found.append(f"{tok.start[0]}: comment {tok.string.strip()!r}")
    return found


def project_modules() -> list[Path]:
    return sorted(p for pkg in ("kernel_cache", "warmup") for p in (ROOT / pkg).rglob("*.py"))


def test_only_the_two_compat_modules_name_private_torch_api():
    modules = project_modules()
    rel = {str(p.relative_to(ROOT)) for p in modules}
    assert DOORS <= rel and "kernel_cache/runtime/load.py" in rel and len(rel) > 50
    leaks = {}
    for path in modules:
        name = str(path.relative_to(ROOT))
        if name not in DOORS:
            uses = private_torch_uses(path.read_text(), name)
            if uses:
                leaks[name] = uses
    assert leaks == {}
    # the doors do name them: the scan reads them the same way
    for door in DOORS:
        assert private_torch_uses((ROOT / door).read_text(), door)


#: A module naming private torch names in every way the scan knows; each line
#: that must be found is marked ``# found``.
PLANTED = '''
import importlib, sys
import torch
import torch as t
import torch._dynamo.utils  # found
import torch.nn.functional as F
from torch import nn, _C  # found
from torch._inductor import cpp_builder  # found
from torch.fx import _pytree  # found
a = torch._C._aoti.AOTIModelPackageLoader  # found
b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # found
c = t._check  # found
d = cpp_builder._run_compile_cmd  # found
e = F._in_projection  # found
f = getattr(torch._C, "x")  # found
g = getattr(torch, "_C")  # found
h = getattr(torch.cuda, name)  # found
setattr(cpp_builder, "_get_optimization_cflags", None)  # found
i = importlib.import_module("torch._inductor.config")  # found
j = sys.modules.get("torch._dynamo.utils")  # found
k = torch.nn.Module()._parameters  # found
# torch._neg_view in a comment: found
def fn():
    """Reads torch._dynamo.utils.counters."""  # found
ok = (torch.__version__, torch.nn, getattr(torch, "float32"), "torch.export", "_x", nn.Linear)
self._x = getattr(obj, "_private"), other._C
'''


def test_the_scan_finds_each_way_to_name_a_private_torch_name():
    found = {int(f.split(":")[0]) for f in private_torch_uses(PLANTED)}
    marked = {i for i, line in enumerate(PLANTED.splitlines(), 1) if "found" in line}
    assert len(marked) == 18 and found == marked


def test_every_listed_name_resolves_in_this_torch():
    from warmup import torch_compat as build_compat

    table = runtime_compat.RUNTIME_API + build_compat.BUILD_API
    assert len({a.name for a in table}) == len(table)
    for api in table:
        assert runtime_compat.resolve(api.name) is not None
        assert api.checked == runtime_compat.CHECKED == ("2.11", "2.13")
        assert torch.__version__.startswith(("2.11", "2.13"))


def test_the_architecture_page_lists_every_name():
    from warmup import torch_compat as build_compat

    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## Torch's private API") :].split("\n## ")[0]
    for api in runtime_compat.RUNTIME_API + build_compat.BUILD_API:
        assert f"`{api.name}`" in section or f"`{api.name.rpartition('.')[2]}`" in section
        assert ", ".join(api.checked) in section


# -- drift of the runtime's names -------------------------------------------------------


def assert_drift(e: TorchAPIDriftError, api: str) -> None:
    msg = str(e)
    assert not isinstance(e, CorruptEntryError)
    assert e.api == api and f"torch {torch.__version__}" in msg and api in msg
    assert "checked with torch 2.11, 2.13" in msg
    assert "pin torch to a checked version" in msg and "upgrade kernel-cache" in msg
    assert "repair" not in msg and "warmup" not in msg


def package(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in members.items():
            z.writestr(f"model/{name}", data)
    return out.getvalue()


#: Bytes of a member that make a package large enough to be stored in its own
#: file (diskcache keeps small values inside its index).
_PAD = b"not an ELF file" * 20_000
#: A package that goes to AOTInductor's loader (an unknown member), which
#: rejects it: its ``.so`` is not a library.
FOR_THE_LOADER = package({"data/aotinductor/model/m.so": _PAD, "data/other.bin": b"x"})
#: A package the CPU runner loads directly (one ``.so`` and its metadata),
#: whose ``.so`` does not load.
FOR_THE_RUNNER = package(
    {
        "data/aotinductor/model/m.so": _PAD,
        "data/aotinductor/model/m_metadata.json": json.dumps({"AOTI_DEVICE_KEY": "cpu"}).encode(),
    }
)


def fake_cache(directory: Path, plan: Plan, data: bytes) -> None:
    """Every key of ``plan`` holding ``data``, with valid metadata (the CPU
    target and features warmup would record)."""
    from kernel_cache.config.recipe import required_cpu_features

    config = plan.config
    tier = DiskTier(directory)
    try:
        for item in plan:
            meta = make_meta(item.key, str(item.variant), data, 0.0)
            meta.update(
                cpu_target=config.cpu_target, cpu_features=required_cpu_features(config.cpu_target)
            )
            tier.put(item.hexdigest, data, meta)
    finally:
        tier.close()


def files(directory: Path) -> tuple[dict[str, str], list[str]]:
    """``{path: sha256}`` of every file under ``directory`` but the index
    (SQLite rewrites its header when opened for writing), read from disk, and
    the keys the index lists."""
    on_disk = {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.name.startswith("cache.db")
    }
    tier = DiskTier(directory, read_only=True)
    try:
        return on_disk, sorted(m["key"] for m in tier.iter_meta())
    finally:
        tier.close()


@pytest.fixture(scope="module")
def tiny_plan(tiny_config) -> Plan:
    return Plan.build(tiny_config)


@pytest.mark.parametrize(
    ("data", "api"),
    [
        (FOR_THE_LOADER, "torch._C._aoti.AOTIModelPackageLoader"),
        (FOR_THE_RUNNER, "torch._C._aoti.AOTIModelContainerRunnerCpu"),
    ],
    ids=["loader", "cpu-runner"],
)
def test_a_missing_loader_is_drift_not_a_corrupt_entry(
    tmp_path, tiny_config, tiny_plan, monkeypatch, data, api
):
    cache = tmp_path / "cache"
    fake_cache(cache, tiny_plan, data)
    before = files(cache)
    assert len(before[0]) == len(before[1]) == len(tiny_plan)  # one artifact file per entry
    with pytest.raises(CorruptEntryError, match="loader rejected it"):  # the bytes are bad
        load_plan(tiny_config, cache, plan=tiny_plan)
    monkeypatch.delattr(torch._C._aoti, api.rpartition(".")[2])
    with pytest.raises(TorchAPIDriftError) as e:
        load_plan(tiny_config, cache, plan=tiny_plan)
    assert_drift(e.value, api)
    assert "is missing" in str(e.value)
    # warmup's check of a cached entry (which quarantines a corrupt one) says the same
    from warmup.builder.report import Status, VariantResult
    from warmup.builder.worker import _check_local

    item = tiny_plan.items[0]
    res = VariantResult(str(item.variant), Status.FAILED, key=item.hexdigest)
    tier = DiskTier(cache)
    try:
        with pytest.raises(TorchAPIDriftError) as e:
            _check_local(tier, item.hexdigest, tiny_config, res)
    finally:
        tier.close()
    assert_drift(e.value, api)
    assert res.quarantined is None
    assert files(cache) == before and not (cache / "quarantine").exists()


def test_a_loader_that_takes_other_arguments_is_drift(tmp_path, monkeypatch):
    class Loader:  # a later torch's loader with another signature
        def __init__(self, model_package_path: str, options: dict):
            raise AssertionError("never reached")

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Loader)
    with pytest.raises(TorchAPIDriftError) as e:
        load_package(FOR_THE_LOADER, "cpu", "here", "k" * 64)
    assert_drift(e.value, "torch._C._aoti.AOTIModelPackageLoader")
    assert "takes other arguments" in str(e.value)


@pytest.fixture
def dynamo_utils():
    """torch's real counters module (imports Dynamo into this process)."""
    import importlib

    return importlib.import_module("torch._dynamo.utils")


@pytest.mark.parametrize("attr", ["counters", "compilation_time_metrics"])
def test_a_renamed_compile_counter_is_drift_never_zero(dynamo_utils, monkeypatch, attr):
    counter = CompileCounter()
    assert counter.read()["compiles"] == 0
    api = f"torch._dynamo.utils.{attr}"
    monkeypatch.delattr(dynamo_utils, attr)
    for read in (counter.read, counter.compiles, CompileCounter):
        with pytest.raises(TorchAPIDriftError) as e:
            read()
        assert_drift(e.value, api)
    monkeypatch.setattr(dynamo_utils, attr, [], raising=False)  # changed: not a dict
    with pytest.raises(TorchAPIDriftError, match=f"{re.escape(api)} is a list, not a dict"):
        counter.read()


def test_a_cuda_torch_without_the_capture_query_refuses_to_start(monkeypatch):
    name = "torch._C._cuda_isCurrentStreamCapturing"
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)  # as a CUDA build
    assert runtime_compat.stream_capture_query() is torch._C._cuda_isCurrentStreamCapturing
    monkeypatch.delattr(torch._C, "_cuda_isCurrentStreamCapturing")
    with pytest.raises(TorchAPIDriftError) as e:
        runtime_compat.stream_capture_query()
    assert_drift(e.value, name)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)  # a CPU-only build
    assert runtime_compat.stream_capture_query()() is False  # no graph can be captured


def test_engine_start_stops_where_the_capture_guard_would_be_lost():
    """A fresh process, as an engine with such a torch: importing the dispatcher
    (engine start does) raises the drift error, it does not run unguarded."""
    code = (
        "import torch\n"
        "torch.backends.cuda.is_built = lambda: True\n"
        "del torch._C._cuda_isCurrentStreamCapturing\n"
        "import kernel_cache.runtime.dispatch\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kernel_cache.errors.TorchAPIDriftError: torch ")
    assert "torch._C._cuda_isCurrentStreamCapturing is missing" in last


def test_warmups_load_check_reports_drift_as_such(tmp_path):
    """The check process that loads each new artifact before it is published
    (warmup/builder/loadcheck.py), run with the loader taken away: the artifact
    is refused with the drift error's text, not the loader's "rejected"."""
    art = tmp_path / "a.pt2"
    art.write_bytes(FOR_THE_LOADER)
    listing = tmp_path / "list.json"
    listing.write_text(json.dumps([{"index": 0, "variant": "v", "path": str(art)}]))
    code = (
        "import sys, torch\n"
        "del torch._C._aoti.AOTIModelPackageLoader\n"
        "from warmup.builder.loadcheck import _child_main\n"
        f"sys.exit(_child_main(['--device', 'cpu', {str(listing)!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    (rejected,) = [e for e in events if e["event"] == "rejected"]
    assert "torch._C._aoti.AOTIModelPackageLoader is missing" in rejected["error"]
    assert "pin torch to a checked version" in rejected["error"]


@pytest.mark.parametrize(
    "accessor, namespace, api",
    [
        ("cond_operator", "higher_order", "torch.ops.higher_order.cond"),
        (
            "cpu_flash_attention",
            "aten",
            "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        ),
    ],
)
def test_a_missing_kernel_operator_is_drift(monkeypatch, accessor, namespace, api):
    """The CPU kernels' operators, reached under export: a torch without one
    raises the drift error naming it, not an AttributeError from the trace."""
    monkeypatch.setattr(torch.ops, namespace, types.SimpleNamespace())
    with pytest.raises(TorchAPIDriftError) as e:
        getattr(runtime_compat, accessor)()
    assert_drift(e.value, api)
