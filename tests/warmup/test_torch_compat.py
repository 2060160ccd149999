"""The build's private torch names (warmup/torch_compat.py) taken away from the
real torch modules: each raises TorchAPIDriftError naming the torch version,
the name and the fix, leaves torch's state as it was, and is never reported as
one variant's compile error. Nothing is compiled."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor import codecache, cpp_builder

from kernel_cache.errors import CompileError, TorchAPIDriftError
from kernel_cache.plan.buckets import Bucketer
from warmup import torch_compat
from warmup.builder.compiler import _host_march, compile_with_options
from warmup.builder.normalize import build_paths_mapped


def assert_drift(e: TorchAPIDriftError, api: str, why: str = "is missing") -> None:
    msg = str(e)
    assert not isinstance(e, CompileError)
    assert e.api == api and f"torch {torch.__version__}: {api} {why}" in msg
    assert "checked with torch 2.11, 2.13" in msg
    assert "pin torch to a checked version" in msg and "upgrade kernel-cache" in msg


def test_a_missing_compile_command_hook_stops_the_build_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/before")
    headers = codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR
    monkeypatch.delattr(cpp_builder, "_run_compile_cmd")
    with pytest.raises(TorchAPIDriftError) as e:
        with build_paths_mapped(str(tmp_path / "build"), str(tmp_path / "pch")):
            raise AssertionError("never entered")
    assert_drift(e.value, "torch._inductor.cpp_builder._run_compile_cmd")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/before"
    assert (codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR) == headers
    assert not hasattr(cpp_builder, "_run_compile_cmd")  # nothing set in its place


def test_a_compile_command_hook_with_other_parameters_is_drift(monkeypatch):
    def run(cmd: list, cwd: str, env: dict) -> None:  # a later torch's, say
        raise AssertionError("never called")

    monkeypatch.setattr(cpp_builder, "_run_compile_cmd", run)
    with pytest.raises(TorchAPIDriftError) as e:
        with torch_compat.compile_command_wrapped(lambda f: f):
            pass
    assert_drift(
        e.value,
        "torch._inductor.cpp_builder._run_compile_cmd",
        "takes (cmd, cwd, env), not (cmd_line, cwd)",
    )
    assert cpp_builder._run_compile_cmd is run


def test_a_missing_headers_folder_is_drift_not_a_silent_new_variable(tmp_path, monkeypatch):
    lock = codecache._HEADER_LOCK_DIR
    monkeypatch.delattr(codecache, "_HEADER_DIR")
    with pytest.raises(TorchAPIDriftError) as e:
        with torch_compat.header_dir(str(tmp_path)):
            pass
    assert_drift(e.value, "torch._inductor.codecache._HEADER_DIR")
    assert not hasattr(codecache, "_HEADER_DIR") and codecache._HEADER_LOCK_DIR == lock


def test_a_missing_march_hook_is_drift(monkeypatch):
    monkeypatch.delattr(cpp_builder, "_get_optimization_cflags")
    assert not torch_compat.has_optimization_cflags()
    with pytest.raises(TorchAPIDriftError) as e:
        with _host_march("x86-64-v2"):
            pass
    assert_drift(e.value, "torch._inductor.cpp_builder._get_optimization_cflags")


def test_a_missing_vec_isa_picker_is_drift(monkeypatch):
    from torch._inductor import cpu_vec_isa

    monkeypatch.delattr(cpu_vec_isa, "pick_vec_isa")
    with pytest.raises(TorchAPIDriftError) as e:
        torch_compat.chosen_vec_isa({})
    assert_drift(e.value, "torch._inductor.cpu_vec_isa.pick_vec_isa")


def test_a_missing_or_uncached_vec_isa_list_is_drift(monkeypatch):
    """The pick narrowed to the target's ISA needs Inductor's ISA list, its
    per-process cache, and a list built from it; each missing is drift, named,
    and leaves Inductor's list as it was."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()  # as in a process that has not picked yet
    listed = cpu_vec_isa.supported_vec_isa_list
    for patch, api, why in (
        (("valid_vec_isa_list", lambda: []), "valid_vec_isa_list", "is not cached per process"),
        (("supported_vec_isa_list", None), "supported_vec_isa_list", "is missing"),
        (("supported_vec_isa_list", ()), "supported_vec_isa_list", "is a tuple, not a list"),
    ):
        if patch[1] is None:
            monkeypatch.delattr(cpu_vec_isa, patch[0])
        else:
            monkeypatch.setattr(cpu_vec_isa, *patch)
        with pytest.raises(TorchAPIDriftError) as e:
            with torch_compat.vec_isa_narrowed("avx2", {"cpp.vec_isa_ok": True}):
                raise AssertionError("never entered")
        assert_drift(e.value, f"torch._inductor.cpu_vec_isa.{api}", why)
        monkeypatch.undo()
        assert cpu_vec_isa.supported_vec_isa_list is listed
    # a list built from elsewhere: the narrowing would do nothing
    full = functools.cache(lambda: list(listed))
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", full)
    with pytest.raises(TorchAPIDriftError) as e:
        with torch_compat.vec_isa_narrowed("avx2", {"cpp.vec_isa_ok": True}):
            raise AssertionError("never entered")
    assert_drift(
        e.value,
        "torch._inductor.cpu_vec_isa.valid_vec_isa_list",
        "is not built from supported_vec_isa_list",
    )
    assert full.cache_info().currsize == 0 and cpu_vec_isa.supported_vec_isa_list is listed
    with pytest.raises(ValueError, match="'avx512' cannot be narrowed to"):
        with torch_compat.vec_isa_narrowed("avx512", {}):
            pass


