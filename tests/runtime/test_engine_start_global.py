"""Engine start runs no program: over a local cache that warmup wrote, over
copied entries alone, over a bundle alone and over a remote tier alone (the
``cxx`` key component read from warmup's record or from the entries' records).

Counted twice, by what actually ran: a ``PATH`` folder of recording wrappers
(every program a start might run: the C++ compiler and its parts, ``nvcc``,
``uname``, ``ldconfig``, ...; ``CXX`` names the wrapped ``g++``), each
appending its name to a log and then running the real program; and, in the
engine's process, a CPython audit hook on every process-creating event
(``subprocess.Popen``, ``os.exec``, ``os.posix_spawn``, ``os.fork``, ...),
which also sees a program started by its absolute path. A positive control in
the same process after the start (warmup's compiler probe and one ``uname``)
must show up in both, so neither counter is a constant.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from kernel_cache.plan.keys import cxx_compiler_id
from kernel_cache.store.imports_memo import MEMO_FILE

from ..conftest import N_TINY, ROOT

#: Programs a start could run (a compiler probe, a CPU or GPU query, a
#: library search), wrapped where this machine has them.
WRAPPED = (
    "c++", "g++", "gcc", "cc", "cpp", "clang", "clang++", "ld", "ld.bfd", "ld.gold", "as",
    "collect2", "nvcc", "ptxas", "nvidia-smi", "which", "uname", "ldconfig", "lscpu", "getconf",
    "sh", "bash", "cat", "ls", "find",
)  # fmt: skip

#: The engine: an audit hook records every process-creating event, then the
#: tiny plan loads and runs once; a marker line, then the positive control.
ENGINE = r"""
import json, os, sys
SPAWNS = []
EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
          "os.fork", "os.forkpty", "pty.spawn")
def _audit(event, args):
    if event in EVENTS:
        SPAWNS.append(f"{event} {args[0] if args else ''}"[:200])
sys.addaudithook(_audit)
import torch
from kernel_cache import load_plan, make_config
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
rt = load_plan(cfg, sys.argv[2])
kc = torch.randn(9, 16, 2, 8)
out = rt.decode(torch.randn(3, 4, 8), kc, kc, torch.zeros(3, 2, dtype=torch.int32), [5, 17, 32])
doc = {"start": list(SPAWNS), "stats": rt.stats(), "out_shape": list(out.shape)}
with open(sys.argv[3], "a") as f:
    f.write("-- control --\n")
SPAWNS.clear()
from kernel_cache.plan.keys import cxx_compiler_id
import subprocess
doc["cxx"] = cxx_compiler_id()
subprocess.run(["uname", "-m"], check=True, capture_output=True)
doc["control"] = list(SPAWNS)
print(json.dumps(doc))
"""


def _wrappers(folder, log) -> dict[str, str]:
    """A recording wrapper in ``folder`` for each of :data:`WRAPPED` found on
    ``PATH``; returns ``{name: real path}``."""
    folder.mkdir()
    found = {}
    for name in WRAPPED:
        real = shutil.which(name)
        if real is None:
            continue
        found[name] = real
        w = folder / name
        w.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexec "{real}" "$@"\n')
        w.chmod(0o755)
    return found


def _start(cache, model, tmp_path, **extra_env) -> tuple[dict, list[str], list[str]]:
    """Engine start over ``cache`` (and ``extra_env``) with every program
    recorded: ``(doc, log lines of the start, log lines of the control)``."""
    log = tmp_path / "exec.log"
    log.touch()
    wrapped = _wrappers(tmp_path / "bin", log)
    assert "g++" in wrapped and "uname" in wrapped, wrapped
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_CACHE_")}
    env.update(
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        CXX=str(tmp_path / "bin" / "g++"),
        KERNEL_CACHE_DIR=str(cache),
        TMPDIR=str(tmp_path),
        **extra_env,
    )
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), str(cache), str(log)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    start, _, control = log.read_text().partition("-- control --\n")
    return doc, start.splitlines(), control.splitlines()


@pytest.mark.compile
def test_engine_start_runs_no_program(cache_copy, tiny_model, tmp_path):
    doc, start, control = _start(cache_copy, tiny_model, tmp_path)
    assert doc["stats"]["loads"] == N_TINY and doc["out_shape"] == [3, 4, 8]
    assert start == [] and doc["start"] == []  # no program, by PATH or by absolute path
    # the control: warmup's compiler probe runs the wrapped g++ (four times), uname once
    assert sum(line.startswith("g++ ") for line in control) >= 4, control
    assert "uname -m" in control
    assert sum(e.startswith("subprocess.Popen") for e in doc["control"]) >= 5, doc["control"]
    # the memo named the compiler warmup used: an exact hit, nothing accepted
    assert doc["stats"]["build_only_accepted"] == {}


@pytest.mark.compile
def test_engine_start_without_warmup_s_record_reads_the_entries_records(
    cache_copy, tiny_model, tmp_path
):
    """A local cache without warmup's record of its compiler (copied entries
    only): the ``cxx`` key component is read from the entries' own records, so
    no program runs and the keys are the builder's exact keys."""
    (cache_copy / MEMO_FILE).unlink()
    doc, start, control = _start(cache_copy, tiny_model, tmp_path)
    assert start == [] and doc["start"] == []
    assert "uname -m" in control and doc["control"]
    assert doc["stats"]["loads"] == N_TINY
    assert doc["stats"]["build_only_accepted"] == {}  # exact keys: nothing accepted


