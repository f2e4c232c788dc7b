"""Device platforms: everything that depends on the device kind, behind one object (platforms/interface.py).

`resolve_device` turns --device (auto | cpu | cuda) into a device kind, `get_platform` gives its Platform.
The CUDA platform (platforms/cuda.py) ran on one H200, one GPU only (docs/gpu.md). This module imports
torch only when it must probe for CUDA, so the configuration layer (engine_args) stays importable without
torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tdpipe.config import DEVICES

if TYPE_CHECKING:
    from tdpipe.platforms.interface import Platform


class DeviceUnavailable(ValueError):
    """The device asked for is not on this machine; the message is one line."""


def _cuda_missing(cuda_available: bool | None) -> str | None:
    """Why CUDA cannot be used here, or None when it can."""
    import torch

    if cuda_available if cuda_available is not None else torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA"
    return "torch sees no CUDA device"


def resolve_device(name: str, cuda_available: bool | None = None) -> str:
    """"auto" -> "cuda" where torch sees a CUDA device, else "cpu"; "cuda" without one raises
    DeviceUnavailable. `cuda_available`: injected by tests (None: ask torch)."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu":
        return "cpu"
    why = _cuda_missing(cuda_available)
    if name == "auto":
        return "cpu" if why else "cuda"
    if why:
        raise DeviceUnavailable(f"device cuda is not available: {why}; use --device cpu or auto")
    return "cuda"


def check_device(name: str) -> None:
    """Fail now, in one line, if `name` is a device this machine lacks. `auto` always resolves and is not
    probed here (no torch import: the configuration is checked before anything heavy loads)."""
    if name != "auto":
        resolve_device(name)


def get_platform(name: str) -> Platform:
    """The platform of a resolved device kind ("cpu" | "cuda"; a "cuda:1" style name counts as "cuda")."""
    kind = name.split(":", 1)[0]
    if kind == "cpu":
        from tdpipe.platforms.cpu import CpuPlatform

        return CpuPlatform()
    if kind == "cuda":
        from tdpipe.platforms.cuda import CudaPlatform

        return CudaPlatform()
    raise ValueError(f"no platform for device {name!r} (resolve 'auto' with resolve_device first)")


def __getattr__(name: str) -> Any:
    if name == "Platform":  # imported on use: interface.py imports torch
        from tdpipe.platforms.interface import Platform

        return Platform
    raise AttributeError(name)


__all__ = ["DEVICES", "DeviceUnavailable", "Platform", "check_device", "get_platform", "resolve_device"]
