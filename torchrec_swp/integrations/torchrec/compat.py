"""The supported TorchRec version, checked before anything of TorchRec is imported."""

from __future__ import annotations

from importlib import metadata

SUPPORTED_TORCHREC = ("1.8.0",)
INSTALL_HINT = "pip install --no-deps torchrec==1.8.0 (see requirements/torchrec.txt)"


def check_torchrec_version(found: str | None = None) -> str:
    """Return the installed torchrec version, or raise ImportError saying what is supported."""
    if found is None:
        try:
            found = metadata.version("torchrec")
        except metadata.PackageNotFoundError:
            raise ImportError(f"torchrec_swp needs torchrec {' or '.join(SUPPORTED_TORCHREC)}, which is not installed: {INSTALL_HINT}") from None
    base = found.split("+", 1)[0]
    if base not in SUPPORTED_TORCHREC:
        raise ImportError(
            f"torchrec_swp supports torchrec {' or '.join(SUPPORTED_TORCHREC)}, but torchrec {found} is installed. "
            f"Its pipelines are drop-in subclasses of that version's classes; install it with: {INSTALL_HINT}"
        )
    return found
