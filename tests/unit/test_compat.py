"""The supported-version check: another torchrec gives a clear ImportError, not a crash inside."""

from __future__ import annotations

import pytest

from torchrec_swp.integrations.torchrec.compat import SUPPORTED_TORCHREC, check_torchrec_version


def test_supported_version_passes_and_local_builds_count() -> None:
    assert check_torchrec_version("1.8.0") == "1.8.0"
    assert check_torchrec_version("1.8.0+cpu") == "1.8.0+cpu"
    assert check_torchrec_version() in SUPPORTED_TORCHREC  # what this environment installed


@pytest.mark.parametrize("found", ["1.9.0", "1.7.1", "2.0.0"])
def test_another_version_is_a_clear_import_error(found: str) -> None:
    with pytest.raises(ImportError) as info:
        check_torchrec_version(found)
    message = str(info.value)
    assert f"torchrec {found} is installed" in message
    assert "supports torchrec 1.8.0" in message and "pip install --no-deps torchrec==1.8.0" in message
