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


#: Inductor probes these ISAs even under ``cpp.vec_isa_ok`` (when the CPU lists them).
_PROBED = {"avx512_vnni", "avx512_bf16", "amx_tile"}

_PICK_CHILD = r"""
import json, os, sys
from kernel_cache import make_config
from warmup import torch_compat
from warmup.builder.compiler import (
    _check_vec_isa, _vec_isa_of_target, compile_options, pin_environment,
)
from torch._inductor import cpu_vec_isa
cfg = make_config(sys.argv[1])
log = sys.argv[4]
pin_environment(cfg.device, cfg.cpu_target, sys.argv[2])
opts = compile_options(cfg.device, cfg.cpu_target)
listed = list(cpu_vec_isa.supported_vec_isa_list)
out = {}
if sys.argv[3] == "narrowed":
    with _vec_isa_of_target(cfg, opts):  # as a compile runs
        _check_vec_isa(cfg, opts)
        out["chosen"] = torch_compat.chosen_vec_isa(opts)  # a later pick of the compile
    out["restored"] = cpu_vec_isa.supported_vec_isa_list == listed
    out["cleared"] = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0
else:
    out["chosen"] = torch_compat.chosen_vec_isa(opts)
out["runs_so_far"] = len(open(log).read().splitlines()) if os.path.exists(log) else 0
# after the compile: a pick of the process with no target (an engine's torch.compile)
os.environ.pop("ATEN_CPU_CAPABILITY")
out["after"] = str(cpu_vec_isa.pick_vec_isa())
print(json.dumps(out))
"""


def _pick_in_a_fresh_process(tmp_path, tiny_model, how: str) -> dict:
    """Inductor's picks in a new process (it keeps its ISA list per process),
    ``CXX`` a ``g++`` that logs every run; returns the child's report."""
    import json
    import shutil
    import subprocess
    import sys

    side = tmp_path / how
    (side / "bin").mkdir(parents=True)
    log = side / "cxx.log"
    cxx = side / "bin" / "g++"  # named g++: Inductor picks its flags by the name
    cxx.write_text(
        f'#!/bin/sh\ncase "$*" in *--version*) ;; *) echo "$*" >> {log};; esac\n'
        f'exec {shutil.which("g++")} "$@"\n'
    )
    cxx.chmod(0o755)
    run = subprocess.run(
        [sys.executable, "-c", _PICK_CHILD, str(tiny_model), str(side / "scratch"), how, str(log)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CXX": str(cxx)},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.skipif(
    not _PROBED & set(open("/proc/cpuinfo").read().split()),
    reason="this CPU lists no ISA that Inductor probes under cpp.vec_isa_ok: nothing to count",
)
def test_a_compiles_pick_probes_no_other_isa_and_leaves_inductors_own_list_after(
    tmp_path, tiny_model
):
    """Under the default target (AVX2) a compile's picks consider AVX2 alone:
    no probe is compiled (counted by the compiler itself, where the same pick
    left to Inductor compiles its probes), and the pick is AVX2. After the
    compile, Inductor's list is its own again: a later pick of the process with
    no target gets this CPU's best ISA, as in a process that never compiled."""
    narrowed = _pick_in_a_fresh_process(tmp_path, tiny_model, "narrowed")
    probed = _pick_in_a_fresh_process(tmp_path, tiny_model, "probed")
    assert narrowed["chosen"] == probed["chosen"] == "avx2"
    assert narrowed["restored"] and narrowed["cleared"]
    assert narrowed["runs_so_far"] == 0 and probed["runs_so_far"] > 0, (narrowed, probed)
    assert narrowed["after"] == probed["after"] != "avx2"


def _wrapper(path, log):
    """A ``CXX`` at ``path`` that logs each call but the probes and runs g++."""
    import shutil

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        '#!/bin/sh\ncase "$*" in --version|-v|-print-file-name*|*-###*) ;; '
        f'*) echo "$*" >> {log};; esac\n'
        f'exec {shutil.which("g++")} "$@"\n'
    )
    path.chmod(0o755)
    return path


@pytest.mark.parametrize(
    "cxx, says",
    [
        ("bin/cxxwrap.sh", "and this one for neither gcc nor clang"),
        ("bin/clang-wrapper", "and this one for clang"),
        ("/bin/false", "does not answer --version as a C++ compiler does"),
        ("no-such-dir/g++", "is not found"),
    ],
)
def test_a_compiler_inductor_would_misname_is_refused_naming_cxx(tmp_path, monkeypatch, cxx, says):
    """Inductor picks pragmas and flags by ``$CXX``'s name (a gcc behind a
    wrapper named otherwise got ``#pragma unroll`` for ``#pragma GCC unroll``,
    so other code under the same key): such a ``CXX``, and one that is no
    compiler, is refused with its name and the fix."""
    from kernel_cache.errors import ConfigError
    from kernel_cache.plan.keys import cxx_toolchain
    from warmup.builder.compiler import check_cxx

    path = tmp_path / cxx if not cxx.startswith("/") else cxx
    if str(path).startswith(str(tmp_path / "bin")):
        _wrapper(path, tmp_path / "log")
    monkeypatch.setenv("CXX", str(path))
    cxx_toolchain.cache_clear()
    try:
        with pytest.raises(ConfigError) as e:
            check_cxx()
    finally:
        cxx_toolchain.cache_clear()
    msg = str(e.value)
    assert f"CXX={str(path)!r}" in msg and says in msg and "fix:" in msg, msg


def test_a_gcc_wrapper_named_for_gcc_passes(tmp_path, monkeypatch):
    from kernel_cache.plan.keys import cxx_toolchain
    from warmup.builder.compiler import check_cxx

    for name in ("g++-counting", "x86_64-linux-gnu-g++", "gcc-wrap"):
        monkeypatch.setenv("CXX", str(_wrapper(tmp_path / "bin" / name, tmp_path / "log")))
        cxx_toolchain.cache_clear()
        check_cxx()
    monkeypatch.delenv("CXX")
    cxx_toolchain.cache_clear()
    check_cxx()  # the default, g++


def test_warmup_refuses_a_misnamed_compiler_before_it_runs_it(tmp_path, tiny_model):
    """The whole warmup, with a gcc behind a wrapper named ``cxxwrap.sh``: every
    variant fails naming CXX and the fix, the wrapper logs no compile (only
    its probes ran), and nothing is cached."""
    import json

    from ..conftest import run_cli, tiny_args

    log = tmp_path / "log"
    cxx = _wrapper(tmp_path / "bin" / "cxxwrap.sh", log)
    proc = run_cli(
        "warmup", *tiny_args(tiny_model), "--kv-buckets", "32", "--query-buckets", "32",
        "--cache-dir", tmp_path / "cache", "--jobs", "1", "--json", env={"CXX": str(cxx)},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["compiled"] == 0 and len(report["failed"]) == 2
    for f in report["failed"]:
        assert "neither gcc nor clang" in f["error"] and "fix:" in f["error"], f
    assert not log.exists() or log.read_text() == ""
