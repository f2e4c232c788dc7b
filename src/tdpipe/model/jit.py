"""Build-once C++ extensions: compiled with the machine's gcc on first use into $TDPIPE_CACHE/kernels."""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("tdpipe")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]  # resolves to the libgomp torch already loaded: one OpenMP runtime in the process

_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}


def cpu_tag(source: Path, flags: list[str]) -> str:
    """What -march=native compiles for, plus the source, so a shared cache never serves a foreign build."""
    key = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            key += "".join(line for line in f if line.startswith(("flags", "model name")))
    except OSError:
        pass
    key += "|".join([torch.__version__, platform.python_version(), " ".join(flags), source.read_text()])
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def build(name: str, source: str, extra_cflags: list[str] | None = None) -> ModuleType | None:
    """The compiled module, or None (logged once) when TDPIPE_NO_KERNEL=1 or the build fails."""
    with _lock:
        if name in _built:
            return _built[name]
        mod = None
        if os.environ.get("TDPIPE_NO_KERNEL") == "1":
            log.warning("TDPIPE_NO_KERNEL=1: %s uses the pure-torch path", name)
        else:
            try:
                from torch.utils.cpp_extension import load

                src = CSRC / source
                flags = CFLAGS + (extra_cflags or [])
                root = Path(os.environ.get("TDPIPE_CACHE", Path.home() / ".cache" / "tdpipe"))
                build_dir = root / "kernels" / f"{name}-{cpu_tag(src, flags)}"
                build_dir.mkdir(parents=True, exist_ok=True)
                # torch's own build lock is a plain file that a killed build leaves behind, after which every
                # later load waits forever. Serialise on a flock (released when a process dies) and clear
                # torch's file while holding it.
                with open(build_dir / "tdpipe.lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    (build_dir / "lock").unlink(missing_ok=True)
                    mod = load(name=name, sources=[str(src)], extra_cflags=flags, extra_ldflags=LDFLAGS,
                               build_directory=str(build_dir), verbose=False)
            except Exception as e:  # no compiler, build error: degrade to torch, never crash the engine
                log.warning("%s kernel unavailable (%s: %s); using the pure-torch path", name, type(e).__name__, e)
        _built[name] = mod
        return mod