def test_a_missing_config_module_is_drift(monkeypatch):
    assert set(torch_compat.config_modules()) == set(torch_compat.CONFIG_MODULES)
    monkeypatch.setitem(sys.modules, "torch._functorch.config", None)  # import fails
    with pytest.raises(TorchAPIDriftError) as e:
        torch_compat.config_modules()
    assert_drift(e.value, "torch._functorch.config", "is missing (no such module)")


def test_a_missing_aoti_compile_is_drift_not_a_variant_compile_error(tiny_config, monkeypatch):
    """Resolved before the export: the variant's build stops with the drift
    error, not ``CompileError("AOTInductor failed for ...")``."""
    import torch._inductor

    monkeypatch.delattr(torch._inductor, "aoti_compile_and_package")
    variant = Bucketer(tiny_config).variants[0]
    with pytest.raises(TorchAPIDriftError) as e:
        compile_with_options(tiny_config, variant, {})
    assert_drift(e.value, "torch._inductor.aoti_compile_and_package")


def test_gpu_kernels_are_linked_in_name_order_whatever_order_they_were_added(tmp_path):
    """The table a CUDA package's link reads: emptied on entry (an earlier
    compile's kernel keeps no place in it), kept sorted by kernel name while
    kernels are added out of order, and torch's own ``set`` put back after."""
    table = codecache.CudaKernelParamCache
    own = vars(table)["set"]
    table.cache["triton_from_an_earlier_compile"] = {}
    with torch._inductor.config.patch({"aot_inductor.output_path": str(tmp_path)}):
        with torch_compat.gpu_kernels_in_name_order():
            for name in ("triton_poi_2", "triton_per_0", "triton_poi_1"):
                table.set(name, {"mangled_name": name}, name.encode(), "cubin")
            assert list(table.cache) == ["triton_per_0", "triton_poi_1", "triton_poi_2"]
            assert sorted(os.listdir(tmp_path)) and all(
                os.path.exists(v["cubin_path"]) for v in table.cache.values()
            )
    assert vars(table)["set"] is own
    table.cache_clear()


def test_a_missing_gpu_kernel_table_is_drift(monkeypatch):
    monkeypatch.delattr(codecache, "CudaKernelParamCache")
    with pytest.raises(TorchAPIDriftError) as e:
        with torch_compat.gpu_kernels_in_name_order():
            raise AssertionError("never entered")
    assert_drift(e.value, "torch._inductor.codecache.CudaKernelParamCache")


