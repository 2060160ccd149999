"""Helpers for the bundle, key-hygiene and housekeeping tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kernel_cache.plan.keys import key_from_components
from kernel_cache.store.disk_tier import DiskTier

from .conftest import ROOT

#: Engine start in a fresh process: load the tiny plan (cache dir argv[2] or
#: "-" for the default lookup: $KERNEL_CACHE_BUNDLE, then $KERNEL_CACHE_DIR;
#: the engine's kernels argv[3], JSON), run one decode call, print a JSON line.
ENGINE_START = r"""
import json, logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import kernel_cache
from kernel_cache import load_plan, make_config
from kernel_cache.errors import MissingVariantsError
from kernel_cache.plan.keys import cxx_compiler_id
from warmup.check.verify import compile_stack_loaded
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,), kernels=json.loads(sys.argv[3]))
doc = {"kernel_cache": kernel_cache.__file__, "cxx": cxx_compiler_id()}
try:
    rt = load_plan(cfg, None if sys.argv[2] == "-" else sys.argv[2])
except MissingVariantsError as e:
    doc["missing"] = [str(v) for v in e.missing]
else:
    kc = torch.randn(9, 16, 2, 8)
    out = rt.decode(torch.randn(3, 4, 8), kc, kc, torch.zeros(3, 2, dtype=torch.int32),
                    [5, 17, 32])
    doc.update(stats=rt.stats(), out_shape=list(out.shape))
