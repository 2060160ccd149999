"""Reproducible packages (docs/reproducible.md): builder paths kept out of the
compile commands (:func:`build_paths_mapped`) and out of the ``.pt2`` package,
whose bytes are made equal across builders of one key (:func:`normalize_package`).

Part of the ``sources`` key component: :mod:`warmup.builder.compiler` imports it,
so it is hashed into every key (:func:`kernel_cache.plan.sources.source_files`).
"""

from __future__ import annotations

import contextlib
import os
import re

from kernel_cache.config.recipe import BUILD_PATH_NAMES

#: The time every member of a normalized package carries (the zip format's
#: earliest; torch's own writer uses it too).
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
#: Member data starts at a multiple of this many bytes, as torch's writer does
#: (``PyTorchFileWriter``, padding in an ``FB`` extra field).
ZIP_ALIGN = 64
#: The package member torch fills with a random id per write.
SERIALIZATION_ID = ".data/serialization_id"


def build_path_map(build_dir: str, pch_dir: str | None = None) -> list[tuple[str, str]]:
    """``(path on this builder, fixed name)`` for every directory of this
    builder that reaches a compile command: Inductor's per-compile directory
    ``build_dir``, the precompiled headers' folder ``pch_dir``, the torch
    install (headers, libraries) and the Python install's include and library
    directories, each also as its real path when it differs
    (:data:`kernel_cache.config.recipe.BUILD_PATH_NAMES`). Shortest path first:
    the compiler takes the last matching ``-ffile-prefix-map``."""
    import sysconfig

    import torch

    names = BUILD_PATH_NAMES
    found = [
        (build_dir, names["build"]),
        (pch_dir, names["pch"]),
        (os.path.dirname(torch.__file__), names["torch"]),
        (sysconfig.get_path("include"), names["python_include"]),
        (sysconfig.get_path("include", scheme="posix_prefix"), names["python_include"]),
        (sysconfig.get_config_var("LIBDIR"), names["python_lib"]),
    ]
    pairs: dict[str, str] = {}
    for path, name in found:
        if not path or not os.path.isabs(path):
            continue
        for p in (os.path.abspath(path), os.path.realpath(path)):
            if p != os.sep:
                pairs.setdefault(p, name)
    return sorted(pairs.items(), key=lambda kv: (len(kv[0]), kv[0]))


@contextlib.contextmanager
def build_paths_mapped(tmp: str, pch_dir: str | None = None):
    """Run AOTInductor in a fresh directory under ``tmp`` (its
    ``TORCHINDUCTOR_CACHE_DIR`` for this compile: the generated files carry
    fixed names, so no two compiles may share one) with every C++ compile
    given ``-ffile-prefix-map=PATH=NAME`` for :func:`build_path_map`, so that
    ``__FILE__`` strings in the shared object name no builder path. Yields the
    map, for :func:`normalize_package`.

    ``pch_dir``: where Inductor keeps the precompiled headers
    (``aot_inductor.precompile_headers``), so that later compiles, in this
    process or another, reuse them (None: under ``tmp``, for this compile
    alone). Inductor names each by a hash of its preprocessed text and compile
    command and builds it once under a file lock; a header is compiled to a
    temporary name and renamed into place, so a compiler killed half way
    leaves no truncated header that later compiles would read; the next build
    of that header removes the temporary file left.

    Inductor has no option for extra compiler flags or the headers' folder: its
    one function that runs a compile command is wrapped
    (:func:`warmup.torch_compat.compile_command_wrapped`), and its headers'
    folder is set (:func:`warmup.torch_compat.header_dir`), for the duration
    and restored after.

    Raises:
        TorchAPIDriftError: the installed torch lacks either (names it).
    """
    import glob
    import shlex

    from warmup import torch_compat
    from warmup.builder.wrapper_split import compile_split

    build = os.path.join(os.path.abspath(tmp), "inductor")
    os.makedirs(build, exist_ok=True)
    pch = os.path.join(build, "precompiled_headers") if pch_dir is None else str(pch_dir)
    pch = os.path.abspath(pch)
    os.makedirs(pch, mode=0o700, exist_ok=True)
    pairs = build_path_map(build, pch)
    flags = " ".join(shlex.quote(f"-ffile-prefix-map={p}={n}") for p, n in pairs)
    interface = torch_compat.aoti_interface_source()

    def wrap(run):
        def mapped(cmd_line: str, cwd: str) -> None:
            compiler, _, rest = cmd_line.partition(" ")
            args = shlex.split(rest)
            out = args[args.index("-o") + 1] if "-o" in args[:-1] else None
            if out is None or not out.endswith(".gch"):
                if compile_split(compiler, args, flags, run, cwd, pch, interface):
                    return None
                return run(f"{compiler} {flags} {rest}", cwd)
            # Inductor holds the header's lock here: any other part is a killed builder's
            for stale in glob.glob(f"{glob.escape(out)}.*.part"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
            part = f"{out}.{os.getpid()}.part"
            args[args.index("-o") + 1] = part
            try:
                run(f"{compiler} {flags} {shlex.join(args)}", cwd)
                os.replace(part, out)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)

        return mapped

    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = build
    try:
        with torch_compat.header_dir(pch), torch_compat.compile_command_wrapped(wrap):
            yield pairs
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