@pytest.mark.compile
def test_a_remote_only_engine_start_runs_no_program(cache_copy, tiny_model, tmp_path):
    """An engine whose entries are only in a remote tier (a real Redis, signed
    entries, an empty local cache): the ``cxx`` key component comes from the
    signed record indexed under the first variant's runtime digest, so no
    program runs, and every hit is exact."""
    from ..kc_helpers import publish_to_redis
    from ..redis_server import RedisServer, redis_server_binary
    from ..signing_keys import make_keypair

    if redis_server_binary() is None:
        pytest.skip("no redis-server binary (Debian: apt-get install -y redis-server)")
    keys = make_keypair(tmp_path / "keys")
    server = RedisServer()
    try:
        publish_to_redis(cache_copy, server.url, keys.signer)  # the builder publishes, signed
        doc, start, control = _start(
            tmp_path / "empty-cache", tiny_model, tmp_path,
            KERNEL_CACHE_REDIS_URL=server.url, **keys.engine_env,
        )  # fmt: skip
    finally:
        server.stop()
    assert doc["stats"]["loads"] == N_TINY and doc["out_shape"] == [3, 4, 8]
    assert start == [] and doc["start"] == []  # no program, by PATH or by absolute path
    assert sum(line.startswith("g++ ") for line in control) >= 4, control  # the control
    assert doc["stats"]["build_only_accepted"] == {}  # the builders' exact keys
    assert doc["stats"]["sources"] == {server.url: N_TINY}, doc["stats"]


@pytest.mark.compile
def test_a_bundle_only_engine_start_runs_no_program(warm_cache, tiny_model, tmp_path):
    """An engine whose only entries are a bundle's (an empty local cache, as in a
    container built with ``kernel-cache export``): the keys take the ``cxx`` the
    bundle's manifest records, so no compiler is asked, and every hit is exact."""
    from ..conftest import run_cli, tiny_args
    from ..signing_keys import make_keypair

    keys = make_keypair(tmp_path / "keys")  # signed by the builder, checked by the engine
    bundle = tmp_path / "bundle"
    args = [*tiny_args(tiny_model), "--cache-dir", str(warm_cache[0]), "--out", str(bundle)]
    run_cli("export", *args, env=keys.builder_env, check=True)
    empty = tmp_path / "empty-cache"
    doc, start, control = _start(
        empty, tiny_model, tmp_path, KERNEL_CACHE_BUNDLE=str(bundle), **keys.engine_env
    )
    assert doc["stats"]["loads"] == N_TINY and doc["out_shape"] == [3, 4, 8]
    assert start == [] and doc["start"] == []  # no program, by PATH or by absolute path
    assert sum(line.startswith("g++ ") for line in control) >= 4, control  # the control
    assert doc["stats"]["build_only_accepted"] == {}  # the builders' exact keys
    assert any(str(bundle) in where for where in doc["stats"]["sources"]), doc["stats"]


@pytest.mark.compile
def test_warmup_records_its_compiler_for_engine_start(warm_cache):
    memo = json.loads((warm_cache[0] / MEMO_FILE).read_text())
    assert memo["cxx"] == cxx_compiler_id() != "none"


