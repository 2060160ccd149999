"""The local cache's memo of import scans (``imports.json``): a fresh process
that reads it computes the same keys and parses no file; a memo it must not
trust, or one made for other bytes, another scanner or another Python, changes
nothing but the parse count. Parses are counted in each child process by
wrapping ``ast.parse``, independently of the memo's own bookkeeping."""

import json
import subprocess
import sys

import pytest

from kernel_cache.store.imports_memo import MEMO_FILE

from ..conftest import ROOT

#: In a fresh process: read the memo of argv[1], build the default plan's keys,
#: count ast.parse calls of .py files, optionally save; print JSON. Mode
#: "engine" runs load_plan on argv[1] instead.
CHILD = r"""
import ast, json, sys
calls = []
_parse = ast.parse
def counting(source, filename="<unknown>", *a, **k):
    if str(filename).endswith(".py"):  # a file's scan; torch parses snippets too
        calls.append(str(filename))
    return _parse(source, filename, *a, **k)
ast.parse = counting
from kernel_cache import make_config
from kernel_cache.plan.plan import Plan
from kernel_cache.store import imports_memo
if sys.argv[2] == "engine":  # engine start on a cache without entries
    from kernel_cache import load_plan
    from kernel_cache.errors import MissingVariantsError
    try:
        load_plan(make_config("llama-3.2-1b"), sys.argv[1])
    except MissingVariantsError as e:
        print(json.dumps({"parsed": calls, "missing": len(e.missing)}))
    raise SystemExit
taken = imports_memo.load(sys.argv[1])
plan = Plan.build(make_config("llama-3.2-1b"))
saved = imports_memo.save(sys.argv[1]) if sys.argv[2] == "save" else None
print(json.dumps({"taken": taken, "parsed": calls, "saved": saved,
                  "keys": [i.hexdigest for i in plan]}))
"""


def child(cache, mode="read") -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache), mode],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def memo_cache(tmp_path):
    """A cache directory whose memo a first process wrote: ``(dir, that process's doc)``."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    first = child(cache, "save")
    assert first["saved"] is True and first["taken"] == 0
    assert len(first["parsed"]) >= 10  # the compile path's files
    return cache, first


def test_a_fresh_process_with_the_memo_parses_nothing_and_gets_the_same_keys(memo_cache):
    cache, first = memo_cache
    doc = child(cache, "save")
    assert doc["parsed"] == [] and doc["taken"] == len(first["parsed"])
    assert doc["keys"] == first["keys"]
    assert doc["saved"] is False  # nothing new: the file is not rewritten
    assert (cache / MEMO_FILE).stat().st_mode & 0o077 == 0


def edit_memo(cache, change):
    path = cache / MEMO_FILE
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(python="3.0"),
        lambda d: d.update(scanner="0" * 16),
        lambda d: d.pop("scanner"),
        lambda d: d["files"].update({k: 7 for k in d["files"]}),
    ],
    ids=["other-python", "other-scanner", "no-scanner", "malformed"],
)
def test_a_memo_of_another_scanner_or_python_or_malformed_is_ignored(memo_cache, change):
    cache, first = memo_cache
    edit_memo(cache, change)
    doc = child(cache)
    assert doc["taken"] == 0 and sorted(doc["parsed"]) == sorted(first["parsed"])
    assert doc["keys"] == first["keys"]


def test_scans_of_other_bytes_are_not_used(memo_cache):
    """A memo keyed by another file content (a digest that is not the file's)
    claiming no imports changes nothing: the files are parsed, the keys equal."""
    cache, first = memo_cache

    def rekey(d):
        d["files"] = {"f" * 64 + k[64:]: [] for k in d["files"]}

    edit_memo(cache, rekey)
    doc = child(cache)
    assert sorted(doc["parsed"]) == sorted(first["parsed"]) and doc["keys"] == first["keys"]


def test_an_untrusted_memo_is_ignored(memo_cache, tmp_path):
    cache, first = memo_cache
    path = cache / MEMO_FILE
    path.chmod(0o664)  # writable by the group: someone else could have written it
    assert child(cache)["taken"] == 0
    path.chmod(0o600)
    real = tmp_path / "elsewhere.json"
    path.rename(real)
    path.symlink_to(real)  # a link is never followed
    doc = child(cache)
    assert doc["taken"] == 0 and doc["keys"] == first["keys"]


def test_a_fifo_or_an_untrusted_directory_neither_blocks_nor_is_read(memo_cache, tmp_path):
    """A FIFO at the memo's path is not opened for a blocking read (a process
    would wait for a writer forever), and a directory others can write is not
    read at all: the load that follows refuses it."""
    import os

    cache, first = memo_cache
    (cache / MEMO_FILE).unlink()
    os.mkfifo(cache / MEMO_FILE, 0o600)
    doc = child(cache)  # subprocess.run's timeout fails the test if it blocks
    assert doc["taken"] == 0 and doc["keys"] == first["keys"]
    (cache / MEMO_FILE).unlink()
    assert child(cache, "save")["saved"] is True
    cache.chmod(0o770)  # writable by the group
    try:
        assert child(cache)["taken"] == 0
    finally:
        cache.chmod(0o700)


def test_clear_removes_the_memo(memo_cache):
    from kernel_cache.store.disk_tier import DiskTier
    from kernel_cache.store.housekeeping import clear

    cache, _ = memo_cache
    clear(DiskTier(cache))
    assert not (cache / MEMO_FILE).exists()


def test_a_read_only_or_missing_directory_gets_no_memo(tmp_path):
    missing = tmp_path / "none"
    assert child(missing, "save")["saved"] is False and not missing.exists()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert child(ro, "save")["saved"] is False
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_engine_start_reads_the_memo_but_never_writes_it(tmp_path, memo_cache):
    """``load_plan`` in a fresh process takes the memo before computing keys and
    parses nothing; without a memo it parses and writes none (a cache without
    entries: the start fails as missing)."""
    cache, first = memo_cache
    doc = child(cache, "engine")
    assert doc["parsed"] == [] and doc["missing"] == len(first["keys"])
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    doc = child(empty, "engine")
    assert sorted(doc["parsed"]) == sorted(first["parsed"])
    assert not (empty / MEMO_FILE).exists()  # only usage.json records the misses
