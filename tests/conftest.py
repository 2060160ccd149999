"""Shared fixtures: a tiny geometry and the run's warm caches of it.

Compiling is the slow part (about 30 s of CPU a variant on a 2-core CPU), so
the tiny plan (3 variants: one KV bucket of 2 blocks, query buckets 1 and 32, a
decode batch of 4) is warmed once per run, and tests that change a cache work
on a copy of it. A second warm build of the same plan, with the plain kernels
(:data:`PLAIN_KERNELS`), serves the compiling tests that remove or damage
entries of a copy and compile them again. Each build starts in the background
as soon as a collected test needs it, and the files holding those tests run
after the others, so the compiles overlap the other tests. The warm caches
serve every pytest-xdist worker of the run: the main process makes their
folder (``$KERNEL_CACHE_TEST_WARM_DIR``, inherited by the workers) and
removes it at the end; the first worker to need a build starts it. A caller
that runs pytest several times (``.ci/run``: both tiers) can give them one
folder, ``$KERNEL_CACHE_TEST_SHARED_WARM_DIR``, so each build is compiled
once for all of them.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from filelock import FileLock

from kernel_cache.config.engine import make_config

from .hooks import kc_testhooks

ROOT = Path(__file__).resolve().parents[1]

#: The suite's fault injection (tests/hooks/kc_testhooks.py): installed here for
#: the test process, and by tests/hooks/sitecustomize.py in every Python
#: process a test starts with one of its KERNEL_CACHE_TEST_* variables set.
HOOKS_DIR = Path(__file__).resolve().parent / "hooks"
if str(HOOKS_DIR) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HOOKS_DIR), os.environ.get("PYTHONPATH")) if p
    )
TRACE = ROOT.parent / "shared" / "data" / "azure-llm-trace-2023" / "conv.csv"

TINY_GEOMETRY = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
TINY_LIMITS = {
    "max_model_len": 32,
    "block_size": 16,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "kv_buckets": (32,),
}
#: The tiny plan's variants, in plan order.
TINY_VARIANTS = ("paged_attention:1:2:1", "paged_attention:32:2:1", "batched_decode:1:2:4")
N_TINY = len(TINY_VARIANTS)


def tiny_args(model_path) -> list[str]:
    """ENGINE OPTIONS for the tiny plan (:data:`TINY_VARIANTS`)."""
    return [
        "--model",
        str(model_path),
        "--max-model-len",
        "32",
        "--block-size",
        "16",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--kv-buckets",
        "32",
    ]


#: Engine kernels for the tests whose claim holds whatever the kernels compute:
#: one compile per key across processes and tiers, leases, killed and stopped
#: warmups. They are the eager oracle's own formulation
#: (:mod:`kernel_cache.kernels.plain`) in the built-in slots: real kernels that
#: ``verify`` checks against the oracle. A cold warmup of two of them costs
#: about 0.55 of the CPU of the built-in CPU kernels, having no ``torch.cond``
#: nor ``flex_attention`` to trace (docs/testing.md, "Cheaper kernels where
#: the kernel does not matter"). Tests of the built-in kernels' code, bytes or
#: speed keep the built-in kernels; tests that remove or damage entries of a
#: warm cache and compile them again start from :func:`plain_warm_cache`.
PLAIN_KERNELS = {
    "paged_attention": "kernel_cache.kernels.plain:PagedAttention",
    "batched_decode": "kernel_cache.kernels.plain:BatchedDecode",
}
#: :data:`TINY_LIMITS` with :data:`PLAIN_KERNELS`: ``make_config`` keywords.
PLAIN_LIMITS = {**TINY_LIMITS, "kernels": PLAIN_KERNELS}


def plain_args(model_path) -> list[str]:
    """ENGINE OPTIONS for the tiny plan compiled with :data:`PLAIN_KERNELS`."""
    kernels = [x for slot, path in PLAIN_KERNELS.items() for x in ("--kernel", f"{slot}={path}")]
    return [*tiny_args(model_path), *kernels]


#: The run's shared folder: the tiny model's config.json and the warm cache.
ENV_WARM_DIR = "KERNEL_CACHE_TEST_WARM_DIR"
#: Seconds a test waits for the background warmup of the tiny plan.
WARM_TIMEOUT_S = 1200


def _shared_dir() -> Path:
    return Path(os.environ[ENV_WARM_DIR])


def _shared_model() -> Path:
    """The tiny model's ``config.json``, written once per run."""
    p = _shared_dir() / "model" / "config.json"
    with FileLock(_shared_dir() / "model.lock"):
        if not p.exists():
            p.parent.mkdir(exist_ok=True)
            p.write_text(json.dumps(TINY_GEOMETRY))
    return p


