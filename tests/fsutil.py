"""File-system helpers for the crash, full-disk and read-only tests (real mounts where allowed)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from pathlib import Path


def tree_state(root: Path) -> dict[str, str]:
    """Every file, directory and link under ``root`` (relative name -> sha256 / kind + mode)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = f"dir:{st.st_mode:o}"
            else:
                out[rel] = f"{st.st_mode:o}:" + hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _run(*cmd) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def umount(path: Path) -> None:
    if not _run("umount", str(path)):
        _run("umount", "-l", str(path))


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int):
    """A real tmpfs of ``size_bytes`` at ``path`` (root only); yields False where mount
    is not permitted (the caller then injects the fault instead)."""
    path.mkdir(parents=True, exist_ok=True)
    ok = _run("mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(path))
    try:
        yield ok
    finally:
        if ok:
            umount(path)


def resize_tmpfs(path: Path, size_bytes: int) -> bool:
    return _run("mount", "-o", f"remount,size={size_bytes}", str(path))


@contextlib.contextmanager
def readonly_bind(src: Path, dst: Path):
    """``src`` bind-mounted read-only at ``dst`` (even root cannot write there: EROFS);
    yields False where mount is not permitted."""
    dst.mkdir(parents=True, exist_ok=True)
    ok = _run("mount", "--bind", str(src), str(dst))
    if ok and not _run("mount", "-o", "remount,bind,ro", str(dst)):
        umount(dst)
        ok = False
    try:
        yield ok
    finally:
        if ok:
            umount(dst)
