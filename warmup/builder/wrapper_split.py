"""AOTInductor's CPU wrapper compiled in two parts (docs/reproducible.md, "Cost").

Inductor writes one C++ wrapper per package: its runtime's interface (torch's
``codegen/aoti_runtime/interface.cpp``, pasted in whole, with the model
container it instantiates) and then the model's own code. About half of the
wrapper's compile time is the interface, the same text in every CPU package of
one torch. :func:`compile_split` compiles that part once per torch, compiler
and command into an object kept in the precompiled headers' folder, and each
package's own part with ``extern template`` for the model base class, which
the kept object instantiates; the two are joined (``-r``) into the ``.o``
Inductor asked for, and linked as before.

The kept object is named by a hash of what reaches its bytes (its source and
compile command, the path map's names, the compiler's build, the torch build
and its AOTInductor headers, this module: :func:`_object_name`), and compiled
from one fixed path in the folder, so that no builder path or hash enters its
bytes: two builders of one key write the same package whether they compiled
the object or found it, and one whose folder is a link (it compiles the object
for this compile alone) writes the same too. The folder is trusted as the
headers are. A wrapper that is not one of these (another interface text, a
CUDA wrapper) is compiled whole, as Inductor would: the same decision on every
builder of the wrapper. A part that does not compile fails the compile with
the compiler's message, as the whole wrapper would.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

from kernel_cache.config.recipe import BUILD_PATH_NAMES

#: Bump when the split or the kept object's naming changes.
FORMAT = 1
#: The kept objects' folder, in the precompiled headers' folder.
FOLDER = "aoti-interface"
#: The one include line Inductor writes above the interface in a CPU wrapper.
CPU_HEADER = "#include <torch/csrc/inductor/aoti_include/cpu.h>"
#: The model base class (CRTP over the package's model): its code calls the
#: package's model only through symbols, so one instantiation serves every package.
BASE = "torch::aot_inductor::AOTInductorModelBase<torch::aot_inductor::AOTInductorModel>"
#: The kept object's source file name, fixed (it reaches the object's symbol table).
SHARED_SOURCE = "aoti_interface.cpp"
#: The name its folder is mapped to (``-ffile-prefix-map``) wherever it is compiled.
MAPPED_FOLDER = f"{BUILD_PATH_NAMES['pch']}/{FOLDER}"
#: Seconds a builder waits for another that compiles the kept object (as long
#: as Inductor waits for a precompiled header).
LOCK_TIMEOUT_S = 600


def split(text: str, interface: str) -> tuple[str, str] | None:
    """``(shared, own)`` sources of the wrapper ``text``, or None where it is
    not a CPU wrapper that begins with ``interface`` after the CPU header.

    ``shared`` is the text up to the interface's end, plus an explicit
    instantiation of :data:`BASE`; ``own`` is the header and the interface's
    ``#include`` lines, an ``extern template`` of :data:`BASE`, then the rest of
    ``text`` under a ``#line`` that keeps its line numbers (``__LINE__`` in the
    runtime's error messages) those of the whole wrapper."""
    at = text.find(interface) if interface else -1
    if at < 0:
        return None
    head = text[:at]
    if CPU_HEADER not in head or any(
        line.strip() not in ("", CPU_HEADER) for line in head.splitlines()
    ):
        return None
    end = at + len(interface)
    includes = [line for line in interface.splitlines() if line.startswith("#include")]
    shared = f"{text[:end]}\ntemplate class {BASE};\n"
    rest_line = text[:end].count("\n") + 1
    own = (
        "".join([head, *(f"{line}\n" for line in includes), f"extern template class {BASE};\n"])
        + f"#line {rest_line}\n{text[end:]}"
    )
    return shared, own


@functools.cache
def _inputs_digest() -> dict[str, str]:
    """What the kept object's bytes depend on besides its source and command: the
    torch build, its AOTInductor headers (``torch/csrc/inductor``: the interface
    includes the model container from there; sha256 of every file) and this
    module's own code."""
    import torch

    headers = hashlib.sha256()
    root = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "inductor"
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        headers.update(f"{f.relative_to(root)}\0".encode())
        headers.update(hashlib.sha256(f.read_bytes()).digest())
    return {
        "torch": torch.__version__,
        "torch_git": str(getattr(torch.version, "git_version", "")),
        "headers": headers.hexdigest(),
        "module": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }


def _object_name(shared: str, compiler: str, args: list[str], flags: str) -> str:
    """The kept object's file name: a hash of its source, the compile command
    (``args``, source and output left out), the names the path map gives
    (``flags``; they reach the object's ``__FILE__`` strings), the compiler that
    runs (its build: :func:`kernel_cache.plan.keys.cxx_toolchain`) and
    :func:`_inputs_digest`."""
    from kernel_cache.plan.keys import cxx_toolchain

    names = [f.rpartition("=")[2] for f in shlex.split(flags) if f.startswith("-ffile-prefix-map=")]
    doc = {
        "format": FORMAT,
        "source": shared,
        "compiler": compiler,
        "args": args,
        "names": sorted(set(names)) + [MAPPED_FOLDER],
        "toolchain": cxx_toolchain(shutil.which(compiler) or compiler),
        **_inputs_digest(),
    }
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return f"{digest[:40]}.o"