#: The run's warm builds of the tiny plan: the folder (under the shared one) each
#: writes, its ENGINE OPTIONS, and the session fixture that waits for it. The
#: built-in kernels' build is the shared folder itself.
_WARM_BUILDS = {
    "builtin": ("", tiny_args, "warm_cache"),
    "plain": ("plain", plain_args, "plain_warm_cache"),
}


def _build_dir(which: str) -> Path:
    return _shared_dir() / _WARM_BUILDS[which][0]


def _start_warm_build(which: str = "builtin") -> None:
    """Start ``kernel-cache warmup`` of the tiny plan (``which``: the built-in
    kernels or :data:`PLAIN_KERNELS`) in the background, once per run
    (whichever process asks first); it writes ``report.json``, ``stderr`` and,
    when it exits, ``rc`` in :func:`_build_dir`."""
    d = _build_dir(which)
    d.mkdir(exist_ok=True)
    with FileLock(d / "build.lock"):
        if (d / "pid").exists() or (d / "rc").exists():
            return
        engine = _WARM_BUILDS[which][1](_shared_model())
        cmd = [
            sys.executable, "-m", "warmup.cli.main", "warmup", *engine,
            "--cache-dir", str(d / "cache"), "--jobs", "2", "--json",
        ]  # fmt: skip
        script = (
            '"$@" >"$D/report.json" 2>"$D/stderr"; echo $? >"$D/rc.tmp"; mv "$D/rc.tmp" "$D/rc"'
        )
        proc = subprocess.Popen(
            ["sh", "-c", script, "sh", *cmd],
            env={**os.environ, "D": str(d)},
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # stopped as a group at the end of the run
        )
        (d / "pid.tmp").write_text(str(proc.pid))
        (d / "pid.tmp").replace(d / "pid")  # whole: another run may read it at once


_OWN_DIR = pytest.StashKey[tuple[str, bool]]()
_OWN_PCH = pytest.StashKey[bool]()
#: The compile workers' precompiled headers (warmup.builder.worker.pch_dir): one
#: folder in the run's shared folder, so they are built once a run, not once a
#: test's cache directory.
ENV_PCH_DIR = "KERNEL_CACHE_PCH_DIR"
_OWN_JOBS = pytest.StashKey[bool]()
#: One compile worker per warmup the tests start: the run's two xdist workers
#: already keep the cores busy, and a second worker process costs its imports and
#: torch's first-use setup again (about 10 s of CPU on the tiny plan). A test whose
#: claim needs several workers passes ``--jobs``.
ENV_JOBS = "KERNEL_CACHE_JOBS"


#: Set by a caller that runs pytest more than once (``.ci/run``: the fast tier,
#: then the full one): the folder the runs share (the caller makes it empty and
#: removes it), so the tiny plan is compiled once for all of them.
ENV_SHARED_WARM_DIR = "KERNEL_CACHE_TEST_SHARED_WARM_DIR"


kc_testhooks.install()  # inert until a test sets a KERNEL_CACHE_TEST_* variable


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return  # a worker: the main process has set $KERNEL_CACHE_TEST_WARM_DIR
    shared = os.environ.get(ENV_SHARED_WARM_DIR)
    if shared:
        shared = str(Path(shared).resolve())  # the build runs from the checkout's root
        Path(shared).mkdir(parents=True, exist_ok=True)
        for sub, _, _ in _WARM_BUILDS.values():
            pid = Path(shared, sub, "pid")
            if pid.exists() and not Path(shared, sub, "rc").exists() and not _alive(pid):
                pid.unlink(missing_ok=True)  # a killed earlier run's build: start it again
        os.environ[ENV_WARM_DIR] = shared
        config.stash[_OWN_DIR] = (shared, False)
        # Runs that share the folder at the same time (.ci/run: both tiers side
        # by side) each leave a file here; the last to end stops the build.
        Path(shared, "sessions").mkdir(exist_ok=True)
        Path(shared, "sessions", str(os.getpid())).write_text(_started(os.getpid()))
    else:
        d = tempfile.mkdtemp(prefix="kernel_cache-tests-")
        os.environ[ENV_WARM_DIR] = d
        config.stash[_OWN_DIR] = (d, True)
    if ENV_PCH_DIR not in os.environ:  # every warmup of the run reuses the headers
        os.environ[ENV_PCH_DIR] = str(Path(os.environ[ENV_WARM_DIR], "pch"))
        config.stash[_OWN_PCH] = True
    if ENV_JOBS not in os.environ:
        os.environ[ENV_JOBS] = "1"
        config.stash[_OWN_JOBS] = True