def _plant(remote, first) -> None:
    """A hostile writer's records in the runtime index set of the plan's first
    variant (its digest ``first``): each names a ``cxx`` the engine must not
    take (too long, not printable, unsigned, a dict), is the newest, and none
    has an artifact the keys accept."""
    import hashlib

    from kernel_cache.plan.keys import key_from_components

    c = remote.client
    index = remote._name("index:runtime", first["runtime"])
    base = dict(first["components"])
    for n, cxx in enumerate(["x" * 5000, "gcc\x1b[31m 12", "gcc 99.9.9 (forged)"]):
        comps = {**base, "cxx": cxx}
        k = key_from_components(comps).hexdigest
        data = f"not a package {n}".encode()
        meta = {
            "key": k, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
            "variant": first["variant"], "components": comps, "created": 4e9,
        }  # fmt: skip
        c.hset(remote._name("entry", k), mapping={"meta": json.dumps(meta), "data": data})
        c.sadd(index, k)
    raw = json.dumps({"key": "f" * 64, "sha256": "0" * 64, "size": 1, "created": 4e9,
                      "components": {**base, "cxx": {"a": "dict"}}})  # fmt: skip
    c.hset(remote._name("entry", "f" * 64), mapping={"meta": raw, "data": b"x"})
    c.sadd(index, "f" * 64, *[f"{i:064x}" for i in range(40)])


@pytest.mark.compile
def test_a_remote_engine_start_takes_no_planted_cxx(cache_copy, tiny_model, tmp_path):
    """A shared Redis whose first variant's index also holds a hostile
    writer's newest records (a 5,000-character, a non-printable and an
    unsigned ``cxx``, a ``cxx`` that is a dict, 40 members with no entry):
    engine start takes the signed record's ``cxx`` (every hit exact), loads
    only signed entries, runs no program, logs no traceback, and sends a
    bounded number of commands (``INFO commandstats``)."""
    from kernel_cache.plan.keys import runtime_digest
    from kernel_cache.store.redis import INDEX_MAX, RedisTier

    from ..kc_helpers import publish_to_redis
    from ..redis_server import RedisServer, redis_server_binary
    from ..signing_keys import make_keypair

    if redis_server_binary() is None:
        pytest.skip("no redis-server binary (Debian: apt-get install -y redis-server)")
    keys = make_keypair(tmp_path / "keys")
    server = RedisServer()
    try:
        metas = publish_to_redis(cache_copy, server.url, keys.signer)
        remote = RedisTier(server.url, fail_open=False)
        # every variant's index gets the planted records: the first one is among them
        for m in metas:
            comps = m["components"]
            _plant(remote, {"runtime": runtime_digest(comps), "components": comps,
                            "variant": m["variant"]})  # fmt: skip
        remote.client.config_resetstat()
        doc, start, _ = _start(
            tmp_path / "empty-cache", tiny_model, tmp_path,
            KERNEL_CACHE_REDIS_URL=server.url, **keys.engine_env,
        )  # fmt: skip
        calls = {k.removeprefix("cmdstat_"): v["calls"]
                 for k, v in remote.client.info("commandstats").items()}  # fmt: skip
        remote.close()
    finally:
        server.stop()
    assert doc["stats"]["loads"] == N_TINY and doc["out_shape"] == [3, 4, 8]
    assert start == [] and doc["start"] == []
    assert doc["stats"]["build_only_accepted"] == {}, doc["stats"]  # the signed record's cxx
    assert doc["stats"]["sources"] == {server.url: N_TINY}, doc["stats"]
    # the first variant's index (one read, at most 64 records), then each entry
    # the first variant's index (one read, then at most INDEX_MAX records, a
    # transaction of 5 commands each), then each entry: no other index is read
    assert calls.get("srandmember") == 1, calls
    assert sum(n for k, n in calls.items() if k != "eval") <= 3 + 6 * (INDEX_MAX + N_TINY), calls


def test_an_empty_store_says_its_keys_name_no_recorded_compiler(tiny_config, tmp_path, caplog):
    """Nothing recorded anywhere: the missing variants are reported as before,
    and a warning says the keys were built under ``cxx='not probed'`` and why."""
    import logging

    from kernel_cache import MissingVariantsError, load_plan
    from kernel_cache.plan.keys import CXX_NOT_PROBED
    from kernel_cache.store.disk_tier import DiskTier

    tier = DiskTier(tmp_path / "empty")
    with caplog.at_level(logging.WARNING, "kernel_cache"):
        with pytest.raises(MissingVariantsError, match="kernel-cache warmup"):
            load_plan(tiny_config, tiers=[tier])
    tier.close()
    (line,) = [r.getMessage() for r in caplog.records if "C++ compiler" in r.getMessage()]
    assert repr(CXX_NOT_PROBED) in line and str(tmp_path / "empty") in line