def test_a_cubin_object_is_the_same_bytes_in_any_scratch_folder(tmp_path):
    """How a CUDA package embeds a kernel's cubin (``ld -r -b binary``, then
    objcopy), with real binutils: from two folders of different lengths the
    object is byte for byte the same, with Inductor's symbol names; inside
    the block Inductor calls this one, after it its own again."""
    original = codecache.convert_cubin_to_obj
    cubin = os.urandom(5000)
    objects = []
    for folder in ("a", "b" * 40):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "cabc123.cubin"
        path.write_bytes(cubin)
        with torch_compat.cubin_objects_named_by_content():
            obj = codecache.convert_cubin_to_obj(str(path), "triton_k_0", "ld", "objcopy")
        assert obj == f"{path}.o"
        objects.append(Path(obj).read_bytes())
    assert objects[0] == objects[1]
    nm = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    assert {line.split()[-1] for line in nm.splitlines()} == {
        f"__triton_k_0_{p}" for p in ("start", "end", "size")
    }
    assert codecache.convert_cubin_to_obj is original


def test_a_cubin_converter_with_other_parameters_is_drift(monkeypatch):
    monkeypatch.setattr(codecache, "convert_cubin_to_obj", lambda path, name: None)
    with pytest.raises(TorchAPIDriftError) as e:
        with torch_compat.cubin_objects_named_by_content():
            raise AssertionError("never entered")
    assert_drift(e.value, "torch._inductor.codecache.convert_cubin_to_obj", "takes (path, name)")


def _symbols(obj: str) -> set[str]:
    nm = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in nm.splitlines()}


@pytest.mark.parametrize("name", ["c-ab.cd.cubin", "a b-c.d.cubin", "-x.cubin", "é1.cubin"])
def test_a_cubin_file_name_with_odd_characters_still_gets_the_kernels_symbols(tmp_path, name):
    """ld names its symbols after the file name, each byte not an ASCII letter
    or digit as ``_``: spaces, dashes, dots, a leading dash (not an option to
    ld or objcopy) and a non-ASCII name (two bytes, two ``_``) all end up as
    the kernel's three symbols, as torch's own converter gives where it runs
    (a name without spaces or a leading dash; torch's splits its command at spaces)."""
    path = tmp_path / name
    path.write_bytes(os.urandom(300))
    want = {f"__triton_k_0_{p}" for p in ("start", "end", "size")}
    if " " not in name and not name.startswith("-") and name.isascii():
        theirs = cpp_builder.convert_cubin_to_obj(str(path), "triton_k_0", "ld", "objcopy")
        assert _symbols(theirs) == want
        os.remove(theirs)
    with torch_compat.cubin_objects_named_by_content():
        obj = codecache.convert_cubin_to_obj(str(path), "triton_k_0", "ld", "objcopy")
    assert obj == f"{path}.o"
    assert _symbols(obj) == want


def test_torch_state_is_put_back_when_the_compile_raises_inside_the_blocks():
    from torch._inductor.codegen import cpp

    table = codecache.CudaKernelParamCache
    own, original = vars(table)["set"], codecache.convert_cubin_to_obj
    stride = cpp.stride_at_vec_range
    with pytest.raises(RuntimeError, match="compile failed"):
        with (
            torch_compat.gpu_kernels_in_name_order(),
            torch_compat.cubin_objects_named_by_content(),
            torch_compat.index_analysis_kept(),
        ):
            assert codecache.convert_cubin_to_obj is not original
            assert cpp.stride_at_vec_range is not stride
            raise RuntimeError("compile failed")
    assert vars(table)["set"] is own and codecache.convert_cubin_to_obj is original
    assert cpp.stride_at_vec_range is stride


