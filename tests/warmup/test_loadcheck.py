"""Warmup loads new artifacts once in a fresh process before publishing them.

The crashing artifacts here are real: a package whose ``wrapper.so`` runs a
constructor that raises SIGSEGV when the AOTInductor loader opens it, built by
the system C compiler, the way a mismatched C++ toolchain's package crashes a
process on load.
"""

import io
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from kernel_cache.store.disk_tier import DiskTier
from warmup.builder.loadcheck import Staged, check_loadable

from ..conftest import plain_args, run_cli

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler"),
]

CRASH_C = (
    "#include <signal.h>\n"
    "__attribute__((constructor)) static void crash(void) { raise(SIGSEGV); }\n"
)


@pytest.fixture(scope="module")
def crash_obj(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("crash")
    (d / "crash.c").write_text(CRASH_C)
    subprocess.run(["cc", "-fPIC", "-c", str(d / "crash.c"), "-o", str(d / "crash.o")], check=True)
    subprocess.run(["cc", "-shared", str(d / "crash.o"), "-o", str(d / "crash.so")], check=True)
    return d


def some_artifact(cache: Path) -> bytes:
    tier = DiskTier(cache)
    try:
        meta = next(iter(tier.iter_meta()))
        return tier.get(meta["key"]).data
    finally:
        tier.close()


def with_crashing_wrapper(package: bytes, crash_so: Path) -> bytes:
    """The same package with its ``wrapper.so`` replaced by one that crashes on load."""
    src = zipfile.ZipFile(io.BytesIO(package))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".so"):
                data = crash_so.read_bytes()
            dst.writestr(info, data)
    return out.getvalue()


def test_check_pins_the_crash_on_its_artifact_and_checks_the_rest(warm_cache, crash_obj):
    good = some_artifact(warm_cache[0])
    bad = with_crashing_wrapper(good, crash_obj / "crash.so")
    staged = [Staged("a:1:1:1", good), Staged("b:1:1:1", bad), Staged("c:1:1:1", good)]
    results, info = check_loadable(staged, "cpu")
    assert [r["ok"] for r in results] == [True, False, True]
    assert info["children"] == 2  # one for the batch, one more after the crash
    err = results[1]["error"]
    assert "SIGSEGV" in err and "not published" in err
    assert "CXX=" in err and "LD_PRELOAD=" in err  # the fix
    assert "libstdc++" in err and info["libstdcxx"]  # what built it, what the process loads


def test_garbage_package_is_rejected_not_crashed(warm_cache):
    results, info = check_loadable([Staged("a:1:1:1", b"not a zip")], "cpu")
    assert results[0]["ok"] is False and "rejected" in results[0]["error"]
    assert info["children"] == 1


def test_warmup_with_a_crashing_toolchain_publishes_nothing(tmp_path, tiny_model, crash_obj):
    """A C++ compiler whose shared objects crash on load: every new artifact is
    reported (variant, compiler, fix) and none reaches the cache."""
    cxx = tmp_path / "crashy-g++"
    cxx.write_text(
        "#!/bin/sh\n"
        # Only the package's shared object: any other .so the compiler builds
        # (Inductor's vector-ISA probes, under --cpu-target native) must still load.
        'for a in "$@"; do case "$a" in *.wrapper.so) '
        f'exec g++ "$@" {crash_obj / "crash.o"} ;; esac; done\n'
        'exec g++ "$@"\n'
    )
    cxx.chmod(0o755)
    cache = tmp_path / "cache"
    small = ["--kv-buckets", "32", "--query-buckets", "32"]  # 2 variants
    proc = run_cli(
        "warmup",
        *plain_args(tiny_model),
        *small,
        "--cache-dir",
        cache,
        "--json",
        env={"CXX": str(cxx)},
    )
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["compiled"] == 0 and len(report["failed"]) == 2
    assert report["load_check"]["checked"] == 2 and report["load_check"]["children"] == 2
    for f in report["failed"]:
        assert "SIGSEGV" in f["error"] and str(cxx) in f["error"] and "CXX=" in f["error"]
    proc = run_cli("verify", *plain_args(tiny_model), *small, "--cache-dir", cache, "--json")
    assert proc.returncode == 1
    assert len(json.loads(proc.stdout)["missing"]) == 2  # nothing was published
