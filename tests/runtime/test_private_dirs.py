"""Private temp directories (engine start's load directory, warmup's scratch):
one left by a process that died is removed by the next, and one whose process
lives is kept even when its name's pid looks dead here (another PID namespace:
containers sharing ``$TMPDIR``). Real processes and SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from kernel_cache.store.locks import OWNER_LOCK, private_temp_dir, remove_private_temp_dir

from ..conftest import ROOT

PREFIX = "kernel_cache-load-"

HOLD = """
import sys, time
from kernel_cache.store.locks import private_temp_dir
print(private_temp_dir(sys.argv[1]), flush=True)
time.sleep(600)
"""


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_live_owner_keeps_its_directory_whatever_its_pid_looks_like(tmp_path, monkeypatch):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, PREFIX], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        made = holder.stdout.readline().strip()
        assert os.path.isfile(os.path.join(made, OWNER_LOCK))
        # Seen from another PID namespace, the holder's pid is one no process here has.
        seen = tmp_path / f"{PREFIX}{_dead_pid()}-elsewhere"
        os.rename(made, seen)
        monkeypatch.setenv("TMPDIR", str(tmp_path))
        monkeypatch.setattr("tempfile.tempdir", None)
        mine = private_temp_dir(PREFIX)
        assert seen.is_dir(), "a live process's directory was removed"
        remove_private_temp_dir(mine)
        assert not os.path.exists(mine)

        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        mine = private_temp_dir(PREFIX)
        assert not seen.exists(), "a dead process's directory was kept"
        assert sorted(os.listdir(tmp_path)) == [os.path.basename(mine)]
        remove_private_temp_dir(mine)
        assert os.listdir(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()


def test_a_directory_without_an_owner_lock_goes_by_its_pid(tmp_path, monkeypatch):
    dead = tmp_path / f"{PREFIX}{_dead_pid()}-old"
    live = tmp_path / f"{PREFIX}{os.getppid()}-old"  # pytest's parent lives
    for d in (dead, live):
        d.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    mine = private_temp_dir(PREFIX)
    assert not dead.exists() and live.is_dir()
    remove_private_temp_dir(mine)
