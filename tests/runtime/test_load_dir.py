"""Engine start leaves no unpacked packages in $TMPDIR (real processes, real loads)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import N_TINY, ROOT

pytestmark = pytest.mark.compile

START = """
import sys, time
from kernel_cache import load_plan, make_config
rt = load_plan(make_config(sys.argv[1], **eval(sys.argv[2])), sys.argv[3])
print(rt.stats()["loads"], flush=True)
if sys.argv[4] == "hang":
    time.sleep(600)
"""


def start(tmpdir, tiny_model, cache, mode="exit", stderr=None):
    from ..conftest import TINY_LIMITS

    env = {**os.environ, "TMPDIR": str(tmpdir)}
    args = [sys.executable, "-c", START, str(tiny_model), repr(TINY_LIMITS), str(cache), mode]
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
    )


def test_no_unpacked_packages_left_after_exit_or_sigkill(warm_cache, tiny_model, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    p = start(tmpdir, tiny_model, warm_cache[0])
    assert p.stdout.readline().strip() == str(N_TINY)
    assert p.wait(timeout=120) == 0
    assert os.listdir(tmpdir) == []  # no aotinductor_*, no kernel_cache-load-*

    # a process killed while serving leaves its directory; the next start removes it
    p = start(tmpdir, tiny_model, warm_cache[0], mode="hang")
    assert p.stdout.readline().strip() == str(N_TINY)
    left = os.listdir(tmpdir)
    assert [n.startswith(f"kernel_cache-load-{p.pid}-") for n in left] == [True]
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert os.listdir(tmpdir) == left
    p = start(tmpdir, tiny_model, warm_cache[0])
    assert p.stdout.readline().strip() == str(N_TINY)
    assert p.wait(timeout=120) == 0
    assert os.listdir(tmpdir) == []


#: Engine start through AOTInductor's package loader (every CPU package sent
#: there, as a CUDA package or a CPU one with weights is), while a thread reads
#: $TMPDIR as Python and as C code see it; prints a JSON line.
THROUGH_THE_LOADER = r"""
import ctypes, json, os, sys, threading
import torch
from kernel_cache import load_plan, make_config
from kernel_cache.runtime import package

calls = []
loader = torch._C._aoti.AOTIModelPackageLoader
def counted(path, *args):
    calls.append(os.path.isdir(path))
    return loader(path, *args)
torch._C._aoti.AOTIModelPackageLoader = counted
package._cpu_library = lambda data, where, key: None  # no CPU shortcut: the package loader
if sys.argv[4] == "archives":  # a torch whose loader takes only archives (2.11)
    from kernel_cache import torch_compat
    torch_compat.aoti_loader_takes_folders = lambda: False

getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
before, tmpdir = dict(os.environ), os.environ["TMPDIR"]
seen, stop = set(), threading.Event()
def read():
    while not stop.is_set():
        seen.add(os.environ.get("TMPDIR"))
        seen.add((getenv(b"TMPDIR") or b"").decode())
