"""An engine kernel's identity covers every source file whose code ran while it
was traced: a helper in another top-level module (followed by the static
closure) and one loaded by ``importlib`` under a computed name (recorded by the
compile worker's trace, :mod:`kernel_cache.plan.traced`).

The kernel package is written into ``tmp_path`` and put on ``PYTHONPATH``; the
compiling test warms, edits each helper, starts the engine in a fresh process,
re-warms (compiles counted through ``KERNEL_CACHE_TEST_COMPILE_LOG``) and
restores the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_cache.config.engine import make_config
from kernel_cache.plan.buckets import BATCHED_DECODE, Bucketer
from kernel_cache.plan.file_origin import MISSING, dist_version
from kernel_cache.plan.keys import build_key
from kernel_cache.plan.sources import source_files
from kernel_cache.plan.traced import Manifest, changes, current, find_file
from kernel_cache.plan.traced_build import manifest_of, stale_loaded_modules
from kernel_cache.store.disk_tier import DiskTier, make_meta
from kernel_cache.store.lookup import Lookup, Source, consistent, current_entry

from ..conftest import PLAIN_KERNELS, ROOT, TINY_LIMITS, run_cli, tiny_args

KERNEL = "userkern2.decode:Decode"

DECODE = '''"""A batched_decode kernel: the scale from a top-level module, the gather and
mask helpers from a module imported by a computed name."""

import importlib

import torch.nn.functional as F
from torch import nn

from nc_outside_helper import score_scale

_helpers = importlib.import_module("userkern2." + "dyn_helper")


class Decode(nn.Module):
    def __init__(self, num_heads, num_kv_heads, head_dim, **launch):
        super().__init__()
        self.groups = num_heads // num_kv_heads
        self.scale = score_scale(head_dim)

    def forward(self, query, key_cache, value_cache, block_tables, seq_lens):
        h = _helpers
        k = h.gather_heads(key_cache, block_tables, self.groups).float()
        v = h.gather_heads(value_cache, block_tables, self.groups).float()
        mask = h.length_mask(seq_lens, k.shape[-2])[:, None, None, :]
        q = query.float().unsqueeze(2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        out = out.squeeze(2) * (seq_lens > 0)[:, None, None] * h.OUT_GAIN
        return out.to(query.dtype)
'''

DYN_HELPER = '''"""Gather paged KV, build the length mask; OUT_GAIN is read at trace time."""

import torch

OUT_GAIN = 1.0


def gather_heads(cache, table, groups):
    blocks = cache[table.long()]
    *lead, nb, bs, kvh, d = blocks.shape
    kv = blocks.reshape(*lead, nb * bs, kvh, d).repeat_interleave(groups, dim=-2)
    return kv.transpose(-2, -3)


def length_mask(lengths, total):
    t = torch.arange(total, device=lengths.device, dtype=torch.int32)
    mask = t[None, :] < lengths[:, None]
    mask[:, 0] = True
    return mask
'''

OUTSIDE_HELPER = '''"""A top-level module outside the kernel's package."""

import math


def score_scale(head_dim):
    return 1.0 / math.sqrt(head_dim)
