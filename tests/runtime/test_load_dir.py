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


def start(tmpdir, tiny_model, cache, mode="exit"):
    from ..conftest import TINY_LIMITS

    env = {**os.environ, "TMPDIR": str(tmpdir)}
    args = [sys.executable, "-c", START, str(tiny_model), repr(TINY_LIMITS), str(cache), mode]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


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
