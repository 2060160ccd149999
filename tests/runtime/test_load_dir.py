"""Engine start leaves no unpacked packages in $TMPDIR (real processes, real loads)."""

import os
import signal
import subprocess
import sys

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


def test_tmpdir_is_pointed_at_the_load_dir_for_one_loader_call_at_a_time(monkeypatch):
    """Two threads loading at once: the second waits until the first has
    restored $TMPDIR, so neither restores the other's value."""
    import threading
    import time

    from kernel_cache.runtime.load import _tmpdir

    monkeypatch.setenv("TMPDIR", "/original")
    inside, release, seen = threading.Event(), threading.Event(), []

    def first():
        with _tmpdir("/load-a"):
            inside.set()
            release.wait(10)
            seen.append(("a", os.environ["TMPDIR"]))

    def second():
        inside.wait(10)
        with _tmpdir("/load-b"):
            seen.append(("b", os.environ["TMPDIR"]))

    ta, tb = threading.Thread(target=first), threading.Thread(target=second)
    ta.start()
    tb.start()
    inside.wait(10)
    time.sleep(0.2)  # the second thread is now at the lock
    assert os.environ["TMPDIR"] == "/load-a"
    release.set()
    ta.join(10)
    tb.join(10)
    assert seen == [("a", "/load-a"), ("b", "/load-b")]
    assert os.environ["TMPDIR"] == "/original"


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
