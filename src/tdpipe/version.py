"""The package version, read once from the installed metadata (pyproject.toml declares it)."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tdpipe")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"