def _compile_shared(folder: Path, name: str, shared: str, compile_to) -> str:
    """``folder/name``, compiled from ``shared`` at the folder's fixed source path
    to a temporary name, flushed to disk and renamed into place, unless it is
    there; a killed builder's temporary file of it removed first. The caller
    holds the lock (or owns the folder)."""
    kept = folder / name
    if kept.is_file() and not kept.is_symlink():
        return str(kept)
    for stale in folder.glob(f"{name}.*.part"):
        stale.unlink(missing_ok=True)
    source = folder / SHARED_SOURCE
    source.unlink(missing_ok=True)
    source.write_text(shared)
    part = f"{kept}.{os.getpid()}.part"
    try:
        compile_to(str(source), part)
        fd = os.open(part, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(part, kept)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
    return str(kept)


def _shared_object(
    pch_dir: str,
    shared: str,
    compiler: str,
    args: list[str],
    flags: str,
    run,
    cwd: str,
    *,
    drop: str | None = None,
) -> str:
    """The object of ``shared``: kept in ``pch_dir`` (compiled there under the
    folder's lock if it is not kept yet; ``drop``, a kept object the join
    refused, removed first), or compiled in ``cwd`` (the compile's own
    folder) for this compile alone where the kept folder, its lock folder or
    the lock is a link. The source's folder is mapped to one name wherever it
    is, so the object's bytes are the same either way.

    Raises:
        OSError: a folder cannot be written; ``filelock.Timeout`` (an OSError)
            after :data:`LOCK_TIMEOUT_S` s waiting for another builder.
    """
    from filelock import FileLock

    name = _object_name(shared, compiler, args, flags)

    def compile_to(source: str, out: str) -> None:
        mapped = shlex.quote(f"-ffile-prefix-map={os.path.dirname(source)}={MAPPED_FOLDER}")
        cmd = [*args, mapped, shlex.quote(source), "-o", shlex.quote(out)]
        run(f"{compiler} {flags} {' '.join(cmd)}", cwd)

    folder, locks = Path(pch_dir, FOLDER), Path(pch_dir, "locks")
    lock = locks / f"{FOLDER}.lock"
    if folder.is_symlink() or locks.is_symlink() or lock.is_symlink():
        own = Path(cwd, FOLDER)
        own.mkdir(mode=0o700, exist_ok=True)
        if drop is not None:
            Path(drop).unlink(missing_ok=True)
        return _compile_shared(own, name, shared, compile_to)
    folder.mkdir(mode=0o700, exist_ok=True)
    locks.mkdir(mode=0o700, exist_ok=True)
    with FileLock(lock, timeout=LOCK_TIMEOUT_S):
        if drop is not None and Path(drop).parent == folder:
            Path(drop).unlink(missing_ok=True)
        return _compile_shared(folder, name, shared, compile_to)


def compile_split(
    compiler: str,
    args: list[str],
    flags: str,
    run: Callable[[str, str], None],
    cwd: str,
    pch_dir: str,
    interface: str | None,
) -> bool:
    """Compile the wrapper that the command ``compiler args`` compiles, in two
    parts (module docstring), with ``flags`` (the path map) before ``args``, the
    interface's object kept in ``pch_dir``. Returns False, having run nothing,
    where the command is not a single C++ source compiled to an object or the
    source is not a CPU wrapper that begins with ``interface``: the caller then
    compiles it whole. A kept object the join refuses (damaged) is removed and
    compiled again, once.

    Raises:
        RuntimeError: torch's ``CppCompileError`` from a part's compile or the
            join, with the compiler's message, as the whole wrapper's would be.
        OSError: the folder or the build directory cannot be written.
    """
    if not interface or "-c" not in args or "-o" not in args[:-1]:
        return False
    out_at = args.index("-o") + 1
    sources = [i for i, a in enumerate(args) if a.endswith(".cpp")]
    if len(sources) != 1:
        return False
    src = args[sources[0]]
    path = Path(cwd, src)
    try:
        original = path.read_bytes()
        parts = split(original.decode("utf-8"), interface)
    except (OSError, UnicodeDecodeError):
        return False
    if parts is None:
        return False
    shared, own = parts
    rest = [shlex.quote(a) for i, a in enumerate(args) if i not in (sources[0], out_at, out_at - 1)]
    out = args[out_at]
    own_o = f"{out}.own.o"

    def join(kept: str) -> None:
        joined = " ".join(shlex.quote(p) for p in (own_o, kept))
        run(f"{compiler} -r -nostdlib -o {shlex.quote(out)} {joined}", cwd)

    try:
        kept = _shared_object(pch_dir, shared, compiler, rest, flags, run, cwd)
        try:  # compiled under the wrapper's own name: __FILE__ unchanged
            path.write_bytes(own.encode("utf-8"))
            run(
                f"{compiler} {flags} {' '.join([*rest, shlex.quote(src)])} -o {shlex.quote(own_o)}",
                cwd,
            )
        finally:
            path.write_bytes(original)
        try:
            join(kept)
        except RuntimeError:  # torch's CppCompileError: the kept object may be damaged
            kept = _shared_object(pch_dir, shared, compiler, rest, flags, run, cwd, drop=kept)
            join(kept)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(Path(cwd, own_o))
    return True
