"""Reading a trace CSV: a file that is not one is a ConfigError naming it."""

from __future__ import annotations

import pytest

from kernel_cache.errors import ConfigError
from warmup.request_lengths import Request, read_trace


def test_a_trace_is_read_by_its_two_columns(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nx,10,3\ny,7,1\n")
    assert read_trace(p) == [Request(10, 3), Request(7, 1)]


@pytest.mark.parametrize(
    "data,says",
    [
        (b"ContextTokens,GeneratedTokens\n\xff\xfe,1\n", "not a UTF-8 CSV: UnicodeDecodeError"),
        (b"ContextTokens,GeneratedTokens\n12,abc\n", "row 0: .*GeneratedTokens='abc' are not"),
        (b"ContextTokens,GeneratedTokens\n12\n", "row 0: .*GeneratedTokens=None are not"),
    ],
)
def test_a_malformed_trace_is_a_config_error_naming_the_file(tmp_path, data, says):
    p = tmp_path / "bad.csv"
    p.write_bytes(data)
    with pytest.raises(ConfigError, match=f"trace '{p}': {says}"):
        read_trace(p)
