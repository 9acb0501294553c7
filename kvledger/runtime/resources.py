"""Locates the data folders (`cuda/` kernels, `migrations/`) in a wheel or a checkout."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the kvledger package


def data_dir(name: str) -> Path:
    """Return the folder `name` ("cuda" or "migrations"), wherever this install keeps it.

    A wheel carries it under `kvledger/_data/`; an editable checkout has it at the
    repository root beside the packages.
    """
    for candidate in (_PACKAGE_DIR / "_data" / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"kvledger data folder {name!r} not found under {_PACKAGE_DIR / '_data'} "
        f"or {_PACKAGE_DIR.parent}; the installation is incomplete"
    )
