"""A traced helper from an installed distribution, reinstalled with other code
under the same version, no longer matches its entry's record.

The distribution is a real ``*.dist-info`` (``METADATA``, a ``RECORD`` with
each file's sha256, as pip writes them) in a ``site-packages`` folder on
``PYTHONPATH``; the recording and the check each run in a fresh process, as
warmup's worker and engine start do."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from ..conftest import ROOT

RECORD_THEN_CHECK = r"""
import json, sys
from kernel_cache.plan.traced import Manifest, changes, current
from kernel_cache.plan.traced_build import manifest_of
if sys.argv[1] == "record":
    import kchelp_dist
    print(json.dumps(manifest_of([kchelp_dist.__file__]).record()))
else:
    stored = Manifest.model_validate_json(sys.argv[2])
    print(json.dumps(changes(stored, current(stored))))
"""


def _install(site: Path, code: str, version: str = "0.1.0") -> None:
    """Write ``kchelp_dist`` as pip installs it: the module and a dist-info
    whose RECORD lists its sha256 (urlsafe base64, no padding) and size."""
    pkg = site / "kchelp_dist"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(code)
    info = site / f"kchelp_dist-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: kchelp-dist\nVersion: {version}\n"
    )
    digest = base64.urlsafe_b64encode(hashlib.sha256(code.encode()).digest()).rstrip(b"=")
    (info / "RECORD").write_text(
        f"kchelp_dist/__init__.py,sha256={digest.decode()},{len(code)}\n"
        f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n"
    )


def _run(site: Path, *args: str) -> object:
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-c", RECORD_THEN_CHECK, *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_reinstall_with_other_code_under_the_same_version_is_a_change(tmp_path):
    site = tmp_path / "site-packages"
    _install(site, "def gain():\n    return 1.0\n")
    stored = _run(site, "record")
    assert list(stored["dists"]) == ["kchelp-dist"] and stored["files"] == {}
    assert stored["dists"]["kchelp-dist"].startswith("0.1.0")
    assert _run(site, "check", json.dumps(stored)) == []  # nothing changed: a hit

    _install(site, "def gain():\n    return 2.0\n")  # same version, other code
    lines = _run(site, "check", json.dumps(stored))
    assert len(lines) == 1 and lines[0].startswith("distribution kchelp-dist 0.1.0"), lines

    _install(site, "def gain():\n    return 1.0\n")  # the first code again: a hit again
    assert _run(site, "check", json.dumps(stored)) == []


def _install_egg_info(site: Path, code: str) -> None:
    """Write ``kchelp_dist`` as a distro package or ``setup.py install`` does: the
    module and an ``.egg-info`` whose ``SOURCES.txt`` lists it with no sha256."""
    (site / "kchelp_dist").mkdir(parents=True, exist_ok=True)
    (site / "kchelp_dist" / "__init__.py").write_text(code)
    info = site / "kchelp_dist-0.1.0.egg-info"
    info.mkdir(exist_ok=True)
    (info / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: kchelp-dist\nVersion: 0.1.0\n")
    (info / "SOURCES.txt").write_text("setup.py\nkchelp_dist/__init__.py\n")
    (info / "top_level.txt").write_text("kchelp_dist\n")


def test_a_file_a_distribution_lists_without_a_sha256_is_hashed_itself(tmp_path):
    """An ``.egg-info`` has no RECORD: its version alone would hide a reinstall
    with other code, so its files are recorded by their own sha256."""
    site = tmp_path / "site-packages"
    _install_egg_info(site, "def gain():\n    return 1.0\n")
    stored = _run(site, "record")
    assert stored["dists"] == {} and list(stored["files"]) == ["kchelp_dist/__init__.py"]
    assert _run(site, "check", json.dumps(stored)) == []

    _install_egg_info(site, "def gain():\n    return 2.0\n")  # same version, other code
    lines = _run(site, "check", json.dumps(stored))
    assert len(lines) == 1 and lines[0].startswith("kchelp_dist/__init__.py changed"), lines


SOURCELESS = r"""
import json, sys
from kernel_cache.errors import CompileError
from kernel_cache.plan.traced_build import manifest_of
import kcpyc
try:
    print(json.dumps(manifest_of([kcpyc.gain.__code__.co_filename]).record()))
except CompileError as e:
    print(json.dumps({"error": str(e)}))
"""


def _sourceless(site: Path, with_dist: bool) -> dict:
    """``kcpyc`` as ``kcpyc/__init__.pyc`` only (compiled with the path it is
    installed at, as a sourceless wheel ships it), with or without a dist-info
    listing it; returns the manifest a fresh process records for its code."""
    pkg = site / "kcpyc"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def gain():\n    return 1.0\n")
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-b", "-d", str(pkg), str(pkg)], check=True
    )
    (pkg / "__init__.py").unlink()
    if with_dist:
        info = site / "kcpyc-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kcpyc\nVersion: 0.1.0\n")
        pyc = (pkg / "__init__.pyc").read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(pyc).digest()).rstrip(b"=").decode()
        (info / "RECORD").write_text(
            f"kcpyc/__init__.pyc,sha256={digest},{len(pyc)}\n{info.name}/METADATA,,\n"
        )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-c", SOURCELESS], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_sourceless_module_of_a_distribution_is_recorded_by_the_distribution(tmp_path):
    m = _sourceless(tmp_path / "site-packages", with_dist=True)
    assert m["files"] == {} and list(m["dists"]) == ["kcpyc"]
    assert m["dists"]["kcpyc"].startswith("0.1.0 (RECORD ")


def test_a_sourceless_module_in_site_packages_outside_a_distribution_is_refused(tmp_path):
    m = _sourceless(tmp_path / "site-packages", with_dist=False)
    assert "kcpyc/__init__.py" in m["error"] and "not on disk" in m["error"]


IMPORTED_IN_A_WINDOW = r"""
import importlib, json
from warmup.builder.recorder import RunRecorder
window = RunRecorder("kcstray_kernel:Decode")
with window:
    importlib.import_module("kcstray").GAIN  # a module-level value, no function runs
    importlib.import_module("kchelp_dist")  # a distribution's: its version stands for it
print(json.dumps(window.manifest().record()))
"""


def test_a_module_copied_into_site_packages_counts_when_only_imported(tmp_path):
    """A kernel reads a value of ``kcstray``, a module copied into
    ``site-packages`` that no distribution lists: only its body ran, inside the
    import. Its file is recorded (no version stands for it), while a
    distribution's module imported the same way is not."""
    site = tmp_path / "site-packages"
    _install(site, "GAIN = 1.0\n")
    (site / "kcstray.py").write_text("GAIN = 2.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    proc = subprocess.run(
        [sys.executable, "-c", IMPORTED_IN_A_WINDOW],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "kcstray.py" in m["files"] and m["dists"] == {}
    assert not any(f.startswith("kchelp_dist") for f in m["files"])
