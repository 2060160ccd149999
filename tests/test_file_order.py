"""The order tests/conftest.py gives the test files (``_file_order``) and the
rows of tests/file_seconds.json it reads (``_seconds``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from . import conftest


def _item(nodeid: str, *fixtures: str):
    return SimpleNamespace(nodeid=nodeid, fixturenames=fixtures)


@pytest.fixture
def seconds(tmp_path, monkeypatch):
    """Writes the file-seconds table the order reads."""

    def write(table) -> None:
        path = tmp_path / "file_seconds.json"
        path.write_text(json.dumps(table))
        monkeypatch.setattr(conftest, "FILE_SECONDS", path)

    return write


def test_cold_files_first_then_warm_each_longest_first_unknown_counted_longest(seconds):
    seconds({"a.py": 10, "b.py": {"wall_s": 50, "cpu_s": 1}, "w1.py": 5, "w2.py": 90})
    items = [
        _item("a.py::t"),
        _item("b.py::t"),
        _item("new.py::t"),
        _item("w1.py::t", "warm_cache"),
        _item("w2.py::t"),
        _item("w2.py::u", "warm_cache"),
    ]
    order = conftest._file_order(items)
    assert sorted(order, key=order.get) == ["new.py", "b.py", "a.py", "w2.py", "w1.py"]


def test_a_server_file_is_not_followed_by_another_while_one_without_is_left(seconds):
    seconds({"s1.py": 100, "s2.py": 90, "c.py": 10, "w.py": 200})
    items = [
        _item("s1.py::t", "shared_servers"),
        _item("s2.py::t", "shared_servers"),
        _item("c.py::t"),
        _item("w.py::t", "warm_cache"),  # another group: never pulled forward
    ]
    order = conftest._file_order(items)
    assert sorted(order, key=order.get) == ["s1.py", "c.py", "s2.py", "w.py"]


@pytest.mark.parametrize(
    "table", [None, [], "text", {"a.py": True}, {"a.py": "9"}, {"a.py": 1e999}, {"a.py": -1}]
)
def test_an_unusable_table_or_row_counts_the_file_as_longest(seconds, table):
    seconds(table)
    rows = table if isinstance(table, dict) else {}
    assert all(conftest._seconds(v) is None for v in rows.values())
    items = [_item("z.py::t"), _item("a.py::t")]
    order = conftest._file_order(items)
    assert set(order) == {"a.py", "z.py"}


def test_a_huge_integer_is_not_a_number_of_seconds():
    assert conftest._seconds(10**400) is None
    assert conftest._seconds({"wall_s": 3}) == 3.0
