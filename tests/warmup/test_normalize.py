"""``normalize_package`` on crafted packages (no compile): the compile and link
commands Inductor appends as comments name the compiler by a fixed name, so
builders whose ``CXX`` differs only in path write the same bytes."""

from __future__ import annotations

import io
import logging
import zipfile

from kernel_cache.config.recipe import BUILD_PATH_NAMES
from warmup.builder.normalize import normalize_package

SRC = "model/data/aotinductor/model/kernel_cache.wrapper.cpp"
SO = "model/data/aotinductor/model/kernel_cache.wrapper.so"
CXX = BUILD_PATH_NAMES["cxx"]


def _source(cxx: str, build: str) -> bytes:
    """A wrapper source as Inductor writes it: code, comments, then the compile
    and link commands run by ``cxx`` in ``build``."""
    return (
        'const char* opt = "g++ -o out";  // a code line\n'
        "// Compile cmd\n"
        f"// {cxx} {build}/w.cpp -O1 -c -o {build}/w.o\n"
        "// Link cmd\n"
        f"  //  {cxx} {build}/w.o -shared -o {build}/w.so -lc\n"
        "// g++ -O1, a comment with no output\n"
        "// usage: see /opt/x/docs -o flag, a comment with -o under no command heading\n"
    ).encode()


def _package(cxx: str, build: str, so: bytes = b"\x7fELF g++") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(SRC, _source(cxx, build))
        z.writestr(SO, so)
        z.writestr("model/.data/serialization_id", "1234")
    return buf.getvalue()


def _member(data: bytes, name: str) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return z.read(name)


def test_builders_whose_compiler_differs_in_path_write_the_same_bytes(caplog):
    builds = [("/usr/bin/g++", "/tmp/a/b1"), ("/opt/x/g++", "/home/u/b2"), ("g++", "/b3")]
    with caplog.at_level(logging.WARNING, "kernel_cache"):
        out = {normalize_package(_package(c, b), [(b, "/kernel-cache/build")]) for c, b in builds}
    assert len(out) == 1
    assert not caplog.records  # the bare "g++" in the .so is no builder path
    (data,) = out
    assert _member(data, SRC).decode().splitlines() == [
        'const char* opt = "g++ -o out";  // a code line',
        "// Compile cmd",
        f"// {CXX} /kernel-cache/build/w.cpp -O1 -c -o /kernel-cache/build/w.o",
        "// Link cmd",
        f"  //  {CXX} /kernel-cache/build/w.o -shared -o /kernel-cache/build/w.so -lc",
        "// g++ -O1, a comment with no output",
        "// usage: see /opt/x/docs -o flag, a comment with -o under no command heading",
    ]


def test_a_compiler_path_left_in_another_member_is_warned_of(caplog):
    pkg = _package("/opt/x/g++", "/tmp/a", so=b"\x7fELF /opt/x/g++")
    with caplog.at_level(logging.WARNING, "kernel_cache"):
        normalize_package(pkg, [("/tmp/a", "/kernel-cache/build")])
    (r,) = caplog.records
    assert SO in r.getMessage() and SRC not in r.getMessage()
