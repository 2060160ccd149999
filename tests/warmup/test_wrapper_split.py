"""The CPU wrapper compiled in two parts (``warmup.builder.wrapper_split``),
with a recording stand-in for torch's compile-command runner: which commands
run, what is kept and what names it, that a linked folder is never used, that
a wrapper that is not a CPU one is left to be compiled whole, and that a part
that does not compile fails with the compiler's error, its source as it was.
The real compiles, their count across processes and their bytes:
``test_index_strides.py``; the split packages' numbers: every compiling test."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
from torch._inductor.exc import CppCompileError

from warmup.builder.wrapper_split import (
    BASE,
    CPU_HEADER,
    FOLDER,
    _object_name,
    compile_split,
    split,
)
from warmup.torch_compat import aoti_interface_source

INTERFACE = '#include <iostream>\n// the runtime\nextern "C" { int run() { return 0; } }\n'
OWN = "\nint model_code() { return 1; }\n"
WRAPPER = f"\n{CPU_HEADER}\n{INTERFACE}{OWN}"


def test_the_installed_torch_has_the_interface_it_pastes():
    text = aoti_interface_source()
    assert text and 'extern "C"' in text and "AOTInductorModelContainerRun" in text


def test_split_keeps_the_interface_whole_and_the_own_part_on_its_lines():
    shared, own = split(WRAPPER, INTERFACE)
    assert shared == f"\n{CPU_HEADER}\n{INTERFACE}\ntemplate class {BASE};\n"
    assert own.startswith(f"\n{CPU_HEADER}\n#include <iostream>\nextern template class {BASE};\n")
    line = WRAPPER[: WRAPPER.index(OWN)].count("\n") + 1
    assert own.endswith(f"#line {line}\n{OWN}")  # model_code keeps its line number


@pytest.mark.parametrize(
    "text",
    [
        f"{CPU_HEADER}\n{OWN}",  # no interface
        # not a CPU wrapper
        f"#include <torch/csrc/inductor/aoti_include/cuda.h>\n{INTERFACE}{OWN}",
        f"{CPU_HEADER}\n#define X 1\n{INTERFACE}{OWN}",  # something before the interface
        f"{INTERFACE}{OWN}",  # no CPU header
    ],
)
def test_split_refuses_anything_but_a_cpu_wrapper_that_begins_with_the_interface(text):
    assert split(text, INTERFACE) is None
    assert split(WRAPPER, "") is None


class Runner:
    """Records each command; creates its ``-o`` target; fails a command whose
    source name contains ``fail``, and one that reads an object that says
    ``damaged``."""

    def __init__(self, fail: str | None = None):
        self.commands: list[list[str]] = []
        self.fail = fail

    def __call__(self, cmd_line: str, cwd: str) -> None:
        args = shlex.split(cmd_line)
        self.commands.append(args)
        if self.fail and any(self.fail in a for a in args if a.endswith(".cpp")):
            raise CppCompileError(args, "error: planted")
        inputs = [
            Path(cwd, a) for a in args if a.endswith(".o") and a != args[args.index("-o") + 1]
        ]
        if any(p.is_file() and p.read_bytes() == b"damaged" for p in inputs):
            raise CppCompileError(args, "file format not recognized")
        Path(cwd, args[args.index("-o") + 1]).write_bytes(b"object")


def _build(tmp_path: Path) -> tuple[Path, list[str]]:
    build = tmp_path / "build"
    build.mkdir()
    (build / "kernel_cache.wrapper.cpp").write_text(WRAPPER)
    return build, ["-O1", "kernel_cache.wrapper.cpp", "-c", "-o", "kernel_cache.wrapper.o"]


def test_the_interface_is_compiled_once_and_kept_the_wrapper_left_as_it_was(tmp_path):
    pch = tmp_path / "pch"
    pch.mkdir()
    build, args = _build(tmp_path)
    runs = []
    for _ in range(2):
        run = Runner()
        assert compile_split(
            "g++", args, "-ffile-prefix-map=/a=/b", run, str(build), str(pch), INTERFACE
        )
        runs.append(run.commands)
        assert (build / "kernel_cache.wrapper.cpp").read_text() == WRAPPER
        assert (build / "kernel_cache.wrapper.o").is_file()
        assert not (build / "kernel_cache.wrapper.o.own.o").exists()
    (kept,) = (pch / FOLDER).glob("*.o")
    first, second = runs
    shared_source = str(pch / FOLDER / "aoti_interface.cpp")
    assert [c[-3] for c in first[:2]] == [shared_source, "kernel_cache.wrapper.cpp"]
    assert first[2][-2:] == ["kernel_cache.wrapper.o.own.o", str(kept)]
    assert first[0][1:3] == ["-ffile-prefix-map=/a=/b", "-O1"]
    assert f"-ffile-prefix-map={pch / FOLDER}=/kernel-cache/pch/{FOLDER}" in first[0]
    assert first[2][:5] == ["g++", "-r", "-nostdlib", "-o", "kernel_cache.wrapper.o"]
    assert (
        len(second) == 2 and second[0][-3] == "kernel_cache.wrapper.cpp"
    )  # kept: not compiled again
    assert (pch / FOLDER / "aoti_interface.cpp").read_text() == split(WRAPPER, INTERFACE)[0]


@pytest.mark.parametrize("fail", ["aoti_interface", "wrapper"])
def test_a_part_that_does_not_compile_fails_with_the_compilers_error_and_leaves_nothing(
    tmp_path, fail
):
    pch = tmp_path / "pch"
    pch.mkdir()
    build, args = _build(tmp_path)
    with pytest.raises(CppCompileError, match="planted"):
        compile_split("g++", args, "", Runner(fail=fail), str(build), str(pch), INTERFACE)
    assert (build / "kernel_cache.wrapper.cpp").read_text() == WRAPPER
    assert sorted(p.name for p in build.iterdir()) == ["kernel_cache.wrapper.cpp"]
    assert not list((pch / FOLDER).glob("*.part"))
    kept = list((pch / FOLDER).glob("*.o"))
    assert len(kept) == (0 if fail == "aoti_interface" else 1)  # a compiled interface is kept


def _kept_once(tmp_path: Path) -> tuple[Path, Path, list[str], Path]:
    """A wrapper split once: (the headers' folder, the build folder, the wrapper's
    compile command, the kept object)."""
    pch = tmp_path / "pch"
    pch.mkdir()
    build, args = _build(tmp_path)
    assert compile_split("g++", args, "", Runner(), str(build), str(pch), INTERFACE)
    (kept,) = (pch / FOLDER).glob("*.o")
    return pch, build, args, kept


def test_a_damaged_kept_object_is_compiled_again_once(tmp_path):
    pch, build, args, kept = _kept_once(tmp_path)
    kept.write_bytes(b"damaged")  # e.g. emptied by a crash of the machine
    run = Runner()
    assert compile_split("g++", args, "", run, str(build), str(pch), INTERFACE)
    sources = [c[-3] if "-r" not in c else "join" for c in run.commands]
    assert sources == [
        "kernel_cache.wrapper.cpp",
        "join",
        str(pch / FOLDER / "aoti_interface.cpp"),
        "join",
    ]
    assert kept.read_bytes() == b"object"


def test_the_kept_objects_name_follows_what_reaches_its_bytes():
    args = ["-O1", "-c"]
    here = "-ffile-prefix-map=/home/a/venv/torch=/kernel-cache/torch"
    there = "-ffile-prefix-map=/srv/b/torch=/kernel-cache/torch"
    name = _object_name("src", "g++", args, here)
    assert name == _object_name("src", "g++", args, there)  # another local path, same name
    assert name != _object_name("src", "g++", args, "-ffile-prefix-map=/srv/b/torch=/torch")
    assert name != _object_name("src2", "g++", args, here)
    assert name != _object_name("src", "g++", ["-O2", "-c"], here)


def test_a_linked_folder_or_lock_is_never_used_the_object_is_this_compiles_own(tmp_path):
    build, args = _build(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for linked in (FOLDER, "locks"):
        pch = tmp_path / f"pch-{linked}"
        pch.mkdir()
        (pch / linked).symlink_to(elsewhere)
        run = Runner()
        build_map = f"-ffile-prefix-map={build}=/kernel-cache/build"
        assert compile_split("g++", args, build_map, run, str(build), str(pch), INTERFACE)
        assert list(elsewhere.iterdir()) == []
        own = build / FOLDER
        (obj,) = own.glob("*.o")
        assert run.commands[0][-3] == str(own / "aoti_interface.cpp")
        # mapped to the name the kept folder's source has, after the build folder's
        # map (the compiler takes the last that matches): the same bytes either way
        mapped = run.commands[0].index(f"-ffile-prefix-map={own}=/kernel-cache/pch/{FOLDER}")
        assert mapped > run.commands[0].index(build_map)
        assert run.commands[2][-1] == str(obj)
        shutil.rmtree(own)


def test_only_a_cpu_wrapper_compile_is_split(tmp_path):
    build, _ = _build(tmp_path)
    run = Runner()
    assert not compile_split("g++", [], "", run, str(build), str(tmp_path), None)
    kernel = ["-O3", "kernel_cache.kernel.cpp", "-c", "-o", "kernel_cache.kernel.o"]
    (build / "kernel_cache.kernel.cpp").write_text(f"{CPU_HEADER}\nvoid kernel() {{}}\n")
    assert not compile_split("g++", kernel, "", run, str(build), str(tmp_path), INTERFACE)
    link = ["-shared", "a.o", "-o", "a.so"]
    assert not compile_split("g++", link, "", run, str(build), str(tmp_path), INTERFACE)
    assert run.commands == []


def test_a_killed_builders_part_is_removed_when_the_interface_is_compiled_again(tmp_path):
    pch, build, args, kept = _kept_once(tmp_path)
    kept.unlink()
    left = pch / FOLDER / f"{kept.name}.99999.part"  # what a builder killed while compiling leaves
    left.write_bytes(b"half an object")
    run = Runner()
    assert compile_split("g++", args, "", run, str(build), str(pch), INTERFACE)
    assert len(run.commands) == 3 and kept.is_file() and not left.exists()
