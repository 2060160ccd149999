"""The host code's -march on a torch whose Inductor has no ``cpp.march`` option
(before 2.13: the GPU image's torch): the C++ builder's flags are rewritten for
the compile only."""

import os

import pytest
from torch._inductor import config, cpp_builder

from warmup.builder.compiler import _host_march


def _march_flags() -> list[str]:
    out = cpp_builder._get_optimization_cflags("g++")
    cflags = out[0] if isinstance(out, tuple) else out
    return [f for f in cflags if str(f).startswith("march=")]


def test_host_march_replaces_native_for_the_block_only():
    with config.patch({"cpp.march": None}):  # as a torch without the option builds
        assert _march_flags() == ["march=native"]
        with _host_march("x86-64-v2"):
            assert _march_flags() == ["march=x86-64-v2"]
        assert _march_flags() == ["march=native"]


def test_host_march_none_changes_nothing():
    original = cpp_builder._get_optimization_cflags
    with _host_march(None):
        assert cpp_builder._get_optimization_cflags is original


def test_a_header_left_half_built_by_a_killed_builder_is_removed_when_built_again(tmp_path):
    """A builder killed while it compiles a precompiled header leaves its
    ``<header>.gch.<pid>.part`` (as a SIGKILLed warmup did, 16 KiB of a 140 MB
    header): the next build of that header (Inductor holds its lock) removes it,
    and the header is compiled by the real compiler (files read back)."""
    from warmup.builder.normalize import build_paths_mapped

    pch = tmp_path / "pch"
    pch.mkdir()
    header = pch / "h.h"
    header.write_text("inline int one() { return 1; }\n")
    stale = pch / "h.h.gch.4242.part"
    stale.write_bytes(b"\0" * 16384)
    with build_paths_mapped(str(tmp_path / "build"), str(pch)):
        cpp_builder._run_compile_cmd(f"g++ -x c++-header {header} -o {header}.gch", str(pch))
    assert sorted(os.listdir(pch)) == ["h.h", "h.h.gch"]
    assert os.path.getsize(f"{header}.gch") > 0


def test_a_refused_precompiled_headers_folder_is_named_by_its_setting(tmp_path, monkeypatch):
    """KERNEL_CACHE_PCH_DIR writable by others: the refusal names the setting,
    the folder, the mode and both fixes (a newcomer did not set a "cache directory")."""
    from kernel_cache.errors import UntrustedCacheError
    from warmup.builder.worker import pch_dir

    folder = tmp_path / "pch"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv("KERNEL_CACHE_PCH_DIR", str(folder))
    with pytest.raises(UntrustedCacheError) as e:
        pch_dir(str(tmp_path / "cache"), allow_shared=False)
    msg = str(e.value)
    assert "KERNEL_CACHE_PCH_DIR" in msg and str(folder) in msg and "0777" in msg
    assert f"chmod -R go-w {folder}" in msg


def test_a_file_given_as_the_precompiled_headers_folder_is_named_by_its_setting(
    tmp_path, monkeypatch
):
    """KERNEL_CACHE_PCH_DIR naming a file (or a folder under a file): a clear error
    naming the setting, the path and the fix, not an OSError from inside a check."""
    from kernel_cache.errors import ConfigError
    from warmup.builder.worker import pch_dir

    afile = tmp_path / "pch"
    afile.write_text("x")
    for given in (afile, afile / "sub"):
        monkeypatch.setenv("KERNEL_CACHE_PCH_DIR", str(given))
        with pytest.raises(ConfigError) as e:
            pch_dir(str(tmp_path / "cache"), allow_shared=False)
        msg = str(e.value)
        assert "KERNEL_CACHE_PCH_DIR" in msg and str(given) in msg and "not a directory" in msg


def test_the_vector_isa_probes_folder_must_be_a_real_folder(tmp_path, monkeypatch):
    """``<pch>/vec-isa`` holds shared objects a probe loads: a file there is named
    with the fix (not a FileExistsError from os.makedirs per variant), and a link
    (to a folder others may write) is refused as the cache's own links are."""
    from kernel_cache.errors import UntrustedCacheError
    from warmup.builder.worker import pch_dir

    folder = tmp_path / "pch"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("KERNEL_CACHE_PCH_DIR", str(folder))
    probes = folder / "vec-isa"
    probes.write_text("x")
    with pytest.raises(UntrustedCacheError) as e:
        pch_dir(str(tmp_path / "cache"), allow_shared=False)
    assert f"{probes}: it is not a folder; fix: rm {probes}" in str(e.value)
    probes.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probes.symlink_to(elsewhere)
    for shared in (False, True):
        with pytest.raises(UntrustedCacheError) as e:
            pch_dir(str(tmp_path / "cache"), allow_shared=shared)
        assert str(probes) in str(e.value) and str(elsewhere) in str(e.value)
    probes.unlink()
    assert pch_dir(str(tmp_path / "cache"), allow_shared=False) == str(folder)


#: Inductor probes these ISAs even under ``cpp.vec_isa_ok`` (when the CPU lists them).
_PROBED = {"avx512_vnni", "amx_tile"}

_PROBE_CHILD = r"""
import sys
from kernel_cache import make_config
from warmup.builder.compiler import _check_vec_isa, compile_options, pin_environment
cfg = make_config(sys.argv[1])
pin_environment(cfg.device, cfg.cpu_target, sys.argv[3])
_check_vec_isa(cfg, compile_options(cfg.device, cfg.cpu_target), sys.argv[2])
print("checked")
"""


@pytest.mark.skipif(
    not _PROBED & set(open("/proc/cpuinfo").read().split()),
    reason="this CPU lists no ISA that Inductor probes under cpp.vec_isa_ok",
)
def test_a_vector_isa_probes_folder_that_cannot_be_written_falls_back_with_a_warning(
    tmp_path, tiny_model
):
    """Inductor cannot write its probes under ``<pch>/vec-isa`` (its ``locks``
    folder is a file here; another user's folder in a shared ``pch`` fails the
    same way): the ISA check still passes, the probes are built in the scratch
    folder (as before they were shared), and a warning names the folder and the
    fix, rather than a bare OSError failing every variant. In a fresh process:
    Inductor keeps the probes' outcome for the life of a process."""
    import subprocess
    import sys

    pch, scratch = tmp_path / "pch", tmp_path / "scratch"
    (pch / "vec-isa").mkdir(parents=True, mode=0o700)
    (pch / "vec-isa" / "locks").write_text("x")
    scratch.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", _PROBE_CHILD, str(tiny_model), str(pch), str(scratch)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout == "checked\n", run.stderr[-2000:]
    probes = pch / "vec-isa"
    assert f"vector-ISA probes cannot be kept in {probes} (FileExistsError" in run.stderr
    assert f"rm -r {probes}" in run.stderr, run.stderr[-2000:]
    assert list(scratch.rglob("*.so")), "the probes were built in the scratch folder"
    assert not list(probes.rglob("*.so"))
