"""Engine start leaves no unpacked packages in $TMPDIR (real processes, real loads)."""

import os
import signal
import subprocess
import sys

import pytest

from .conftest import ROOT

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
    from .conftest import TINY_LIMITS

    env = {**os.environ, "TMPDIR": str(tmpdir)}
    args = [sys.executable, "-c", START, str(tiny_model), repr(TINY_LIMITS), str(cache), mode]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def test_no_unpacked_packages_left_after_exit_or_sigkill(warm_cache, tiny_model, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    p = start(tmpdir, tiny_model, warm_cache[0])
    assert p.stdout.readline().strip() == "6"
    assert p.wait(timeout=120) == 0
    assert os.listdir(tmpdir) == []  # no aotinductor_*, no kernel_cache-load-*

    # a process killed while serving leaves its directory; the next start removes it
    p = start(tmpdir, tiny_model, warm_cache[0], mode="hang")
    assert p.stdout.readline().strip() == "6"
    left = os.listdir(tmpdir)
    assert [n.startswith(f"kernel_cache-load-{p.pid}-") for n in left] == [True]
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert os.listdir(tmpdir) == left
    p = start(tmpdir, tiny_model, warm_cache[0])
    assert p.stdout.readline().strip() == "6"
    assert p.wait(timeout=120) == 0
    assert os.listdir(tmpdir) == []
