"""Reproducible artifacts: two builders of one key write identical bytes.

Two cold warmups of the tiny plan (one variant of each kernel) run as separate
processes with every builder-specific path different (HOME, cwd, TMPDIR,
TORCHINDUCTOR_CACHE_DIR, the cache directory, the C++ compiler's path and, as
root, the user) and each its own PYTHONHASHSEED: each key's package bytes must
be identical, and no builder path may appear in any package member
(decompressed).
Then the two builders alternate warmups against one Redis: only the first
uploads; Redis's own command counters (``INFO commandstats``) show no write
after it. Finally ``verify --rebuild`` rebuilds a stored entry and finds it
identical; its comparison names the member that differs in a tampered one.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kernel_cache.plan.keys import cxx_executable
from kernel_cache.store.disk_tier import DiskTier

from ..conftest import HOOKS_DIR, ROOT, tiny_args
from ..kc_helpers import entries_of, other_user_kwargs, world_readable_dir
from ..redis_server import RedisServer, redis_server_binary
from ..signing_keys import make_keypair

pytestmark = pytest.mark.compile

#: Both kernels of the tiny plan, one variant each (its query-length-1 prefill
#: variant is left out: a third compile per builder adds no kernel).
SUBSET = ("--query-buckets", "32")
N = 2


def warmup_as(builder: dict, *extra: str) -> dict:
    """``kernel-cache warmup`` of the tiny plan as ``builder`` (its env, cwd,
    user); the JSON report."""
    proc = subprocess.run(
        [sys.executable, "-m", "warmup.cli.main", "warmup", *tiny_args(builder["model"])]
        + [*SUBSET, "--cache-dir", str(builder["cache"]), "--jobs", "1", "--json", "-q", *extra],
        capture_output=True,
        text=True,
        env=builder["env"],
        cwd=builder["cwd"],
        timeout=1800,
        **builder["user"],
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def make_builder(
    root: Path, name: str, user_kwargs: dict, user_env: dict, model: Path, cxx_elsewhere=False
) -> dict:
    """``cxx_elsewhere``: ``CXX`` is a script at a path of this builder's that
    runs the compiler this process would (the same compiler, so the same keys)."""
    base = root / name
    dirs = {d: base / d for d in ("home", "cwd", "tmp", "inductor", "cache-parent", "bin")}
    for d in dirs.values():
        d.mkdir(parents=True)
        if user_kwargs:
            os.chown(d, user_kwargs["user"], user_kwargs["group"])
    if cxx_elsewhere:
        real = cxx_executable()
        assert real, "these tests need a C++ compiler"
        cxx = dirs["bin"] / Path(real).name  # the same name: Inductor picks its flags by it
        cxx.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
        cxx.chmod(0o755)
        user_env = {**user_env, "CXX": str(cxx)}
    env = {
        **os.environ,
        **user_env,
        "HOME": str(dirs["home"]),
        "TMPDIR": str(dirs["tmp"]),
        "TORCHINDUCTOR_CACHE_DIR": str(dirs["inductor"]),
        "KERNEL_CACHE_TEST_COMPILE_LOG": str(dirs["tmp"] / "compiles.log"),
        # the checkout, whatever the cwd, and the suite's hooks (the compile log)
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HOOKS_DIR)]),
    }
    model_copy = dirs["cwd"] / "config.json"  # each builder its own model path too
    model_copy.write_bytes(model.read_bytes())
    # Each its own precompiled headers (under its cache directory), as on two machines.
    for k in (
        "KERNEL_CACHE_DIR",
        "KERNEL_CACHE_REDIS_URL",
        "KERNEL_CACHE_SIGNING_KEY",
        "KERNEL_CACHE_PCH_DIR",
    ):
        env.pop(k, None)
    return {
        "model": model_copy,
        "cache": dirs["cache-parent"] / "cache",
        "env": env,
        "cwd": dirs["cwd"],
        "user": user_kwargs,
        "paths": [str(p) for p in dirs.values()],
        "log": dirs["tmp"] / "compiles.log",
    }


def _variants(cache: Path) -> list[str]:
    tier = DiskTier(cache, read_only=True, allow_shared=True)
    try:
        return [m["variant"] for m in tier.iter_meta()]
    finally:
        tier.close()


@pytest.fixture(scope="module")
def builders(tiny_model):
    """Two builders (A: this user; B: uid 65534 as root, else another user
    name, and its ``CXX`` at its own path) of the tiny plan, each warmed cold
    once."""
    user_kwargs, user_env = other_user_kwargs()
    with world_readable_dir() as root:
        # Each its own string-hash seed too: the recipe pins the compile workers'.
        a = make_builder(root, "builder-a", {}, {"PYTHONHASHSEED": "1"}, tiny_model)
        b = make_builder(
            root,
            "builder-b",
            user_kwargs,
            {**user_env, "PYTHONHASHSEED": "2"},
            tiny_model,
            cxx_elsewhere=True,
        )
        for x in (a, b):
            x["report"] = warmup_as(x)
        yield a, b


def test_two_cold_builders_write_identical_bytes_without_builder_paths(builders):
    a, b = builders
    for x in (a, b):
        assert x["report"]["compiled"] == N
        assert len(x["log"].read_text().splitlines()) == N  # the compiler really ran
    ea, eb = entries_of(a["cache"]), entries_of(b["cache"])
    assert sorted(ea) == sorted(eb) and len(ea) == N
    assert sorted(_variants(a["cache"])) == ["batched_decode:1:2:4", "paged_attention:32:2:1"]
    assert_same_bytes_and_no_builder_path(a, b, ea, eb)


def assert_same_bytes_and_no_builder_path(a: dict, b: dict, ea: dict, eb: dict) -> None:
    """Builders ``a`` and ``b`` stored the same bytes under each key (``ea``,
    ``eb``: their entries), and no member of a package holds a path of either
    builder; on failure, every differing member and every path found, with
    the bytes around it."""
    builder_paths = {*a["paths"], *b["paths"], sys.prefix, str(ROOT), os.path.realpath(ROOT)}
    builder_paths |= {str(Path(p).resolve()) for p in builder_paths}
    found = []
    for entries in (ea, eb):
        for key, data in entries.items():
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for name in z.namelist():
                    body = z.read(name)
                    for p in [*builder_paths, "torchinductor_"]:
                        at = body.find(p.encode())
                        if at >= 0:
                            ctx = body[max(0, at - 60) : at + len(p) + 60]
                            found.append(f"{key[:12]} {name}: {p!r} in {ctx!r}")
    differ = []
    for k in ea:
        if ea[k] != eb.get(k):
            with zipfile.ZipFile(io.BytesIO(ea[k])) as za, zipfile.ZipFile(io.BytesIO(eb[k])) as zb:
                names = sorted(set(za.namelist()) | set(zb.namelist()))
                bad = [
                    n
                    for n in names
                    if n not in za.namelist() or n not in zb.namelist() or za.read(n) != zb.read(n)
                ]
            differ.append(f"{k[:12]}: {bad}")
    assert not found and not differ, "\n".join(
        ["members that differ between the builders:", *differ, "builder paths found:", *found]
    )


def _with_signing_key(builder: dict, keys) -> dict:
    """``builder`` holding a copy of the fleet's private key (its own file, its
    user's, mode 600): what a builder that publishes to a shared tier needs."""
    home = Path(builder["env"]["HOME"])
    key = home / "signing.key"
    shutil.copy(keys.private, key)
    if builder["user"]:
        os.chown(key, builder["user"]["user"], builder["user"]["group"])
    os.chmod(key, 0o600)
    return {**builder, "env": {**builder["env"], "KERNEL_CACHE_SIGNING_KEY_FILE": str(key)}}


@pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server on PATH")
def test_alternating_builders_upload_nothing_after_the_first(builders, tmp_path):
    a, b = builders
    keys = make_keypair(tmp_path / "keys")  # the fleet's builders share one private key
    server = RedisServer()
    try:
        url = server.url

        def writes() -> dict[str, int]:
            """Redis's own count of the write commands it ran, by command."""
            import redis

            stats = redis.Redis.from_url(url).info("commandstats")
            names = ("hset", "hmset", "set", "del", "unlink", "expire", "pexpire")
            return {n: stats.get(f"cmdstat_{n}", {}).get("calls", 0) for n in names}

        signed = {x["cwd"]: _with_signing_key(x, keys) for x in (a, b)}
        hsets, other, uploaded = [], [], []
        for x in (a, b, a, b):
            before = writes()
            r = warmup_as(signed[x["cwd"]], "--redis-url", url)
            after = writes()
            hsets.append(after["hset"] - before["hset"])
            other.append(sum(after.values()) - sum(before.values()) - hsets[-1])
            uploaded.append(r["uploaded"])
            assert r["compiled"] == 0 and r["cached"] == N
        assert hsets == [N, 0, 0, 0], hsets  # one HSET per entry, by the first builder only
        assert other[1:] == [0, 0, 0], other  # and no other write after it
        assert uploaded == [N, 0, 0, 0]
    finally:
        server.stop()