def test_the_stride_analysis_runs_once_per_expression_across_compiles(monkeypatch):
    """More distinct index expressions than torch's 128 cache entries, asked
    for through the code generator's name in one block and again in the next
    (a worker's next compile): the function runs once per expression (counted
    inside it, not by a cache), and torch's function is back after each block."""
    import sympy
    from torch._inductor.codegen import cpp

    runs, real = [], cpp.stride_at_vec_range.__wrapped__

    def stride_at_vec_range(index, var, vec_length=None):
        runs.append(index)
        return real(index, var, vec_length)

    torchs = functools.lru_cache(maxsize=128)(stride_at_vec_range)
    monkeypatch.setattr(cpp, "stride_at_vec_range", torchs)
    # a factory of its own: no kept cache of this test's function outlives it
    monkeypatch.setattr(torch_compat, "_kept", functools.cache(torch_compat._kept.__wrapped__))
    x = sympy.Symbol("x0", integer=True, nonnegative=True)
    exprs = [k * x + k for k in range(1, 301)]
    for _ in range(2):
        with torch_compat.index_analysis_kept():
            assert cpp.stride_at_vec_range is not torchs
            assert [cpp.stride_at_vec_range(e, x, 8) for e in exprs] == list(range(1, 301))
        assert cpp.stride_at_vec_range is torchs
    assert len(runs) == len(exprs) == len(set(runs))
    for e in exprs:  # torch's own 128 entries, asked again in the same order: none kept
        torchs(e, x, 8)
    assert len(runs) == 2 * len(exprs)


@pytest.mark.parametrize("how", ["missing", "uncached"])
def test_a_stride_analysis_of_another_form_is_drift(monkeypatch, how):
    from torch._inductor.codegen import cpp

    api = "torch._inductor.codegen.cpp.stride_at_vec_range"
    if how == "missing":
        monkeypatch.delattr(cpp, "stride_at_vec_range")
        why = "is missing"
    else:
        monkeypatch.setattr(cpp, "stride_at_vec_range", lambda index, var, vec_length=None: 0)
        why = "is not cached by torch (functools.lru_cache)"
    before = getattr(cpp, "stride_at_vec_range", None)
    with pytest.raises(TorchAPIDriftError) as e:
        with torch_compat.index_analysis_kept():
            raise AssertionError("never entered")
    assert_drift(e.value, api, why)
    assert getattr(cpp, "stride_at_vec_range", None) is before


def test_built_headers_are_forgotten_when_the_folder_changes(tmp_path, monkeypatch):
    """Inductor's header builder returns the path of a header it built and
    keeps it for the process; a block with another folder clears what it kept
    (the builder runs again, counted inside it), one with the same folder does
    not, and ``headers_forgotten`` clears it after the last block."""
    built = []

    @functools.cache
    def _precompile_header(header, hashable_cmd_line, **compile_command):
        built.append(codecache._HEADER_DIR)
        return os.path.join(codecache._HEADER_DIR, "h.h")

    monkeypatch.setattr(codecache, "_precompile_header", _precompile_header)
    monkeypatch.setattr(torch_compat, "_headers_of", None)
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    for folder in (first, first, second):
        with torch_compat.header_dir(folder):
            assert codecache._precompile_header("x.h", "g++") == os.path.join(folder, "h.h")
    assert built == [first, second]
    torch_compat.headers_forgotten()
    assert torch_compat._headers_of is None and _precompile_header.cache_info().currsize == 0
    with torch_compat.header_dir(second):
        codecache._precompile_header("x.h", "g++")
    assert built == [first, second, second]


@pytest.mark.parametrize("how", ["missing", "uncached"])
def test_a_header_builder_of_another_form_is_drift(tmp_path, monkeypatch, how):
    api = "torch._inductor.codecache._precompile_header"
    if how == "missing":
        monkeypatch.delattr(codecache, "_precompile_header")
        why = "is missing"
    else:
        monkeypatch.setattr(codecache, "_precompile_header", lambda header, cmd, **kw: header)
        why = "is not cached by torch (functools.cache)"
    monkeypatch.setattr(torch_compat, "_headers_of", None)
    folders = codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR
    with pytest.raises(TorchAPIDriftError) as e:
        with torch_compat.header_dir(str(tmp_path)):
            raise AssertionError("never entered")
    assert_drift(e.value, api, why)
    assert (codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR) == folders
