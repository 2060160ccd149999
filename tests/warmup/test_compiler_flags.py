"""The host code's -march on a torch whose Inductor has no ``cpp.march`` option
(before 2.13: the GPU image's torch): the C++ builder's flags are rewritten for
the compile only."""

from torch._inductor import config, cpp_builder

from warmup.build.compiler import _host_march


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