reader = threading.Thread(target=read)
reader.start()
rt = load_plan(make_config(sys.argv[1], **eval(sys.argv[2])), sys.argv[3])
stop.set()
reader.join()
kc = torch.randn(9, 16, 2, 8)
out = rt.decode(torch.randn(3, 4, 8), kc, kc, torch.zeros(3, 2, dtype=torch.int32), [5, 17, 32])
print(json.dumps({
    "loads": rt.stats()["loads"], "loader_calls": calls, "out_shape": list(out.shape),
    "environ_same": dict(os.environ) == before, "seen": sorted(seen), "tmpdir": tmpdir,
    "in_tmpdir": sorted(os.listdir(tmpdir)), "in_load_dir": sorted(os.listdir(package.load_dir())),
}))
"""


def run_start(script, tiny_model, cache, tmpdir, *extra, timeout=300):
    """``script`` (argv: the tiny model, its limits, ``cache``, ``extra``) in a
    fresh process with ``TMPDIR=tmpdir``."""
    from ..conftest import TINY_LIMITS

    args = [str(tiny_model), repr(TINY_LIMITS), str(cache), *extra]
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT, env={**os.environ, "TMPDIR": str(tmpdir)}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _through_the_loader(tiny_model, cache, tmp_path, loader: str) -> tuple[dict, Path]:
    """:data:`THROUGH_THE_LOADER` with a loader that takes ``loader``
    (``folders`` or ``archives``), in an empty $TMPDIR: its JSON line and that $TMPDIR."""
    import json

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = run_start(THROUGH_THE_LOADER, tiny_model, cache, tmpdir, loader)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), tmpdir


def test_engine_start_changes_no_environment_variable(warm_cache, tiny_model, tmp_path):
    """AOTInductor's package loader is given the unpacked package: os.environ is
    the same after engine start, a thread reading $TMPDIR (through os.environ
    and C's getenv) during it only ever sees its value, and the loader
    unpacks nothing into $TMPDIR itself (no ``aotinductor_*`` folder)."""
    doc, tmpdir = _through_the_loader(tiny_model, warm_cache[0], tmp_path, "folders")
    assert doc["loads"] == N_TINY and doc["out_shape"] == [3, 4, 8]
    assert doc["loader_calls"] == [True] * N_TINY  # the loader ran, on unpacked folders
    assert doc["environ_same"] and doc["seen"] == [str(tmpdir)]
    assert [n.startswith("kernel_cache-load-") for n in doc["in_tmpdir"]] == [True]
    unpacked = [n for n in doc["in_load_dir"] if n != ".owner.lock"]  # the directory's flock
    assert len(unpacked) == N_TINY and all(n.startswith("kernel_cache-") for n in unpacked)
    assert os.listdir(tmpdir) == []  # removed at exit


def test_a_loader_that_takes_only_archives_is_given_the_package_file(
    warm_cache, tiny_model, tmp_path
):
    """Where torch's loader opens every path as an archive (torch 2.11), it is
    given each package as a ``.pt2`` file in the load directory, and the
    engine's kernels run."""
    doc, _ = _through_the_loader(tiny_model, warm_cache[0], tmp_path, "archives")
    assert doc["loads"] == N_TINY and doc["out_shape"] == [3, 4, 8]
    assert doc["loader_calls"] == [False] * N_TINY  # files, not folders
    unpacked = [n for n in doc["in_load_dir"] if n != ".owner.lock"]
    assert len(unpacked) == N_TINY


def test_a_noexec_tmpdir_is_named_not_reported_as_corrupt_entries(warm_cache, tiny_model, tmp_path):
    """$TMPDIR on a noexec mount: no kernel can be mapped from it. Engine start says
    so, names the directory and the fix, and removes what it made there; the
    entries are not called corrupt (nothing to warm again)."""
    mnt = tmp_path / "noexec"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "noexec,size=16m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a noexec tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        p = start(mnt, tiny_model, warm_cache[0], stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=120)
        assert p.returncode != 0, out
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert "ConfigError" in err and "noexec" in err and "set TMPDIR" in err, err
    assert "corrupt" not in err.lower(), err


def test_a_full_tmpdir_is_named_not_reported_as_corrupt_entries(cache_copy, tiny_model, tmp_path):
    """$TMPDIR on a real 64 KiB tmpfs: a CPU variant's ``.so`` (hundreds of KB) does
    not fit. Engine start fails with a ConfigError naming the directory, the
    errno and the fix (not an OSError from deep in the loader, not a corrupt
    entry), leaves nothing on the tmpfs and changes no entry of the cache."""
    from ..fsutil import tmpfs, tree_state

    def entries():
        return {k: v for k, v in tree_state(cache_copy).items() if not k.startswith("usage")}

    before = entries()
    with tmpfs(tmp_path / "full", 64 << 10) as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here (not root)")
        p = start(tmp_path / "full", tiny_model, cache_copy, stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=120)
        left = os.listdir(tmp_path / "full")
    assert p.returncode == 1, out
    last = err.strip().splitlines()[-1]
    assert last.startswith("kernel_cache.errors.ConfigError: cannot unpack entry"), err
    assert "No space left" in last and str(tmp_path / "full") in last and "set TMPDIR" in last
    assert "corrupt" not in err.lower(), err
    assert left == []
    assert entries() == before


#: Eight engines start at once in eight threads of one process; prints their
#: loads and what $TMPDIR holds while they live.
THREADS = r"""
import json, os, sys, threading
from kernel_cache import load_plan, make_config
cfg = make_config(sys.argv[1], **eval(sys.argv[2]))
go, loads = threading.Barrier(8), []
def start():
    go.wait()
    loads.append(load_plan(cfg, sys.argv[3]).stats()["loads"])
threads = [threading.Thread(target=start) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({"loads": loads, "tmp": os.listdir(os.environ["TMPDIR"])}))
"""


def test_engines_starting_in_threads_share_one_load_directory(warm_cache, tiny_model, tmp_path):
    """load_plan in eight threads at once: every engine loads the whole plan, the
    process makes one load directory (not one per thread that raced to make it),
    and nothing is left in $TMPDIR after it exits."""
    import json

    from ..conftest import TINY_LIMITS

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    args = [sys.executable, "-c", THREADS, str(tiny_model), repr(TINY_LIMITS), str(warm_cache[0])]
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen["loads"] == [N_TINY] * 8
    assert len(seen["tmp"]) == 1 and seen["tmp"][0].startswith("kernel_cache-load-"), seen
    assert os.listdir(tmpdir) == []


#: Engine start as torch 2.11's engine makes it: every package through the
#: package loader, which takes only archives (so it unpacks each into $TMPDIR).
ARCHIVES = """
import sys
from kernel_cache import load_plan, make_config, torch_compat
from kernel_cache.runtime import package
package._cpu_library = lambda data, where, key: None
torch_compat.aoti_loader_takes_folders = lambda: False
rt = load_plan(make_config(sys.argv[1], **eval(sys.argv[2])), sys.argv[3])
print(rt.stats()["loads"], flush=True)
"""


def test_a_tmpdir_too_full_for_the_archive_loader_s_unpack_is_named_not_a_corrupt_entry(
    cache_copy, tiny_model, tmp_path
):
    """A loader that takes only archives (torch older than 2.13) unpacks the
    ``.pt2`` it is given into $TMPDIR itself. $TMPDIR on a real 900 KiB tmpfs:
    the package's copy (about 600 KB) fits, the loader's unpack of its ``.so``
    beside it does not. Engine start fails with a ConfigError naming $TMPDIR
    and the fix, not a corrupt entry (warmup's check would quarantine and
    rebuild a good entry for it), nothing is left on the tmpfs and no entry of
    the cache changes."""
    from ..fsutil import tmpfs, tree_state

    def entries():
        return {k: v for k, v in tree_state(cache_copy).items() if not k.startswith("usage")}

    before = entries()
    full = tmp_path / "full"
    with tmpfs(full, 900 << 10) as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here (not root)")
        p = run_start(ARCHIVES, tiny_model, cache_copy, full, timeout=120)
        left = os.listdir(full)
    assert p.returncode == 1, p.stdout
    assert left == []  # neither the package's copy nor the loader's partial unpack
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kernel_cache.errors.ConfigError: "), p.stderr
    assert str(full) in last and "set TMPDIR" in last, last
    assert "corrupt" not in p.stderr.lower(), p.stderr
    assert entries() == before


def test_a_read_only_tmpdir_for_the_archive_loader_s_unpack_is_named_not_a_corrupt_entry(
    cache_copy, tiny_model, tmp_path
):
    """$TMPDIR a read-only bind mount (EROFS even for root): Python's
    ``tempfile`` falls back to another folder for the load directory, but the
    archive-only loader unpacks into $TMPDIR. Engine start fails with a
    ConfigError naming $TMPDIR and the fix, not a corrupt entry."""
    from ..fsutil import readonly_bind

    (tmp_path / "src").mkdir()
    ro = tmp_path / "ro"
    with readonly_bind(tmp_path / "src", ro) as mounted:
        if not mounted:
            pytest.skip("cannot bind-mount here (not root)")
        p = run_start(ARCHIVES, tiny_model, cache_copy, ro, timeout=120)
    assert p.returncode == 1, p.stdout
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kernel_cache.errors.ConfigError: "), p.stderr
    assert str(ro) in last and "set TMPDIR" in last, last
    assert "corrupt" not in p.stderr.lower(), p.stderr


#: One package through the archive-only loader, its ``.so``'s bytes altered
#: under the archive's CRC-32 (a record and sha256 made for the altered bytes).
ALTERED = """
import sys
from kernel_cache import torch_compat
from kernel_cache.errors import CorruptEntryError
from kernel_cache.runtime import package
package._cpu_library = lambda data, where, key: None
torch_compat.aoti_loader_takes_folders = lambda: sys.argv[2] == "folders"
data = bytearray(open(sys.argv[1], "rb").read())
at = data.find(b"\\x7fELF") + 5000
data[at : at + 100] = bytes(100)
try:
    package.load_package(bytes(data), "cpu", "here", "k" * 64)
except CorruptEntryError as e:
    print("refused:", e.reason)
"""


@pytest.mark.parametrize("loader", ["folders", "archives"])
def test_a_package_whose_so_fails_its_crc_is_refused_by_either_loader(warm_cache, tmp_path, loader):
    """A package whose ``.so`` bytes disagree with the archive's CRC-32: the
    folder loader's unpack (Python's zipfile) refuses it; so must the path of
    the archive-only loader (torch older than 2.13), whose own unpack does not
    check, and which dlopen()ed it and died of SIGSEGV."""
    from kernel_cache.store.disk_tier import DiskTier

    tier = DiskTier(warm_cache[0], read_only=True)
    meta = next(iter(tier.iter_meta()))
    pkg = tmp_path / "p.pt2"
    pkg.write_bytes(tier.get(meta["key"]).data)
    p = subprocess.run(
        [sys.executable, "-c", ALTERED, str(pkg), loader], cwd=ROOT, capture_output=True,
        text=True, env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert p.stdout.startswith("refused: ") and "CRC-32" in p.stdout, p.stdout