def _alive(pid_file: Path) -> bool:
    """Whether the process group of the build ``pid_file`` names still runs
    (reaped first where this process started it)."""
    pgid = int(pid_file.read_text())
    try:
        os.waitpid(pgid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_warm_build(d: str, wait_s: float = 30) -> None:
    """Stop the tiny plan's build if it still runs, wait for it to exit, and
    forget it, so that a later run sharing ``d`` starts it again (warmup
    resumes what was published)."""
    pid = Path(d, "pid")
    if not pid.exists() or Path(d, "rc").exists():
        return
    try:
        os.killpg(int(pid.read_text()), signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + wait_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not Path(d, "rc").exists():  # it exited on the signal: no result to keep
        pid.unlink(missing_ok=True)
        Path(d, "report.json").unlink(missing_ok=True)


def _started(pid: int | str) -> str:
    """When process ``pid`` started (``/proc/PID/stat``, clock ticks since boot;
    "" if it is gone): with the pid, names one process even after the pid is
    reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def _other_sessions(d: str) -> list[int]:
    """The pids of other live pytest runs sharing ``d`` (its ``sessions`` files,
    each holding its run's start time), after this run's file is removed; the
    files of runs that have ended (a killed run leaves one) are removed too."""
    sessions = Path(d, "sessions")
    Path(sessions, str(os.getpid())).unlink(missing_ok=True)
    live = []
    for f in sessions.iterdir() if sessions.is_dir() else ():
        try:
            started = f.read_text()
        except OSError:
            continue
        if f.name.isdigit() and started and _started(f.name) == started:
            live.append(int(f.name))
        else:
            f.unlink(missing_ok=True)
    return live


def pytest_unconfigure(config):
    own = config.stash.get(_OWN_DIR, None)
    if own is None:
        return
    d, remove = own
    if remove or not _other_sessions(d):
        for sub, _, _ in _WARM_BUILDS.values():
            _stop_warm_build(str(Path(d, sub)))
    if remove:
        shutil.rmtree(d, ignore_errors=True)
    os.environ.pop(ENV_WARM_DIR, None)
    if config.stash.get(_OWN_PCH, False):
        os.environ.pop(ENV_PCH_DIR, None)
    if config.stash.get(_OWN_JOBS, False):
        os.environ.pop(ENV_JOBS, None)


#: Wall seconds per test file in a run of the full tier, read to order the files:
#: ``{path: seconds}``, or the JSON a run writes to ``$KERNEL_CACHE_TEST_DURATIONS``
#: (``{path: {"wall_s": ..., "cpu_s": ...}}``) copied as it is. Refresh it after a
#: file's cost changes much: ``KERNEL_CACHE_TEST_DURATIONS=tests/file_seconds.json
#: bash .ci/run`` (both tiers write the file; the full tier, ending last, wins).
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def _seconds(row) -> float | None:
    """A file's wall seconds from one :data:`FILE_SECONDS` row: a number, or a
    ``{"wall_s": number}`` row; None for anything else (not finite, negative,
    a bool)."""
    if isinstance(row, dict):
        row = row.get("wall_s")
    if isinstance(row, bool) or not isinstance(row, (int, float)):
        return None
    try:
        value = float(row)
    except OverflowError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _file_of(item) -> str:
    """The test file of a collected test or of a test's report: its node id up
    to ``::``."""
    return item.nodeid.split("::")[0]


def _uses(item, fixture: str) -> bool:
    """Whether a collected test uses ``fixture``, directly or through another."""
    return fixture in getattr(item, "fixturenames", ())


#: The fixtures that hand out the run's shared Redis and S3 servers: a test that
#: uses one, directly or through another fixture, holds :func:`shared_servers`.
SHARED_SERVER_FIXTURES = ("redis_url", "s3_server")


def _uses_servers(item) -> bool:
    """Whether a collected test holds :func:`shared_servers` (see
    :data:`SHARED_SERVER_FIXTURES`)."""
    return any(_uses(item, f) for f in ("shared_servers", *SHARED_SERVER_FIXTURES))


def _needs_warm(item) -> bool:
    """Whether a collected test needs one of the run's warm builds."""
    return any(_uses(item, fixture) for _, _, fixture in _WARM_BUILDS.values())


def _file_order(items) -> dict[str, int]:
    """Each test file's place in the run: files with no test that needs a warm
    cache (:func:`_needs_warm`) first, then those with one; in each group the
    longest first (a file :data:`FILE_SECONDS` does not know counts as longest),
    except that a file whose tests hold the shared servers (``shared_servers``:
    one such test at a time across workers) does not follow another such file
    where a file without them is left to put between. With ``--dist loadfile`` and
    ``--no-loadscope-reorder`` (addopts), pytest-xdist hands the files out in
    this order: the cold builds run while the warm builds compile, two workers
    seldom wait for each other's servers, and the short files are left to fill
    the end, when one worker would otherwise wait for the other's long one."""
    try:
        seconds = json.loads(FILE_SECONDS.read_text())
    except (OSError, ValueError):
        seconds = {}
    if not isinstance(seconds, dict):
        seconds = {}
    files: dict[str, list] = {}  # path -> [needs warm, uses the servers]
    for i in items:
        row = files.setdefault(_file_of(i), [False, False])
        row[0] |= _needs_warm(i)
        row[1] |= _uses_servers(i)

    def cost(path: str) -> float:
        known = _seconds(seconds.get(path))
        return float("inf") if known is None else known

    ranked = sorted(files, key=lambda p: (files[p][0], -cost(p), p))
    order: list[str] = []
    while ranked:
        pick = 0
        if order and files[order[-1]][1]:  # after a server file: the next without servers
            group = files[ranked[0]][0]
            pick = next((n for n, p in enumerate(ranked) if files[p] == [group, False]), 0)
        order.append(ranked.pop(pick))
    return {p: n for n, p in enumerate(order)}


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs
def pytest_collection_modifyitems(config, items):
    """The files in :func:`_file_order`'s order; in each file, the tests that
    need a warm cache last (the builds they need start now). The order is made
    where the tests are collected, in each xdist worker, and is the same for every
    ``--dist`` mode (xdist sets a worker's ``dist`` option to ``no``): under
    ``loadfile`` the files go out in this order; under ``load`` (the fast tier)
    single tests do, so a file's warm-cache tests run at the file's place, after
    every file without one."""
    for which, (_, _, fixture) in _WARM_BUILDS.items():
        if any(_uses(i, fixture) for i in items):
            _start_warm_build(which)
    order = _file_order(items)
    items.sort(key=lambda i: (order[_file_of(i)], _needs_warm(i)))  # stable


#: Seconds the test waited for :func:`shared_servers`.
_SERVERS_WAIT = pytest.StashKey[float]()


@pytest.fixture
def shared_servers(request):
    """Held for the test: no test of another pytest-xdist worker or tier uses
    the run's shared Redis and S3 servers meanwhile (tests empty the Redis
    database and count the servers' requests). The wait is reported per file
    (:func:`pytest_terminal_summary`)."""
    start = time.monotonic()
    with FileLock(_shared_dir() / "servers.lock"):
        request.node.stash[_SERVERS_WAIT] = time.monotonic() - start
        yield


@pytest.fixture(autouse=True)
def _one_test_on_the_shared_servers(request):
    """A test that uses a fixture of :data:`SHARED_SERVER_FIXTURES` holds
    :func:`shared_servers`, taken before its function-scoped fixtures (which
    empty the database). Tests with a server of their own, or none, run beside
    it. The function-scoped fixtures that hand out a shared server (``s3``,
    ``redis_db``) also take the lock, for a test that asks for one at run time
    (``request.getfixturevalue``)."""
    if any(f in request.fixturenames for f in SHARED_SERVER_FIXTURES):
        request.getfixturevalue("shared_servers")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return _shared_model()


@pytest.fixture(scope="session")
def tiny_config(tiny_model):
    return make_config(str(tiny_model), **TINY_LIMITS)


@pytest.fixture(scope="session")
def plain_config(tiny_model):
    """The tiny plan's config with :data:`PLAIN_KERNELS` (:func:`plain_args`)."""
    return make_config(str(tiny_model), **PLAIN_LIMITS)


def run_cli(*args, env=None, check=False, timeout=600) -> subprocess.CompletedProcess:
    """Run ``kernel-cache ARGS`` in a fresh Python process."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "warmup.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"kernel-cache {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def _wait_warm_build(which: str) -> tuple[Path, dict]:
    """The cache and JSON report of the run's warm build ``which``, once it has
    ended (started here if no process of the run has started it)."""
    _start_warm_build(which)
    d = _build_dir(which)
    deadline = time.monotonic() + WARM_TIMEOUT_S
    while not (d / "rc").exists():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the tiny plan's warmup ({which}) did not finish in {WARM_TIMEOUT_S} s"
            )
        time.sleep(0.2)
    rc = int((d / "rc").read_text())
    if rc != 0:
        err = (d / "stderr").read_text() if (d / "stderr").exists() else "(no stderr file)"
        shared = f" (in {d}, shared by ${ENV_SHARED_WARM_DIR}: empty it to build again)"
        where = shared if os.environ.get(ENV_SHARED_WARM_DIR) else ""
        raise AssertionError(f"the tiny plan's warmup ({which}) exited {rc}{where}:\n{err}")
    return d / "cache", json.loads((d / "report.json").read_text())


@pytest.fixture(scope="session")
def warm_cache() -> tuple[Path, dict]:
    """A cache with the tiny plan compiled, and warmup's JSON report. Read-only use."""
    return _wait_warm_build("builtin")


@pytest.fixture
def cache_copy(warm_cache, tmp_path) -> Path:
    """A private, writable copy of the warmed cache."""
    dst = tmp_path / "cache"
    shutil.copytree(warm_cache[0], dst)
    return dst


@pytest.fixture(scope="session")
def plain_warm_cache() -> tuple[Path, dict]:
    """:func:`warm_cache` of the tiny plan compiled with :data:`PLAIN_KERNELS`
    (:func:`plain_args`, :func:`plain_config`). Read-only use."""
    return _wait_warm_build("plain")


@pytest.fixture
def plain_cache_copy(plain_warm_cache, tmp_path) -> Path:
    """A private, writable copy of :func:`plain_warm_cache`: for a test that
    removes or damages entries and compiles them again, where the claim holds
    for any kernel."""
    dst = tmp_path / "cache"
    shutil.copytree(plain_warm_cache[0], dst)
    return dst


#: CPU seconds at the end of the test's last phase (see :func:`_cpu_s`).
_CPU_MARK = pytest.StashKey[float]()


def _cpu_s() -> float:
    """User + system CPU seconds of this process and of the children it has
    waited for (``getrusage``): a test's subprocesses, their compile workers and
    compilers count once reaped."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_CPU_MARK] = _cpu_s()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries its CPU seconds as ``cpu_s``, an attribute
    pytest's report serialization takes to the main process under pytest-xdist
    (not ``user_properties``, which ``--junitxml`` would write)."""
    rep = yield
    now = _cpu_s()
    rep.cpu_s = now - item.stash.get(_CPU_MARK, now)
    rep.servers_wait_s = item.stash.get(_SERVERS_WAIT, 0.0)  # the phase that took the lock
    if _SERVERS_WAIT in item.stash:
        del item.stash[_SERVERS_WAIT]
    item.stash[_CPU_MARK] = now
    return rep


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Wall and CPU seconds per test file (setup, call and teardown summed), and
    the seconds its tests waited for :func:`shared_servers` (part of the wall
    time), slowest first, and the same as JSON in ``$KERNEL_CACHE_TEST_DURATIONS``
    when that is set. The CPU column is the load a file puts on the machine,
    which the wall column hides when the other xdist worker competes for the
    cores."""
    per_file: dict[str, dict[str, float]] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            duration = getattr(rep, "duration", None)
            nodeid = getattr(rep, "nodeid", "")
            if duration is None or not nodeid:
                continue
            row = per_file.setdefault(
                _file_of(rep), {"wall_s": 0.0, "cpu_s": 0.0, "servers_wait_s": 0.0}
            )
            row["wall_s"] += duration
            row["cpu_s"] += getattr(rep, "cpu_s", 0.0)
            row["servers_wait_s"] += getattr(rep, "servers_wait_s", 0.0)
    if not per_file:
        return
    ranked = sorted(per_file.items(), key=lambda kv: -kv[1]["wall_s"])
    total = sum(r["cpu_s"] for r in per_file.values())
    waited = sum(r["servers_wait_s"] for r in per_file.values())
    terminalreporter.write_sep(
        "=",
        f"seconds per test file: wall, CPU, waiting for the shared servers "
        f"(CPU in all: {total:.1f} s; waiting: {waited:.1f} s)",
    )
    for path, row in ranked:
        terminalreporter.write_line(
            f"{row['wall_s']:8.1f} {row['cpu_s']:8.1f} {row['servers_wait_s']:8.1f}  {path}"
        )
    out = os.environ.get("KERNEL_CACHE_TEST_DURATIONS")
    if out:
        doc = {p: {k: round(v, 1) for k, v in row.items()} for p, row in ranked}
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