'''

#: Each helper, its path as recorded, and an edit that changes the kernel's output.
EDITS = {
    "dyn_helper": ("userkern2/dyn_helper.py", "OUT_GAIN = 1.0", "OUT_GAIN = 3.0"),
    "outside": ("nc_outside_helper.py", "return 1.0 /", "return 2.0 /"),
}


def write_kernels(site: Path) -> None:
    (site / "userkern2").mkdir(parents=True)
    (site / "userkern2" / "__init__.py").write_text('"""An engine\'s kernels."""\n')
    (site / "userkern2" / "decode.py").write_text(DECODE)
    (site / "userkern2" / "dyn_helper.py").write_text(DYN_HELPER)
    (site / "nc_outside_helper.py").write_text(OUTSIDE_HELPER)


def _fresh_memos(monkeypatch) -> None:
    """Empty the recorder's per-process memos for one test (the files earlier
    windows ran and imported, which later windows add, and the code objects
    the manifest checks), so its windows record only what they see."""
    from warmup.builder import recorder

    for name in ("_RAN", "_IMPORTED", "_CODES"):
        monkeypatch.setattr(recorder, name, {})


def _forget_modules(*prefixes: str) -> None:
    """Drop the modules whose names start with one of ``prefixes`` (default: the
    kernel package and its outside helper) from ``sys.modules``."""
    prefixes = prefixes or ("userkern2", "nc_outside_helper")
    for name in [m for m in sys.modules if m.startswith(prefixes)]:
        del sys.modules[name]


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """The kernel package and its outside helper, on ``sys.path`` and ``PYTHONPATH``."""
    site = tmp_path / "site"
    write_kernels(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    source_files.cache_clear()
    yield site
    source_files.cache_clear()
    _forget_modules()


def edit(site: Path, which: str, undo: bool = False) -> str:
    """Apply (or undo) one of :data:`EDITS`; returns the recorded path."""
    rel, old, new = EDITS[which]
    path = site / rel
    a, b = (new, old) if undo else (old, new)
    text = path.read_text()
    assert a in text
    path.write_text(text.replace(a, b))
    return rel


# -- the static closure ------------------------------------------------------------


def test_the_static_key_follows_imports_into_a_sibling_top_level_module(site, tiny_model):
    cfg = make_config(str(tiny_model), **TINY_LIMITS, kernels={BATCHED_DECODE: KERNEL})
    v = next(v for v in Bucketer(cfg).variants if v.kernel == BATCHED_DECODE)
    files = json.loads(build_key(cfg, v).as_dict()["sources"])
    assert {"userkern2/decode.py", "nc_outside_helper.py"} <= set(files)
    assert "userkern2/dyn_helper.py" not in files  # a computed name: found by the trace
    assert not [f for f in files if f.startswith(("torch/", "math", "importlib"))]
    assert not [m for m in sys.modules if m.startswith(("userkern2", "nc_outside_helper"))]
    before = build_key(cfg, v).hexdigest
    edit(site, "outside")
    source_files.cache_clear()
    assert build_key(cfg, v).hexdigest != before


# -- the manifest -------------------------------------------------------------------


def test_the_manifest_hashes_source_files_and_names_distributions(site):
    import importlib.metadata

    import pydantic
    import torch
    import userkern2.decode  # noqa: F401 - its modules are what is classified

    dyn = site / "userkern2" / "dyn_helper.py"
    m = manifest_of(
        [
            str(dyn),
            str(site / "nc_outside_helper.py"),
            os.__file__,  # the standard library: the python component pins it
            torch.__file__,  # torch: the torch component pins it
            pydantic.__file__,  # an installed distribution: its version
            "<frozen importlib._bootstrap>",
            str(ROOT / "kernel_cache" / "plan" / "traced.py"),  # an editable install: hashed
        ]
    )
    import hashlib

    assert m.files == {
        "userkern2/dyn_helper.py": hashlib.sha256(dyn.read_bytes()).hexdigest(),
        "nc_outside_helper.py": hashlib.sha256(
            (site / "nc_outside_helper.py").read_bytes()
        ).hexdigest(),
        "kernel_cache/plan/traced.py": hashlib.sha256(
            (ROOT / "kernel_cache" / "plan" / "traced.py").read_bytes()
        ).hexdigest(),
    }
    assert m.dists == {"pydantic": dist_version("pydantic")}
    assert m.dists["pydantic"].startswith(importlib.metadata.version("pydantic") + " (RECORD ")
    assert str(site) not in json.dumps(m.record())


def test_the_check_finds_files_along_sys_path_and_names_what_changed(site, tmp_path, monkeypatch):
    import userkern2.decode  # noqa: F401

    stored = manifest_of(
        [str(site / "userkern2" / "dyn_helper.py"), str(site / "nc_outside_helper.py")]
    )
    stored = Manifest(files=stored.files, dists={"pydantic": "0.0.1"})
    assert find_file("userkern2/dyn_helper.py") == site / "userkern2" / "dyn_helper.py"
    assert find_file("nc_outside_helper.py") == site / "nc_outside_helper.py"
    assert changes(stored, current(stored)) == [
        f"distribution pydantic 0.0.1 stored, {current(stored).dists['pydantic']} here"
    ]
    stored = Manifest(files=stored.files)
    # mounted elsewhere: the same files found along sys.path match
    _forget_modules()
    moved = tmp_path / "elsewhere"
    shutil.copytree(site, moved)
    shutil.rmtree(site)
    monkeypatch.syspath_prepend(str(moved))
    assert changes(stored, current(stored)) == []
    rel = edit(moved, "dyn_helper")
    (moved / "nc_outside_helper.py").unlink()
    lines = changes(stored, current(stored))
    old, new = stored.files[rel][:16], current(stored).files[rel][:16]
    assert lines == [
        f"nc_outside_helper.py not found on sys.path (sha256 "
        f"{stored.files['nc_outside_helper.py'][:16]} stored)",
        f"{rel} changed (sha256 {old} stored, {new} here)",
    ]
    assert current(stored).files["nc_outside_helper.py"] == MISSING


def test_a_changed_traced_file_leads_to_a_derived_key_and_back(site, tiny_config, tmp_path):
    """The lookup every path shares (:func:`current_entry`): an entry whose
    traced file changed misses, naming it; an artifact stored under the derived
    key hits while the file stays edited; restoring the file hits the first
    entry again. Also through the compatible (build-only ``cxx``) lookup."""
    import userkern2.decode  # noqa: F401

    v = Bucketer(tiny_config).variants[0]
    key = build_key(tiny_config, v)
    traced = manifest_of([str(site / "userkern2" / "dyn_helper.py")])
    tier = DiskTier(tmp_path / "cache")
    try:
        tier.put(key.hexdigest, b"first", make_meta(key, str(v), b"first", 1.0, traced=traced))
        assert Lookup([tier]).find(key).entry.data == b"first"
        rel = edit(site, "dyn_helper")
        lookup = Lookup([tier])
        result = lookup.search(key)
        assert result.found is None
        assert len(result.changes) == 1 and result.changes[0].startswith(f"{rel} changed")
        assert lookup.why_missing(key, result.changes) == (
            f"traced files changed since its entry was built: {result.changes[0]}"
        )
        cur = current_entry(tier.get, key.hexdigest)
        assert cur.entry is None and cur.key != key.hexdigest and len(cur.derived) == 1
        now = manifest_of([str(site / "userkern2" / "dyn_helper.py")])
        meta = make_meta(key, str(v), b"second", 1.0, traced=now, derived=cur.derived)
        assert meta["key"] == cur.key and consistent(meta)
        tier.put(cur.key, b"second", meta)
        assert Lookup([tier]).find(key).entry.data == b"second"
        # another C++ compiler here: the compatible lookup takes the entry whose files match
        other = build_key(tiny_config, v, overrides={"cxx": "none"})
        found = Lookup([tier]).find(other)
        assert found.entry.data == b"second" and found.accepted
        edit(site, "dyn_helper", undo=True)
        assert Lookup([tier]).find(key).entry.data == b"first"
        assert Lookup([tier]).find(other).entry.data == b"first"
    finally:
        tier.close()


def test_an_unreadable_derived_entry_is_rebuilt_under_its_own_key(site, tiny_config):
    """Warmup's search (``stop_on``) ends at a corrupt entry with the states that
    derive its key, so the artifact built to replace it records them."""
    import userkern2.decode  # noqa: F401

    from kernel_cache.errors import CorruptEntryError
    from kernel_cache.store.disk_tier import Entry

    v = Bucketer(tiny_config).variants[0]
    key = build_key(tiny_config, v)
    traced = manifest_of([str(site / "userkern2" / "dyn_helper.py")])
    first = Entry(key.hexdigest, make_meta(key, str(v), b"a", 1.0, traced=traced), b"a")
    edit(site, "dyn_helper")

    def get(k):
        if k == key.hexdigest:
            return first
        raise CorruptEntryError(k, "artifact bytes missing")

    with pytest.raises(CorruptEntryError):  # engine start: an error, never a miss
        current_entry(get, key.hexdigest)
    cur = current_entry(get, key.hexdigest, stop_on=(CorruptEntryError,))
    assert cur.entry is None and cur.key != key.hexdigest and len(cur.derived) == 1
    assert make_meta(key, str(v), b"b", 1.0, derived=cur.derived)["key"] == cur.key


def test_a_changed_static_source_is_named_by_the_lookup(site, tiny_model, tmp_path):
    cfg = make_config(str(tiny_model), **TINY_LIMITS, kernels={BATCHED_DECODE: KERNEL})
    v = next(v for v in Bucketer(cfg).variants if v.kernel == BATCHED_DECODE)
    key = build_key(cfg, v)
    tier = DiskTier(tmp_path / "cache")
    try:
        tier.put(key.hexdigest, b"x", make_meta(key, str(v), b"x", 1.0))
        edit(site, "outside")
        source_files.cache_clear()
        now = build_key(cfg, v)
        lookup = Lookup([tier])
        result = lookup.search(now)
        assert result.found is None and result.changes == ()
        assert lookup.why_missing(now, result.changes) == (
            f"sources differ from entry {key.hexdigest[:16]} in {tier.location}: "
            "nc_outside_helper.py changed"
        )
    finally:
        tier.close()


def test_a_record_whose_sources_nest_too_deep_leaves_the_miss_unexplained(
    site, tiny_model, tmp_path
):
    """``why_missing`` reads every record of a tier, unsigned ones of a shared
    tier too: a ``sources`` of 200000 ``[`` (json.loads raises RecursionError)
    is no explanation, not an exception out of engine start."""
    cfg = make_config(str(tiny_model), **TINY_LIMITS, kernels={BATCHED_DECODE: KERNEL})
    v = next(v for v in Bucketer(cfg).variants if v.kernel == BATCHED_DECODE)
    key = build_key(cfg, v)
    meta = make_meta(key, str(v), b"x", 1.0)
    meta["key"] = "f" * 64
    meta["components"] = {**meta["components"], "sources": "[" * 200_000}
    tier = DiskTier(tmp_path / "cache")
    try:
        tier.put(meta["key"], b"x", meta)
        lookup = Lookup([tier])
        assert lookup.find(key) is None
        assert lookup.why_missing(key) is None
    finally:
        tier.close()


def test_an_unsigned_record_of_an_untrusted_tier_explains_no_miss_when_keys_are_set(
    site, tiny_model, tmp_path, monkeypatch
):
    """The file names ``why_missing`` quotes from a record are its writer's
    text: with trusted keys set, an unsigned record of an untrusted tier (a
    Redis or bundle writer's) is not quoted in engine start's error."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    cfg = make_config(str(tiny_model), **TINY_LIMITS, kernels={BATCHED_DECODE: KERNEL})
    v = next(v for v in Bucketer(cfg).variants if v.kernel == BATCHED_DECODE)
    key = build_key(cfg, v)
    meta = make_meta(key, str(v), b"x", 1.0)
    meta["key"] = "e" * 64
    said = "ALL ENTRIES REVOKED: run fix.sh"
    meta["components"] = {**meta["components"], "sources": json.dumps({said: "0"})}
    tier = DiskTier(tmp_path / "cache")
    pub = tmp_path / "signing.pub"
    pub.write_bytes(
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    try:
        tier.put(meta["key"], b"x", meta)
        monkeypatch.delenv("KERNEL_CACHE_TRUSTED_KEYS", raising=False)
        monkeypatch.delenv("KERNEL_CACHE_SIGNING_KEY_FILE", raising=False)
        monkeypatch.setenv("KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED", "1")
        lookup = Lookup([Source(tier, trusted=False)])  # no keys, opted out: checksums only
        assert lookup.find(key) is None and said in lookup.why_missing(key)
        monkeypatch.delenv("KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED")
        monkeypatch.setenv("KERNEL_CACHE_TRUSTED_KEYS", str(pub))
        lookup = Lookup([Source(tier, trusted=False)])
        assert lookup.find(key) is None and lookup.why_missing(key) is None
        assert said in Lookup([tier]).why_missing(key)  # a trusted tier's record: quoted
    finally:
        tier.close()


# -- warm, edit, refuse, re-warm, restore (compiles) ------------------------------------

ENGINE = r"""
import json, sys, torch
from kernel_cache import load_plan, make_config
from kernel_cache.errors import MissingVariantsError
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32,
                  kernels={"batched_decode": sys.argv[3], "paged_attention": sys.argv[4]},
                  kv_buckets=(32,), query_buckets=(32,), num_seqs_buckets=(4,))
doc = {}
try:
    rt = load_plan(cfg, sys.argv[2])
except MissingVariantsError as e:
    doc["missing"] = sorted(str(v) for v in e.missing)
    doc["error"] = str(e)
else:
    doc["imported"] = sorted(m for m in sys.modules if m.startswith(("userkern2", "nc_outside")))
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(9, 16, 2, 8, generator=g), torch.randn(9, 16, 2, 8, generator=g)
    q = torch.randn(3, 4, 8, generator=g)
    bt = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    out = rt.decode(q, kc, vc, bt, [5, 17, 32])
    from userkern2.decode import Decode  # the source as it is now, run eagerly
    with torch.no_grad():
        eager = Decode(num_heads=4, num_kv_heads=2, head_dim=8)(
            q, kc, vc, bt, torch.tensor([5, 17, 32], dtype=torch.int32))
    doc["err"] = float((out - eager).abs().max())
print(json.dumps(doc))
"""


def engine_start(model, cache) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), str(cache), KERNEL, PLAIN_PREFILL],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def warm(args, log: Path) -> list[str]:
    """Run warmup; the variants the compiler ran for (its own log, not the report)."""
    log.unlink(missing_ok=True)
    env = {"KERNEL_CACHE_TEST_COMPILE_LOG": str(log)}
    run_cli("warmup", *args, "--jobs", "2", "--json", env=env, check=True)
    return sorted(line.split()[1] for line in log.read_text().splitlines()) if log.exists() else []


#: One bucket per ladder: a plan of two variants, a prefill and the engine's
#: decode (the fewest compiles that still load a whole plan). The prefill is the
#: plain kernels' (another engine kernel, whose files are not edited): the
#: claims are about the decode's files.
SMALL = {"kv_buckets": (32,), "query_buckets": (32,), "num_seqs_buckets": (4,)}
SMALL_ARGS = ["--kv-buckets", "32", "--query-buckets", "32", "--num-seqs-buckets", "4"]
PLAIN_PREFILL = PLAIN_KERNELS["paged_attention"]


@pytest.mark.compile
def test_editing_a_helper_refuses_recompiles_its_variants_and_restoring_hits(
    site, tiny_model, tmp_path
):
    cache = tmp_path / "cache"
    args = [*tiny_args(tiny_model), *SMALL_ARGS, "--kernel", f"{BATCHED_DECODE}={KERNEL}"]
    args += ["--kernel", f"paged_attention={PLAIN_PREFILL}"]
    args += ["--cache-dir", cache]
    log = tmp_path / "compiles.log"
    cfg = make_config(str(tiny_model), **{**TINY_LIMITS, **SMALL})
    variants = sorted(str(v) for v in Bucketer(cfg).variants)
    decode = [v for v in variants if v.startswith(BATCHED_DECODE)]
    assert len(variants) == 2 and len(decode) == 1
    assert warm(args, log) == variants
    doc = engine_start(tiny_model, cache)
    assert "missing" not in doc and doc["imported"] == [] and doc["err"] < 1e-5, doc
    for which in EDITS:
        rel = edit(site, which)
        doc = engine_start(tiny_model, cache)
        assert doc.get("missing") == decode, doc
        assert rel in doc["error"], doc["error"]
        explain = run_cli("explain", *args, check=True).stdout
        assert rel in explain, explain
        if which == "dyn_helper":  # the old code is not taken for the new: verify agrees
            verify = json.loads(run_cli("verify", *args, "--json").stdout)
            assert not verify["ok"] and verify["missing"] == decode, verify
        assert warm(args, log) == decode
        doc = engine_start(tiny_model, cache)
        assert "missing" not in doc and doc["err"] < 1e-5, doc  # the edited code, compiled
        edit(site, which, undo=True)
        assert warm(args, log) == []
        doc = engine_start(tiny_model, cache)
        assert "missing" not in doc and doc["err"] < 1e-5, doc


SHARED_DECODE = """import importlib

from kernel_cache.kernels.plain import BatchedDecode

_c = importlib.import_module("userkern5." + "consts")


class Decode(BatchedDecode):
    def forward(self, query, key_cache, value_cache, block_tables, seq_lens):
        return super().forward(query, key_cache, value_cache, block_tables, seq_lens) * _c.GAIN
"""

SHARED_PREFILL = """import importlib

from kernel_cache.kernels.plain import PagedAttention

_c = importlib.import_module("userkern5." + "consts")


class Prefill(PagedAttention):
    def forward(self, query, key_cache, value_cache, block_table, seq_len, real_query_len):
        out = super().forward(query, key_cache, value_cache, block_table, seq_len, real_query_len)
        return out * _c.GAIN
"""


def test_a_module_two_kernels_load_by_a_computed_name_is_in_both_manifests(
    tmp_path, monkeypatch, tiny_model
):
    """One compile worker traces the prefill kernel, then the decode kernel; both
    read ``GAIN`` of a module loaded with ``importlib`` at their import. Its body
    runs in the first window only, and the second kernel's code never calls into
    it: the second manifest must list it all the same (it did not, so an edit of
    ``GAIN`` left the decode entries loading with the old value)."""
    from kernel_cache.kernels.slots import kernel_path
    from warmup.builder.compiler import RunRecorder, export_variant

    site = tmp_path / "site5"
    (site / "userkern5").mkdir(parents=True)
    (site / "userkern5" / "__init__.py").write_text("")
    (site / "userkern5" / "consts.py").write_text("GAIN = 1.0\n")
    (site / "userkern5" / "decode.py").write_text(SHARED_DECODE)
    (site / "userkern5" / "prefill.py").write_text(SHARED_PREFILL)
    monkeypatch.syspath_prepend(str(site))
    cfg = make_config(
        str(tiny_model),
        **TINY_LIMITS,
        kernels={
            BATCHED_DECODE: "userkern5.decode:Decode",
            "paged_attention": "userkern5.prefill:Prefill",
        },
    )
    variants = Bucketer(cfg).variants
    try:
        for slot in ("paged_attention", BATCHED_DECODE):  # one worker, one after the other
            v = next(v for v in variants if v.kernel == slot)
            window = RunRecorder(kernel_path(cfg, slot))
            with window:
                export_variant(cfg, v)
            assert "userkern5/consts.py" in window.manifest().files, slot
    finally:
        _forget_modules("userkern5")


def test_code_from_a_pyc_only_module_is_refused_not_left_out(tmp_path, monkeypatch):
    """A helper shipped as ``.pyc`` only: its code ran in the trace, but its
    source path (the code's ``co_filename``) is not on disk, so nothing could
    be hashed. Building from it is refused, naming the file, rather than
    recording an identity that leaves it out."""
    import importlib
    import py_compile

    from kernel_cache.errors import CompileError

    pkg = tmp_path / "site" / "pyconly"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    src = pkg / "helper.py"
    src.write_text("def gain():\n    return 2.0\n")
    py_compile.compile(str(src), cfile=str(pkg / "helper.pyc"), doraise=True)
    src.unlink()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    helper = importlib.import_module("pyconly.helper")
    assert helper.gain() == 2.0 and helper.__file__.endswith(".pyc")
    with pytest.raises(CompileError, match=r"pyconly/helper\.py .*not on disk.*ship the \.py"):
        manifest_of([helper.gain.__code__.co_filename])


def test_code_from_a_folder_a_package_adds_to_its_path_is_refused(tmp_path, monkeypatch):
    """A package whose ``__init__`` puts another folder first on its ``__path__``
    imports ``pkg.helper`` from there, while engine start, which runs no
    ``__init__``, would find ``pkg/helper.py`` in the package's own folder: with
    a copy there, an edit to the file that ran would hit the old entry. Building
    from it is refused, naming both files."""
    import importlib

    from kernel_cache.errors import CompileError

    over = tmp_path / "override"
    over.mkdir()
    pkg = tmp_path / "site" / "pathedit"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__path__.insert(0, {str(over)!r})\n")
    for folder in (pkg, over):  # the same helper in both folders
        (folder / "helper.py").write_text("def gain():\n    return 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        helper = importlib.import_module("pathedit." + "helper")
        assert helper.__file__ == str(over / "helper.py")
        with pytest.raises(CompileError, match=r"override/helper\.py ran.*pathedit/helper\.py"):
            manifest_of([helper.gain.__code__.co_filename])
    finally:
        _forget_modules("pathedit")


def test_code_from_bytecode_of_an_earlier_version_of_its_file_is_refused(tmp_path, monkeypatch):
    """A helper edited keeping its size and modification time (an unpacked
    archive, a copy that keeps times): Python reuses the ``.pyc`` of the old
    text, so the code that ran is not the file the manifest would hash. Building
    from it is refused, naming the ``.pyc``; once the file is touched, the import
    compiles the source and the manifest takes it."""
    import importlib
    import py_compile

    from kernel_cache.errors import CompileError

    pkg = tmp_path / "site" / "stalepyc"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    src = pkg / "helper.py"
    src.write_text("def gain():\n    return 2.0\n")
    pyc = py_compile.compile(str(src), doraise=True)  # __pycache__/helper.*.pyc
    st = os.stat(src)
    src.write_text("def gain():\n    return 1.0\n")  # same size
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        helper = importlib.import_module("stalepyc.helper")
        assert helper.gain() == 2.0  # Python ran the old bytecode
        with pytest.raises(CompileError, match=r"stalepyc/helper\.py ran from .*helper\..*\.pyc"):
            manifest_of([helper.gain.__code__.co_filename])
        # a module imported before the run recorder is found among the loaded ones
        assert (str(src), pyc) in stale_loaded_modules()
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
        del sys.modules["stalepyc.helper"]
        helper = importlib.import_module("stalepyc.helper")
        assert helper.gain() == 1.0
        assert list(manifest_of([helper.gain.__code__.co_filename]).files) == ["stalepyc/helper.py"]
        assert os.path.isfile(pyc)
    finally:
        _forget_modules("stalepyc")


def test_the_manifest_names_the_bytes_imported_not_an_edit_made_since(tmp_path, monkeypatch):
    """With imports recorded (as in a compile worker), a helper edited after it
    was imported, while the kernel compiles, is recorded with the sha256 of the
    bytes that ran, so engine start misses on the edited file; a stale ``.pyc``
    (edit keeping size and modification time) is refused."""
    import hashlib
    import importlib
    import py_compile
    from importlib.machinery import SourceFileLoader

    from kernel_cache.errors import CompileError
    from kernel_cache.plan import traced_build as traced

    monkeypatch.setattr(SourceFileLoader, "get_code", SourceFileLoader.get_code)
    monkeypatch.setattr(traced, "LOADED_SOURCES", {})
    traced.record_imports()
    pkg = tmp_path / "site" / "racehelp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    src = pkg / "helper.py"
    old = b"GAIN = 3.0\n\ndef gain():\n    return GAIN\n"
    src.write_bytes(old)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        helper = importlib.import_module("racehelp.helper")
        src.write_bytes(b"GAIN = 1.0\n\ndef gain():\n    return GAIN\n")  # mid-compile fix
        files = manifest_of([helper.gain.__code__.co_filename]).files
        assert files == {"racehelp/helper.py": hashlib.sha256(old).hexdigest()}

        src.write_bytes(old)
        py_compile.compile(str(src), doraise=True)
        st = os.stat(src)
        src.write_bytes(b"GAIN = 2.0\n\ndef gain():\n    return GAIN\n")  # same size
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
        del sys.modules["racehelp.helper"]
        helper = importlib.import_module("racehelp.helper")
        assert helper.gain() == 3.0  # the stale .pyc ran
        with pytest.raises(CompileError, match=r"racehelp/helper\.py is not that file's"):
            manifest_of([helper.gain.__code__.co_filename])
    finally:
        _forget_modules("racehelp")


def test_code_a_later_trace_reuses_from_an_earlier_one_is_in_both_manifests(tmp_path, monkeypatch):
    """A helper behind ``functools.cache`` runs in the first trace of a worker
    only; the second trace of the same kernel reuses its result, so the helper
    is recorded for both entries (else an edit to it would rebuild only the
    first)."""
    import importlib

    from warmup.builder import recorder

    monkeypatch.setattr(recorder, "_RAN", {})
    monkeypatch.setattr(recorder, "_IMPORTED", {})
    pkg = tmp_path / "site" / "memohelp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "lib.py").write_text(
        "import functools\n\n@functools.cache\ndef gain():\n    return 2.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        lib = importlib.import_module("memohelp.lib")
        manifests = []
        for _ in range(2):
            with recorder.RunRecorder("memohelp.kern:K") as w:
                assert lib.gain() == 2.0
            manifests.append(w.manifest())
        assert ["memohelp/lib.py" in m.files for m in manifests] == [True, True]
    finally:
        _forget_modules("memohelp")


@pytest.mark.parametrize("how", ["runpy", "sourceless"])
def test_code_read_outside_imports_must_be_the_file_the_manifest_hashes(tmp_path, monkeypatch, how):
    """A helper run with ``runpy`` and edited before the manifest is made (while
    the kernel compiles), or loaded from a ``.pyc`` beside a ``.py`` that says
    something else: the code that ran is not the file's, and the build is
    refused naming it, rather than recording the file's hash for other code."""
    import importlib.machinery
    import py_compile
    import runpy

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    pkg = tmp_path / "site" / "knobpkg"
    pkg.mkdir(parents=True)
    knob = pkg / "knob.py"
    knob.write_text("GAIN = 3.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    if how == "sourceless":
        py_compile.compile(str(knob), cfile=str(pkg / "knob.pyc"), doraise=True)
        knob.write_text("GAIN = 1.0\n")
    with recorder.RunRecorder("knobpkg.kern:K") as w:
        if how == "runpy":
            gain = runpy.run_path(str(knob))["GAIN"]
        else:
            loader = importlib.machinery.SourcelessFileLoader("knobpkg_knob", str(pkg / "knob.pyc"))
            gain = loader.load_module().GAIN
    assert gain == 3.0
    if how == "runpy":
        knob.write_text("GAIN = 1.0\n")  # fixed while the kernel compiles
    with pytest.raises(CompileError, match=r"knobpkg/knob\.py is not that file's contents"):
        w.manifest()
    sys.modules.pop("knobpkg_knob", None)


def test_code_the_engine_runs_from_text_with_no_file_name_is_refused(monkeypatch):
    """``exec`` of a helper file's text (its code then names ``<string>``, no file):
    nothing records the file, so the build is refused naming the exec's place.
    Code the standard library generates from text (a dataclass's methods) is not."""
    import dataclasses

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    with recorder.RunRecorder("textpkg.kern:K"):
        dataclasses.make_dataclass("Point", ["x", "y"])(1, 2)  # stdlib exec: fine
    ns: dict = {}
    line = sys._getframe().f_lineno + 3
    with pytest.raises(CompileError, match=rf"exec or eval of a string, at .*{__file__}:{line}"):
        with recorder.RunRecorder("textpkg.kern:K"):
            exec("GAIN = 3.0", ns)  # the text of a helper file, read by the kernel
    assert ns["GAIN"] == 3.0


def test_code_compiled_from_text_with_an_empty_file_name_is_refused(monkeypatch):
    """``compile(text, "", "exec")``: no file name either."""
    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    with pytest.raises(CompileError, match="exec or eval of a string"):
        with recorder.RunRecorder("textpkg.kern:K"):
            exec(compile("GAIN = 3.0", "", "exec"), {})


def test_other_text_compiled_under_an_imported_files_name_is_refused(tmp_path, monkeypatch):
    """Code that ran under the name of a file whose imported bytes are recorded
    must be those bytes' code: a helper's text compiled under the kernel file's
    name (``compile(text, __file__, "exec")``, or a loader that names one file
    and reads another) is refused, naming the file, not recorded as that file."""
    from kernel_cache.errors import CompileError
    from kernel_cache.plan import traced_build as traced
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    pkg = tmp_path / "site" / "namepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    kern = pkg / "kern.py"
    kern.write_text("def gain():\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    data = kern.read_bytes()
    path = str(kern)
    monkeypatch.setitem(traced.LOADED_SOURCES, path, traced.hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(traced._LOADED_BYTES, path, data)
    ns: dict = {}
    exec(compile(data, path, "exec"), ns)  # the file's own code: fine
    with recorder.RunRecorder("namepkg.kern:K") as w:
        assert ns["gain"]() == 1.0
    assert "namepkg/kern.py" in w.manifest().files
    exec(compile("def gain():\n    return 3.0\n", path, "exec"), ns)  # other text
    with recorder.RunRecorder("namepkg.kern:K") as w:
        assert ns["gain"]() == 3.0
    with pytest.raises(CompileError, match=r"namepkg/kern\.py is not that file's contents"):
        w.manifest()
    _forget_modules("namepkg")


@pytest.mark.parametrize("where", ["stdlib", "torch", "missing"])
def test_module_code_run_under_another_files_name_is_refused(tmp_path, monkeypatch, where):
    """A helper's text compiled under the name of a standard-library or torch file
    (recorded by version, never hashed) or of a file that does not exist: the
    build is refused naming the file; a file's own text under its own name runs."""
    import os as os_module

    import torch

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    own = tmp_path / "own_helper.py"
    own.write_text("GAIN = 1.0\n")
    with recorder.RunRecorder("namepkg.kern:K"):
        exec(compile(own.read_bytes(), str(own), "exec"), {})
    name = {
        "stdlib": os_module.__file__,
        "torch": torch.__file__,
        "missing": str(tmp_path / "no_such_helper.py"),
    }[where]
    with pytest.raises(CompileError, match=f"module code under the name {name} .* not that"):
        with recorder.RunRecorder("namepkg.kern:K"):
            exec(compile("GAIN = 3.0\n", name, "exec"), {})


@pytest.mark.parametrize("how", ["renamed", "runpy", "interpreter"])
def test_module_code_under_another_name_is_refused_however_it_is_started(monkeypatch, how):
    """The same text under ``os.py``'s name: with its code object renamed
    (``co_name``), or run for the engine by ``runpy`` or ``code``'s interpreter
    (the engine's frame is found above the library's): refused."""
    import code as code_module
    import os as os_module
    import runpy

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    text, name = "GAIN = 3.0\n", os_module.__file__
    with pytest.raises(CompileError, match="module code under the name .*os.py"):
        with recorder.RunRecorder("namepkg.kern:K"):
            if how == "renamed":
                exec(compile(text, name, "exec").replace(co_name="x"), {})
            elif how == "runpy":
                runpy._run_code(compile(text, name, "exec"), {})
            else:
                code_module.InteractiveInterpreter({}).runsource(text, name, "exec")
    with pytest.raises(CompileError, match="code compiled from text with no file name"):
        with recorder.RunRecorder("namepkg.kern:K"):
            exec(compile(text, "<string>", "exec").replace(co_name="x"), {})


def test_a_file_evaluated_as_an_expression_under_its_own_name_runs(tmp_path, monkeypatch):
    """``eval(compile(text, path, "eval"))`` of a file holding an expression."""
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    f = tmp_path / "site" / "kc_eval_gain.py"
    f.parent.mkdir()
    f.write_text("1.0 * 2\n")
    monkeypatch.syspath_prepend(str(f.parent))
    with recorder.RunRecorder("namepkg.kern:K") as w:
        assert eval(compile(f.read_text(), str(f), "eval")) == 2.0
    assert "kc_eval_gain.py" in w.manifest().files


@pytest.mark.parametrize("profiler", ["cProfile", "setprofile"])
def test_a_profiler_that_replaces_the_trace_hook_refuses_the_build(monkeypatch, profiler):
    """A profiler started inside the kernel's code that replaces the profile hook
    and removes its own at the end: cProfile before Python 3.12, or one that
    sets a Python profile function (``sys.setprofile``, as ``profile`` and
    torch.profiler with_stack do, on every Python): what ran after it would go
    unrecorded, so the build is refused."""
    import cProfile

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    if profiler == "cProfile" and sys.version_info >= (3, 12):
        pytest.skip("cProfile runs on sys.monitoring from Python 3.12: the hook stays")
    _fresh_memos(monkeypatch)
    before = sys.getprofile()
    with pytest.raises(CompileError, match="profile hook .* was replaced while it was traced"):
        with recorder.RunRecorder("profpkg.kern:K"):
            if profiler == "cProfile":
                prof = cProfile.Profile()
                prof.enable()
                sum(range(10))
                prof.disable()
            else:
                sys.setprofile(lambda frame, event, arg: None)
                sum(range(10))
                sys.setprofile(None)
    assert sys.getprofile() is before  # the previous hook is back


@pytest.mark.skipif(sys.version_info < (3, 12), reason="cProfile takes the hook before 3.12")
def test_cprofile_inside_the_kernels_code_leaves_the_hook_and_the_record_whole(
    tmp_path, monkeypatch
):
    """From Python 3.12 cProfile is a ``sys.monitoring`` tool: started inside the
    kernel's code, it leaves the window's profile hook in place, which records
    on, the helper called while cProfile ran included, and the build goes on."""
    import cProfile
    import importlib

    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    pkg = _helper_pkg(tmp_path, monkeypatch, "monitpkg", helper="def gain():\n    return 2.0\n")
    before = sys.getprofile()
    try:
        helper = importlib.import_module("monitpkg.helper")
        with recorder.RunRecorder("monitpkg.kern:K") as w:
            prof = cProfile.Profile()
            prof.enable()
            assert helper.gain() == 2.0
            prof.disable()
        assert str(pkg / "helper.py") in w.files
        profiled = {getattr(e.code, "co_filename", None) for e in prof.getstats()}
        assert str(pkg / "helper.py") in profiled  # and cProfile saw it too
        assert sys.getprofile() is before
    finally:
        _forget_modules("monitpkg")


def test_a_thread_started_in_one_trace_is_recorded_in_the_next(tmp_path, monkeypatch):
    """A worker thread a kernel's first trace started (a thread pool it keeps)
    runs a helper during the second trace: the helper is in the second manifest."""
    import concurrent.futures
    import importlib

    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    pkg = tmp_path / "site" / "poolpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "first.py").write_text("def gain():\n    return 1.0\n")
    (pkg / "second.py").write_text("def gain():\n    return 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        first = importlib.import_module("poolpkg.first")
        second = importlib.import_module("poolpkg.second")
        with recorder.RunRecorder("poolpkg.kern:K") as w1:
            assert pool.submit(first.gain).result() == 1.0  # starts the pool's thread
        with recorder.RunRecorder("poolpkg.kern:K") as w2:
            assert pool.submit(second.gain).result() == 2.0  # runs in that thread
        assert str(pkg / "first.py") in w1.files
        assert str(pkg / "second.py") in w2.files
    finally:
        pool.shutdown()
        _forget_modules("poolpkg")


def test_a_function_first_run_by_an_import_is_recorded_when_it_runs_outside_one(
    tmp_path, monkeypatch
):
    """The profile function skips a function it has seen, separately inside and
    outside imports: a helper that an import ran first (at module level) and
    the trace then calls is in ``files``, in this window and in a later one; a
    file only an import ran is in ``imported`` only."""
    import importlib

    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    pkg = tmp_path / "site" / "seenpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("def gain():\n    return 3.0\n")
    (pkg / "user.py").write_text(
        "from seenpkg.helper import gain\nAT_IMPORT = gain()\n\ndef run():\n    return gain()\n"
    )
    (pkg / "only.py").write_text("def once():\n    return 1\n\nONCE = once()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        with recorder.RunRecorder("seenpkg.kern:K") as w1:
            user = importlib.import_module("seenpkg.user")  # runs gain() inside an import
            importlib.import_module("seenpkg.only")
            assert user.run() == 3.0  # and again outside one
        helper, only = str(pkg / "helper.py"), str(pkg / "only.py")
        assert helper in w1.imported and helper in w1.files
        assert only in w1.imported and only not in w1.files
        with recorder.RunRecorder("seenpkg.kern:K") as w2:
            assert user.run() == 3.0
        assert helper in w2.files and str(pkg / "user.py") in w2.files
    finally:
        _forget_modules("seenpkg")


def test_windows_closed_out_of_order_leave_none_recording(tmp_path, monkeypatch):
    """Two windows closed in the order they opened (not nested): each refuses
    (the second replaced the first's hook while the first was open, and the
    first put back the hook it found before the second closed), and once both
    are closed, a call records into neither and no hook is left."""
    import importlib
    import threading

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    pkg = tmp_path / "site" / "orderpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "late.py").write_text("def late():\n    return 5\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    before, before_threads = sys.getprofile(), threading.getprofile()
    a, b = recorder.RunRecorder("orderpkg.kern:K"), recorder.RunRecorder("orderpkg.kern:K")
    try:
        a.__enter__()
        b.__enter__()
        with pytest.raises(CompileError, match="was replaced"):  # by b's
            a.__exit__(None, None, None)
        with pytest.raises(CompileError, match="was replaced"):  # a put its saved hook back
            b.__exit__(None, None, None)
        assert sys.getprofile() is before and threading.getprofile() is before_threads
        assert recorder._WINDOW is None and not recorder._OPEN
        late = importlib.import_module("orderpkg.late")
        assert late.late() == 5
        assert not any("orderpkg" in f for f in a.files | a.imported | b.files | b.imported)
    finally:
        sys.setprofile(before)
        threading.setprofile(before_threads)
        recorder._OPEN.clear()
        recorder._set_window()
        _forget_modules("orderpkg")


def test_a_change_to_torchs_global_compiler_settings_is_named_and_put_back():
    """A kernel factory that sets ``torch._inductor.config`` (a graph pass, an
    option) would build code its key does not describe, in its own compile and
    every later one of the worker: the compile names the setting and puts it
    back (``compile_with_options`` then refuses the variant)."""
    import torch._inductor.config as inductor_config

    from warmup.builder import compiler

    before = compiler._global_configs()
    assert compiler._config_changes(before) == []
    old = inductor_config.post_grad_custom_post_pass
    inductor_config.post_grad_custom_post_pass = lambda graph: None
    try:
        changed = compiler._config_changes(before)
        assert inductor_config.post_grad_custom_post_pass is old  # put back
    finally:
        inductor_config.post_grad_custom_post_pass = old
    assert changed == ["torch._inductor.config.post_grad_custom_post_pass"]


def test_a_same_size_edit_that_puts_the_modification_time_back_is_hashed_again(tmp_path):
    """A long-lived process hashes a file once per version: an edit of the same size
    whose modification time is put back (``os.utime``) still moves the change time."""
    import os
    import time

    from kernel_cache.plan.file_origin import file_sha256

    f = tmp_path / "helper.py"
    f.write_text("GAIN = 1.0\n")
    before = file_sha256(str(f))
    st = os.stat(f)
    time.sleep(0.05)  # past the file system's timestamp granularity
    f.write_text("GAIN = 3.0\n")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(f).st_size, os.stat(f).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert file_sha256(str(f)) != before


def _helper_pkg(tmp_path, monkeypatch, name: str, **files: str):
    """A package ``name`` in ``tmp_path/site`` with the modules ``files`` (module name:
    text), on ``sys.path``; returns its folder."""
    pkg = tmp_path / "site" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for module, text in files.items():
        (pkg / f"{module}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return pkg


@pytest.mark.parametrize("how", ["monitoring", "busy"])
def test_a_c_profiler_that_does_not_take_the_profile_hook_leaves_the_window_to_the_function(
    tmp_path, monkeypatch, how
):
    """From Python 3.12 ``_lsprof`` runs on ``sys.monitoring``: enabled, it is not
    the thread's profile hook (``sys.getprofile()`` stays None), and enabling it
    while another profiler runs raises ValueError. The window then records with
    the profile function: it closes without a refusal, with the helper recorded."""
    import importlib

    from warmup.builder import recorder

    class Monitoring(recorder._WindowProfiler):
        def enable(self, *args, **kwargs):
            if how == "busy":
                raise ValueError("Another profiling tool is already active")

    _fresh_memos(monkeypatch)
    monkeypatch.setattr(recorder, "_WindowProfiler", Monitoring)
    pkg = _helper_pkg(tmp_path, monkeypatch, "monpkg", helper="def gain():\n    return 2.0\n")
    before = sys.getprofile()
    try:
        helper = importlib.import_module("monpkg.helper")
        with recorder.RunRecorder("monpkg.kern:K") as w:
            assert helper.gain() == 2.0
        assert str(pkg / "helper.py") in w.files
        assert sys.getprofile() is before and recorder._PROFILING is None
    finally:
        _forget_modules("monpkg")


@pytest.mark.parametrize("how", ["none", "chained", "nested"])
def test_a_profile_hook_put_back_after_a_replacement_leaves_no_window_open(
    tmp_path, monkeypatch, how
):
    """Kernel code that saves the profile hook, replaces it and puts it back
    (``saved = sys.getprofile()`` ... ``sys.setprofile(saved)``), its own hook
    calling the saved one meanwhile (``chained``, as torch's cycle observer
    does), or in a function it calls (``nested``): the window is refused (what
    ran in between went unrecorded; where it records with the C profiler, the
    put-back profiler takes the hook again; where with the profile function,
    from Python 3.12, the change is seen as it is made), with no error in the
    kernel's code, the replacement's hook called for every event while
    installed, and nothing left installed once the window closed."""
    import importlib
    import threading

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    _helper_pkg(tmp_path, monkeypatch, "backpkg", helper="def gain():\n    return 2.0\n")
    before, before_threads = sys.getprofile(), threading.getprofile()
    try:
        helper = importlib.import_module("backpkg.helper")
        window = recorder.RunRecorder("backpkg.kern:K")
        events = []

        def replace_and_put_back():
            saved = sys.getprofile()
            sys.setprofile(None)
            assert helper.gain() == 2.0  # unrecorded
            sys.setprofile(saved)

        def kernel_code():  # the replacement two calls below the window's frame
            replace_and_put_back()

        with pytest.raises(CompileError, match="was replaced .*then put back"):
            with window:
                if how == "nested":
                    kernel_code()
                else:
                    saved = sys.getprofile()

                    def chained(frame, event, arg):
                        events.append(event)
                        saved(frame, event, arg)

                    sys.setprofile(chained if how == "chained" else None)
                    assert helper.gain() == 2.0  # unrecorded, unless chained passes it on
                    sys.setprofile(saved)
                assert helper.gain() == 2.0
        assert how != "chained" or events.count("call") >= 1 and len(events) >= 3
        assert sys.getprofile() is before and threading.getprofile() is before_threads
        assert recorder._PROFILING is None and window not in recorder._OPEN
    finally:
        _forget_modules("backpkg")


def test_a_window_opened_under_cprofile_records_and_gives_cprofile_back(tmp_path, monkeypatch):
    """A worker run under cProfile: the window records with the profile function
    and, once closed, cProfile records again (``sys.setprofile`` cannot put back
    a C profiler: it would call it as a Python function)."""
    import cProfile
    import importlib

    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    pkg = _helper_pkg(
        tmp_path,
        monkeypatch,
        "cprofpkg",
        inside="def gain():\n    return 2.0\n",
        after="def gain():\n    return 3.0\n",
    )
    before = sys.getprofile()
    prof = cProfile.Profile()
    try:
        inside = importlib.import_module("cprofpkg.inside")
        after = importlib.import_module("cprofpkg.after")
        prof.enable()
        hook = sys.getprofile()
        with recorder.RunRecorder("cprofpkg.kern:K") as w:
            assert inside.gain() == 2.0
        assert sys.getprofile() is hook
        assert after.gain() == 3.0
        prof.disable()
        assert str(pkg / "inside.py") in w.files
        profiled = {getattr(e.code, "co_filename", None) for e in prof.getstats()}
        assert str(pkg / "after.py") in profiled  # cProfile records again
    finally:
        prof.disable()
        sys.setprofile(before)
        _forget_modules("cprofpkg")


def test_module_code_a_library_runs_for_the_windows_own_frame_is_checked(monkeypatch):
    """Module code under ``os.py``'s name, run as a function (no ``exec``) by a
    standard-library function that the window's own frame called (an
    ``ExitStack`` callback): the engine's frame above it is the window's, and
    the build is refused as when an engine function calls the library."""
    import contextlib
    import os as os_module
    import types

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    code = compile("GAIN = 3.0\n", os_module.__file__, "exec")
    with pytest.raises(CompileError, match="module code under the name .*os.py"):
        with recorder.RunRecorder("namepkg.kern:K"):
            with contextlib.ExitStack() as stack:
                stack.callback(types.FunctionType(code, {}))


def test_module_code_run_again_outside_its_import_records_what_it_calls(tmp_path, monkeypatch):
    """A module's own code object, run by its import and then again outside any
    import as a function (``types.FunctionType``, no ``exec``): the helper its
    body calls ran outside an import too, and is in ``files``."""
    import importlib
    import types

    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    pkg = _helper_pkg(
        tmp_path,
        monkeypatch,
        "againpkg",
        helper="def gain():\n    return 2.0\n",
        body="import sys\n\nfrom againpkg import helper\n\nCODE = sys._getframe().f_code\n"
        "GAIN = helper.gain()\n",
    )
    try:
        with recorder.RunRecorder("againpkg.kern:K") as w:
            body = importlib.import_module("againpkg.body")
            ns = dict(vars(body))
            types.FunctionType(body.CODE, ns)()
        assert ns["GAIN"] == 2.0
        assert str(pkg / "helper.py") in w.files and str(pkg / "body.py") in w.files
    finally:
        _forget_modules("againpkg")


def test_a_closed_window_holds_no_profiler(tmp_path, monkeypatch):
    """A window kept for its manifest, nested in another: once both closed,
    no C profiler (each holds every code object its window ran) is left."""
    import gc

    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    with recorder.RunRecorder("nestpkg.kern:K"):
        with recorder.RunRecorder("nestpkg.kern:K") as inner:
            sum(range(3))
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, recorder._WindowProfiler)]
    assert inner.files is not None


@pytest.mark.parametrize("how", ["paused", "cleared"])
def test_code_that_pauses_or_clears_the_profiler_it_finds_is_refused(tmp_path, monkeypatch, how):
    """Kernel code that takes the profiler it finds (``sys.getprofile()``) and
    disables it for a while, or clears what it recorded: what ran meanwhile is
    not in the record, so the window is refused."""
    import importlib

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    _helper_pkg(tmp_path, monkeypatch, "pausepkg", helper="def gain():\n    return 2.0\n")
    before = sys.getprofile()
    try:
        helper = importlib.import_module("pausepkg.helper")
        with pytest.raises(CompileError, match="was replaced"):
            with recorder.RunRecorder("pausepkg.kern:K"):
                found = sys.getprofile()
                if not isinstance(found, recorder._WindowProfiler):
                    pytest.skip("the C profiler does not hold the hook here (Python 3.12+)")
                if how == "paused":
                    found.disable()
                    assert helper.gain() == 2.0  # unrecorded
                    found.enable()
                else:
                    assert helper.gain() == 2.0
                    found.clear()
        assert sys.getprofile() is before and recorder._PROFILING is None
    finally:
        _forget_modules("pausepkg")


def test_windows_open_at_once_in_two_threads_are_refused(tmp_path, monkeypatch):
    """Another thread opens a window while this thread's is open, and this
    window's kernel runs its helper in a thread of its own meanwhile: the
    helper is recorded into the window opened last (one window records the
    threads the kernels start), so neither record can be trusted and both
    windows are refused."""
    import importlib
    import threading

    from kernel_cache.errors import CompileError
    from warmup.builder import recorder

    _fresh_memos(monkeypatch)
    _helper_pkg(
        tmp_path,
        monkeypatch,
        "twopkg",
        first="def gain():\n    return 1.0\n",
        second="def gain():\n    return 2.0\n",
    )
    opened, go = threading.Event(), threading.Event()
    errors: dict = {}

    def other(second):
        try:
            with recorder.RunRecorder("twopkg.kern:K2"):
                opened.set()
                go.wait(10)
                assert second.gain() == 2.0
        except CompileError as e:
            errors["second"] = str(e)

    try:
        first = importlib.import_module("twopkg.first")
        second = importlib.import_module("twopkg.second")
        with pytest.raises(CompileError, match="another thread") as refused:
            with recorder.RunRecorder("twopkg.kern:K1"):
                t = threading.Thread(target=other, args=(second,))
                t.start()
                assert opened.wait(10)
                helper = threading.Thread(target=first.gain)  # window 1's kernel's thread
                helper.start()
                helper.join()
                go.set()
                t.join()
        assert "another thread" in errors.get("second", "")
        assert "twopkg.kern:K1" in str(refused.value)
    finally:
        go.set()
        _forget_modules("twopkg")


def test_code_named_by_no_readable_file_is_not_a_files_code():
    """A code object whose file name cannot be opened (a NUL byte in it, as
    ``code.replace`` allows) is not that file's code: False, not an error."""
    from kernel_cache.plan.traced_build import code_is_files

    code = compile("x = 1", "ab", "exec").replace(co_filename="/tmp/a\x00b")
    assert code_is_files(code, code.co_filename) is False


def test_a_distributions_record_digest_names_its_code_not_its_venv_or_installer():
    """The same distribution installed into another venv (a script's first line
    holds the interpreter's path: ``../../../bin/isympy``'s hash differs), by
    another installer (``INSTALLER``, ``REQUESTED``, ``direct_url.json``), in
    another order, digests the same; a changed file of its own does not."""
    import importlib.metadata

    from kernel_cache.plan.file_origin import _code_rows

    record = importlib.metadata.distribution("sympy").read_text("RECORD")
    lines = record.splitlines()
    other = []
    for line in reversed(lines):
        if line.startswith("../"):
            path, _, size = line.split(",")
            line = f"{path},sha256=another-venvs-script,{size}"
        elif "dist-info/INSTALLER," in line:
            line = line.split(",")[0] + ",sha256=uv,3"
        other.append(line)
    other.append("sympy-1.14.0.dist-info/direct_url.json,sha256=a-local-path,60")
    assert any(line.startswith("../../../bin/isympy,") for line in lines)
    assert _code_rows(record) == _code_rows("\n".join(other))
    changed = [
        line.replace("sha256=", "sha256=x", 1) if line.startswith("sympy/__init__.py,") else line
        for line in lines
    ]
    assert _code_rows("\n".join(changed)) != _code_rows(record)
    assert dist_version("sympy").startswith(importlib.metadata.version("sympy") + " (RECORD ")