#: What a precompiled header's hashed file name becomes in the package's
#: comments: the hash covers the torch install's path, which differs between
#: builders of one key.
_PCH_NAME = BUILD_PATH_NAMES["pch"].encode() + b"/header.h"

#: A compile or link command Inductor appends as a comment
#: (``// <compiler> <args> -o <out>``): group 2 is the compiler as it was run.
_COMMAND = re.compile(rb"^(\s*//\s*)(\S+)(?=.* -o )")
#: The comment lines Inductor writes just above those commands.
_COMMAND_HEADS = (b"// Compile cmd", b"// Link cmd")


def _commands(lines: list[bytes]) -> list[int]:
    """Indexes of the lines of ``lines`` that are a compile or link command
    Inductor appended: a :data:`_COMMAND` line just below one of
    :data:`_COMMAND_HEADS` (another comment that mentions ``-o`` is not one)."""
    return [
        i
        for i in range(1, len(lines))
        if lines[i - 1].strip() in _COMMAND_HEADS and _COMMAND.match(lines[i])
    ]


def _map_comments(text: bytes, pairs: list[tuple[str, str]]) -> bytes:
    """``text`` (C++ source) with each path of ``pairs`` replaced by its name
    in comment lines (``//``: the compile and link commands Inductor appends,
    the kernel file's first line), the compiler that starts a command by
    ``BUILD_PATH_NAMES["cxx"]``, and a precompiled header's hashed file name
    by :data:`_PCH_NAME`; code lines are left as they are."""
    longest_first = [(p.encode(), n.encode()) for p, n in reversed(pairs)]
    pch = re.compile(re.escape(BUILD_PATH_NAMES["pch"].encode()) + rb"/\w+\.h\b")
    cxx = BUILD_PATH_NAMES["cxx"].encode()
    lines = text.split(b"\n")
    commands = set(_commands(lines))
    for i, line in enumerate(lines):
        if line.lstrip().startswith(b"//"):
            if i in commands:
                line = _COMMAND.sub(lambda m: m[1] + cxx, line, count=1)
            for p, n in longest_first:
                line = line.replace(p, n)
            lines[i] = pch.sub(_PCH_NAME, line)
    return b"\n".join(lines)


def _compiler_paths(text: bytes) -> set[bytes]:
    """The compilers that start the commands in ``text``'s comments, where
    named by a path (a bare ``g++`` found on PATH names no builder's path)."""
    lines = text.split(b"\n")
    found = (_COMMAND.match(lines[i]) for i in _commands(lines))
    return {m[2] for m in found if m and b"/" in m[2]}


def normalize_package(data: bytes, pairs: list[tuple[str, str]]) -> bytes:
    """The ``.pt2`` package ``data`` rewritten so that two builds of one key
    give the same bytes: the builder paths of ``pairs`` and the compiler's
    path in the C++ sources' comments replaced by their fixed names
    (:data:`kernel_cache.config.recipe.BUILD_PATH_NAMES`), the random
    serialization id replaced by a digest of every other member (names and
    bytes), the members in torch's order with :data:`ZIP_DATE`, stored, data
    aligned to :data:`ZIP_ALIGN` bytes as torch aligns it.

    Logs a warning naming the members that still hold a builder path, the
    compiler's included (the package is then correct but not reproducible
    across builders).
    """
    import hashlib
    import io
    import logging
    import struct
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as src:
        members = [(i.filename, src.read(i)) for i in src.infolist()]
    paths = {p.encode() for p, _ in pairs}
    paths |= {c for n, b in members if n.endswith(".cpp") for c in _compiler_paths(b)}
    members = [(n, _map_comments(b, pairs) if n.endswith(".cpp") else b) for n, b in members]
    digest = hashlib.sha256()
    for name, body in members:
        if not name.endswith(SERIALIZATION_ID):
            digest.update(name.encode() + b"\0" + hashlib.sha256(body).digest())
    ident = f"{int(digest.hexdigest(), 16) % 10**40:040d}".encode()
    members = [(n, ident if n.endswith(SERIALIZATION_ID) else b) for n, b in members]
    leaks = [n for n, b in members if any(p in b for p in paths)]
    if leaks:
        logging.getLogger("kernel_cache").warning(
            "the package still holds a builder path in %s: it is correct, but another "
            "builder of this key writes other bytes (docs/reproducible.md)",
            ", ".join(leaks),
        )
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out:
        for name, body in members:
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
            info.create_system = 3
            info.external_attr = 0
            start = buf.tell() + 30 + len(name.encode()) + 4
            pad = -start % ZIP_ALIGN
            info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            out.writestr(info, body)
    return buf.getvalue()