doc["compile_stack"] = compile_stack_loaded()
print(json.dumps(doc))
"""


def engine_start(model, cache="-", *, env=None, cwd=ROOT, user_kwargs=None, kernels=None) -> dict:
    """Run :data:`ENGINE_START` in a fresh process (``kernels``: the engine's, as
    ``make_config`` takes them; None for the built-in ones); its JSON line (plus
    ``stderr``)."""
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_START, str(model), str(cache), json.dumps(kernels or {})],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
        **(user_kwargs or {}),
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["stderr"] = proc.stderr
    return doc


def rekey(cache: Path, overrides: dict[str, str]) -> list[str]:
    """Rewrite every entry of ``cache`` as if it had been warmed where the key
    components ``overrides`` had other values (a cache warmed under another
    torch, compiler, ...): same bytes, recorded components and key changed.
    Returns the new keys."""
    tier = DiskTier(cache)
    new = []
    try:
        for meta in list(tier.iter_meta()):
            entry = tier.get(meta["key"])
            comps = {**meta["components"], **overrides}
            key = key_from_components(comps).hexdigest
            tier.put(key, entry.data, {**meta, "key": key, "components": comps})
            tier.delete(meta["key"])
            new.append(key)
    finally:
        tier.close()
    return new


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its mode, size, mtime and (files) bytes:
    equal snapshots mean nothing was written, created or removed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else b""
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, data)
    return out


def entries_of(cache: Path) -> dict[str, bytes]:
    """``{key: package bytes}`` of every entry in the disk cache ``cache`` (read
    only; its trust checks off: another user's cache too)."""
    tier = DiskTier(cache, read_only=True, allow_shared=True)
    try:
        return {m["key"]: tier.get(m["key"]).data for m in tier.iter_meta()}
    finally:
        tier.close()


def other_user_kwargs() -> tuple[dict, dict]:
    """How to run a child as another user: ``(subprocess kwargs, env additions)``.

    As root, where uid 65534 (nobody) can run this interpreter and read the
    checkout, the child really runs as nobody; otherwise (not root, or the
    interpreter lies under a private /root) the user name the process sees
    (``USER``/``LOGNAME``, what ``getpass.getuser()`` reads) is changed.
    """
    env = {"USER": "kc-other-user", "LOGNAME": "kc-other-user"}
    if os.geteuid() == 0:
        kwargs = {"user": 65534, "group": 65534, "extra_groups": []}
        try:
            ok = (
                subprocess.run(
                    [sys.executable, "-c", "import kernel_cache"],
                    cwd=ROOT,
                    capture_output=True,
                    timeout=120,
                    **kwargs,
                ).returncode
                == 0
            )
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return kwargs, env
    return {}, env


@contextlib.contextmanager
def world_readable_dir():
    """A fresh directory under the system temp dir, mode 0755 (pytest's tmp_path
    is private to its user), removed afterwards whatever modes were set inside."""
    root = Path(tempfile.mkdtemp(prefix="kc-test-"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        for dirpath, _, _ in os.walk(root):
            with contextlib.suppress(OSError):
                os.chmod(dirpath, 0o755)
        shutil.rmtree(root, ignore_errors=True)


def wait_for_pause(marker: Path, proc: subprocess.Popen, point: str, timeout=900) -> None:
    """Wait until ``proc`` (started with ``KERNEL_CACHE_TEST_PAUSE_AT``) has written
    ``point`` to ``marker``; fail if it exits first or ``timeout`` seconds pass."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if marker.exists() and point in marker.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"warmup exited {proc.returncode} first: {proc.communicate()}")
        time.sleep(0.1)
    raise AssertionError(f"warmup did not reach {point} in {timeout} s")


def check_lease_lifecycle(a, b, wake_s: float = 1.0) -> str:
    """The build lease of two tiers ``a`` and ``b`` over one store: exclusive,
    renewed while held, taken over once its holder stalls and it expires, a
    stalled holder's renewal refused (checked ``wake_s`` after it wakes), free
    at once when released, and ``published`` once the entry is there. Returns
    the key it used."""
    import time

    from kernel_cache.store.redis import ACQUIRED, BUSY, PUBLISHED

    key = "ab" * 32
    first = a.build_lock(key, ttl_s=1.5)
    assert first.acquire(wait=False) == ACQUIRED
    assert b.build_lock(key, ttl_s=1.5).acquire(wait=False) == BUSY
    time.sleep(2.5)  # renewed: still held
    assert b.build_lock(key, ttl_s=1.5).acquire(wait=False) == BUSY
    first._stop.set()  # the holder stalls (stops renewing) ...
    first._thread.join()
    time.sleep(2.0)  # ... and its lease expires
    second = b.build_lock(key, ttl_s=30)
    assert second.acquire(wait=False) == ACQUIRED and second.holder() == second.token
    first._start_renewal()  # the stalled holder wakes up: its renewal is refused
    time.sleep(wake_s)
    assert first.lost and second.holder() == second.token
    second.release()
    third = a.build_lock(key)
    assert third.acquire(wait=False) == ACQUIRED  # a released lease is free at once
    a.put(key, b"z" * 100, {"key": key, "sha256": "0" * 64, "size": 100})
    assert b.build_lock(key).acquire(wait=True) == PUBLISHED
    third.release()
    return key


def knowing_cxx(cache):
    """``cache`` made (0700) with warmup's record of this machine's compiler, as
    a warmup leaves it: engine start then asks for the builders' exact keys
    (it runs no compiler, and an object planted under an exact key without an
    index object would otherwise never be asked for)."""
    cache.mkdir(mode=0o700, parents=True)
    from kernel_cache.plan.keys import environment
    from kernel_cache.store import imports_memo

    assert imports_memo.save(cache, cxx=environment("cpu")["cxx"])
    return cache


def publish_to_redis(cache: Path, url: str, signer=None) -> list[dict]:
    """Copy every entry of the local cache ``cache`` into the Redis at ``url``
    (signed when ``signer``), as a builder publishes; their records."""
    from kernel_cache.store.redis import RedisTier
    from kernel_cache.trust.signing import sign_meta

    local, remote = DiskTier(cache), RedisTier(url, fail_open=False)
    metas = []
    try:
        for meta in local.iter_meta():
            e = local.get(meta["key"])
            remote.put(e.key, e.data, sign_meta(e.meta, e.data, signer))
            metas.append(e.meta)
    finally:
        local.close()
        remote.close()
    return metas


def counting_cxx(tmp_path: Path, log: Path) -> Path:
    """A ``CXX`` that logs each link of a package's ``wrapper.so`` (one per
    compile: ``wrapper-pid path``) and runs the system compiler. Its
    ``--version``/``-v`` answers are the real compiler's, so the ``cxx`` key
    component is unchanged."""
    real = shutil.which("g++")
    assert real, "these tests need g++"
    w = tmp_path / "g++-counting"
    w.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in *.wrapper.so) '
        f'echo "$$ $a" >> {log}; break;; esac; done\n'
        f'exec {real} "$@"\n'
    )
    w.chmod(0o755)
    return w


def lines_of(path: Path) -> list[str]:
    """The lines of ``path``; none where it does not exist."""
    return path.read_text().splitlines() if path.exists() else []
