"""CPU packages load their verified ``.so`` with AOTInductor's CPU runner.

Real artifacts of the tiny plan, loaded in this process; torch's two load entry
points are wrapped to count what each load did (which constructor ran, and the
sha256 of the file it opened, read at that moment).
"""

import hashlib
import io
import json
import os
import zipfile

import pytest
import torch

from kernel_cache import load_plan
from kernel_cache.errors import CorruptEntryError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.runtime import package as package_mod
from kernel_cache.store.disk_tier import DiskTier

from ..conftest import N_TINY


def so_member(package: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(package)) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".so")]
        return z.read(name)


def rewritten(package: bytes, change) -> bytes:
    """``package`` with each member passed through ``change(name, data)``
    (None drops it); ``change`` may add members by returning a dict."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(package)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            got = change(info.filename, src.read(info))
            for name, data in (got if isinstance(got, dict) else {info.filename: got}).items():
                if data is not None:
                    dst.writestr(name, data)
    return out.getvalue()


@pytest.fixture
def calls(monkeypatch):
    """Counts of torch's CPU runner and package loader constructions; for the
    runner, the sha256 of the file it was given, hashed as it opens it."""
    aoti = torch._C._aoti
    runner, loader = aoti.AOTIModelContainerRunnerCpu, aoti.AOTIModelPackageLoader
    seen = {"runner": [], "loader": 0}

    def counted_runner(path, n):
        with open(path, "rb") as f:
            seen["runner"].append(hashlib.sha256(f.read()).hexdigest())
        return runner(path, n)

    def counted_loader(*args):
        seen["loader"] += 1
        return loader(*args)

    monkeypatch.setattr(aoti, "AOTIModelContainerRunnerCpu", counted_runner)
    monkeypatch.setattr(aoti, "AOTIModelPackageLoader", counted_loader)
    return seen


def entries(cache, config):
    tier = DiskTier(cache, read_only=True)
    try:
        return [tier.get(build_key(config, v).hexdigest) for v in Bucketer(config).variants]
    finally:
        tier.close()


def test_not_a_package_is_refused_before_any_load(calls):
    with pytest.raises(CorruptEntryError, match="loader rejected it: not a package"):
        package_mod.load_package(os.urandom(3000), "cpu", "here", "k" * 64)
    assert calls == {"runner": [], "loader": 0}


@pytest.mark.compile
def test_the_plan_loads_the_verified_libraries_and_leaves_no_file(warm_cache, tiny_config, calls):
    es = entries(warm_cache[0], tiny_config)
    rt = load_plan(tiny_config, warm_cache[0])
    assert rt.stats()["loads"] == N_TINY
    assert calls["loader"] == 0
    assert calls["runner"] == [hashlib.sha256(so_member(e.data)).hexdigest() for e in es]
    assert [n for n in os.listdir(package_mod.load_dir()) if n.endswith((".so", ".pt2"))] == []


@pytest.mark.compile
def test_the_direct_runner_computes_what_the_loader_does(warm_cache, tiny_config, monkeypatch):
    e = entries(warm_cache[0], tiny_config)[0]
    direct = package_mod.load_package(e.data, "cpu", e.where, e.key)
    extra = rewritten(e.data, lambda n, d: {n: d, n + ".unknown": b"x"} if n.endswith(".so") else d)
    via_loader = package_mod.load_package(extra, "cpu", e.where, e.key)  # an unknown file: loader
    assert type(direct).__name__ == "AOTIModelContainerRunnerCpu"
    assert type(via_loader).__name__ == "AOTIModelPackageLoader"
    v = Bucketer(tiny_config).variants[0]
    c, g = tiny_config, torch.Generator().manual_seed(0)
    q = torch.randn(v.query_len, c.num_heads, c.head_dim, generator=g)
    kv = [torch.randn(8, c.block_size, c.num_kv_heads, c.head_dim, generator=g) for _ in "kv"]
    bt = torch.arange(v.num_blocks, dtype=torch.int32) % 8
    lens = torch.tensor([v.num_blocks * c.block_size, v.query_len], dtype=torch.int32)
    args = [q, *kv, bt, lens[0:1], lens[1:2]]
    assert torch.equal(direct.run(args)[0], via_loader.run(args)[0])


@pytest.mark.compile
def test_packages_the_direct_load_does_not_handle_go_to_the_loader(warm_cache, tiny_config, calls):
    """Weights beside the library, or metadata naming another device: the loader
    decides (it loads the first; a CPU build of torch refuses a CUDA package)."""
    e = entries(warm_cache[0], tiny_config)[0]

    def cuda(name, data):
        if name.endswith("_metadata.json"):
            return json.dumps({**json.loads(data), "AOTI_DEVICE_KEY": "cuda"}).encode()
        return data

    weights = rewritten(
        e.data, lambda n, d: {n: d, n[:-3] + "_weights.bin": b""} if n.endswith(".so") else d
    )
    package_mod.load_package(weights, "cpu", e.where, e.key)
    assert calls == {"runner": [], "loader": 1}
    if not torch.cuda.is_available():
        with pytest.raises(CorruptEntryError, match="loader rejected it"):
            package_mod.load_package(rewritten(e.data, cuda), "cpu", e.where, e.key)
        assert calls == {"runner": [], "loader": 2}


@pytest.mark.compile
def test_a_tampered_library_is_never_loaded(cache_copy, tiny_config, calls):
    """One flipped byte in the second entry's ``.so`` (its stored sha256 left
    as it was): engine start refuses the plan; the libraries loaded before it
    are the verified ones, and the tampered bytes are never given to the runner."""
    tier = DiskTier(cache_copy)
    keys = [build_key(tiny_config, v).hexdigest for v in Bucketer(tiny_config).variants]
    good = [tier.get(k).data for k in keys]
    path = tier.artifact_path(keys[1])
    tier.close()
    data, so = bytearray(path.read_bytes()), so_member(good[1])
    at = bytes(data).find(so)
    data[at + 4096] ^= 0xFF
    path.write_bytes(bytes(data))
    tampered = hashlib.sha256(data[at : at + len(so)]).hexdigest()
    with pytest.raises(CorruptEntryError, match="sha256"):
        load_plan(tiny_config, cache_copy)
    assert calls["runner"] == [hashlib.sha256(so_member(good[0])).hexdigest()]
    assert tampered not in calls["runner"] and calls["loader"] == 0


def fake_package(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in members:
            z.writestr(name, data)
    return out.getvalue()


MODEL = "model/data/aotinductor/model/"
META = (MODEL + "w_metadata.json", json.dumps({"AOTI_DEVICE_KEY": "cpu"}).encode())


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_ambiguous_packages_go_to_the_loader():
    """A ``.so`` name used twice, or a second top folder holding another ``.so``
    of the same name: the direct load would take one of them and the loader
    another (or refuse), so the loader decides."""
    one = fake_package([META, (MODEL + "w.so", b"first")])
    assert package_mod._cpu_library(one, "", "") == b"first"
    twice = fake_package([META, (MODEL + "w.so", b"first"), (MODEL + "w.so", b"second")])
    assert package_mod._cpu_library(twice, "", "") is None
    other_top = [META, (MODEL + "w.so", b"first"), ("zzz/" + MODEL[6:] + "w.so", b"second")]
    assert package_mod._cpu_library(fake_package(other_top), "", "") is None


def test_a_package_whose_graph_calls_custom_ops_goes_to_the_loader():
    """A graph that calls a custom op (``torch.library.custom_op``) runs it through
    AOTInductor's proxy executor, which the loader sets up from the package's
    ``<name>.json``: the ``.so`` alone would fail at the first call."""
    plain = fake_package([META, (MODEL + "w.so", b"lib"), (MODEL + "w.cpp", b"")])
    assert package_mod._cpu_library(plain, "", "") == b"lib"
    extern = fake_package([META, (MODEL + "w.so", b"lib"), (MODEL + "w.json", b"{}")])
    assert package_mod._cpu_library(extern, "", "") is None
