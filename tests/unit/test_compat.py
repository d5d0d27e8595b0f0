"""The supported-version check: 1.8.x and 1.9.x pass, another torchrec is a clear ImportError."""

from __future__ import annotations

from importlib import metadata

import pytest

from torchrec_swp.integrations.torchrec.compat import check_torchrec_version, installed, parse_version


@pytest.mark.parametrize("found", ["1.8.0", "1.8.0+cpu", "1.8.3", "1.9.0", "1.9.2", "1.9.0rc1"])
def test_supported_series_pass_and_local_builds_count(found: str) -> None:
    assert check_torchrec_version(found) == found


def test_installed_is_what_pip_installed() -> None:
    assert installed().text == metadata.version("torchrec")
    assert check_torchrec_version() == metadata.version("torchrec")


@pytest.mark.parametrize("found", ["1.7.1", "1.10.0", "2.0.0", "nightly"])
def test_another_version_is_a_clear_import_error(found: str) -> None:
    with pytest.raises(ImportError) as info:
        check_torchrec_version(found)
    message = str(info.value)
    assert f"torchrec {found} is installed" in message
    assert "supports torchrec 1.8.x and 1.9.x" in message and "pip install torchrec==1.9.2" in message
    assert "torch 2.14" in message and "docs/install.md" in message


@pytest.mark.parametrize(
    ("text", "release", "async_copy", "pec"),
    [("1.8.0", (1, 8, 0), False, False), ("1.9.2+cpu", (1, 9, 2), True, True), ("1.9", (1, 9, 0), True, True)],
)
def test_version_facts(text: str, release: tuple[int, int, int], async_copy: bool, pec: bool) -> None:
    v = parse_version(text)
    assert v.release == release
    assert (v.has_async_inplace_copy, v.has_pec, v.has_maglev) == (async_copy, pec, pec)
