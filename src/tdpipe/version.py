"""The package version, read from the installed metadata (pyproject.toml declares it) on first use:
importlib.metadata walks sys.path, 40-70 ms here that every process (each stage too) would otherwise pay
at import. `from tdpipe.version import __version__` still works (the module's __getattr__)."""
from __future__ import annotations

import functools


@functools.cache
def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tdpipe")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return package_version()
    raise AttributeError(name)
