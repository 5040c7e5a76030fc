"""Files users name are read as regular files only, within a limit, text as UTF-8."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlscope import regular_files


def test_read_regular_refuses_what_is_not_a_file_or_too_large(tmp_path: Path) -> None:
    with pytest.raises(regular_files.NotRegularFile, match=r"a directory"):
        regular_files.read_regular(tmp_path, 10)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 11)
    with pytest.raises(regular_files.FileTooLarge) as err:
        regular_files.read_regular(big, 10)
    assert (err.value.size, err.value.limit) == (11, 10)
    assert regular_files.read_regular(big, 11) == b"x" * 11


def test_read_text_is_utf8_or_an_os_error_naming_the_bad_byte(tmp_path: Path) -> None:
    """Every refusal of a text file is an OSError, so each reader's one ``except
    OSError`` translates all of them; a bad byte is located by line and column."""
    text = tmp_path / "t"
    text.write_bytes("ok\ncafé\n".encode())
    assert regular_files.read_text(text, 100) == "ok\ncafé\n"
    text.write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(regular_files.NotUtf8) as err:
        regular_files.read_text(text, 100)
    assert (err.value.line, err.value.column) == (2, 4)
    assert err.value.strerror == "byte 0xe9 on line 2, column 4 is not UTF-8"
    for refused in (tmp_path, text):  # a directory; a file over the limit
        with pytest.raises(OSError):
            regular_files.read_text(refused, 5)
