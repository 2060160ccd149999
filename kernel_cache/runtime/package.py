"""One verified ``.pt2`` package loaded into a runner, for engine start and
warmup's checks: :func:`load_package`, and the process's load directory
(:func:`load_dir`) it unpacks into.

A package goes to AOTInductor's runtime loader
(:func:`kernel_cache.torch_compat.load_aoti_package`), unpacked first, or, on
the CPU, when its ``.so`` is all the loader would load, that ``.so`` alone to
the CPU runner. Nothing here finds or verifies an entry: engine start
(:func:`kernel_cache.runtime.load.load_plan`) and warmup hand in bytes already
checked.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

from kernel_cache.errors import ConfigError, CorruptEntryError, TorchAPIDriftError

_LOAD_PREFIX = "kernel_cache-load-"
_load_dir: str | None = None
_load_dir_lock = threading.Lock()


def _remove_own_load_dir(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that inherited the handler
        shutil.rmtree(path, ignore_errors=True)


def load_dir() -> str:
    """This process's directory for unpacked packages, made on first use.

    AOTInductor's loader, given a ``.pt2`` file, unpacks it (its ``.so`` and
    data) into a new ``aotinductor_*`` directory under ``$TMPDIR`` and never
    removes it: a start of a 26-variant plan left 26 such directories behind.
    Loads therefore unpack into ``$TMPDIR/kernel_cache-load-<pid>-*`` themselves
    (:func:`load_package`), removed when the process exits;
    directories of processes that died without exiting (SIGKILL) are removed by
    the next process that loads. A process holds an ``flock`` in its directory
    while it lives (:func:`kernel_cache.store.locks.private_temp_dir`), so
    processes in other PID namespaces (containers sharing ``$TMPDIR``) never
    remove each other's.

    Raises:
        ConfigError: the directory is on a ``noexec`` mount, from which no
            compiled kernel can be mapped (every load would fail as if the
            entries were corrupt).
    """
    global _load_dir
    with _load_dir_lock:  # engines that start in two threads share one directory
        if _load_dir is None:
            from kernel_cache.store.locks import private_temp_dir, remove_private_temp_dir

            made = private_temp_dir(_LOAD_PREFIX)
            if os.statvfs(made).f_flag & getattr(os, "ST_NOEXEC", 0):
                remove_private_temp_dir(made)
                raise ConfigError(
                    f"the load directory {made} is on a noexec mount (TMPDIR="
                    f"{os.environ.get('TMPDIR', '')!r}): compiled kernels cannot be mapped "
                    "from it; set TMPDIR to a folder on a mount that allows executables"
                )
            _load_dir = made
            atexit.register(_remove_own_load_dir, _load_dir, os.getpid())
        return _load_dir


def load_package(data: bytes, device: str, where: str = "", key: str = ""):
    """Load verified ``.pt2`` bytes with the AOTInductor runtime loader.

    The package is unpacked into a new folder of :func:`load_dir` (never the
    cache directory, which may be read-only), and the loader is given that
    folder: AOTInductor's ``AOTIModelPackageLoader`` loads an unpacked package
    in place (torch 2.13), so it creates nothing under ``$TMPDIR`` and no
    environment variable is changed for it. The folder stays while the
    process runs (on CUDA the runner reads its kernels' cubin files from it)
    and goes with :func:`load_dir` at exit.

    On the CPU, a package that holds only its ``.so``, metadata and source
    (:func:`_cpu_library`) skips the loader: only the ``.so``, read from
    ``data``, is written and loaded (:func:`_load_cpu_library`; 1.7 ms per
    variant against 2.3 ms through the loader; docs/benchmarks/engine-start.md,
    "`load_plan` alone").

    On CUDA the runner is created in AOTInductor's single-threaded mode
    (``AOTIModelPackageLoader(path, model_name, run_single_threaded=True,
    num_runners=1, device_index)``): a call only enqueues its kernels on the
    current stream and returns, and it can be captured in a CUDA graph. The
    thread-safe mode waits, in every call, for the previous call's kernels to
    finish on the GPU (host time per call = GPU time; measured on an H200: 374
    us of host time per decode call against 34 us) and cannot be captured.
    Single-threaded runners must not be called from two threads at once, which
    :class:`~kernel_cache.runtime.dispatch.AttentionRuntime` already requires.

    Raises:
        CorruptEntryError: the loader rejected the package.
        TorchAPIDriftError: the installed torch's loader is missing or takes
            other arguments (:mod:`kernel_cache.torch_compat`); the entry is not
            at fault and is left as it is.
        ConfigError: the package cannot be unpacked into the load directory,
            or, by a loader that takes only archives, into ``$TMPDIR`` (full
            or unwritable; names it).
    """
    import torch  # here, not at module top: listings and ``explain`` need no torch

    from kernel_cache import torch_compat

    if device == "cpu":
        library = _cpu_library(data, where, key)
        if library is not None:
            return _load_cpu_library(library, where, key)
    archive = not torch_compat.aoti_loader_takes_folders()
    path = _write_archive(data, where, key) if archive else _unpack(data, where, key)
    folder = os.path.dirname(path) if archive else path  # ours, removed if the load fails
    device_index = torch.cuda.current_device() if device == "cuda" else -1
    try:
        return torch_compat.load_aoti_package(
            path,
            model_name="model",
            run_single_threaded=device == "cuda",
            num_runners=1,
            device_index=device_index,
        )
    except TorchAPIDriftError:
        shutil.rmtree(folder, ignore_errors=True)
        raise  # torch's API, not this entry
    except Exception as e:  # the loader raises RuntimeError for a bad package
        shutil.rmtree(folder, ignore_errors=True)
        if archive:
            unwritable = _loader_unpack_error(key, data, str(e))
            if unwritable is not None:
                raise unwritable from None
        raise CorruptEntryError(key, f"the AOTInductor loader rejected it: {e}", where) from None


def _unpack(data: bytes, where: str, key: str) -> str:
    """The package ``data`` unpacked into a new folder of :func:`load_dir`
    (its path). :mod:`zipfile` writes no file outside that folder (absolute
    names and ``..`` are dropped) and makes no link.

    Raises:
        CorruptEntryError: ``data`` is not a zip archive.
        ConfigError: writing into the load directory failed (full, unwritable).
    """
    import io
    import zipfile

    out = _new_load_folder(data, key)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            z.extractall(out)
    except _not_a_zip() as e:
        shutil.rmtree(out, ignore_errors=True)
        raise CorruptEntryError(
            key, f"the AOTInductor loader rejected it: not a package ({e})", where
        ) from None
    except OSError as e:  # the load directory, not the entry: a full or unwritable TMPDIR
        shutil.rmtree(out, ignore_errors=True)
        raise _load_dir_error(key, data, out, e) from None
    return out


def _write_archive(data: bytes, where: str, key: str) -> str:
    """``data`` written as ``package.pt2`` in a new folder of :func:`load_dir`
    (its path), for a loader that takes only archives (torch older than 2.13,
    :func:`kernel_cache.torch_compat.aoti_loader_takes_folders`). That loader
    unpacks the archive under ``$TMPDIR`` itself and leaves the folder there
    (docs/serving.md, "What engine start leaves to the engine").

    Its members' CRC-32 are checked first, as :func:`_unpack`'s extraction
    checks them: that loader's unpack does not, and it would load a ``.so``
    whose bytes disagree with the archive's own record of them.

    Raises:
        CorruptEntryError: ``data`` is not a zip archive, or a member's bytes
            fail their CRC-32.
        ConfigError: writing into the load directory failed (full, unwritable).
    """
    import io
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            bad = z.testzip()
    except _not_a_zip() as e:
        bad, why = None, f"not a package ({e})"
    else:
        why = None if bad is None else f"not a package (Bad CRC-32 for file {bad!r})"
    if why is not None:
        raise CorruptEntryError(key, f"the AOTInductor loader rejected it: {why}", where)
    out = _new_load_folder(data, key)
    path = os.path.join(out, "package.pt2")
    try:
        with open(path, "xb") as f:
            f.write(data)
    except OSError as e:
        shutil.rmtree(out, ignore_errors=True)
        raise _load_dir_error(key, data, out, e) from None
    return path


def _new_load_folder(data: bytes, key: str) -> str:
    """A new folder of :func:`load_dir` for the package ``data`` of ``key``.

    Raises:
        ConfigError: it cannot be made (a full or unwritable load directory).
    """
    base = load_dir()
    try:
        return tempfile.mkdtemp(prefix="kernel_cache-", dir=base)
    except OSError as e:
        raise _load_dir_error(key, data, base, e) from None


def _not_a_zip() -> tuple[type[BaseException], ...]:
    """What :mod:`zipfile` raises for bytes that are not a package it can read
    (a bad or truncated archive, an unknown compression method)."""
    import zipfile

    return (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, NotImplementedError)


#: How the archive-only loader (torch older than 2.13) says that its own
#: unpack could not be written: its folder not made (a read-only, missing or
#: unwritable ``$TMPDIR``), a write failed (miniz's write callback: ENOSPC,
#: EACCES, a file-size limit); and the folder it made for that unpack.
_LOADER_WRITE_FAILED = ("Error generating temporary directory", "write callback failed")
_LOADER_UNPACK_DIR = re.compile(r"to destination file (.*?/aotinductor_[^/]+)/")


def _loader_tmp() -> str:
    """Where that loader unpacks (``std::filesystem::temp_directory_path``:
    ``$TMPDIR``, ``$TMP``, ``$TEMP``, ``$TEMPDIR``, else ``/tmp``); Python's
    :func:`tempfile.gettempdir` may differ, as it skips an unwritable one."""
    return next(filter(None, map(os.environ.get, ("TMPDIR", "TMP", "TEMP", "TEMPDIR"))), "/tmp")


def _loader_unpack_error(key: str, data: bytes, message: str) -> ConfigError | None:
    """The error of an archive-only loader whose unpack into ``$TMPDIR`` could
    not be written (the directory's fault, not the entry's), its partial
    folder removed; None for any other rejection."""
    if not any(m in message for m in _LOADER_WRITE_FAILED):
        return None
    tmp = _loader_tmp()
    made = _LOADER_UNPACK_DIR.search(message)
    if made is not None and os.path.dirname(made[1]) == tmp.rstrip("/"):
        shutil.rmtree(made[1], ignore_errors=True)
    return ConfigError(
        f"cannot unpack entry {key[:16]} ({len(data)} bytes) into {tmp}: the AOTInductor "
        f"loader of this torch unpacks every package there itself, and a write failed "
        f"({message[:300]}); free space there or set TMPDIR to a folder with room"
    )


def _load_dir_error(key: str, data: bytes, path: str, e: OSError) -> ConfigError:
    """The error of a write into the load directory that failed (``e``: ENOSPC,
    EACCES...): the directory's fault, not the entry's."""
    return ConfigError(
        f"cannot unpack entry {key[:16]} ({len(data)} bytes) into the load directory "
        f"{path}: {e}; free space there or set TMPDIR to a folder with room"
    )


#: A CPU package's model files, under its archive's top folder (``model/``).
_MODEL_DIR = "data/aotinductor/model/"


def _cpu_library(data: bytes, where: str, key: str) -> bytes | None:
    """The ``.so`` of a CPU package, if loading it alone is all AOTInductor's
    loader would do with the package; else None (the loader then loads it).

    That is: the package's model folder holds one ``.so``, its
    ``<name>_metadata.json`` saying ``AOTI_DEVICE_KEY`` ``cpu``, and otherwise
    only ``.cpp`` and ``_metadata.json`` files (generated source, flags: the
    loader reads the source only to compile a package that has no ``.so``,
    which an engine never does). Weights stored beside the ``.so``, the
    ``<name>.json`` of a graph that calls custom ops (the loader hands it to
    the proxy executor that runs them), anything else unknown, more than one
    top folder or a member name used twice (where this reading and the
    loader's could pick different ``.so`` files; the loader refuses two) send
    the package to the loader. ``data`` are the verified bytes:
    the ``.so`` returned is read from them, not from a file.

    Raises:
        CorruptEntryError: ``data`` is not a zip archive (the loader rejects it too).
    """
    import io
    import json
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = z.namelist()
            if len(set(names)) != len(names) or len({n.partition("/")[0] for n in names}) != 1:
                return None
            files = {}
            for info in z.infolist():
                _, _, rest = info.filename.partition("/")
                if rest.startswith(_MODEL_DIR) and not info.is_dir():
                    files[rest[len(_MODEL_DIR) :]] = info
            libs = [n for n in files if n.endswith(".so")]
            if len(libs) != 1 or any(
                "/" in n or not n.endswith((".so", ".cpp", "_metadata.json")) for n in files
            ):
                return None
            meta = files.get(libs[0][: -len(".so")] + "_metadata.json")
            if meta is None or json.loads(z.read(meta)).get("AOTI_DEVICE_KEY") != "cpu":
                return None
            return z.read(files[libs[0]])
    except _not_a_zip() as e:
        raise CorruptEntryError(
            key, f"the AOTInductor loader rejected it: not a package ({e})", where
        ) from None


def _load_cpu_library(library: bytes, where: str, key: str):
    """AOTInductor's CPU runner (``AOTIModelContainerRunnerCpu(so_path, 1)``, the
    runner the package loader makes for a CPU package, with one model) of the
    ``.so`` bytes ``library``, written to a private file in :func:`load_dir`,
    loaded (``dlopen``) and removed (the loaded library stays mapped).

    Raises:
        CorruptEntryError: the library does not load.
        TorchAPIDriftError: as :func:`load_package`'s.
        ConfigError: the library cannot be written into the load directory (a
            full ``$TMPDIR``; names it).
    """
    from kernel_cache import torch_compat

    base = load_dir()
    try:
        fd, path = tempfile.mkstemp(suffix=".so", prefix="kernel_cache-", dir=base)
    except OSError as e:
        raise _load_dir_error(key, library, base, e) from None
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(library)
        except OSError as e:  # a full TMPDIR: the load directory's fault, not the entry's
            raise _load_dir_error(key, library, base, e) from None
        try:
            return torch_compat.load_cpu_runner(path, num_models=1)
        except TorchAPIDriftError:
            raise  # torch's API, not this file
        except Exception as e:  # dlopen or a missing symbol: RuntimeError
            raise CorruptEntryError(
                key, f"the AOTInductor loader rejected it: {e}", where
            ) from None
    finally:
        Path(path).unlink(missing_ok=True)