def test_verify_rebuild_finds_a_stored_entry_identical(builders):
    """``verify --rebuild`` compiles the variant again (a real compile in a
    worker process) and compares with the entry in builder A's cache."""
    a, _ = builders
    tier = DiskTier(a["cache"], read_only=True)
    try:
        meta = next(m for m in tier.iter_meta() if m["variant"] == "batched_decode:1:2:4")
    finally:
        tier.close()
    log = a["log"].parent / "rebuild.log"
    args = [sys.executable, "-m", "warmup.cli.main", "verify", *tiny_args(a["model"]), *SUBSET]
    args += ["--cache-dir", str(a["cache"]), "--rebuild", meta["variant"]]
    env = {**os.environ, "KERNEL_CACHE_TEST_COMPILE_LOG": str(log)}
    proc = subprocess.run(
        [*args, "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr
    compiles = [line.split()[-1] for line in log.read_text().splitlines()]  # "PID VARIANT"
    assert compiles == [meta["variant"]]  # it really compiled, once
    (r,) = json.loads(proc.stdout)
    assert r["key"] == meta["key"] and r["where"] == str(a["cache"])
    assert r["identical"] and r["differs"] == [] and r["stored_sha256"] == meta["sha256"]
    assert r["rebuilt_sha256"] == meta["sha256"]


def test_compare_packages_names_the_member_that_differs(builders):
    """The comparison ``verify --rebuild`` reports, on a real package and a
    copy with one comment byte of the kernel source changed."""
    from warmup.check.rebuild import compare_packages

    a, _ = builders
    data = next(iter(entries_of(a["cache"]).values()))
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(buf, "w") as dst:
        for info in src.infolist():
            body = src.read(info)
            if info.filename.endswith(".kernel.cpp"):
                body = body.replace(b"// Compile cmd", b"// Compile CMD", 1)
            dst.writestr(info, body)
    got = compare_packages(data, buf.getvalue())
    assert not got["identical"] and got["only_stored"] == got["only_rebuilt"] == []
    assert [m["member"] for m in got["differs"]] == [
        "model/data/aotinductor/model/kernel_cache.kernel.cpp"
    ]
    assert compare_packages(data, data) == {
        "identical": True,
        "differs": [],
        "only_stored": [],
        "only_rebuilt": [],
    }


#: Two ``jobs=0`` warmups in one process, each into its own cache (an engine
#: that warms itself, then warms another plan's cache); prints their reports.
_TWICE_IN_ONE_PROCESS = """
import json, sys
from kernel_cache.config.engine import make_config
from kernel_cache.plan.buckets import KernelVariant
from warmup.builder.planner import warmup
spec = json.loads(sys.argv[1])
cfg = make_config(spec["model"], **spec["limits"])
variants = [KernelVariant.parse(spec["variant"])]
reports = [warmup(cfg, c, jobs=0, progress=False, variants=variants) for c in spec["caches"]]
print(json.dumps([{"compiled": r["compiled"], "failed": r["failed"]} for r in reports]))
"""


def test_two_in_process_warmups_write_the_workers_bytes(builders, tmp_path):
    """The second of two ``jobs=0`` warmups in one process runs (the first
    removed its scratch folder, where the process's temp folder pointed) and
    compiles its own precompiled headers: both write builder A's bytes under
    A's key, with no path of either cache in them (Inductor keeps the path of
    each header it built for the process, not per folder)."""
    from kernel_cache.config.recipe import HASH_SEED

    from ..conftest import TINY_LIMITS

    a, _ = builders
    variant = "batched_decode:1:2:4"
    caches = [tmp_path / "first" / "cache", tmp_path / "second" / "cache"]
    (tmp_path / "tmp").mkdir()
    log = tmp_path / "compiles.log"
    spec = {"model": str(a["model"]), "limits": TINY_LIMITS, "variant": variant}
    spec["caches"] = [str(c) for c in caches]
    env = {
        **os.environ,
        "PYTHONHASHSEED": str(HASH_SEED),
        "TMPDIR": str(tmp_path / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "KERNEL_CACHE_TEST_COMPILE_LOG": str(log),
    }
    for k in ("KERNEL_CACHE_DIR", "KERNEL_CACHE_REDIS_URL", "KERNEL_CACHE_PCH_DIR"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-c", _TWICE_IN_ONE_PROCESS, json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [{"compiled": 1, "failed": []}] * 2
    assert [line.split()[-1] for line in log.read_text().splitlines()] == [variant] * 2
    for c in caches:
        assert sorted(p.name for p in (c / "pch").glob("*.h")), f"no headers built in {c}"
    first, second = entries_of(caches[0]), entries_of(caches[1])
    (key,) = first
    dirs = {"paths": [str(tmp_path)]}
    assert_same_bytes_and_no_builder_path(dirs, dirs, first, second)
    workers = entries_of(a["cache"])
    assert key in workers and first[key] == workers[key]  # the worker's key and bytes
